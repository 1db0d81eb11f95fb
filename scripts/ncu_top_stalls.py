#!/usr/bin/env python3
"""The SASS instructions where a kernel's warps stall most, from ncu's source page.

  ncu --section WarpStateStats --section SourceCounters -k regex:KERNEL -c 1 -o REPORT CMD...
  ncu --import REPORT.ncu-rep --page source --csv --print-source sass > source.csv
  scripts/ncu_top_stalls.py source.csv [N]

Prints the N instructions (default 30) with the most stall samples: samples, share of the
kernel's, offset from the function's first instruction (compare with cuobjdump -sass of the same
build), times executed (warp-level), the instruction and its three largest stall reasons. A wait
loop shows as its branch back; `executed` tells a per-item instruction from a per-step one.
"""
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    path = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    rows = list(csv.reader(open(path, errors="replace")))
    header_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    head, data = rows[header_at], [r for r in rows[header_at + 1:] if len(r) > 3]
    samples = head.index("Warp Stall Sampling (All Samples)")
    executed = head.index("Instructions Executed")
    reasons = [i for i, c in enumerate(head) if c.startswith("stall_") and "(Not Issued)" not in c]
    base = int(data[0][0], 16)
    total = sum(number(r[samples]) for r in data) or 1.0
    print(f"{total:.0f} stall samples over {len(data)} instructions")
    for r in sorted(data, key=lambda r: -number(r[samples]))[:count]:
        top = sorted(((number(r[i]), head[i][len("stall_"):]) for i in reasons), reverse=True)[:3]
        why = ", ".join(f"{name} {value:.0f}" for value, name in top if value > 0)
        print(f"{number(r[samples]):7.0f} {100 * number(r[samples]) / total:5.1f}%  +{int(r[0], 16) - base:#07x}"
              f"  x{number(r[executed]):<9.0f} {r[1].strip()[:60]:60s} | {why}")


if __name__ == "__main__":
    main()
