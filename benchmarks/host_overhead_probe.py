"""Host time per call of the RoPE paths (the bench's RoPE backward has a 0.227 ms minimum but a
0.264 ms median and 0.34 ms p95: the GPU waits on the host between calls). Measures, per call, the
host time (perf_counter over many calls on tiny tensors, so the GPU never limits) of each layer of
the backward path, ours and Liger's, and the bench-shaped GPU time (CUDA events, median/p95) of the
autograd backward with the custom op and with the launcher called directly.

    PYTHONPATH=. python benchmarks/host_overhead_probe.py [--json PATH]
"""

import argparse
import json
import time

import torch
import triton.testing

from triforge.ops import rope as R


def host_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def gpu_ms(fn):
    times = sorted(triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="all"))
    return {"median": times[len(times) // 2], "p95": times[int(0.95 * len(times))], "min": times[0]}


def paths(B, T, HQ, HK, D):
    q = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, T, HK, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = R.hf_cos_sin(T, D, dtype=torch.bfloat16, device="cuda")
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    qo, ko = R.apply_rotary_qk(q, k, cos, sin)
    out = {
        "rope_launch (kernel launch)": lambda: R.rope_launch(gq, gk, cos, sin, backward=True),
        "torch.ops.triforge.rope_qk_bwd (custom op)": lambda: torch.ops.triforge.rope_qk_bwd(gq, gk, cos, sin),
        "apply_rotary_qk forward (validate + op)": lambda: R.apply_rotary_qk(q.detach(), k.detach(), cos, sin),
        "autograd.grad through apply_rotary_qk": lambda: torch.autograd.grad((qo, ko), (q, k), (gq, gk), retain_graph=True),
    }
    qd, kd = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
    od = _Direct.apply(qd, kd, cos, sin)
    out["autograd.grad through a plain autograd.Function"] = (
        lambda: torch.autograd.grad(od, (qd, kd), (gq, gk), retain_graph=True))
    try:
        from liger_kernel.ops.rope import LigerRopeFunction

        lq = q.detach().clone().requires_grad_(True)
        lk = k.detach().clone().requires_grad_(True)
        lo = LigerRopeFunction.apply(lq.transpose(1, 2), lk.transpose(1, 2), cos[None], sin[None])
        lg = (gq.transpose(1, 2), gk.transpose(1, 2))
        out["liger autograd.grad"] = lambda: torch.autograd.grad(lo, (lq, lk), lg, retain_graph=True)
    except ImportError:
        pass
    return out


class _Direct(torch.autograd.Function):
    """The same kernels under a plain autograd.Function (launcher called directly, no custom op)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return R.rope_launch(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        gq, gk = R.rope_launch(dq.contiguous(), dk.contiguous(), cos, sin, backward=True)
        return gq, gk, None, None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    res = {"host_us_tiny": {}, "gpu_ms_bench_shape": {}}
    for name, fn in paths(1, 16, 4, 2, 128).items():
        res["host_us_tiny"][name] = host_us(fn)
    big = paths(8, 4096, 32, 8, 128)
    for name in ("rope_launch (kernel launch)", "autograd.grad through apply_rotary_qk", "liger autograd.grad",
                 "autograd.grad through a plain autograd.Function"):
        if name in big:
            res["gpu_ms_bench_shape"][name] = gpu_ms(big[name])
    for name, us in res["host_us_tiny"].items():
        print(f"host {name:<52} {us:8.1f} us/call")
    for name, t in res["gpu_ms_bench_shape"].items():
        print(f"gpu  {name:<52} median {t['median']:.4f} p95 {t['p95']:.4f} min {t['min']:.4f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
