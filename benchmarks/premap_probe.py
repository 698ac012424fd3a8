"""mHC pre-map forward (K3: y[t, c] = sum_j h[t, j] x[t, j, c]) against torch.compile at T = 65536,
C = 2560, bf16: the library kernel, a flat variant (one contiguous block of the [T*C] output per
program, as Inductor generates elementwise kernels) over block sizes, warps and eviction hints, and
torch.compile's own kernel, whose source is printed (the thing to match).

    PYTHONPATH=. python benchmarks/premap_probe.py [--json PATH]
"""

import argparse
import json

import torch
import triton
import triton.language as tl
import triton.testing

from triforge import _runtime, bench
from triforge.ops import mhc as M

DEV = _runtime.default_device()


@triton.jit
def premap_flat_kernel(x_ptr, h_ptr, y_ptr, n, C: tl.constexpr, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    t = o // C
    c = o % C
    p_x = x_ptr + t * (4 * C) + c
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(4):
        b_h = tl.load(h_ptr + t * 4 + j, mask=m, other=0.0, eviction_policy="evict_last")
        if EVICT:
            b_x = tl.load(p_x + j * C, mask=m, other=0.0, eviction_policy="evict_first")
        else:
            b_x = tl.load(p_x + j * C, mask=m, other=0.0)
        acc += b_h * b_x.to(tl.float32)
    tl.store(y_ptr + o, acc.to(y_ptr.dtype.element_ty), mask=m)


def flat(x, h, block, warps, evict):
    T, _, C = x.shape
    y = torch.empty(T, C, device=x.device, dtype=x.dtype)
    premap_flat_kernel[(triton.cdiv(T * C, block),)](x, h, y, T * C, C=C, BLOCK=block, EVICT=evict, num_warps=warps)
    return y


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--T", type=int, default=65536)
    p.add_argument("--C", type=int, default=2560)
    args = p.parse_args()
    T, C = args.T, args.C
    dt = torch.bfloat16
    x = torch.randn(T, 4, C, device=DEV, dtype=dt)
    h = torch.rand(T, 4, device=DEV)
    nbytes = 5 * T * C * 2 + 16 * T
    copy = bench.peaks()["copy_tbps"] * 1e3
    ref = M.pre_map_fwd(x, h)

    def fn(x, h):
        return (h[:, :, None] * x.float()).sum(1).to(x.dtype)

    comp = torch.compile(fn)
    from torch._inductor.utils import run_and_get_code

    _, codes = run_and_get_code(comp, x, h)
    print("=== torch.compile's code ===")
    for code in codes:
        print(code[-6000:])
    rows = []

    def row(name, f):
        got = f()
        err = (got.float() - ref.float()).abs().max().item()
        t = triton.testing.do_bench(f, warmup=25, rep=300, return_mode="median")
        rows.append({"variant": name, "ms": t, "pct": 100 * nbytes / t / 1e9 / copy, "max_abs": err})

    for _ in range(2):  # twice: the spread between repeats is the noise to compare against
        row("library", lambda: M.pre_map_fwd(x, h))
        row("torch.compile", lambda: comp(x, h))
    for block in (512, 1024, 2048, 4096):
        for warps in (4, 8):
            for evict in (False, True):
                row(f"flat b{block} w{warps}{' evict' if evict else ''}", lambda b=block, w=warps, e=evict: flat(x, h, b, w, e))
    for r in rows:
        print(f"{r['variant']:<28} {r['ms']:8.4f} ms {r['pct']:6.1f}%  max_abs {r['max_abs']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "copy_GBps": copy, "device": torch.cuda.get_device_name(), "T": T, "C": C}, f, indent=1)


if __name__ == "__main__":
    main()
