"""The Gluon mma.sync ternary kernel (benchmarks/ternary_m8_kernel.py) against the library's at M <= 8 (issue 6).

For each shape and M: every config of the grid checked against the float64 product (testing.compare) and timed as
CUDA-graph replay (weights and x rotated past the L2, as ``triforge bench``), beside the library's ``ternary.matmul``
re-timed in the same process; the fastest printed per shape, every row in the JSON.

    PYTHONPATH=. python benchmarks/ternary_m8_probe.py [--json PATH] [--shapes 8192x8192 ...] [--m 1 4]
"""

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ternary_m8_kernel import ternary_matmul_m8  # noqa: E402
from ternary_tc_probe import graph_us, weight_sets  # noqa: E402

from triforge.ops import ternary as T  # noqa: E402
from triforge.ops.ternary.reference import matmul_dense_ref  # noqa: E402
from triforge.testing import compare  # noqa: E402


def grid(which):
    if which == "small":
        return [dict(WARPS=1, BLOCKS_K=2, STAGES=8)]
    return [dict(WARPS=w, BLOCKS_K=b, STAGES=st, splits=sp, XS=xs)
            for w, b, st, sp, xs in itertools.product((1, 4), (1, 2), (4, 8), (1, 2, 4), (0, 1))]


def run(N, K, ms, gen, which):
    tts, codes = weight_sets(N, K, gen)
    rows = []
    for M in ms:
        xs = [torch.randn(M, K, generator=gen).cuda().to(torch.bfloat16) for _ in tts]
        ref = matmul_dense_ref(xs[0], tts[0])
        y_lib = T.matmul(xs[0], tts[0])
        lib_ok = compare("lib", ref, y_lib, dtype=torch.bfloat16, verbose=False).ok
        lib_us = graph_us([lambda t=t, x=x: T.matmul(x, t) for t, x in zip(tts, xs)])
        print(f"N={N} K={K} M={M}: library {lib_us:.2f} us (parity {'ok' if lib_ok else 'FAIL'})", flush=True)
        timed = []
        for cfg in grid(which):
            try:
                y = ternary_matmul_m8(xs[0], tts[0], codes[0], cfg, pdl=False)
                c = compare("m8", ref, y, dtype=torch.bfloat16, verbose=False)
                same = torch.equal(y, y_lib)
                us = graph_us([lambda t=t, c_=c_, x=x: ternary_matmul_m8(x, t, c_, cfg, pdl=True)
                               for t, c_, x in zip(tts, codes, xs)]) if c.ok else None
                timed.append({"config": cfg, "ok": c.ok, "max_abs": c.max_abs, "equal_lib": same, "us": us})
            except Exception as e:  # out of resources etc.: reported, skipped
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                timed.append({"config": cfg, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}", "us": None})
        good = sorted((t for t in timed if t["us"] is not None), key=lambda t: t["us"])
        print(f"N={N} K={K} M={M}: {len(good)} of {len(timed)} configs timed, parity failures "
              f"{sum(not t['ok'] for t in timed)}; library {lib_us:.2f} us", flush=True)
        for t in good[:8]:
            print(f"   {t['us']:7.2f} us ({lib_us / t['us']:.3f}x library) equal-bits {t['equal_lib']}  {t['config']}",
                  flush=True)
        rows.append({"N": N, "K": K, "M": M, "library_us": lib_us, "library_ok": lib_ok, "timed": timed,
                     "best": good[0] if good else None})
    del tts, codes
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--shapes", nargs="*", default=["8192x8192"])
    ap.add_argument("--m", nargs="*", type=int, default=[1])
    ap.add_argument("--grid", default="main", choices=["main", "small"])
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    rows = []
    for s in args.shapes:
        N, K = (int(v) for v in s.split("x"))
        rows += run(N, K, args.m, gen, args.grid)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
