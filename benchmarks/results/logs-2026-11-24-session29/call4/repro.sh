set -x
cd /tmp/tf
export PYTHONPATH=.:/tmp/site
for M in 1 16; do
CUDA_LAUNCH_BLOCKING=1 timeout 120 python3 -m triforge bench ternary_matmul --M $M --N 4864 --K 896 > $OUT/blk-$M.log 2>&1; echo "blocking M=$M rc=$?"; grep -E "Error|error|ternary_matmul" $OUT/blk-$M.log | head -8
done
timeout 100 python3 - > $OUT/noextras.log 2>&1 <<'PY'
import torch
from triforge import registry, bench
import triforge.ops.ternary
import dataclasses
spec = dataclasses.replace(registry.get("ternary_matmul"), extras=None)
for M in (1, 4):
    rows = bench.bench_op(spec, dtype=torch.bfloat16, modes=("fwd",), shape={"M": M, "N": 4864, "K": 896})
    torch.cuda.synchronize()
    for r in rows: print(M, r["impl"], r.get("median_ms"), r.get("error"))
PY
echo "noextras rc=$?"; tail -12 $OUT/noextras.log
