#!/usr/bin/env python3
"""Median duration per kernel from `ncu --csv --metrics gpu__time_duration.sum` output.

  scripts/kernel_times.py CASE ncu.csv   ->  one line: CASE: prep_kernel 123.4 us (x3; 123.4 us a call), ...
"""
import csv
import re
import statistics
import sys


def main():
    case, path = sys.argv[1], sys.argv[2]
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]  # ncu prints its own log lines before the CSV
    times = {}
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"]
        m = re.search(r"(prep_kernel|state_persistent_kernel|state_wgmma_kernel|state_kernel|stitch_kernel)(<[^>]*>)?", name)
        name = (m.group(1) + (m.group(2) or "")) if m else name[:40]
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(row.get("Metric Unit", "nsecond"), 1e-3)
        times.setdefault(name, []).append(float(row["Metric Value"].replace(",", "")) * scale)
    # Per forward call: prep runs once a call; kernels launched several times a call (the split
    # pass's stitches) are summed over the call.
    calls = sum(len(v) for k, v in times.items() if k.startswith("prep_kernel")) or 1
    parts = [f"{k} {statistics.median(v):.1f} us (x{len(v)}; {sum(v) / calls:.1f} us a call)" for k, v in times.items()]
    print(f"{case}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
