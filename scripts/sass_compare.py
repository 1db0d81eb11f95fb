#!/usr/bin/env python3
"""Which kernels two SASS dumps compile the same, instruction for instruction: the check that a
refactor leaves measured kernels as they were, without a GPU.

    cuobjdump -sass old/prep_kernel.cu.o > old.sass
    cuobjdump -sass build/src/CMakeFiles/flashkda.dir/gpu/prefill/prep_kernel.cu.o > new.sass
    python3 scripts/sass_compare.py old.sass new.sass [--match REGEX]

Kernels are matched by name with the anonymous-namespace hash (which changes with the file's
contents) removed; instructions are compared without their addresses and encodings. Prints one
line a kernel (same, differs with the first differing instruction, or only in one dump) and
exits 1 when any matched kernel differs. cuobjdump and nvdisasm come with the CUDA toolkit, or
from PyPI (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm).
"""
import argparse
import re
import sys

FUNCTION = re.compile(r"\s*Function : (\S+)")
INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
ANONYMOUS = re.compile(r"_GLOBAL__N__[0-9a-f]+_\d+_\w+?_[0-9a-f]{8}")


def kernels(path, match):
    found, name = {}, None
    with open(path) as f:
        for line in f:
            m = FUNCTION.match(line)
            if m:
                name = ANONYMOUS.sub("_GLOBAL__N_", m.group(1))
                name = name if re.search(match, name) else None
                if name:
                    found[name] = []
                continue
            m = INSTRUCTION.match(line) if name else None
            if m:
                found[name].append(m.group(1))
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--match", default=".", help="compare only kernels whose name matches")
    args = ap.parse_args()
    old, new = kernels(args.old, args.match), kernels(args.new, args.match)
    differs = False
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            print(f"only in {'new' if name in new else 'old'}: {name}")
            continue
        a, b = old[name], new[name]
        if a == b:
            print(f"same ({len(a)} instructions): {name}")
            continue
        differs = True
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"DIFFERS ({len(a)} -> {len(b)} instructions, first at {first}): {name}")
        print(f"    old: {a[first] if first < len(a) else '(end)'}")
        print(f"    new: {b[first] if first < len(b) else '(end)'}")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
