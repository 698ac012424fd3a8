#!/usr/bin/env bash
# One device call on the lent GPU: peers, compiled tests, sanitizer, peaks, tuning, benchmark, report.
#   benchmarks/gpu.sh [STEP...]   steps: tests sanitize tune bench (default: all)
#   Each step runs under a time limit (TESTS_S, SANITIZE_S, TUNE_S, BENCH_S seconds) so one call fits the lease.
#   TESTS="tests/x.py" limits the tests step; TUNE="mhc swiglu" limits tuning to those kernel prefixes; OPS="rms_norm swiglu" limits tune/bench/sanitize to those ops; results land in $OUT.
set -uo pipefail
FINAL=${OUT:-/tmp/triforge-out}
OUT=/tmp/triforge-work
mkdir -p "$OUT" "$FINAL"
if ls .peers/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/*.whl
fi
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 TRIFORGE_CACHE=/tmp/triforge-cache
# the copy on the GPU machine has no .git: the caller writes the commit to .commit and carries it
export TRIFORGE_COMMIT=${TRIFORGE_COMMIT:-$(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}
STEPS=${*:-tests sanitize tune bench}
OPS=${OPS:-}
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
python3 -m triforge peaks | tee -a "$OUT/gpu.txt"
for step in $STEPS; do
  case $step in
    tests)
      timeout ${TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee "$OUT/tests.log" | tail -25 || status=1
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    sanitize)
      timeout ${SANITIZE_S:-240} compute-sanitizer --tool memcheck --print-limit 20 python3 -m triforge check --tier tiny --seed 1 $OPS > "$OUT/sanitize.log" 2>&1 || status=1
      tail -5 "$OUT/sanitize.log" ;;
    tune)
      SECONDS=0
      for k in $(python3 -c 'from triforge import tune; print(" ".join(tune.all_tunables()))'); do
        sel=${TUNE:-$OPS}
        if [ -n "$sel" ] && ! echo "$k" | grep -qE "^($(echo $sel | tr ' ' '|'))"; then continue; fi
        if [ $SECONDS -ge ${TUNE_S:-300} ]; then echo "tune: time is up, $k not tuned"; continue; fi
        python3 -m triforge tune "$k" --write --top 3 --json "$OUT/tune-$k.json" 2>&1 | tail -6
      done
      ;;
    bench)
      f="$OUT/bench-$(date -u +%Y-%m-%d).json"
      timeout ${BENCH_S:-420} python3 -m triforge bench $OPS --json "$f" || status=1
      [ -f "$f" ] && python3 -m triforge report "$f" --out "$OUT/report" && cp "$OUT/report/report.md" "$OUT/report.md" && cp "$OUT/report/roofline.png" "$OUT/roofline.png" ;;
  esac
done
# the device returns at most 8 files: one archive of everything, plus the files read first
tar czf "$FINAL/all.tgz" -C "$OUT" .
cp "$OUT"/bench-*.json "$OUT/report.md" "$OUT/gpu.txt" "$FINAL/" 2>/dev/null
cp triforge/configs/*.json "$FINAL/" 2>/dev/null
exit $status
