#!/usr/bin/env bash
# Copies the GPU binaries of a local build into one folder for `PREBUILT=dir scripts/gpu-check.sh`
# on a GPU machine (the device tool carries ignored folders named in its `carry`, with .deps/):
# the GPU test binaries, the flashkda CLI and the probes. Building on the GPU machine instead
# costs its device time.
#
#   scripts/stage-prebuilt.sh [build dir, build] [destination, build-gpu-prebuilt] [baseline CLI]
#
# A baseline CLI (a flashkda binary of another commit) goes to destination/base/flashkda, for
# gpu-check.sh's ab step to time both builds in one call (AB_VARIANTS="bin:DEST/base default").
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
dest=${2:-build-gpu-prebuilt}
rm -rf "$dest"
mkdir -p "$dest"
cp "$build"/tests/gpu/test_*_gpu "$build"/tools/flashkda/flashkda "$dest"/
for probe in record_ring_probe f16_step_probe chunk64_step_probe; do
  [ -x "$build/tools/probes/$probe" ] && cp "$build/tools/probes/$probe" "$dest"/
done
if [ -n "${3:-}" ]; then
  mkdir -p "$dest/base"
  cp "$3" "$dest/base/flashkda"
  "$dest/base/flashkda" --version
fi
"$dest/flashkda" --version
ls "$dest"
