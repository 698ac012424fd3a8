"""Issue 2's two missed rows, probed in one process: RoPE (>= 1.0x Liger) and the RMSNorm + residual
backward (>= 90% of copy). Times launch-config grids of the library kernels and candidate kernel
variants against Liger and torch.compile, and checks every variant's outputs against the library's.

    PYTHONPATH=. python benchmarks/rowwise_probe.py [--json PATH]

Median ms of triton.testing.do_bench (L2 flushed between runs); bf16; the bench shapes
(RoPE q 8x4096x32x128 + k 8x4096x8x128; RMSNorm 65536x4096). GB/s on the byte model of the bench.
"""

import argparse
import json

import torch
import triton
import triton.language as tl
import triton.testing

from triforge import _runtime, bench
from triforge.ops import norm as N
from triforge.ops import rope as R


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")


# ----------------------------------------------------------------------------- RoPE variants


@triton.jit
def rope_flat_kernel(
    x_ptr, cos_ptr, sin_ptr, o_ptr, n_elem, T,
    D: tl.constexpr, HD: tl.constexpr, BLOCK: tl.constexpr, BACKWARD: tl.constexpr, EVICT: tl.constexpr,
):
    """One contiguous BLOCK of the flattened [B*T, H, D] tensor per program (torch.compile's shape of
    work); the rotate-half partner is a second load of the same lines, cos/sin come from L2."""
    HALF: tl.constexpr = D // 2
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n_elem
    d = (idx % D).to(tl.int32)
    t = (idx // HD) % T
    first = d < HALF
    partner = tl.where(first, idx + HALF, idx - HALF)
    d_p = tl.where(first, d + HALF, d - HALF)
    if EVICT:
        x = tl.load(x_ptr + idx, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        x = tl.load(x_ptr + idx, mask=m, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + partner, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * D + d, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
    if BACKWARD:
        # dx[d] = dy[d] c[d] + dy[d+H] s[d+H] (d < H);  dy[d] c[d] - dy[d-H] s[d-H] (d >= H)
        sp = tl.load(sin_ptr + t * D + d_p, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
        y = x * c + tl.where(first, xp * sp, -xp * sp)
    else:
        s = tl.load(sin_ptr + t * D + d, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
        y = x * c + tl.where(first, -xp * s, xp * s)
    tl.store(o_ptr + idx, y.to(o_ptr.dtype.element_ty), mask=m)


def rope_flat(q, k, cos, sin, backward=False, block=1024, warps=4, evict=False):
    outs = []
    for x in (q, k):
        o = torch.empty_like(x)
        B, T, H, D = x.shape
        n = x.numel()
        rope_flat_kernel[(triton.cdiv(n, block),)](
            x, cos, sin, o, n, T, D=D, HD=H * D, BLOCK=block, BACKWARD=backward, EVICT=evict, num_warps=warps
        )
        outs.append(o)
    return tuple(outs)


@triton.jit
def _heads_evict(x_ptr, o_ptr, base, H, D, HALF, b_c1, b_c2, b_s1, b_s2, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    o_d = tl.arange(0, BLOCK_D)
    for h0 in range(0, H, BLOCK_H):
        o_h = h0 + tl.arange(0, BLOCK_H)
        o_1 = base + (o_h * D)[:, None] + o_d[None, :]
        m = (o_h < H)[:, None] & (o_d < HALF)[None, :]
        b_x1 = tl.load(x_ptr + o_1, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
        b_x2 = tl.load(x_ptr + o_1 + HALF, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
        tl.store(o_ptr + o_1, (b_x1 * b_c1 - b_x2 * b_s1).to(o_ptr.dtype.element_ty), mask=m, cache_modifier=".cs")
        tl.store(o_ptr + o_1 + HALF, (b_x2 * b_c2 + b_x1 * b_s2).to(o_ptr.dtype.element_ty), mask=m, cache_modifier=".cs")


@triton.jit
def rope_row_evict_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, T, HQ, HK, D, HALF,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr,
):
    """The library kernel at one position per program with streaming cache hints (loads evict-first,
    stores .cs) and cos/sin kept (evict-last)."""
    i_p = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    o_cs = (i_p % T) * D + o_d
    m_cs = o_d < HALF
    b_c1 = tl.load(cos_ptr + o_cs, mask=m_cs, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
    b_c2 = tl.load(cos_ptr + o_cs + HALF, mask=m_cs, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
    s_lo = tl.load(sin_ptr + o_cs, mask=m_cs, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
    s_hi = tl.load(sin_ptr + o_cs + HALF, mask=m_cs, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
    if BACKWARD:
        b_s1 = -s_hi
        b_s2 = -s_lo
    else:
        b_s1 = s_lo
        b_s2 = s_hi
    _heads_evict(q_ptr, qo_ptr, i_p * HQ * D, HQ, D, HALF, b_c1, b_c2, b_s1, b_s2, BLOCK_HQ, BLOCK_D)
    _heads_evict(k_ptr, ko_ptr, i_p * HK * D, HK, D, HALF, b_c1, b_c2, b_s1, b_s2, BLOCK_HK, BLOCK_D)


def rope_row_evict(q, k, cos, sin, backward=False, warps=4):
    B, T, HQ, D = q.shape
    HK = k.shape[2]
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    bhq, bhk, bd = R._blocks(HQ, HK, D)
    rope_row_evict_kernel[(B * T,)](
        q, k, cos, sin, qo, ko, T, HQ, HK, D, D // 2,
        BLOCK_HQ=bhq, BLOCK_HK=bhk, BLOCK_D=bd, BACKWARD=backward, num_warps=warps,
    )
    return qo, ko


def probe_rope(rows, checks):
    B, T, HQ, HK, D = 8, 4096, 32, 8, 128
    dt = torch.bfloat16
    q = torch.randn(B, T, HQ, D, device="cuda", dtype=dt)
    k = torch.randn(B, T, HK, D, device="cuda", dtype=dt)
    cos, sin = R.hf_cos_sin(T, D, dtype=dt, device="cuda")
    nbytes = 2 * 2 * (q.numel() + k.numel()) + 2 * 2 * cos.numel()
    for bwd in (False, True):
        mode = "bwd" if bwd else "fwd"
        ref = R.rope_launch(q, k, cos, sin, backward=bwd)
        variants = {}
        for w in (2, 4, 8):
            for r in (1, 2, 4):
                variants[f"lib w{w} rows{r}"] = (lambda w=w, r=r: R.rope_launch(q, k, cos, sin, bwd, {"num_warps": w, "ROWS": r}))
        for w in (2, 4, 8):
            variants[f"row+evict w{w}"] = (lambda w=w: rope_row_evict(q, k, cos, sin, bwd, w))
        for blk, w in ((512, 4), (1024, 4), (2048, 8), (4096, 8)):
            for ev in (False, True):
                variants[f"flat {blk} w{w}{' evict' if ev else ''}"] = (
                    lambda blk=blk, w=w, ev=ev: rope_flat(q, k, cos, sin, bwd, blk, w, ev))
        try:
            from liger_kernel.ops.rope import rope_backward, rope_forward

            ql, kl = q.transpose(1, 2).clone(), k.transpose(1, 2).clone()  # Liger rotates in place
            lfn = rope_backward if bwd else rope_forward
            variants["liger (in place)"] = (lambda lfn=lfn: lfn(ql, kl, cos[None], sin[None])[:2])
        except ImportError:
            pass
        if not bwd:
            comp = torch.compile(lambda q, k, c, s: (R._rope_ref_one(q, c, s), R._rope_ref_one(k, c, s)))
            variants["torch.compile"] = (lambda: comp(q, k, cos, sin))
        for name, fn in variants.items():
            if not name.startswith("liger"):
                got = fn()
                err = max(((g.float() - r.float()).abs().max().item()) for g, r in zip(got, ref))
                checks.append({"op": "rope", "mode": mode, "variant": name, "max_abs_vs_lib": err})
            t = ms(fn)
            rows.append({"op": "rope", "mode": mode, "variant": name, "ms": t, "GBps": nbytes / t / 1e6})


# ----------------------------------------------------------------------------- RMSNorm + residual backward


@triton.jit
def rms_bwd_prefetch_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dh_ptr, dx_ptr, dw_part_ptr, M, N, rows_per_program,
    BLOCK_N: tl.constexpr, EVICT: tl.constexpr,
):
    """The library's persistent backward with the next row's loads issued before this row's math
    (two rows in flight per program)."""
    i_g = tl.program_id(0)
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_w = tl.load(w_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = i_g * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    o_row = tl.cast(row_start, tl.int64) * N
    b_x = tl.load(x_ptr + o_row + o_n, mask=m_n, other=0.0)
    b_dy = tl.load(dy_ptr + o_row + o_n, mask=m_n, other=0.0)
    b_dh = tl.load(dh_ptr + o_row + o_n, mask=m_n, other=0.0)
    b_rstd = tl.load(rstd_ptr + row_start)
    for i_m in range(row_start, row_end):
        o_next = tl.cast(i_m + 1, tl.int64) * N
        m_next = m_n & (i_m + 1 < row_end)
        if EVICT:
            n_x = tl.load(x_ptr + o_next + o_n, mask=m_next, other=0.0, eviction_policy="evict_first")
            n_dy = tl.load(dy_ptr + o_next + o_n, mask=m_next, other=0.0, eviction_policy="evict_first")
            n_dh = tl.load(dh_ptr + o_next + o_n, mask=m_next, other=0.0, eviction_policy="evict_first")
        else:
            n_x = tl.load(x_ptr + o_next + o_n, mask=m_next, other=0.0)
            n_dy = tl.load(dy_ptr + o_next + o_n, mask=m_next, other=0.0)
            n_dh = tl.load(dh_ptr + o_next + o_n, mask=m_next, other=0.0)
        n_rstd = tl.load(rstd_ptr + tl.minimum(i_m + 1, M - 1))
        b_xhat = b_x.to(tl.float32) * b_rstd
        b_g = b_dy.to(tl.float32) * b_w
        b_dw += b_dy.to(tl.float32) * b_xhat
        b_c = tl.sum(b_g * b_xhat, axis=0) / N
        b_dx = b_rstd * (b_g - b_xhat * b_c) + b_dh.to(tl.float32)
        o_row = tl.cast(i_m, tl.int64) * N
        tl.store(dx_ptr + o_row + o_n, b_dx.to(dx_ptr.dtype.element_ty), mask=m_n)
        b_x, b_dy, b_dh, b_rstd = n_x, n_dy, n_dh, n_rstd
    tl.store(dw_part_ptr + i_g.to(tl.int64) * N + o_n, b_dw, mask=m_n)


def rms_bwd_prefetch(dy, x, w, rstd, dh, warps=8, pps=2, evict=False):
    M, Nn = x.shape
    n_prog = max(1, min(M, _runtime.num_sms() * pps))
    rpp = triton.cdiv(M, n_prog)
    n_prog = triton.cdiv(M, rpp)
    dx = torch.empty_like(x)
    part = torch.empty(n_prog, Nn, device=x.device, dtype=torch.float32)
    rms_bwd_prefetch_kernel[(n_prog,)](
        dy, x, w, rstd, dh, dx, part, M, Nn, rpp, BLOCK_N=triton.next_power_of_2(Nn), EVICT=evict, num_warps=warps
    )
    return dx, part.sum(0).to(w.dtype)


def probe_residual_bwd(rows, checks):
    M, Nn = 65536, 4096
    dt = torch.bfloat16
    x = torch.randn(M, Nn, device="cuda", dtype=dt)
    res = torch.randn(M, Nn, device="cuda", dtype=dt)
    w = (1 + 0.1 * torch.randn(Nn, device="cuda")).to(dt)
    _, h, rstd = N.rms_norm_fwd(x, w, res, 1e-6)
    dy, dh = torch.randn_like(x), torch.randn_like(x)
    nbytes = 4 * x.numel() * 2
    ref = N.rms_norm_bwd(dy, h, w, rstd, dh)
    variants = {}
    for wp in (4, 8, 16):
        for pps in (1, 2, 4, 8, 16):
            variants[f"lib w{wp} pps{pps}"] = (lambda wp=wp, pps=pps: N.rms_norm_bwd(dy, h, w, rstd, dh, {"num_warps": wp, "programs_per_sm": pps}))
    for wp in (4, 8, 16):
        for pps in (1, 2, 4, 8):
            for ev in (False, True):
                variants[f"prefetch w{wp} pps{pps}{' evict' if ev else ''}"] = (
                    lambda wp=wp, pps=pps, ev=ev: rms_bwd_prefetch(dy, h, w, rstd, dh, wp, pps, ev))
    part = torch.randn(132 * 8, Nn, device="cuda")
    variants["dw partial sum alone (1056 x 4096)"] = (lambda: (part.sum(0).to(dt),))
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        xl = x.clone().requires_grad_(True)
        rl = res.clone().requires_grad_(True)
        wl = w.clone().requires_grad_(True)
        yl, sl = LigerFusedAddRMSNormFunction.apply(xl, rl, wl, 1e-6, 0.0, "llama")
        variants["liger fused-add bwd (autograd)"] = (
            lambda: torch.autograd.grad((yl, sl), (xl, rl, wl), (dy, dh), retain_graph=True))
    except ImportError:
        pass
    for name, fn in variants.items():
        if name.startswith(("lib", "prefetch")):
            got = fn()
            err = (got[0].float() - ref[0].float()).abs().max().item()
            errw = ((got[1].float() - ref[1].float()).abs().max() / ref[1].float().abs().max()).item()
            checks.append({"op": "rms_res_bwd", "variant": name, "dx_max_abs_vs_lib": err, "dw_rel_vs_lib": errw})
        t = ms(fn)
        rows.append({"op": "rms_res_bwd", "mode": "bwd", "variant": name, "ms": t, "GBps": nbytes / t / 1e6})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    copy = bench.peaks()["copy_tbps"] * 1e3
    rows, checks = [], []
    probe_rope(rows, checks)
    probe_residual_bwd(rows, checks)
    bad = [c for c in checks if max(v for k, v in c.items() if k not in ("op", "mode", "variant")) > 0.02]
    for c in bad:
        print("MISMATCH", c)
    for r in rows:
        pct = f"{100 * r['GBps'] / copy:5.1f}%" if copy else ""
        print(f"{r['op']:<12} {r['mode']:<4} {r['variant']:<40} {r['ms']:8.4f} ms {r['GBps']:7.0f} GB/s {pct}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "checks": checks, "copy_GBps": copy, "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
