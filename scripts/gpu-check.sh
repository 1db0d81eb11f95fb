#!/usr/bin/env bash
# One GPU iteration: build (or take prebuilt binaries), run the GPU test suite, the sanitizers on
# a small varlen case with states, the main job and the benchmark. Logs and JSON go to $OUT.
#
#   scripts/gpu-check.sh [steps...]      steps: build tests sanitize run bench profile stalls python wgmma ab ring f16step chunk64 fusedtiming
#                                        (default: build tests sanitize run bench python)
#   PROFILE_CASES="P1 P9"  cases whose kernel times ncu measures in the profile step
#   PROFILE_DRAM=1  the profile step also reads each kernel's device-memory bytes (read, written)
#   stalls step (not a default one): STALL_CASE=P9 STALL_KERNEL=state_persistent_kernel, the SASS
#                instructions where that kernel's warps stall most (scripts/ncu_top_stalls.py) and
#                the samples by code segment between barriers (scripts/ncu_stall_segments.py);
#                STALLS="P1:prep_kernel P1:state_kernel" several (case:kernel regex) at once;
#                STALL_SAVE=1 also writes each source page to $OUT/stalls-CASE-KERNEL.csv.gz
#                STALL_DETAILS=1 adds the speed-of-light, compute-workload, scheduler and memory-workload sections (pipes, issue, shared-memory wavefronts) to the summary
#   PREBUILT=dir  use dir/test_{prefill,decode,serving,wgmma,wgmma_step}_gpu and dir/flashkda instead of building
#                (and dir/record_ring_probe for the ring step, dir/f16_step_probe for f16step)
#   ring step (not a default one): the record-ring probe (tools/probes/record_ring_probe.cu) under ncu
#                on P1, P3, P9 shapes, plain workspace and records on a 24 MB ring (RING_MB): kernel times and
#                DRAM bytes, to the summary
#   f16step step (not a default one): tools/probes/f16_step_probe.cu, the fp16 chunk step against the
#                tf32 one on one chunk (a time a step at 132 and 264 blocks, both forms against fp64), to the summary
#   chunk64 step (not a default one): tools/probes/chunk64_step_probe.cu, the state chain of a fused chunk-64
#                design on fp16 wgmma (a time a 64-token step at CHUNK64_SHAPES="blocks:steps ...", fp64 check)
#   fusedtiming step (not a default one): the fused prefill's phase times at FUSED_TIMING_CASES (default P4)
#                from a CLI configured with -DFLASHKDA_FUSED_TIMING=ON (FUSED_TIMING_CLI; else
#                $PREBUILT/timing/flashkda; else built here in build-gpu-timing), one chunk of block 0
#                in clock64 cycles, to the summary
#   BENCH_ARGS="--case P1,P7"  extra flags for `flashkda bench`; TEST_ARGS for the test binary
#   ab step (not a default one): AB_VARIANTS="default FLASHKDA_STATE_PDL=0 FLASHKDA_SPLIT=0,FLASHKDA_PERSISTENT=1"
#                AB_CASES=P1,P3,P9 AB_RUNS=2: each variant once a round (same binary, interleaved;
#                a `bin:DIR` setting runs DIR/flashkda instead: two builds in one call, e.g.
#                AB_VARIANTS="bin:build-gpu-prebuilt/base default" with the build before a change
#                staged by `scripts/stage-prebuilt.sh build build-gpu-prebuilt BASE_CLI`),
#                a table of medians in the summary and every run's in ab.json (scripts/ab_table.py);
#                AB_NAME=x: ab-x.json. Two groups in one device call: the second with KEEP_SUMMARY=1
#   python step: builds the package from source on this machine, as users do (`pip install .`,
#                without build isolation: the GPU machine has no index to fetch the build
#                requirements from; they are installed there), records the link of the
#                extension (ldd, the C++ runtime it needs), and runs the whole pytest suite
#   WHEEL=dist/flashkda-*.whl  the python step installs this wheel instead of building
# bench runs the cases twice (the same build) and writes h200.md with scripts/bench_report.py.
# At most 8 files land in $OUT (the device tool returns no more): build.log, gpu-tests.log (the
# sanitizers too), python.log, summary.txt (the bench output too), bench.json, bench-repeat.json,
# h200.md and h200.png. The wgmma step (not a default one) adds bench-default.json and
# bench-wgmma.json: run it without bench and python to stay within the 8.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
steps=${*:-build tests sanitize run bench python}
summary="$OUT/summary.txt"
[ -n "${KEEP_SUMMARY:-}" ] || : >"$summary"  # KEEP_SUMMARY=1: append (several calls in one run)
note() { echo "$*" | tee -a "$summary"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader 2>&1 |
  sed 's/^/gpu: /' | tee -a "$summary"
# The checkout's git state as this machine sees it; a copied working tree may carry an older .git
# than its files (seen on the device machine), so COMMIT= from the caller takes precedence.
note "commit: ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (+uncommitted changes, or a stale .git)')}"

if [ -n "${PREBUILT:-}" ]; then
  TEST_DIR=$PREBUILT
  CLI_BIN=$PREBUILT/flashkda
  # The checkout's git state says nothing about binaries built elsewhere: they carry their commit.
  note "prebuilt binaries: $("$CLI_BIN" --version 2>&1 | head -1)"
else
  BUILD=${BUILD_DIR:-build-gpu}
  TEST_DIR=$BUILD/tests/gpu
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
        # The CLI's header-only dependencies (CLI11, nlohmann/json) are unpacked into .deps/ by
        # scripts/fetch-cli-deps.sh where apt works, and carried to a GPU machine without it.
        prefix=""
        [ -d .deps/usr ] && prefix="-DCMAKE_PREFIX_PATH=$PWD/.deps/usr"
        run_step build "$OUT/build.log" 600 bash -c "cmake -S . -B $BUILD -G Ninja -DFLASHKDA_PTXAS_VERBOSE=ON $prefix && cmake --build $BUILD -j\$(nproc)"
        grep -E "registers|spill" "$OUT/build.log" | sort | uniq -c | sed 's/^/ptxas: /' | tee -a "$summary"
      fi
      ;;
    tests)  # the chunked prefill, the recurrent kernel (decode), the serving suites on the device
      # GpuPrefillSplitShared (FLASHKDA_SPLIT_SHARED=1, built without a GPU) on its own, under a short
      # limit, until it has run: a hang there must not cost the rest of the prefill suite.
      for bin in test_prefill_gpu test_decode_gpu test_serving_gpu test_wgmma_gpu; do
        filter=()
        [ "$bin" = test_prefill_gpu ] && [ -z "${TEST_ARGS:-}" ] && filter=(--gtest_filter='-*GpuPrefillSplitShared*')
        run_step "tests $bin" "$OUT/gpu-tests.log" "${TESTS_LIMIT:-300}" "$TEST_DIR/$bin" "${filter[@]}" ${TEST_ARGS:-}
      done
      run_step "tests split shared (experimental)" "$OUT/gpu-tests.log" 90 "$TEST_DIR/test_prefill_gpu" --gtest_filter='*GpuPrefillSplitShared*'
      # The pool and checkpoint suites on the plan's own kernels (V-major: the chunked prefill), per-item
      # and persistent, one state-pass layout for every call (checkpoints vs prefix prefills bit for bit).
      chunked_env="FLASHKDA_CUDA_KERNELS=auto FLASHKDA_STATE_CONFIG=8x1 FLASHKDA_SPLIT=0"
      run_step "tests pools+checkpoints, chunked" "$OUT/gpu-tests.log" 120 env $chunked_env \
        "$TEST_DIR/test_serving_gpu" --gtest_filter='StatePools.*:Checkpoints.*:StridedInputs.*'
      run_step "tests pools+checkpoints, persistent" "$OUT/gpu-tests.log" 120 env $chunked_env FLASHKDA_PERSISTENT=1 \
        "$TEST_DIR/test_serving_gpu" --gtest_filter='StatePools.*:Checkpoints.*:StridedInputs.*'
      # The experimental wgmma state pass on the pool and strided suites (checkpoint and K-major
      # calls keep the mma.sync passes), and its step prototype (fp64 check, then a time a step).
      run_step "tests pools+strided, wgmma" "$OUT/gpu-tests.log" 120 env $chunked_env FLASHKDA_STATE_WGMMA=1 \
        "$TEST_DIR/test_serving_gpu" --gtest_filter='StatePools.*:StridedInputs.*'
      # The tf32 step (FLASHKDA_STATE_F16=0; the fp16 step is the default) on the pool, checkpoint and
      # strided suites, per item and persistent, and on the prefill suites that run its passes.
      for pass in FLASHKDA_PERSISTENT=0 FLASHKDA_PERSISTENT=1; do
        run_step "tests pools+checkpoints, tf32 step $pass" "$OUT/gpu-tests.log" 120 env $chunked_env FLASHKDA_STATE_F16=0 \
          $pass "$TEST_DIR/test_serving_gpu" --gtest_filter='StatePools.*:Checkpoints.*:StridedInputs.*'
      done
      run_step "tests prefill, tf32 step" "$OUT/gpu-tests.log" 300 env FLASHKDA_STATE_F16=0 "$TEST_DIR/test_prefill_gpu" \
        --gtest_filter='Lengths/GpuPrefillLength.*:Heads/*:Layouts/*:GpuPrefillPersistent.*:GpuPrefill.PrepTail*:GpuPrefill.Softplus*:GpuPrefill.LargeInitialState'
      run_step "tests pools+checkpoints, 4x1" "$OUT/gpu-tests.log" 120 env FLASHKDA_CUDA_KERNELS=auto FLASHKDA_STATE_CONFIG=4x1 \
        FLASHKDA_SPLIT=0 "$TEST_DIR/test_serving_gpu" --gtest_filter='StatePools.*:Checkpoints.*:StridedInputs.*'
      [ -x "$TEST_DIR/test_wgmma_step_gpu" ] && run_step "tests wgmma step prototype" "$OUT/gpu-tests.log" 60 \
        "$TEST_DIR/test_wgmma_step_gpu"

      grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests? ran|\[gpu vs oracle\]|FAILED" "$OUT/gpu-tests.log" | tail -80 >>"$summary"
      ;;
    sanitize)
      for tool in memcheck racecheck synccheck; do
        run_step "sanitizer $tool (prefill)" "$OUT/gpu-tests.log" 180 compute-sanitizer --tool "$tool" --error-exitcode 1 \
          "$TEST_DIR/test_prefill_gpu" --gtest_filter='GpuPrefill.SmallVarlenWithStates:Layouts/GpuPrefillLayout.*:Lengths/GpuPrefillSplit.MatchesOracle/3:GpuPrefillPersistent.ManyTinyItems:GpuPrefillPersistent.EdgeLengthsEveryStateForm:GpuPrefillPersistent.LongestFirstOrderAndBeyondItsBound:GpuPrefill.SoftplusGateEveryStatePass:GpuPrefill.SmallPrepTail:GpuPrefill.SmallStitchExperiments:GpuPrefillWgmma.*:Passes/GpuPrefillF16.EdgeLengthsEveryStateForm/*:Segments/GpuPrefillSplitSegments.MatchesOracle/0:Segments/GpuPrefillSplitSegments.MatchesOracle/3:GpuPrefillFused.EdgeLengthsEveryStateForm:GpuPrefillFusedPair.EdgeLengthsEveryStateForm:GpuPrefillFusedPair.BitForBitOneBlockAnItem:Segments/GpuPrefillSplitFused.MatchesOracle/0'
        run_step "sanitizer $tool (decode)" "$OUT/gpu-tests.log" 180 compute-sanitizer --tool "$tool" --error-exitcode 1 \
          "$TEST_DIR/test_decode_gpu" --gtest_filter='Tokens/GpuDecodeTokens.MatchesOracle/0:Tokens/GpuDecodeTokens.MatchesOracle/3:GpuDecode.*:PoolDtypes/GpuDecodeGraph.*:PoolForms/GpuDecodePools.*/bf16_VK:PoolForms/GpuDecodePools.*/fp32_KV'
        run_step "sanitizer $tool (serving)" "$OUT/gpu-tests.log" 180 compute-sanitizer --tool "$tool" --error-exitcode 1 \
          "$TEST_DIR/test_serving_gpu" --gtest_filter='StatePools.*:Checkpoints.WithinTheBarOfTheOracleInBothLayouts:StridedInputs.WithPoolsAndCheckpoints'
        run_step "sanitizer $tool (pools+checkpoints, chunked)" "$OUT/gpu-tests.log" 180 env FLASHKDA_CUDA_KERNELS=auto \
          FLASHKDA_PERSISTENT=1 compute-sanitizer --tool "$tool" --error-exitcode 1 "$TEST_DIR/test_serving_gpu" \
          --gtest_filter='StatePools.*:Checkpoints.*:StridedInputs.*'
      done
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/gpu-tests.log" | tee -a "$summary"
      ;;
    run)
      run_step "flashkda run" "$summary" 120 "$CLI_BIN" run
      ;;
    bench)
      run_step "flashkda bench" "$summary" "${BENCH_LIMIT:-400}" "$CLI_BIN" bench --json "$OUT/bench.json" ${BENCH_ARGS:-}
      run_step "flashkda bench (repeat)" "$summary" "${BENCH_LIMIT:-400}" "$CLI_BIN" bench --json "$OUT/bench-repeat.json" ${BENCH_ARGS:-}
      python3 scripts/bench_report.py --plot "$OUT/h200.png" "$OUT/bench.json" "$OUT/bench-repeat.json" >"$OUT/h200.md" || status=1
      cat "$OUT/h200.md" >>"$summary"
      ;;
    ab)  # launcher switches against each other in one binary: AB_RUNS rounds, each variant once a round
      # AB_VARIANTS: space-separated variants, each `default` or comma-joined VAR=VALUE settings
      read -r -a variants <<<"${AB_VARIANTS:-default FLASHKDA_STATE_PDL=0}"
      ab_files=()
      for run in $(seq 1 "${AB_RUNS:-2}"); do
        for i in "${!variants[@]}"; do
          v=${variants[$i]}
          settings=()
          [ "$v" != default ] && IFS=, read -r -a settings <<<"$v"
          cli=$CLI_BIN
          for j in "${!settings[@]}"; do  # bin:DIR runs DIR/flashkda (another build) instead
            case ${settings[$j]} in bin:*) cli=${settings[$j]#bin:}/flashkda; unset "settings[$j]" ;; esac
          done
          run_step "ab $v (run $run)" "$summary" "${BENCH_LIMIT:-400}" env "${settings[@]}" "$cli" bench \
            --case "${AB_CASES:-P1,P3,P9}" --oracle-heads 0 --json "$OUT/ab-$i-$run.json"
          ab_files+=("$v=$OUT/ab-$i-$run.json")
        done
      done
      python3 scripts/ab_table.py --json "$OUT/ab${AB_NAME:+-$AB_NAME}.json" "${ab_files[@]}" | tee -a "$summary" || status=1
      for f in "${ab_files[@]}"; do rm -f "${f##*=}"; done  # the medians are in ab.json ($OUT holds 8 files)
      ;;
    wgmma)  # the experimental wgmma state pass against the default passes, same cases, one run each
      for mode in default wgmma; do
        flag=""
        [ "$mode" = wgmma ] && flag="FLASHKDA_STATE_WGMMA=1"
        run_step "flashkda bench ($mode state pass)" "$summary" "${BENCH_LIMIT:-400}" env $flag \
          "$CLI_BIN" bench --case "${WGMMA_CASES:-P1,P3,P4,P9}" --json "$OUT/bench-$mode.json"
      done
      ;;
    profile)  # per-kernel durations (ncu, clocks not locked), three calls per case
      for c in ${PROFILE_CASES:-P1 P3 P7 P8 P9}; do
        metrics=gpu__time_duration.sum
        [ -n "${PROFILE_DRAM:-}" ] && metrics+=,dram__bytes_read.sum,dram__bytes_write.sum
        run_step "ncu $c" "$OUT/profile.log" 120 ncu --clock-control none --csv --metrics "$metrics" \
          -k regex:"(prep|state|stitch|fused_prefill)_([a-z]+_)?kernel" --log-file "$OUT/ncu-$c.csv" \
          "$CLI_BIN" bench --case "$c" --iters 2 --warmup 1 --oracle-heads 0 --json /tmp/ncu-bench.json
        python3 scripts/kernel_times.py "$c" "$OUT/ncu-$c.csv" | tee -a "$summary"
        rm -f "$OUT/ncu-$c.csv"
      done
      ;;
    ring)  # tools/probes/record_ring_probe.cu: kernel times and DRAM bytes with the records in the L2
      probe=$([ -n "${PREBUILT:-}" ] && echo "$PREBUILT/record_ring_probe" || echo "$BUILD/tools/probes/record_ring_probe")
      for shape in "8192 1 96 P1" "1024 8 96 P3" "128 64 32 P9"; do
        read -r len seqs heads label <<<"$shape"
        for mode in plain ring; do
          run_step "ring probe $label $mode" "$OUT/profile.log" 120 ncu --clock-control none --csv \
            --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
            -k regex:"(prep|state)_([a-z]+_)?kernel" --log-file "$OUT/ncu-ring.csv" \
            "$probe" "$len" "$seqs" "$heads" "$mode" "${RING_MB:-24}" 3
          python3 scripts/kernel_times.py "$label $mode" "$OUT/ncu-ring.csv" | tee -a "$summary"
          rm -f "$OUT/ncu-ring.csv"
        done
      done
      ;;
    chunk64)  # tools/probes/chunk64_step_probe.cu: a fused chunk-64 design's state chain on fp16 wgmma
      probe=$([ -n "${PREBUILT:-}" ] && echo "$PREBUILT/chunk64_step_probe" || echo "$BUILD/tools/probes/chunk64_step_probe")
      for shape in ${CHUNK64_SHAPES:-96:128 64:128 132:128 96:512}; do
        run_step "chunk64 step probe $shape" "$summary" 60 "$probe" "${shape%:*}" "${shape#*:}"
      done
      ;;
    fusedtiming)  # the fused prefill's phase times: a flashkda CLI built with -DFLASHKDA_FUSED_TIMING=ON
      # (FUSED_TIMING_CLI, $PREBUILT/timing/flashkda or one built here) prints block 0's stamps of one chunk a launch
      cli=${FUSED_TIMING_CLI:-${PREBUILT:+$PREBUILT/timing/flashkda}}
      if [ -z "$cli" ]; then  # not staged: configure and build one here (the CLI target only)
        prefix=""
        [ -d .deps/usr ] && prefix="-DCMAKE_PREFIX_PATH=$PWD/.deps/usr"
        run_step "build (fused timing)" "$OUT/build.log" 600 bash -c "cmake -S . -B build-gpu-timing -G Ninja \
          -DFLASHKDA_FUSED_TIMING=ON -DFLASHKDA_BUILD_TESTS=OFF $prefix && cmake --build build-gpu-timing --target flashkda_cli -j\$(nproc)"
        cli=build-gpu-timing/tools/flashkda/flashkda
      fi
      for c in ${FUSED_TIMING_CASES:-P4}; do
        FLASHKDA_FUSED=1 timeout 120 "$cli" bench --case "$c" --iters 1 --warmup 0 --oracle-heads 0 2>&1 |
          grep 'fused timing' | head -15 | sed "s/^/$c: /" | tee -a "$summary"
      done
      ;;
    f16step)  # tools/probes/f16_step_probe.cu: the fp16 step against the tf32 one, time and accuracy
      probe=$([ -n "${PREBUILT:-}" ] && echo "$PREBUILT/f16_step_probe" || echo "$BUILD/tools/probes/f16_step_probe")
      for shape in "132 2048" "264 1024"; do
        run_step "f16 step probe $shape" "$summary" 60 "$probe" $shape
      done
      ;;
    stalls)  # where one kernel's warps stall, per SASS instruction (ncu's source page, one launch)
      for spec in ${STALLS:-${STALL_CASE:-P9}:${STALL_KERNEL:-state_persistent_kernel}}; do
        c=${spec%%:*} k=${spec#*:}
        run_step "ncu stalls $c $k" "$summary" 120 ncu --section WarpStateStats --section SourceCounters \
          $([ "${STALL_DETAILS:-0}" = 1 ] && echo --section ComputeWorkloadAnalysis --section SchedulerStats --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables) -k regex:"$k" -c 1 -f -o /tmp/stalls "$CLI_BIN" bench --case "$c" --iters 1 --warmup 0 --oracle-heads 0 \
          --json /tmp/stalls-bench.json
        ncu --import /tmp/stalls.ncu-rep --page source --csv --print-source sass >/tmp/stalls-source.csv 2>&1
        # STALL_DETAILS=1: the pipes' utilization and the schedulers' issue rates as well
        [ "${STALL_DETAILS:-0}" = 1 ] && ncu --import /tmp/stalls.ncu-rep --page details --print-details all 2>&1 | sed "s/^/details $c: /" >>"$summary"
        python3 scripts/ncu_top_stalls.py /tmp/stalls-source.csv 40 | sed "s/^/stalls $c: /" >>"$summary"
        python3 scripts/ncu_stall_segments.py /tmp/stalls-source.csv 0.5 | sed "s/^/segments $c: /" >>"$summary"
        # STALL_SAVE=1: the whole source page (executed counts and stalls of every instruction) to $OUT
        [ "${STALL_SAVE:-0}" = 1 ] && gzip -c /tmp/stalls-source.csv >"$OUT/stalls-$c-$k.csv.gz"
      done
      ;;
    python)
      if [ -n "${WHEEL:-}" ]; then
        run_step "python wheel" "$OUT/python.log" 300 python3 -m pip install --no-deps --force-reinstall $WHEEL
      else
        { env | grep -E '^(CC|CXX|CFLAGS|CXXFLAGS|LDFLAGS|CMAKE_[A-Z_]*)=' || true; g++ --version | head -1; cmake --version | head -1
          [ -n "${CXX:-}" ] && { file -L "$CXX"; head -c 1500 "$CXX" | strings | head -40; }
          python3 -m pip show scikit-build-core nanobind 2>/dev/null | grep -E '^(Name|Version)'; } >>"$OUT/python.log" 2>&1
        run_step "pip install . (from source)" "$OUT/python.log" 900 env CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
          python3 -m pip install --no-build-isolation --no-deps --force-reinstall -v -C build-dir=build-py .
        ext=$(find build-py -name '_ext*.so' | head -1)
        { echo "extension: $ext"; ldd "$ext"; readelf -d "$ext" | grep NEEDED
          grep -E -- '-o python/_ext|_ext.*\.so' build-py/build.ninja | head -3; } >>"$OUT/python.log" 2>&1
        ldd "$ext" 2>&1 | grep -E 'libstdc|libgcc' | sed 's/^/python ext links: /' | tee -a "$summary"
      fi
      # A fresh inductor cache: compiled graphs cached by an earlier build call the op with its old schema.
      run_step "pytest" "$OUT/python.log" "${PYTEST_LIMIT:-500}" env PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" \
        python3 -m pytest python/tests -rs -q -p no:cacheprovider
      tail -25 "$OUT/python.log" >>"$summary"
      ;;
    *) note "unknown step: $step"; status=2 ;;
  esac
done
cat "$summary"
exit $status
