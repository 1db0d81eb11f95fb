#!/usr/bin/env python3
"""Opcode counts of the kernels in a binary's SASS, one table per kernel; or, with --lines,
instruction counts by source line.

    cuobjdump -sass build/tools/flashkda/flashkda | python3 scripts/sass_histogram.py [--match REGEX] [--top N]
    cuobjdump -xelf all build/src/CMakeFiles/flashkda.dir/gpu/prefill/prep_kernel.cu.o
    nvdisasm -g -c prep_kernel.sm_90a.cubin | python3 scripts/sass_histogram.py --lines --match 'ILb0ELb0E'

Static counts (each instruction once, loops not unrolled by execution): what a kernel spends its
issue slots on, by opcode without modifiers (FFMA, LDS, SHFL, ...), or by the source line the
instruction came from (nvdisasm -g; the library compiles with -lineinfo), split into integer and
control work, memory and floating point, to find what to cut. cuobjdump and nvdisasm come with
the CUDA toolkit, or from PyPI (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) where it lacks them.
"""
import argparse
import collections
import re
import sys

# Opcodes counted as integer or control work in --lines (the rest: memory or floating point).
INTEGER = {"IMAD", "IADD3", "LEA", "SHF", "LOP3", "ISETP", "SEL", "MOV", "VIADD", "VIADDMNMX", "IABS", "PRMT",
           "UIMAD", "UIADD3", "ULEA", "USHF", "UMOV", "ULDC", "LDC", "S2R", "S2UR", "CS2R", "VIMNMX", "UISETP",
           "PLOP3", "FSEL", "BRA", "BSSY", "BSYNC", "NOP", "IMNMX", "I2F", "F2I", "I2FP", "POPC", "FLO"}
INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def opcode_tables(stream, match):
    kernels = collections.OrderedDict()
    name = None
    for line in stream:
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1) if re.search(match, m.group(1)) else None
            if name:
                kernels[name] = collections.Counter()
            continue
        m = INSTRUCTION.match(line) if name else None
        if m:  # "        /*0040*/                   LDC R1, c[0x0][0x28] ;" (a predicate may lead)
            kernels[name][m.group(1)] += 1
    return kernels


def line_tables(stream, match):
    kernels = collections.OrderedDict()
    name = where = None
    for line in stream:
        m = re.match(r"\.text\.(\S+):", line)
        if m:
            name = m.group(1) if re.search(match, m.group(1)) else None
            if name:
                kernels[name] = collections.defaultdict(collections.Counter)
            where = None
            continue
        if name is None:
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = f"{m.group(1).split('/')[-1]}:{m.group(2)}"
            continue
        m = INSTRUCTION.match(line)
        if m and where:
            op = m.group(1).split(".")[0]
            kind = "integer" if op in INTEGER else "memory" if op.startswith(("LD", "ST", "BAR", "RED", "ATOM")) else "float"
            kernels[name][where][kind] += 1
            kernels[name][where]["all"] += 1
    return kernels


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--match", default=".", help="only kernels whose mangled name matches this regex")
    ap.add_argument("--top", type=int, default=25, help="opcodes (or source lines) shown per kernel")
    ap.add_argument("--lines", action="store_true", help="count by source line (input: nvdisasm -g -c)")
    args = ap.parse_args()
    if args.lines:
        kernels = line_tables(sys.stdin, args.match)
        for name, lines in kernels.items():
            total = collections.Counter()
            for counts in lines.values():
                total.update(counts)
            print(f"{name}: {total['all']} instructions ({total['integer']} integer and control, "
                  f"{total['memory']} memory, {total['float']} floating point)")
            for where, counts in sorted(lines.items(), key=lambda kv: -kv[1]["integer"])[: args.top]:
                print(f"  {where:<32} integer {counts['integer']:4d}  memory {counts['memory']:4d}  float {counts['float']:4d}")
        return 0 if kernels else 1
    kernels = opcode_tables(sys.stdin, args.match)
    for name, counts in kernels.items():
        total = sum(counts.values())
        print(f"{name}: {total} instructions")
        for op, n in counts.most_common(args.top):
            print(f"  {op:<12} {n:6d}  {100.0 * n / total:5.1f}%")
    return 0 if kernels else 1


if __name__ == "__main__":
    sys.exit(main())
