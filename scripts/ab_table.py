#!/usr/bin/env python3
"""Medians of `flashkda bench` JSON runs side by side, one column per variant (its runs joined by
" / "), and each variant's mean over its runs against the first variant's, per case.

    python3 scripts/ab_table.py [--json OUT] default=ab-0-1.json FLASHKDA_X=1=ab-1-1.json default=ab-0-2.json ...

Arguments are VARIANT=PATH (the variant is everything before the last '='), in any order; the
first variant named is the reference. --json writes every run's medians to one file
({"variants": {variant: [{case: median_ms}, ...]}, "commit": ...}). Used by gpu-check.sh's ab step.
"""
import collections
import json
import sys


def main(args):
    json_out = None
    if len(args) >= 2 and args[0] == "--json":
        json_out, args = args[1], args[2:]
    runs = collections.OrderedDict()  # variant -> [ {case: median_ms} ]
    commit = None
    for arg in args:
        variant, _, path = arg.rpartition("=")
        if not variant:
            sys.exit(f"ab_table: expected VARIANT=PATH, got '{arg}'")
        with open(path) as f:
            doc = json.load(f)
        commit = commit or doc.get("commit")
        runs.setdefault(variant, []).append({c["name"]: c["median_ms"] for c in doc["cases"]})
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
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"commit": commit, "variants": runs}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
