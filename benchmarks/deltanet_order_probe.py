"""Which grid order the intra kernel's launcher picks at the bench shapes (ORDER 2), and the chunked forward's time
under each sm90 ORDER (0, 1, 2) in one process (issue 4, session 45).

    PYTHONPATH=. python3 benchmarks/deltanet_order_probe.py [OUT.json [BxTxHxHV ...]]

Each forward runs twice: on q, k, v, g, beta alone ("plain", session 45's call 7) and with the bench's whole input
set (an initial state, the final state returned: "bench"); the orders run 0, 1, 2 and then 2, 1, 0 again. In
session 45 ORDER 1 measured 1.358 against 1.377 ms for ORDER 0 in the plain form at (1, 32768, 16, 32), while
`triforge bench` (the bench form) measured 1.377-1.378 ms both before and after ORDER 2 took 1 there: this probe's
second form and its reversed pass are the check of that.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_bwd_sweep import bench_ms  # noqa: E402

from triforge import _runtime  # noqa: E402
from triforge.ops import deltanet as D  # noqa: E402
from triforge.ops.deltanet import chunk  # noqa: E402

rows = []
for shape in sys.argv[2:] or ("1x32768x16x32", "8x4096x16x32"):
    B, T, H, HV = (int(v) for v in shape.split("x"))
    x = D._make_inputs("real", torch.bfloat16, "cuda", torch.Generator().manual_seed(0),
                       ((B, T, H, HV, 128, 128), (B, T, H, HV, 128, 128)))
    base = chunk.fwd_config("gated_delta_rule_fwd_intra", 128, 128, torch.bfloat16)
    picked = []
    real = chunk._intra_order
    chunk._intra_order = lambda *a: picked.append(real(*a)) or picked[-1]
    try:
        # two passes in opposite orders: a first measurement in a fresh process may run slow (in session 45 the
        # first config timed, ORDER 0 here and ours in the bench, both read 1.377 ms)
        for pas, order in enumerate((0, 1, 2, 2, 1, 0)):
            cfg = dict(base, ORDER=order)
            orig = chunk.fwd_config
            chunk.fwd_config = lambda kernel, *a, **k: (cfg if kernel == "gated_delta_rule_fwd_intra"
                                                        else orig(kernel, *a, **k))
            try:
                for form in ("plain", "bench"):
                    if form == "plain":
                        fn = lambda: D.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                              use_qk_l2norm_in_kernel=True)
                    else:
                        fn = lambda: D.chunk_gated_delta_rule(**x)
                    picked.clear()
                    fn()
                    ms = bench_ms(fn)
                    rows.append({"shape": shape, "pass": pas // 3, "form": form, "ORDER": order,
                                 "picked": sorted(set(picked)), "ms": ms,
                                 "resident": list(chunk._RESIDENT.values()), "sms": _runtime.num_sms()})
                    print(json.dumps(rows[-1]), flush=True)
            finally:
                chunk.fwd_config = orig
    finally:
        chunk._intra_order = real
if len(sys.argv) > 1:
    json.dump(rows, open(sys.argv[1], "w"), indent=1)
print(f"\n{'shape':>14} {'pass':>4} {'form':>6} {'ORDER':>5} {'picked':>8} {'fwd ms':>8}")
for r in rows:
    print(f"{r['shape']:>14} {r['pass']:>4} {r['form']:>6} {r['ORDER']:>5} {str(r['picked']):>8} {r['ms']:8.3f}")
