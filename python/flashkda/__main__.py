"""`python -m flashkda`: prints what this build of flashkda has (CUDA kernels, devices)."""

import flashkda

for key, value in flashkda.info().items():
    print(f"{key}: {value}")
