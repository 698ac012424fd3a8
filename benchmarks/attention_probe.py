"""Diagnose attention backward parity on the GPU: each gradient against the float64 reference for
several launch configs, causal and not, with the error located by query-row block.

    PYTHONPATH=. python benchmarks/attention_probe.py [--json FILE]

Variants per case: the fallback configs; num_stages=1 for the backward kernels (no software
pipelining); the dots computed in fp32 (UPCAST, as the CPU interpreter does). A variant that passes
where the fallback fails points at the compiler (pipelining, wgmma layout), one that fails the same
way at the kernel's math.
"""

import argparse
import json

import torch

from triforge.ops import attention as A
from triforge.testing import compare


def grads(q, k, v, do, causal, cfgs, upcast=False):
    D, dt = q.shape[-1], q.dtype
    scale = D**-0.5
    flags = A._flags
    if upcast:
        A._flags = lambda dtype: {"UPCAST": dtype == torch.bfloat16, "IEEE": dtype == torch.float32}
    try:
        o, lse, ores = A.attn_fwd(q, k, v, causal, scale, cfg=cfgs["fwd"], residual=True)
        delta = A.attn_bwd_preprocess(o, do, ores)
        dk, dv = A.attn_bwd_dkdv(q, k, v, do, lse, delta, causal, scale, cfg=cfgs["dkdv"])
        dq = A.attn_bwd_dq(q, k, v, do, lse, delta, causal, scale, cfg=cfgs["dq"])
    finally:
        A._flags = flags
    return o, dq, dk, dv


def row_blocks(ref, got, block=128):
    """Max |got - ref| per block of query rows (dim 1), as a short list."""
    d = (got.double() - ref).abs().amax(dim=(0, 2, 3))
    S = d.shape[0]
    return [round(float(d[i : i + block].max()), 4) for i in range(0, S, block)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    cases = [(1, 4, 1024, 64, True), (1, 4, 1024, 64, False), (1, 4, 2048, 128, True), (1, 2, 1000, 128, True)]
    for B, H, S, D, causal in cases:
        torch.manual_seed(S + D)
        dt = torch.bfloat16
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=dt) for _ in range(3))
        do = torch.randn(B, S, H, D, device="cuda", dtype=dt)
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        st = A.attention_ref(q64, k64, v64, causal)
        ref = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(st["o"], (q64, k64, v64), do.double())))
        base = {n: A.fallback_config(f"flash_attn_{kn}", D, dt) for n, kn in (("fwd", "fwd"), ("dkdv", "bwd_dkdv"), ("dq", "bwd_dq"))}
        variants = {
            "fallback": (base, False),
            "bwd_stages1": ({**base, "dkdv": {**base["dkdv"], "num_stages": 1}, "dq": {**base["dq"], "num_stages": 1}}, False),
            "dq_64x64": ({**base, "dq": {**base["dq"], "BLOCK_M": 64, "BLOCK_N": 64}}, False),
            "upcast_fp32_dots": (base, True),
        }
        for name, (cfgs, upcast) in variants.items():
            try:
                o, dq, dk, dv = grads(q, k, v, do, causal, cfgs, upcast)
                torch.cuda.synchronize()
            except Exception as e:  # a config that does not compile is reported, not fatal
                print(f"{name}: {type(e).__name__}: {str(e)[:200]}")
                continue
            tag = f"B{B} H{H} S{S} D{D} {'causal' if causal else 'full'} {name}"
            for n, got in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
                r = st["o"] if n == "o" else ref[n]
                res = compare(f"{tag} {n}", r, got, dtype=dt, verbose=False)
                row = {"case": tag, "tensor": n, **res.row()}
                if not res.ok:
                    row["max_by_row_block"] = row_blocks(r, got)
                rows.append(row)
                print(("PASS " if res.ok else "FAIL ") + f"{tag:<44} {n:<3} rel_rms={res.rel_rms:.2e} "
                      f"max={res.max_abs:.2e} at {res.max_abs_at} over={res.n_over}"
                      + ("" if res.ok else f"\n      max by 128-row block: {row['max_by_row_block']}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
