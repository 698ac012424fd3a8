"""Where RoPE's backward time goes on the GPU: the kernel launched directly, the custom op, the full
autograd path (eager and replayed from a CUDA graph), and Liger's backward, at the bench shape
(q 8x4096x32x128, k 8x4096x8x128, bf16). Median ms of triton.testing.do_bench (L2 flushed).

    PYTHONPATH=. python benchmarks/rope_probe.py
"""

import torch
import triton.testing

from triforge.ops import rope as R


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def graphed(fn):
    """fn captured in a CUDA graph: its replay has no host overhead per kernel."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main():
    B, T, HQ, HK, D = 8, 4096, 32, 8, 128
    dt = torch.bfloat16
    q = torch.randn(B, T, HQ, D, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(B, T, HK, D, device="cuda", dtype=dt, requires_grad=True)
    cos, sin = R.hf_cos_sin(T, D, dtype=dt, device="cuda")
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    rows = {}
    rows["kernel fwd (rope_launch)"] = ms(lambda: R.rope_launch(q.detach(), k.detach(), cos, sin))
    rows["kernel bwd (rope_launch)"] = ms(lambda: R.rope_launch(gq, gk, cos, sin, backward=True))
    rows["custom op rope_qk_bwd"] = ms(lambda: torch.ops.triforge.rope_qk_bwd(gq, gk, cos, sin))
    qo, ko = R.apply_rotary_qk(q, k, cos, sin)
    full = lambda: torch.autograd.grad((qo, ko), (q, k), (gq, gk), retain_graph=True)  # noqa: E731
    rows["autograd.grad (eager)"] = ms(full)
    rows["kernel bwd, CUDA graph"] = ms(graphed(lambda: R.rope_launch(gq, gk, cos, sin, backward=True)))
    try:
        from liger_kernel.ops.rope import LigerRopeFunction

        lq = q.detach().clone().requires_grad_(True)
        lk = k.detach().clone().requires_grad_(True)
        out = LigerRopeFunction.apply(lq.transpose(1, 2), lk.transpose(1, 2), cos[None], sin[None])
        rows["liger autograd.grad (eager)"] = ms(
            lambda: torch.autograd.grad(out, (lq, lk), (gq.transpose(1, 2), gk.transpose(1, 2)), retain_graph=True)
        )
    except ImportError:
        pass
    nbytes = 2 * 2 * (q.numel() + k.numel()) + 2 * 2 * cos.numel()
    for name, t in rows.items():
        print(f"{name:<32} {t:8.4f} ms  {nbytes / t / 1e6:7.0f} GB/s")


if __name__ == "__main__":
    main()
