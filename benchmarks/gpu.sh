#!/usr/bin/env bash
# One device call on the lent GPU: compiled tests, sanitizer, peaks, tuning, benchmark, report.
#   benchmarks/gpu.sh [STEP...]   steps: tests realtier sanitize tune tunelist bench attnprobe scripts ncu qwen2 (default: tests sanitize tune bench)
# Each step runs under a time limit (TESTS_S, REAL_S, SANITIZE_S, TUNE_S, BENCH_S, QWEN2_S seconds) so one
# call fits the lease. Selection:
#   TESTS="tests/x.py ..."  files for the tests step (run with pytest-xdist, TEST_WORKERS processes, when installed)
#   TESTS_K="expr"          pytest -k filter for the tests step; REAL_K="expr": for the realtier step (tests/test_gpu.py)
#   OPS="rms_norm swiglu"   ops (or families) for tune/bench/sanitize; TUNE="mhc swiglu": kernel prefixes to tune,
#                           TUNE_ARGS="--shape T=65536,C=1024" at a shape (TUNE_TAG names its JSON files);
#                           TUNE_BUDGET=SECONDS caps each kernel's tune (tune --budget),
#                           TUNE_FOR_DEVICE=1 writes to the device model's file (configs/sm90.h200.json), not the arch's
# Results land in $OUT: all.tgz (everything) plus the bench JSON, report and configs.
# Run from a snapshot of a commit (benchmarks/snapshot.sh writes .snap/ with the tree and .commit).
set -uo pipefail
FINAL=${OUT:-/tmp/triforge-out}
OUT=/tmp/triforge-work
mkdir -p "$OUT" "$FINAL"
if ls .peers/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/*.whl
fi
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 TRIFORGE_CACHE=/tmp/triforge-cache TRIFORGE_FAILLOG=$OUT/failures.log
# a test that runs past this (a hung kernel) ends its worker, named, instead of the step (tests/conftest.py)
export TRIFORGE_TEST_TIMEOUT=${TRIFORGE_TEST_TIMEOUT:-240}
# the copy on the GPU machine has no .git: the caller writes the commit to .commit
export TRIFORGE_COMMIT=${TRIFORGE_COMMIT:-$(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}
STEPS=${*:-tests sanitize tune bench}
OPS=${OPS:-}
status=0
script_i=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
echo "commit $TRIFORGE_COMMIT" | tee -a "$OUT/gpu.txt"
python3 -m triforge peaks | tee -a "$OUT/gpu.txt"
run_script() {  # one benchmark script: its output to $OUT/<name>.log, its JSON (argument {OUT}) to $OUT
  local n; n=$(basename "$1" .py)-$((++script_i))
  local args=("${@//\{OUT\}/$OUT}")
  SECONDS=0
  timeout "${SCRIPT_S:-240}" python3 "${args[@]}" > "$OUT/$n.log" 2>&1 || status=1
  echo "$n: ${SECONDS}s"; tail -${SCRIPT_TAIL:-25} "$OUT/$n.log"
}
kexpr=(); rexpr=(); fordev=()
[ "${TUNE_FOR_DEVICE:-0}" = 1 ] && fordev=(--for-device)
[ -n "${TESTS_K:-}" ] && kexpr=(-k "$TESTS_K")
[ -n "${REAL_K:-}" ] && rexpr=(-k "$REAL_K")
for step in $STEPS; do
  SECONDS=0
  case $step in
    tests)
      workers=()
      python3 -c 'import xdist' 2>/dev/null && workers=(-n "${TEST_WORKERS:-8}")
      # in parallel: everything but the big tests (LLM shapes, GBs to tens of GB each: they run in realtier; under
      # -n 12 on the H200 they ran out of memory together, session 44, while the other 308 gpu-marked tests passed)
      timeout "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider "${workers[@]}" "${kexpr[@]}" -m "not big" \
        ${TESTS:-tests} > "$OUT/tests.log" 2>&1
      rc=$?; [ $rc = 0 ] || status=1
      echo "tests: rc=$rc in ${SECONDS}s"; tail -2 "$OUT/tests.log"; grep "^=====" "$OUT/failures.log" 2>/dev/null | head -40 ;;
    realtier)
      # one process: the big tests of TESTS, then tests/test_gpu.py's (real-tier parity of every op, spills)
      timeout "${REAL_S:-300}" python3 -m pytest -q -p no:cacheprovider -m big "${rexpr[@]}" ${TESTS:-tests} tests/test_gpu.py \
        > "$OUT/realtier.log" 2>&1
      rc=$?; [ $rc = 0 ] || status=1
      echo "realtier: rc=$rc in ${SECONDS}s"; tail -2 "$OUT/realtier.log"; grep "^=====.*test_gpu" "$OUT/failures.log" 2>/dev/null | head -30 ;;
    sanitize)
      timeout "${SANITIZE_S:-240}" compute-sanitizer --tool memcheck --print-limit 20 \
        python3 -m triforge check --tier tiny --seed 1 $OPS > "$OUT/sanitize.log" 2>&1 || status=1
      echo "sanitize: ${SECONDS}s"; grep -E "ERROR SUMMARY|FAIL" "$OUT/sanitize.log" | head; tail -3 "$OUT/sanitize.log" ;;
    tune)  # TUNE_ARGS may hold several argument sets separated by ';' (e.g. two shapes): each set tunes every selected kernel
      IFS=';' read -ra targs <<< "${TUNE_ARGS:- }"
      ti=0
      for ta in "${targs[@]}"; do
        ti=$((ti + 1))
        for k in $(python3 -c 'from triforge import tune; print(" ".join(tune.all_tunables()))'); do
          sel=${TUNE:-$OPS}
          if [ -n "$sel" ] && ! echo "$k" | grep -qE "^($(echo $sel | tr ' ' '|'))"; then continue; fi
          if [ $SECONDS -ge "${TUNE_S:-300}" ]; then echo "tune: time is up, $k ($ta) not tuned"; continue; fi
          python3 -m triforge tune "$k" $ta --write "${fordev[@]}" ${TUNE_BUDGET:+--budget "$TUNE_BUDGET"} --top 3 --json "$OUT/tune-$k${TUNE_TAG:-}-$ti.json" 2>&1 | tail -4
        done
      done
      ;;
    tunelist)  # TUNE_LIST="kernel:B=1,T=32768 kernel2:M=4096 ...": each kernel at its own shape (written, as tune)
      ti=0
      for kv in ${TUNE_LIST:-}; do
        ti=$((ti + 1)); k=${kv%%:*}; shape=${kv#*:}
        if [ $SECONDS -ge "${TUNE_S:-300}" ]; then echo "tunelist: time is up, $k ($shape) not tuned"; continue; fi
        python3 -m triforge tune "$k" --shape "$shape" --write "${fordev[@]}" --top 3 --json "$OUT/tune-$k-$ti.json" 2>&1 | tail -5
      done ;;
    bench)
      f="$OUT/bench-$(date -u +%Y-%m-%d)-$TRIFORGE_COMMIT.json"
      timeout "${BENCH_S:-420}" python3 -m triforge bench $OPS --json "$f" > "$OUT/bench.log" 2>&1 || status=1
      echo "bench: ${SECONDS}s"; tail -4 "$OUT/bench.log"
      [ -f "$f" ] && python3 -m triforge report "$f" --out "$OUT/report" > /dev/null && cp "$OUT/report/report.md" "$OUT/report.md"
      if [ -n "${BENCH2:-}" ]; then  # a second sweep, e.g. BENCH2="mhc --T 65536 --C 1024"
        f2="$OUT/bench-$(date -u +%Y-%m-%d)-$TRIFORGE_COMMIT-2.json"
        timeout "${BENCH2_S:-200}" python3 -m triforge bench $BENCH2 --json "$f2" > "$OUT/bench2.log" 2>&1 || status=1
        echo "bench2: ${SECONDS}s"; tail -4 "$OUT/bench2.log"
      fi ;;
    attnprobe)
      timeout "${PROBE_S:-120}" python3 benchmarks/attention_probe.py --json "$OUT/attention-probe.json" > "$OUT/attnprobe.log" 2>&1 || status=1
      echo "attnprobe: ${SECONDS}s"; grep -E "FAIL|Error|max by" "$OUT/attnprobe.log" | head -40; grep -c PASS "$OUT/attnprobe.log" ;;
    scripts)  # SCRIPTS="benchmarks/a.py benchmarks/b.py --flag": each file with the arguments after it
      cur=()
      for sc in ${SCRIPTS:-}; do
        if [[ $sc == *.py && ${#cur[@]} -gt 0 ]]; then run_script "${cur[@]}"; cur=(); fi
        cur+=("$sc")
      done
      [ ${#cur[@]} -gt 0 ] && run_script "${cur[@]}" ;;
    ncu)  # NCU="target:kernel_regex ...": Nsight Compute on one launch of each (benchmarks/ncu_targets.py)
      for tk in ${NCU:-}; do
        t=${tk%%:*}; k=${tk#*:}
        timeout "${NCU_S:-120}" ncu --clock-control none -k "regex:$k" -s 2 -c 1 --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
          --section SchedulerStats python3 benchmarks/ncu_targets.py "$t" > "$OUT/ncu-$t.log" 2>&1 || status=1
        if [ -n "${NCU_FULL:-}" ]; then  # also the full set, and per-SASS-instruction counters (stall samples) as CSV
          timeout "${NCU_S:-120}" ncu --clock-control none -k "regex:$k" -s 2 -c 1 --set full --import-source no \
            -o "$OUT/ncu-$t" python3 benchmarks/ncu_targets.py "$t" > "$OUT/ncu-$t-full.log" 2>&1 || status=1
          ncu -i "$OUT/ncu-$t.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-$t-sass.csv" 2>&1 \
            || ncu -i "$OUT/ncu-$t.ncu-rep" --page source --csv > "$OUT/ncu-$t-sass.csv" 2>&1 || status=1
          ncu -i "$OUT/ncu-$t.ncu-rep" --page details > "$OUT/ncu-$t-details.txt" 2>&1 || status=1
        fi
        echo "ncu $t: ${SECONDS}s"; grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|Issued Ipc|No Eligible|Waves Per SM|Block Limit" "$OUT/ncu-$t.log" | head -24
      done ;;
    qwen2)
      timeout "${QWEN2_S:-300}" python3 benchmarks/qwen2_decode.py --json "$OUT/qwen2-decode-$(date -u +%Y-%m-%d)-$TRIFORGE_COMMIT.json" \
        ${QWEN2_ARGS:-} > "$OUT/qwen2.log" 2>&1 || status=1
      echo "qwen2: ${SECONDS}s"; tail -30 "$OUT/qwen2.log" ;;
  esac
done
# the device returns at most 8 files: one archive of everything, plus the files read first
tar czf "$FINAL/all.tgz" -C "$OUT" .
cp "$OUT"/bench-*.json "$OUT"/qwen2-decode-*.json "$OUT/report.md" "$FINAL/" 2>/dev/null
cp triforge/configs/*.json "$FINAL/" 2>/dev/null
exit $status
