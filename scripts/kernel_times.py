#!/usr/bin/env python3
"""Median duration per kernel from `ncu --csv --metrics gpu__time_duration.sum` output, and its
median device-memory traffic where the CSV has dram__bytes_read.sum / dram__bytes_write.sum.

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
    times, traffic = {}, {}  # kernel -> [us]; (kernel, "read" / "write") -> [MB]
    units = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}
    for row in csv.DictReader(lines):
        metric = row.get("Metric Name")
        if metric not in ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum"):
            continue
        name = row["Kernel Name"]
        m = re.search(r"((?:prep|prep_tail|state_persistent|state_wgmma|state|stitch|stitch_rows|stitch_chain|fused_prefill)_kernel)\b(<[^>]*>)?", name)
        name = (m.group(1) + (m.group(2) or "")) if m else name[:40]
        value = float(row["Metric Value"].replace(",", "")) * units.get(row.get("Metric Unit", ""), 1.0)
        if metric == "gpu__time_duration.sum":
            if row.get("Metric Unit") not in units:  # ncu reports durations in nanoseconds by default
                value *= 1e-3
            times.setdefault(name, []).append(value)
        else:
            traffic.setdefault((name, metric.split("_")[-1].split(".")[0]), []).append(value)
    # Per forward call: prep runs once a call; kernels launched several times a call (the split
    # pass's stitches) are summed over the call.
    # (The fused prefill is one kernel a call.)
    calls = sum(len(v) for k, v in times.items() if k.startswith(("prep_kernel", "fused_prefill_kernel"))) or 1
    def part(k, v):
        text = f"{k} {statistics.median(v):.1f} us (x{len(v)}; {sum(v) / calls:.1f} us a call"
        moved = [f"DRAM {d} {statistics.median(traffic[(k, d)]):.0f} MB" for d in ("read", "write") if (k, d) in traffic]
        return text + ("; " + ", ".join(moved) if moved else "") + ")"

    parts = [part(k, v) for k, v in times.items()]
    print(f"{case}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
