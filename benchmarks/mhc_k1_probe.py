"""Where mHC K1's backward (79.7% of copy, floor 0.895 ms at T = 65536, C = 2560) loses its time:
the library kernel against variants that leave one stage out or change one thing, all at the same
grid and tiles, in one process.

    PYTHONPATH=. python benchmarks/mhc_k1_probe.py [--json PATH] [--ncu]

Rows "persistent": the library's kernel (one wave of balanced runs) at launch configs; its dx and
dW are compared with the library's at its tuned config.
Variants (--variants; flags of one probe kernel on the former 2-D grid):
  copy      stream x -> dx with the kernel's tiles and grid (no dots, no a/coef loads): the access
            pattern's own ceiling
  dx        dx = a_hi W - coef x only (no dW)
  dw        copy + dW (x^T a_hi + x^T a_lo) (dx = x stored, no dx dot)
  full      dx and dW (the library's math)
  full-cat  dW as ONE dot [a_hi | a_lo]^T x ([2R, BLOCK_K], x is the B operand as loaded: no x^T)
  +evict    x loaded evict_first, dx stored .cs (streaming)
Each variant's dx (and dW where computed) is checked against the library's outputs.
With --ncu: one launch of the library kernel only (for `ncu -k regex:mhc_project_bwd_kernel`).
"""

import argparse
import json

import torch
import triton
import triton.language as tl
import triton.testing

from triforge import _runtime, bench, launch
from triforge.ops import mhc as M
from triforge.ops.mhc.forward import dot16

DEV = _runtime.default_device()


