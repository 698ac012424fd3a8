#!/usr/bin/env bash
# One device call's set-up and steps in one line: the snapshot of a commit (benchmarks/snapshot.sh) unpacked to
# /tmp/tf, the peers' wheels installed, Triton's compile cache loaded (benchmarks/tcache.sh), then each STEP run
# there in turn under its own time limit, its output in $OUT/stepN.log (the last lines echoed), and the compile
# cache saved to $OUT at the end (as two 15 MiB parts; keep them with `bash benchmarks/tcache.sh keep DIR`).
#   device command:  bash benchmarks/devrun.sh [-t SECONDS] 'STEP' [-t SECONDS] 'STEP' ...
#   (carry [".snap", ".peers", ".tcache"]; -t sets the limit of the steps after it, 300 s by default; a step is a
#    shell command run with PYTHONPATH, TRIFORGE_COMMIT and PYTHONUNBUFFERED set; $OUT is the call's output folder)
# Exits nonzero when a step failed or hit its limit. DEVRUN_NO_CACHE=1 skips the compile cache's save. At most 8
# files come back from a call: past that the step logs are packed into logs.tgz, then everything into devrun-all.tgz.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/devrun-out}
mkdir -p "$OUT"
export OUT
cd "$root" || exit 1
bash benchmarks/tcache.sh load
work=${DEVRUN_DIR:-/tmp/tf}
if [ -f "$root/.snap/tree.tar" ]; then
  rm -rf "$work" && mkdir -p "$work"
  tar xf "$root/.snap/tree.tar" -C "$work"
  cp "$root/.snap/.commit" "$work/"
else  # no snapshot: the working tree as it travelled
  work=$root
fi
if ls "$root"/.peers/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$root"/.peers/*.whl 2> /dev/null
fi
cd "$work" || exit 1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
# a test that runs past this (a hung kernel) ends its worker, named, instead of the step (tests/conftest.py)
export TRIFORGE_TEST_TIMEOUT=${TRIFORGE_TEST_TIMEOUT:-240}
export TRIFORGE_COMMIT=${TRIFORGE_COMMIT:-$(cat .commit 2> /dev/null || echo unknown)}
echo "devrun: commit $TRIFORGE_COMMIT in $work"
limit=300
n=0
status=0
while [ $# -gt 0 ]; do
  if [ "$1" = "-t" ]; then
    limit=${2:?-t needs seconds}
    shift 2
    continue
  fi
  n=$((n + 1))
  SECONDS=0
  timeout "$limit" bash -c "$1" > "$OUT/step$n.log" 2>&1
  rc=$?
  [ $rc = 0 ] || status=1
  echo "== step $n (rc $rc, ${SECONDS}s of ${limit}s): $1"
  tail -"${DEVRUN_TAIL:-15}" "$OUT/step$n.log"
  shift
done
# the device returns at most 8 files from $OUT (session 48 lost a tune's JSON and the compile cache past that): the
# step logs go into one archive when there are more, then everything; the compile cache is saved only where its
# parts still fit
nfiles() { find "$OUT" -type f | wc -l; }
if [ "$(nfiles)" -gt 8 ] && ls "$OUT"/step*.log > /dev/null 2>&1; then
  (cd "$OUT" && tar czf logs.tgz step*.log && rm -f step*.log)
fi
if [ "$(nfiles)" -gt 8 ]; then  # (named apart from gpu.sh's own all.tgz, which it may hold; a file over 16 MiB does
  # not come back either: split in 15 MiB parts, joined with `cat devrun-all.tgz.part-* | tar xz`)
  if tar czf /tmp/devrun-all.tgz -C "$OUT" .; then
    find "$OUT" -mindepth 1 -delete
    if [ "$(stat -c %s /tmp/devrun-all.tgz)" -gt $((15 * 1024 * 1024)) ]; then
      split -b 15m /tmp/devrun-all.tgz "$OUT/devrun-all.tgz.part-" && rm -f /tmp/devrun-all.tgz
    else
      mv /tmp/devrun-all.tgz "$OUT/devrun-all.tgz"
    fi
    echo "devrun: more than 8 files: all of them in devrun-all.tgz ($(nfiles) file(s))"
  else
    echo "devrun: more than 8 files, and their archive failed: $OUT left as it is"
  fi
fi
if [ "${DEVRUN_NO_CACHE:-0}" != 1 ]; then
  rm -rf /tmp/devrun-tcache && mkdir -p /tmp/devrun-tcache
  if bash "$root/benchmarks/tcache.sh" save /tmp/devrun-tcache; then
    parts=$(find /tmp/devrun-tcache -type f | wc -l)
    if [ $(($(nfiles) + parts)) -le 8 ]; then
      mv /tmp/devrun-tcache/* "$OUT/" 2> /dev/null
    else
      echo "devrun: compile cache not saved ($parts parts would pass the 8-file limit)"
    fi
  else
    echo "devrun: compile cache not saved (its archive failed)"
  fi
fi
exit $status
