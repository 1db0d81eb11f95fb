#!/usr/bin/env bash
# One GPU iteration: build (or take prebuilt binaries), run the GPU test suite, the sanitizers on
# a small varlen case with states, the main job and the benchmark. Logs and JSON go to $OUT.
#
#   scripts/gpu-check.sh [steps...]      steps: build tests sanitize run bench profile python
#                                        (default: build tests sanitize run bench)
#   PROFILE_CASES="P1 P9"  cases whose kernel times ncu measures in the profile step
#   PREBUILT=dir  use dir/test_prefill_gpu and dir/flashkda instead of building
#   BENCH_ARGS="--case P1,P7"  extra flags for `flashkda bench`; TEST_ARGS for the test binary
#   WHEEL=dist/flashkda-*.whl  the python step installs this wheel (built where pip works) and
#                             runs the pytest suite, GPU tests included
# bench runs the cases twice (the same build) and writes h200.md with scripts/bench_report.py.
# At most 8 files land in $OUT (the device tool returns no more).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
steps=${*:-build tests sanitize run bench}
summary="$OUT/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader 2>&1 |
  sed 's/^/gpu: /' | tee -a "$summary"
note "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (+uncommitted changes)')"

if [ -n "${PREBUILT:-}" ]; then
  TEST_BIN=$PREBUILT/test_prefill_gpu
  CLI_BIN=$PREBUILT/flashkda
  # The checkout's git state says nothing about binaries built elsewhere: they carry their commit.
  note "prebuilt binaries: $("$CLI_BIN" --version 2>&1 | head -1)"
else
  BUILD=${BUILD_DIR:-build-gpu}
  TEST_BIN=$BUILD/tests/gpu/test_prefill_gpu
  CLI_BIN=$BUILD/tools/flashkda/flashkda
fi

status=0
run_step() {  # name, log file, time limit (s), command...; the log is appended to
  local name=$1 log=$2 limit=$3
  shift 3
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  note "$name: rc=$rc ($((SECONDS - t0)) s) -> $(basename "$log")"
  [ $rc -eq 0 ] || status=1
  return $rc
}

for step in $steps; do
  case $step in
    build)
      if [ -z "${PREBUILT:-}" ]; then
        run_step build "$OUT/build.log" 600 bash -c "cmake -S . -B $BUILD -G Ninja -DFLASHKDA_PTXAS_VERBOSE=ON && cmake --build $BUILD -j\$(nproc)"
        grep -E "registers|spill" "$OUT/build.log" | sort | uniq -c | sed 's/^/ptxas: /' | tee -a "$summary"
      fi
      ;;
    tests)
      run_step tests "$OUT/gpu-tests.log" "${TESTS_LIMIT:-300}" "$TEST_BIN" ${TEST_ARGS:-}
      grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests? ran|\[gpu vs oracle\]" "$OUT/gpu-tests.log" | tail -60 >>"$summary"
      ;;
    sanitize)
      for tool in memcheck racecheck synccheck; do
        run_step "sanitizer $tool" "$OUT/sanitize.log" 180 compute-sanitizer --tool "$tool" --error-exitcode 1 \
          "$TEST_BIN" --gtest_filter='GpuPrefill.SmallVarlenWithStates:Layouts/GpuPrefillLayout.*:Lengths/GpuPrefillSplit.MatchesOracle/3:GpuPrefillPersistent.ManyTinyItems:GpuPrefillPersistent.EdgeLengthsEveryStateForm'
      done
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitize.log" | tee -a "$summary"
      ;;
    run)
      run_step "flashkda run" "$summary" 120 "$CLI_BIN" run
      ;;
    bench)
      run_step "flashkda bench" "$OUT/bench.log" "${BENCH_LIMIT:-400}" "$CLI_BIN" bench --json "$OUT/bench.json" ${BENCH_ARGS:-}
      run_step "flashkda bench (repeat)" "$OUT/bench.log" "${BENCH_LIMIT:-400}" "$CLI_BIN" bench --json "$OUT/bench-repeat.json" ${BENCH_ARGS:-}
      python3 scripts/bench_report.py "$OUT/bench.json" "$OUT/bench-repeat.json" >"$OUT/h200.md" || status=1
      cat "$OUT/h200.md" >>"$summary"
      ;;
    profile)  # per-kernel durations (ncu, clocks not locked), three calls per case
      for c in ${PROFILE_CASES:-P1 P3 P7 P8 P9}; do
        run_step "ncu $c" "$OUT/profile.log" 120 ncu --clock-control none --csv --metrics gpu__time_duration.sum \
          -k regex:"prep_kernel|state_kernel|state_persistent_kernel|stitch_kernel" --log-file "$OUT/ncu-$c.csv" \
          "$CLI_BIN" bench --case "$c" --iters 2 --warmup 1 --oracle-heads 0 --json /tmp/ncu-bench.json
        python3 scripts/kernel_times.py "$c" "$OUT/ncu-$c.csv" | tee -a "$summary"
        rm -f "$OUT/ncu-$c.csv"
      done
      ;;
    python)
      run_step "python wheel" "$OUT/python.log" 300 python3 -m pip install --no-deps --force-reinstall ${WHEEL:-dist/*.whl}
      run_step "pytest" "$OUT/python.log" "${PYTEST_LIMIT:-500}" env PYTHONUNBUFFERED=1 python3 -m pytest python/tests -rs -q
      tail -15 "$OUT/python.log" >>"$summary"
      ;;
    *) note "unknown step: $step"; status=2 ;;
  esac
done
cat "$summary"
exit $status
