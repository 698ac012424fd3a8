"""Issue 5's missed rows, probed in one process at T = 65536, C = 2560, bf16: where K1's backward
(mhc_project bwd, 75% of copy) spends its time - the PyTorch prologue (a, coef, the hi/lo split)
against the kernel - and candidate kernels; K4's backward (89.6%) and the pre-map forward (0.98x
torch.compile) over launch configs. Every variant's outputs are checked against the library's.

    PYTHONPATH=. python benchmarks/mhc_probe.py [--json PATH]

Median ms of triton.testing.do_bench (L2 flushed between runs); % of the copy ceiling on the byte
model of the bench (the kernel's compulsory traffic).
"""

import argparse
import json

import torch
import triton
import triton.language as tl
import triton.testing

from triforge import _runtime, bench
from triforge.ops import mhc as M
from triforge.ops.mhc.forward import dot16

from mhc_k1_probe import grid2d  # the former 2-D grid (this script runs from benchmarks/)


DEV = _runtime.default_device()


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")


@triton.jit
def project_bwd_cat_kernel(
    x_ptr, a_hi_ptr, a_cat_ptr, coef_ptr, w_ptr, dx_ptr, dw_part_ptr, T, K, tokens_per_split,
    R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """K1 backward with dW^T = x^T [a_hi | a_lo] as ONE dot of N = 2R (the halves summed on the host)
    instead of two dots of N = R."""
    i_k, i_s = tl.program_id(0), tl.program_id(1)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_k = o_k < K
    o_r = tl.arange(0, R)
    o_r2 = tl.arange(0, 2 * R)
    b_w = tl.load(w_ptr + o_r[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
    b_dwT = tl.zeros([BLOCK_K, 2 * R], dtype=tl.float32)
    t_start = i_s * tokens_per_split
    t_end = tl.minimum(t_start + tokens_per_split, T)
    for t0 in range(t_start, t_end, BLOCK_T):
        o_t = t0 + tl.arange(0, BLOCK_T)
        m_t = o_t < t_end
        o_t64 = o_t.to(tl.int64)
        m_tk = m_t[:, None] & m_k[None, :]
        o_x = o_t64[:, None] * K + o_k[None, :]
        b_x = tl.load(x_ptr + o_x, mask=m_tk, other=0.0)
        b_a_hi = tl.load(a_hi_ptr + o_t64[:, None] * R + o_r[None, :], mask=m_t[:, None], other=0.0)
        b_a_cat = tl.load(a_cat_ptr + o_t64[:, None] * (2 * R) + o_r2[None, :], mask=m_t[:, None], other=0.0)
        b_coef = tl.load(coef_ptr + o_t, mask=m_t, other=0.0)
        b_dx = dot16(b_a_hi, b_w, tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32), False)
        b_dwT = dot16(tl.trans(b_x), b_a_cat, b_dwT, False)
        b_dx -= b_coef[:, None] * b_x.to(tl.float32)
        tl.store(dx_ptr + o_x, b_dx.to(dx_ptr.dtype.element_ty), mask=m_tk)
    o_dw = i_s.to(tl.int64) * 2 * R * K + o_r2[None, :] * K + o_k[:, None]
    tl.store(dw_part_ptr + o_dw, b_dwT, mask=m_k[:, None])


def prologue(x_flat, W, proj, inv_rms, dproj, dinv):
    K = x_flat.shape[1]
    a = dproj.float() * inv_rms[:, None]
    coef = inv_rms.square() * (dproj.float() * proj).sum(1)
    coef = ((coef + inv_rms.pow(3) * dinv.float()) / K).contiguous()
    a_hi, a_lo = M._split16(a, x_flat.dtype)
    return a_hi, a_lo, coef, W.to(x_flat.dtype).contiguous()


def kernel_only(x_flat, a_hi, a_lo, coef, w, cfg, R):
    dx, part = M.project_bwd_main(x_flat, a_hi, a_lo, coef, w.float(), cfg)
    return dx, M.project_bwd_reduce(part, *x_flat.shape, cfg, torch.float32)[None]  # errs() sums dim 0


def cat_kernel(x_flat, a_hi, a_cat, coef, w, cfg, R):
    T, K = x_flat.shape
    n_k, splits, tps = grid2d(T, K, cfg)
    dx = torch.empty_like(x_flat)
    part = torch.empty(splits, 2 * R, K, device=x_flat.device, dtype=torch.float32)
    project_bwd_cat_kernel[(n_k, splits)](
        x_flat, a_hi, a_cat, coef, w, dx, part, T, K, tps, R=R, BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return dx, part


def cfgs_k1():
    out = []
    for bt in (32, 64):
        for bk in (64, 128, 256):
            for w in (4, 8):
                for pps in (1, 2, 4):
                    out.append({"BLOCK_T": bt, "BLOCK_K": bk, "num_warps": w, "num_stages": 3, "programs_per_sm": pps})
    return out


def probe_k1(rows, checks, T, C, copy):
    dt = torch.bfloat16
    K, R = 4 * C, M.N_PROJ
    x = torch.randn(T, K, device=DEV, dtype=dt)
    W = torch.randn(R, K, device=DEV) * 0.02
    proj, inv_rms = M.project_fwd(x, W, M.EPS)
    dproj = torch.randn(T, R, device=DEV)
    dinv = torch.randn(T, device=DEV)
    nbytes = 2 * x.numel() * 2 + T * (R + 1) * 4
    ref_dx, ref_dw = M.project_bwd(x, W, proj, inv_rms, dproj, dinv)

    def row(variant, fn, check=None):
        if check is not None:
            err_dx, err_dw = check()
            checks.append({"op": "k1_bwd", "variant": variant, "dx_max_abs": err_dx, "dw_rel": err_dw})
        t = ms(fn)
        rows.append({"op": "k1_bwd", "variant": variant, "ms": t, "pct_copy": 100 * nbytes / t / 1e9 / copy})

    def errs(dx, dw):
        return (dx.float() - ref_dx.float()).abs().max().item(), ((dw.float() - ref_dw.float()).norm() / ref_dw.float().norm()).item()

    row("library project_bwd (prologue + kernel + dW sum)", lambda: M.project_bwd(x, W, proj, inv_rms, dproj, dinv),
        lambda: errs(*M.project_bwd(x, W, proj, inv_rms, dproj, dinv)))
    row("prologue alone (a, coef, hi/lo split, W cast)", lambda: prologue(x, W, proj, inv_rms, dproj, dinv))
    a_hi, a_lo, coef, w = prologue(x, W, proj, inv_rms, dproj, dinv)
    a_cat = torch.cat([a_hi, a_lo], 1).contiguous()
    cfg0 = M._cfg("mhc_project_bwd", C, dt)
    best = (None, 1e9)
    for cfg in [cfg0] + cfgs_k1():
        name = "kernel " + ("(library cfg) " if cfg is cfg0 else "") + "bt{BLOCK_T} bk{BLOCK_K} w{num_warps} s{num_stages} pps{programs_per_sm}".format(**cfg)
        try:
            dx, part = kernel_only(x, a_hi, a_lo, coef, w, cfg, R)
            sync()
        except Exception as e:  # out of resources
            rows.append({"op": "k1_bwd", "variant": name, "ms": None, "error": repr(e)[:120]})
            continue
        row(name, lambda cfg=cfg: kernel_only(x, a_hi, a_lo, coef, w, cfg, R),
            lambda dx=dx, part=part: errs(dx, part.sum(0)))
        if rows[-1]["ms"] < best[1]:
            best = (cfg, rows[-1]["ms"])
    for cfg in [c for c in (cfg0, best[0]) if c is not None] + [c for c in cfgs_k1() if c["num_stages"] == 3 and c["programs_per_sm"] == 2]:
        name = "cat kernel bt{BLOCK_T} bk{BLOCK_K} w{num_warps} s{num_stages} pps{programs_per_sm}".format(**cfg)
        try:
            dx, part = cat_kernel(x, a_hi, a_cat, coef, w, cfg, R)
            sync()
        except Exception as e:
            rows.append({"op": "k1_bwd", "variant": name, "ms": None, "error": repr(e)[:120]})
            continue
        row(name, lambda cfg=cfg: cat_kernel(x, a_hi, a_cat, coef, w, cfg, R),
            lambda dx=dx, part=part: errs(dx, part.sum(0)[:R] + part.sum(0)[R:]))


def probe_k4_premap(rows, checks, T, C, copy):
    dt = torch.bfloat16
    x = torch.randn(T, 4, C, device=DEV, dtype=dt)
    f = torch.randn(T, C, device=DEV, dtype=dt)
    g = torch.randn(T, 4, C, device=DEV, dtype=dt)
    H = torch.rand(T, 4, 4, device=DEV)
    hp = torch.rand(T, 4, device=DEV)
    nb_k4 = 14 * T * C * 2 + 160 * T
    ref = M.post_res_bwd(g, x, f, H, hp)
    grid = [{"BLOCK_T": bt, "BLOCK_C": bc, "num_warps": w} for bt in (1, 2, 4) for bc in (256, 512, 1024) for w in (4, 8)]
    for cfg in [M._cfg("mhc_post_res_bwd", C, dt)] + grid:
        name = "k4 bwd bt{BLOCK_T} bc{BLOCK_C} w{num_warps}".format(**cfg)
        got = M.post_res_bwd(g, x, f, H, hp, cfg)
        checks.append({"op": "k4_bwd", "variant": name,
                       "max_abs": max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))})
        t = ms(lambda cfg=cfg: M.post_res_bwd(g, x, f, H, hp, cfg))
        rows.append({"op": "k4_bwd", "variant": name, "ms": t, "pct_copy": 100 * nb_k4 / t / 1e9 / copy})
    nb_pm = 5 * T * C * 2 + 16 * T
    ref = M.pre_map_fwd(x, hp)
    grid = [{"BLOCK": b, "num_warps": w} for b in (1024, 2048, 4096, 8192) for w in (4, 8)]
    for cfg in [M._cfg("mhc_pre_map_fwd", C, dt)] + grid:
        name = "pre-map fwd b{BLOCK} w{num_warps}".format(**cfg)
        got = M.pre_map_fwd(x, hp, cfg)
        checks.append({"op": "premap_fwd", "variant": name, "max_abs": (got.float() - ref.float()).abs().max().item()})
        t = ms(lambda cfg=cfg: M.pre_map_fwd(x, hp, cfg))
        rows.append({"op": "premap_fwd", "variant": name, "ms": t, "pct_copy": 100 * nb_pm / t / 1e9 / copy})
    comp = torch.compile(lambda x, h: (h[:, :, None] * x.float()).sum(1).to(x.dtype))
    t = ms(lambda: comp(x, hp))
    rows.append({"op": "premap_fwd", "variant": "torch.compile", "ms": t, "pct_copy": 100 * nb_pm / t / 1e9 / copy})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--T", type=int, default=65536)
    p.add_argument("--C", type=int, default=2560)
    args = p.parse_args()
    copy = bench.peaks()["copy_tbps"] * 1e3  # GB/s
    rows, checks = [], []
    probe_k1(rows, checks, args.T, args.C, copy)
    probe_k4_premap(rows, checks, args.T, args.C, copy)
    for c in checks:
        print("CHECK", json.dumps(c))
    for r in rows:
        if r.get("ms") is None:
            print(f"{r['op']:<11} {r['variant']:<52} {r.get('error')}")
        else:
            print(f"{r['op']:<11} {r['variant']:<52} {r['ms']:8.4f} ms {r['pct_copy']:6.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "checks": checks, "copy_GBps": copy, "device": torch.cuda.get_device_name(),
                       "T": args.T, "C": args.C}, f, indent=1)


if __name__ == "__main__":
    main()
