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


class SourcePage:
    """ncu's source page as CSV: the header row, one row per SASS instruction, and the columns
    of the stall samples, the executed counts and each stall reason (shared with
    ncu_stall_segments.py)."""

    def __init__(self, path):
        rows = list(csv.reader(open(path, errors="replace")))
        header_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
        self.head, self.data = rows[header_at], [r for r in rows[header_at + 1:] if len(r) > 3]
        self.samples = self.head.index("Warp Stall Sampling (All Samples)")
        self.executed = self.head.index("Instructions Executed")
        self.reasons = [i for i, c in enumerate(self.head) if c.startswith("stall_") and "(Not Issued)" not in c]
        self.base = int(self.data[0][0], 16)
        self.total = sum(number(r[self.samples]) for r in self.data) or 1.0


def main():
    path = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    page = SourcePage(path)
    head, data, samples, executed = page.head, page.data, page.samples, page.executed
    reasons, base, total = page.reasons, page.base, page.total
    print(f"{total:.0f} stall samples over {len(data)} instructions")
    for r in sorted(data, key=lambda r: -number(r[samples]))[:count]:
        top = sorted(((number(r[i]), head[i][len("stall_"):]) for i in reasons), reverse=True)[:3]
        why = ", ".join(f"{name} {value:.0f}" for value, name in top if value > 0)
        print(f"{number(r[samples]):7.0f} {100 * number(r[samples]) / total:5.1f}%  +{int(r[0], 16) - base:#07x}"
              f"  x{number(r[executed]):<9.0f} {r[1].strip()[:60]:60s} | {why}")


if __name__ == "__main__":
    main()