@triton.jit
def k1_bwd_probe_kernel(
    x_ptr, a_hi_ptr, a_lo_ptr, a_cat_ptr, coef_ptr, w_ptr, dx_ptr, dw_part_ptr, T, K, tokens_per_split,
    R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    DO_DX: tl.constexpr, DO_DW: tl.constexpr, CAT: tl.constexpr, EVICT: tl.constexpr, UPCAST: tl.constexpr,
):
    i_k, i_s = tl.program_id(0), tl.program_id(1)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_k = o_k < K
    o_r = tl.arange(0, R)
    o_r2 = tl.arange(0, 2 * R)
    b_w = tl.load(w_ptr + o_r[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
    if CAT:
        b_dw = tl.zeros([2 * R, BLOCK_K], dtype=tl.float32)
    else:
        b_dw = tl.zeros([BLOCK_K, R], dtype=tl.float32)
    t_start = i_s * tokens_per_split
    t_end = tl.minimum(t_start + tokens_per_split, T)
    for t0 in range(t_start, t_end, BLOCK_T):
        o_t = t0 + tl.arange(0, BLOCK_T)
        m_t = o_t < t_end
        o_t64 = o_t.to(tl.int64)
        m_tk = m_t[:, None] & m_k[None, :]
        o_x = o_t64[:, None] * K + o_k[None, :]
        if EVICT:
            b_x = tl.load(x_ptr + o_x, mask=m_tk, other=0.0, eviction_policy="evict_first")
        else:
            b_x = tl.load(x_ptr + o_x, mask=m_tk, other=0.0)
        if DO_DX:
            b_a_hi = tl.load(a_hi_ptr + o_t64[:, None] * R + o_r[None, :], mask=m_t[:, None], other=0.0)
            b_coef = tl.load(coef_ptr + o_t, mask=m_t, other=0.0)
            b_dx = dot16(b_a_hi, b_w, tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32), UPCAST)
            b_out = b_dx - b_coef[:, None] * b_x.to(tl.float32)
        else:
            b_out = b_x.to(tl.float32)
        if DO_DW:
            if CAT:
                b_ac = tl.load(a_cat_ptr + o_t64[:, None] * (2 * R) + o_r2[None, :], mask=m_t[:, None], other=0.0)
                b_dw = dot16(tl.trans(b_ac), b_x, b_dw, UPCAST)
            else:
                b_ah = tl.load(a_hi_ptr + o_t64[:, None] * R + o_r[None, :], mask=m_t[:, None], other=0.0)
                b_al = tl.load(a_lo_ptr + o_t64[:, None] * R + o_r[None, :], mask=m_t[:, None], other=0.0)
                b_xT = tl.trans(b_x)
                b_dw = dot16(b_xT, b_ah, b_dw, UPCAST)
                b_dw = dot16(b_xT, b_al, b_dw, UPCAST)
        if EVICT:
            tl.store(dx_ptr + o_x, b_out.to(dx_ptr.dtype.element_ty), mask=m_tk, cache_modifier=".cs")
        else:
            tl.store(dx_ptr + o_x, b_out.to(dx_ptr.dtype.element_ty), mask=m_tk)
    if DO_DW:
        if CAT:
            o_dw = i_s.to(tl.int64) * 2 * R * K + o_r2[:, None] * K + o_k[None, :]
            tl.store(dw_part_ptr + o_dw, b_dw, mask=m_k[None, :])
        else:
            o_dw = i_s.to(tl.int64) * 2 * R * K + o_r[None, :] * K + o_k[:, None]
            tl.store(dw_part_ptr + o_dw, b_dw, mask=m_k[:, None])


@triton.jit
def stream_probe_kernel(x_ptr, y_ptr, T, K, n_t, n_k, U, P, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                        ROW_MAJOR: tl.constexpr, TMA: tl.constexpr):
    """x -> y in [BLOCK_T, BLOCK_K] tiles, one wave of balanced runs over the units (as K1 backward):
    column-block-major (K1's order: a program walks down one column block) or row-major (a program
    walks along rows): the access pattern's own ceiling, no math."""
    p = tl.program_id(0).to(tl.int64)
    if TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, [T, K], [K, 1], [BLOCK_T, BLOCK_K])
        y_desc = tl.make_tensor_descriptor(y_ptr, [T, K], [K, 1], [BLOCK_T, BLOCK_K])
    for u in range(p * U // P, (p + 1) * U // P):
        if ROW_MAJOR:
            i_t = u // n_k
            kb = u % n_k
        else:
            kb = u // n_t
            i_t = u % n_t
        if TMA:
            b = x_desc.load([(i_t * BLOCK_T).to(tl.int32), (kb * BLOCK_K).to(tl.int32)])
            y_desc.store([(i_t * BLOCK_T).to(tl.int32), (kb * BLOCK_K).to(tl.int32)], b)
        else:
            o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
            o_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            m = (o_t < T)[:, None] & (o_k < K)[None, :]
            o = o_t[:, None] * K + o_k[None, :]
            tl.store(y_ptr + o, tl.load(x_ptr + o, mask=m), mask=m)


def stream_rows(x, pct, nbytes):
    T, K = x.shape
    rows = []
    y = torch.empty_like(x)
    launch.use_tensor_descriptors()
    for bt, bk, w, st, pps, rm, tma in [(32, 128, 4, 3, 3, 0, 1), (32, 128, 4, 3, 3, 1, 1), (16, 256, 4, 3, 3, 0, 1),
                                        (64, 64, 4, 3, 3, 0, 1), (8, 256, 4, 4, 4, 0, 1), (32, 128, 4, 3, 3, 0, 0),
                                        (16, 256, 4, 3, 3, 0, 0), (8, 512, 4, 3, 3, 0, 0), (64, 128, 4, 3, 2, 0, 1),
                                        (32, 256, 8, 3, 2, 0, 1), (16, 256, 4, 4, 4, 0, 1)]:
        n_t, n_k = triton.cdiv(T, bt), triton.cdiv(K, bk)
        U = n_t * n_k
        P = _runtime.num_sms() * pps
        cfg = {"BLOCK_T": bt, "BLOCK_K": bk, "num_warps": w, "num_stages": st, "programs_per_sm": pps,
               "ROW_MAJOR": rm, "TMA": tma}

        def go(bt=bt, bk=bk, w=w, st=st, rm=rm, tma=tma, n_t=n_t, n_k=n_k, U=U, P=P):
            stream_probe_kernel[(P,)](x, y, T, K, n_t, n_k, U, P, BLOCK_T=bt, BLOCK_K=bk, ROW_MAJOR=rm, TMA=tma,
                                      num_warps=w, num_stages=st)

        go()
        torch.cuda.synchronize()
        ok = torch.equal(x, y)
        t = triton.testing.do_bench(go, warmup=25, rep=300, return_mode="median")
        rows.append({"variant": "stream", "cfg": cfg, "ms": t, "pct": pct(nbytes, t), "dx_max_abs": 0.0 if ok else 1.0})
    return rows


VARIANTS = {  # name: (DO_DX, DO_DW, CAT, EVICT)
    "copy": (False, False, False, False),
    "dx": (True, False, False, False),
    "dw": (False, True, False, False),
    "full": (True, True, False, False),
    "full-cat": (True, True, True, False),
    "full+evict": (True, True, False, True),
    "full-cat+evict": (True, True, True, True),
    "copy+evict": (False, False, False, True),
}


def grid2d(T, K, cfg):
    """The 2-D grid K1's backward had before the persistent one (column blocks x token splits)."""
    n_k = triton.cdiv(K, cfg["BLOCK_K"])
    n_t = triton.cdiv(T, cfg["BLOCK_T"])
    splits = max(1, min(n_t, triton.cdiv(_runtime.num_sms() * cfg["programs_per_sm"], n_k)))
    tps = triton.cdiv(n_t, splits) * cfg["BLOCK_T"]
    return n_k, triton.cdiv(T, tps), tps


def run_variant(flags, x, a_hi, a_lo, a_cat, coef, w, cfg, R):
    T, K = x.shape
    n_k, splits, tps = grid2d(T, K, cfg)
    dx = torch.empty_like(x)
    part = torch.zeros(splits, 2 * R, K, device=x.device, dtype=torch.float32)
    do_dx, do_dw, cat, evict = flags
    k1_bwd_probe_kernel[(n_k, splits)](
        x, a_hi, a_lo, a_cat, coef, w, dx, part, T, K, tps, R=R, BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"],
        DO_DX=do_dx, DO_DW=do_dw, CAT=cat, EVICT=evict, UPCAST=_runtime.INTERPRET, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return dx, part.sum(0)[:R] + part.sum(0)[R:]


def host_rows(args, x, W, proj, inv_rms, dproj):
    """K1 backward's host time per call (tiny tensors: the GPU never limits) directly and through
    autograd, and at the real shape the bench's autograd timing (CUDA events: min/median/p95) per config:
    a median far above the minimum is the GPU waiting on the host."""
    from host_overhead_probe import host_us  # this script runs from benchmarks/

    out = {}
    cfgs = {"tma-pps3": {"BLOCK_T": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 3, "TMA": 1},
            "ptr-prefetch-pps2": {"BLOCK_T": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2,
                                  "TMA": 0, "PREFETCH": 1}}
    xs = torch.randn(64, 4 * 64, device=DEV, dtype=x.dtype)
    Ws = torch.randn(M.N_PROJ, 4 * 64, device=DEV) * 0.02
    ps, ivs = M.project_fwd(xs, Ws, M.EPS)
    dps = torch.randn_like(ps)
    for name, cfg in cfgs.items():
        out[f"host_us direct {name}"] = host_us(lambda c=cfg: M.project_bwd(xs, Ws, ps, ivs, dps, None, c), n=500)
    xl = xs.clone().requires_grad_(True)
    Wl = Ws.clone().requires_grad_(True)
    o = M.fused_rmsnorm_project(xl, Wl)
    g = [torch.randn_like(t) for t in o]
    out["host_us autograd (library cfg)"] = host_us(lambda: torch.autograd.grad(o, [xl, Wl], g, retain_graph=True),
                                                     n=500)
    xr = x.clone().requires_grad_(True)
    Wr = W.clone().requires_grad_(True)
    orr = M.fused_rmsnorm_project(xr, Wr)
    gr = [torch.randn_like(t) for t in orr]
    for name, cfg in cfgs.items():
        t = bench.time_ms(lambda c=cfg: M.project_bwd(x, W, proj, inv_rms, dproj, None, c))
        out[f"gpu direct {name}"] = t
    out["gpu autograd (library cfg)"] = bench.time_ms(lambda: torch.autograd.grad(orr, [xr, Wr], gr, retain_graph=True))
    for k, v in out.items():
        print(f"{k:<40} {v if isinstance(v, float) else {kk: round(vv, 4) for kk, vv in v.items()}}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--T", type=int, default=65536)
    p.add_argument("--C", type=int, default=2560)
    p.add_argument("--ncu", action="store_true", help="one launch of the library kernel, nothing timed")
    p.add_argument("--variants", action="store_true", help="also the 2-D-grid stage-removal variants")
    p.add_argument("--sweep", action="store_true", help="persistent configs: TMA, PREFETCH, register caps")
    p.add_argument("--fwd", action="store_true", help="also K1 forward: tiled vs persistent configs")
    p.add_argument("--stream", action="store_true", help="also x -> y streaming in K1 backward's tiles and orders")
    p.add_argument("--host", action="store_true", help="only: host time per call and the bench-shaped autograd timing")
    args = p.parse_args()
    dt = torch.bfloat16
    T, C = args.T, args.C
    K, R = 4 * C, M.N_PROJ
    x = torch.randn(T, K, device=DEV, dtype=dt)
    W = torch.randn(R, K, device=DEV) * 0.02
    proj, inv_rms = M.project_fwd(x, W, M.EPS)
    dproj = torch.randn(T, R, device=DEV)
    if args.host:
        return host_rows(args, x, W, proj, inv_rms, dproj)
    if args.ncu:
        for _ in range(3):
            M.project_bwd(x, W, proj, inv_rms, dproj, None)
        torch.cuda.synchronize()
        return
    copy = bench.peaks()["copy_tbps"] * 1e3  # GB/s

    def pct(nb, ms):  # % of the measured copy bandwidth
        return 100 * nb / (ms * 1e-3) / 1e9 / copy
    ref_dx, ref_dw = M.project_bwd(x, W, proj, inv_rms, dproj, None, {"BLOCK_T": 32, "BLOCK_K": 128, "num_warps": 4,
                                                                       "num_stages": 3, "programs_per_sm": 2})
    a = dproj * inv_rms[:, None]
    coef = (inv_rms.square() * (dproj * proj).sum(1) / K).contiguous()
    a_hi = a.to(dt)
    a_lo = (a - a_hi.float()).to(dt)
    a_cat = torch.cat([a_hi, a_lo], 1).contiguous()
    w = W.to(dt).contiguous()
    nbytes = 2 * x.numel() * 2
    rows = []
    lib = M._cfg("mhc_project_bwd", C, dt)
    cfgs = [lib,
            {"BLOCK_T": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2},
            {"BLOCK_T": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "programs_per_sm": 1},
            {"BLOCK_T": 32, "BLOCK_K": 256, "num_warps": 8, "num_stages": 3, "programs_per_sm": 2},
            {"BLOCK_T": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4, "programs_per_sm": 4},
            {"BLOCK_T": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "programs_per_sm": 4}]
    t_lib = triton.testing.do_bench(lambda: M.project_bwd(x, W, proj, inv_rms, dproj, None), warmup=25, rep=300,
                                    return_mode="median")
    rows.append({"variant": "library project_bwd", "cfg": lib, "ms": t_lib, "pct": pct(nbytes, t_lib)})
    y = torch.empty_like(x)
    t_copy = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=300, return_mode="median")
    rows.append({"variant": "torch copy_ x->dx", "cfg": None, "ms": t_copy, "pct": pct(nbytes, t_copy)})
    if args.stream:
        rows += stream_rows(x, pct, nbytes)
    # the library's persistent kernel (balanced runs over column-block x token-tile units) at launch configs:
    # --sweep: TMA x PREFETCH x register caps (more programs per SM)
    sweep = [lib] + [dict(c, programs_per_sm=p) for c in cfgs for p in (2, 3, 4)] if not args.sweep else [lib] + [
        dict(BLOCK_T=bt, BLOCK_K=bk, num_warps=w, num_stages=st, programs_per_sm=pps, TMA=tma, PREFETCH=pf, maxnreg=mr)
        for bt, bk, w, st, pps, tma, pf, mr in [
            (32, 128, 4, 3, 3, 1, 1, None), (32, 128, 4, 4, 3, 1, 1, None), (64, 128, 4, 3, 2, 1, 1, None),
            (32, 128, 4, 3, 3, 0, 1, None), (64, 128, 4, 3, 2, 0, 1, None), (32, 128, 4, 3, 3, 0, 0, None),
            (32, 128, 4, 3, 4, 1, 1, 128), (32, 128, 4, 3, 4, 0, 1, 128), (16, 256, 4, 4, 4, 1, 1, 128),
            (64, 128, 4, 4, 2, 1, 1, None)]]
    for cfg in sweep:
        try:
            dx, dw = M.project_bwd(x, W, proj, inv_rms, dproj, None, cfg)
            torch.cuda.synchronize()
        except Exception as e:
            rows.append({"variant": "persistent", "cfg": cfg, "ms": None, "error": repr(e)[:160]})
            continue
        res = launch.kernel_resources("mhc_project_bwd")
        err_dx = (dx.float() - ref_dx.float()).abs().max().item()
        err_dw = ((dw.float() - ref_dw.float()).norm() / ref_dw.float().norm()).item()
        t = triton.testing.do_bench(lambda c=cfg: M.project_bwd(x, W, proj, inv_rms, dproj, None, c), warmup=25,
                                    rep=300, return_mode="median")
        rows.append({"variant": "persistent", "cfg": cfg, "ms": t, "pct": pct(nbytes, t), "res": res,
                     "dx_max_abs": err_dx, "dw_rel": err_dw})
    if args.fwd:  # K1 forward: the tiled grid against the persistent one (balanced row ranges, flattened loops)
        fbytes = x.numel() * 2 + T * (R + 1) * 4
        flib = M._cfg("mhc_project_fwd", C, dt)
        ref_p, ref_i = M.project_fwd(x, W, M.EPS, flib)
        fsweep = [flib] + [dict(BLOCK_T=bt, BLOCK_K=bk, num_warps=w, num_stages=st)
                           for bt, bk, w, st in [
                               (128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 3), (128, 128, 4, 3)]]
        for cfg in fsweep:
            try:
                p_, i_ = M.project_fwd(x, W, M.EPS, cfg)
                torch.cuda.synchronize()
            except Exception as e:
                rows.append({"variant": "fwd", "cfg": cfg, "ms": None, "error": repr(e)[:160]})
                continue
            res = launch.kernel_resources("mhc_project_fwd")
            err = max((p_ - ref_p).abs().max().item(), (i_ - ref_i).abs().max().item())
            t = triton.testing.do_bench(lambda c=cfg: M.project_fwd(x, W, M.EPS, c), warmup=25, rep=300,
                                        return_mode="median")
            rows.append({"variant": "fwd", "cfg": cfg, "ms": t, "pct": pct(fbytes, t), "res": res, "dx_max_abs": err})
    for ci, cfg in enumerate(cfgs if args.variants else []):
        for name, flags in VARIANTS.items():
            if ci > 0 and name not in ("copy", "full", "full-cat", "full-cat+evict"):
                continue
            try:
                dx, dw = run_variant(flags, x, a_hi, a_lo, a_cat, coef, w, cfg, R)
                torch.cuda.synchronize()
            except Exception as e:  # out of resources
                rows.append({"variant": name, "cfg": cfg, "ms": None, "error": repr(e)[:160]})
                continue
            want_dx = ref_dx if flags[0] else x
            err_dx = (dx.float() - want_dx.float()).abs().max().item()
            err_dw = ((dw - ref_dw.float()).norm() / ref_dw.float().norm()).item() if flags[1] else None
            t = triton.testing.do_bench(lambda f=flags, c=cfg: run_variant(f, x, a_hi, a_lo, a_cat, coef, w, c, R),
                                        warmup=25, rep=300, return_mode="median")
            rows.append({"variant": name, "cfg": cfg, "ms": t, "pct": pct(nbytes, t),
                         "dx_max_abs": err_dx, "dw_rel": err_dw})
    for r in rows:
        c = r["cfg"]
        cs = "" if c is None else " ".join(f"{k}={v}" for k, v in c.items() if v is not None)
        res = r.get("res") or {}
        rs = f"regs {res.get('registers')} spill {res.get('spills')} smem {res.get('shared_bytes')}" if res else ""
        if r.get("ms") is None:
            print(f"{r['variant']:<20} {cs:<90} ERROR {r.get('error')}")
        else:
            print(f"{r['variant']:<20} {cs:<90} {r['ms']:8.4f} ms {r['pct']:6.1f}%  err {r.get('dx_max_abs')}"
                  f"  dW {r.get('dw_rel')}  {rs}")
    if args.json:
        for name in ("mhc_project_bwd", "mhc_project_fwd"):
            k = launch._compiled.get(name)
            if k is not None:
                with open(args.json.replace(".json", f"-{name}.ttgir"), "w") as f:
                    f.write(k.asm.get("ttgir", ""))
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "copy_GBps": copy, "device": torch.cuda.get_device_name(), "T": T, "C": C}, f, indent=1)


if __name__ == "__main__":
    main()
