"""The Gated DeltaNet backward's reverse recurrence (kernel 1, dh) by V-block (issue 4).

At B = 1 the dh kernel runs V / BV x HV programs (64 at BV 64 with HV = 32: half the H100's SMs), each a serial
loop over the sequence's chunks. V-blocks of 32 double the programs; they hit an illegal address on sm90 in the
first tune (2026-11-23). This probe runs one config (so a fault kills one process, not the sweep):

- a check at a small shape (B=1, T=200, H=2, HV=4, K=V=128, bf16) against the fallback config's output (same math,
  a different V split: each V column's arithmetic is the same, so the outputs should agree to rounding);
- CUDA-event time (bench.time_ms, median) at the bench shapes given.

    PYTHONPATH=. python benchmarks/deltanet_dh_probe.py --cfg BV=32,num_warps=4,num_stages=2 \
        [--shapes 1x32768x16x32 8x4096x16x32 1x8192x32x32] [--json PATH]
"""

import argparse
import json

import torch

from triforge import bench
from triforge.ops import deltanet as D
from triforge.ops.deltanet import chunk, chunk_bwd


def setup_tensors(B, T, H, HV, seed=0):
    """(qn, kn, w, gamma, do, scale, P): the dh kernel's inputs as the backward builds them (a saving forward with
    l2norm)."""
    gen = torch.Generator().manual_seed(seed)
    i = D._make_inputs({"B": B, "T": T, "H": H, "HV": HV}, torch.bfloat16, "cuda", gen, None)
    q, k, v, g, beta = (i[n] for n in ("q", "k", "v", "g", "beta"))
    scale = q.shape[-1] ** -0.5
    o, _, saved = chunk.chunk_fwd(q, k, v, g, beta, scale, l2norm=True, save=True)
    do = torch.randn_like(o)
    qn = saved["qn"] if saved["qn"].numel() else chunk_bwd.chunk_bwd_l2norm(q)[0]
    return qn, saved["kn"], saved["w"], saved["gamma"], do, scale, saved["P"]


def setup(B, T, H, HV, seed=0):
    """The dh launch at a shape (with the forward's P, as after a training forward), taking a config (None: the
    library's own)."""
    qn, kn, w, gamma, do, scale, p = setup_tensors(B, T, H, HV, seed)
    return lambda cfg: chunk_bwd.chunk_bwd_dh(qn, kn, w, gamma, do, None, scale, cfg=cfg, p=p)


def parse_cfg(text):
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--shapes", nargs="*", default=["1x32768x16x32", "8x4096x16x32", "1x8192x32x32"])
    ap.add_argument("--json")
    args = ap.parse_args()
    cfg = parse_cfg(args.cfg)
    out = {"cfg": cfg}
    run = setup(1, 200, 2, 4)
    ref = run({"BV": 64, "num_warps": 4, "num_stages": 2})
    got = run(cfg)
    torch.cuda.synchronize()
    diffs = {n: float((a.float() - b.float()).abs().max()) for n, a, b in zip(("dh", "dv_new"), ref, got)}
    finite = all(bool(torch.isfinite(t).all()) for t in got[:2])
    out["check"] = {"max_abs_diff": diffs, "finite": finite}
    print(f"{args.cfg}: check max|diff| dh {diffs['dh']:.3g} dv_new {diffs['dv_new']:.3g} finite {finite}", flush=True)
    out["us"] = {}
    for shape in args.shapes:
        B, T, H, HV = (int(v) for v in shape.split("x"))
        run = setup(B, T, H, HV)
        us = bench.time_ms(lambda: run(cfg))["median_ms"] * 1e3
        out["us"][shape] = us
        print(f"{args.cfg}: {shape} {us:.1f} us", flush=True)
        del run
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
