#!/usr/bin/env python3
"""Medians of `flashkda bench` JSON runs side by side, one column per variant (its runs joined by
" / "), and each variant's mean over its runs against the first variant's, per case.

    python3 scripts/ab_table.py default=ab-0-1.json FLASHKDA_X=1=ab-1-1.json default=ab-0-2.json ...

Arguments are VARIANT=PATH (the variant is everything before the last '='), in any order; the
first variant named is the reference. Written by gpu-check.sh's ab step.
"""
import collections
import json
import sys


def main(args):
    runs = collections.OrderedDict()  # variant -> [ {case: median_ms} ]
    for arg in args:
        variant, _, path = arg.rpartition("=")
        if not variant:
            sys.exit(f"ab_table: expected VARIANT=PATH, got '{arg}'")
        with open(path) as f:
            cases = json.load(f)["cases"]
        runs.setdefault(variant, []).append({c["name"]: c["median_ms"] for c in cases})
    if not runs:
        sys.exit("ab_table: no runs")
    variants = list(runs)
    reference = variants[0]
    names = list(runs[reference][0])
    print("| case | " + " | ".join(variants) + " |")
    print("|---|" + "---|" * len(variants))
    for name in names:
        cells = []
        ref = [r[name] for r in runs[reference] if name in r]
        ref_mean = sum(ref) / len(ref) if ref else None
        for v in variants:
            times = [r[name] for r in runs[v] if name in r]
            if not times:
                cells.append("-")
                continue
            cell = " / ".join(f"{t:.4f}" for t in times)
            if v != reference and ref_mean:
                cell += f" ({100 * (sum(times) / len(times) / ref_mean - 1):+.1f}%)"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
