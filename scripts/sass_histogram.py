#!/usr/bin/env python3
"""Opcode counts of the kernels in a binary's SASS (cuobjdump -sass), one table per kernel.

    cuobjdump -sass build/tools/flashkda/flashkda | python3 scripts/sass_histogram.py [--match REGEX] [--top N]

Static counts (each instruction once, loops not unrolled by execution): what a kernel spends its
issue slots on, by opcode without modifiers (FFMA, LDS, SHFL, ...), to find what to cut.
"""
import argparse
import collections
import re
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--match", default=".", help="only kernels whose mangled name matches this regex")
    ap.add_argument("--top", type=int, default=25, help="opcodes shown per kernel")
    args = ap.parse_args()
    kernels = collections.OrderedDict()
    name = None
    for line in sys.stdin:
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1) if re.search(args.match, m.group(1)) else None
            if name:
                kernels[name] = collections.Counter()
            continue
        if name is None:
            continue
        # "        /*0040*/                   LDC R1, c[0x0][0x28] ;" (a predicate may lead: @P0, @!PT)
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            kernels[name][m.group(1)] += 1
    for name, counts in kernels.items():
        total = sum(counts.values())
        print(f"{name}: {total} instructions")
        for op, n in counts.most_common(args.top):
            print(f"  {op:<12} {n:6d}  {100.0 * n / total:5.1f}%")
    return 0 if kernels else 1


if __name__ == "__main__":
    sys.exit(main())
