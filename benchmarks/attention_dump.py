"""Dump one causal attention case from the GPU (inputs, the kernel's o / lse / dq / dk / dv) for offline
analysis of its error structure against the float64 reference on a CPU.

    PYTHONPATH=. python benchmarks/attention_dump.py OUT_DIR [--B 2 --H 8 --S 2048 --D 64]

Writes OUT_DIR/attn-{o,lse,dq,dk,dv}.pt (the inputs are drawn on the CPU from seed 0: rebuild them),
and prints the parity rows (tensor-wide rms and per-element magnitudes) computed on the GPU, with
the worst elements and their offsets in the key/query blocks.
"""

import argparse
import os

import torch

from triforge.ops import attention as A
from triforge.testing import compare


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    for n, d in (("B", 2), ("H", 8), ("S", 2048), ("D", 64)):
        p.add_argument(f"--{n}", type=int, default=d)
    a = p.parse_args()
    gen = torch.Generator().manual_seed(0)  # drawn on the CPU: the inputs can be rebuilt offline
    dt = torch.bfloat16
    q, k, v, do = (torch.randn(a.B, a.S, a.H, a.D, generator=gen).to("cuda", dt) for _ in range(4))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o, lse = A.flash_attn_func(*leaves, causal=True, return_lse=True)
    dq, dk, dv = torch.autograd.grad(o, leaves, do)
    os.makedirs(a.out, exist_ok=True)
    for name, t in (("o", o.detach()), ("lse", lse.detach()), ("dq", dq), ("dk", dk), ("dv", dv)):
        torch.save(t.cpu(), f"{a.out}/attn-{name}.pt")  # one file each: the device returns files up to 16 MiB
    r64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    st = A.attention_ref_chunked(*r64, causal=True)
    ref = torch.autograd.grad(st["o"], r64, do.double())
    mags = A.attention_magnitudes_chunked(*(t.double() for t in (q, k, v)), do.double(), True)
    for name, r, g in zip(("dq", "dk", "dv"), ref, (dq, dk, dv)):
        for label, sc in (("tensor rms", None), ("magnitudes", mags[name])):
            res = compare(f"{name} {label}", r, g, dtype=dt, scale=sc, verbose=False)
            print(f"{'PASS' if res.ok else 'FAIL'} {res.name:<16} rel_rms={res.rel_rms:.2e} max={res.max_abs:.2e} "
                  f"at {res.max_abs_at} over={res.n_over}")
        # the worst elements against the bound (0.05 * magnitude + 0.05 * |ref|): where they sit
        ratio = (g.double() - r).abs() / (0.05 * mags[name] + 0.05 * r.abs())
        top = ratio.flatten().topk(8)
        for val, flat in zip(top.values.tolist(), top.indices.tolist()):
            b, s_, h, d = (int(i) for i in torch.unravel_index(torch.tensor(flat), r.shape))
            print(f"   {name}[{b},{s_},{h},{d}] err/bound={val:.2f} ref={float(r[b, s_, h, d]):+.4e} "
                  f"got={float(g[b, s_, h, d]):+.4e} scale={float(mags[name][b, s_, h, d]):.3e} "
                  f"(s mod 64 = {s_ % 64}, mod 128 = {s_ % 128})")

if __name__ == "__main__":
    main()
