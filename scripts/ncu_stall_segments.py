#!/usr/bin/env python3
"""A kernel's stall samples by code segment: the SASS cut at every barrier instruction (BAR,
SYNCS wait loops excluded), so that each segment is one phase of one role's code path.

  scripts/ncu_stall_segments.py source.csv [min share %, 0.5]   (source.csv: as for ncu_top_stalls.py)

Prints, for each segment holding at least the given share of the samples: its offsets, the
samples and their share, the warp-level instructions executed in it, samples per 1000 executed
instructions (how long an instruction waits there), its three largest stall
reasons and its most frequent opcodes (executed counts), to tell which phase a segment is.
"""
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_top_stalls import SourcePage, number  # noqa: E402


def main():
    path = sys.argv[1]
    min_share = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
    page = SourcePage(path)
    head, samples, executed, total = page.head, page.samples, page.executed, page.total
    segments, current = [], []
    for r in page.data:
        current.append(r)
        opcode = r[1].strip().split()[0] if r[1].strip() else ""
        if opcode.startswith("@"):
            opcode = r[1].strip().split()[1]
        if opcode.startswith("BAR"):
            segments.append(current)
            current = []
    if current:
        segments.append(current)
    print(f"{total:.0f} stall samples, {len(page.data)} instructions, {len(segments)} segments")
    for seg in segments:
        s = sum(number(r[samples]) for r in seg)
        if 100 * s / total < min_share:
            continue
        ex = sum(number(r[executed]) for r in seg)
        why = Counter()
        ops = Counter()
        for r in seg:
            for i in page.reasons:
                why[head[i][len("stall_"):]] += number(r[i])
            words = r[1].strip().split()
            if words:
                op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
                ops[op.split(".")[0]] += number(r[executed])
        top = ", ".join(f"{k} {100 * v / max(s, 1):.0f}%" for k, v in why.most_common(3) if v > 0)
        opstr = " ".join(f"{k}:{v:.0f}" for k, v in ops.most_common(6))
        print(f"+{int(seg[0][0], 16) - page.base:#07x}..+{int(seg[-1][0], 16) - page.base:#07x}  {s:7.0f} {100 * s / total:5.1f}%  "
              f"x{ex:<9.0f} {1000 * s / max(ex, 1):6.2f}/Kinstr | {top} | {opstr} | ends {seg[-1][1].strip()[:40]}")


if __name__ == "__main__":
    main()
