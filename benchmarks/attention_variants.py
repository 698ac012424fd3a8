"""Attention launch-config variants side by side on the GPU, against SDPA's FlashAttention-2 and cuDNN.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/attention_variants.py OUT.json [--only fwd|bwd] [--shapes 0,2]

For each of the issue's (B, H, S, D) bf16 configs, non-causal and causal:
  1. each variant's o (forward) or dq/dk/dv (backward, from the same forward outputs) is compared with
     SDPA's math backend in fp32 on one batch and two heads of the same inputs; a variant whose
     relative RMS error exceeds 1e-2 is reported, not timed;
  2. triton.testing.do_bench (median) times it, and SDPA FLASH_ATTENTION / CUDNN_ATTENTION in the same
     process (their backward: autograd.grad through their forward's graph).
The forward variants with warp specialization run after everything else (a compiler problem there
could hang the GPU; the results before it are already printed and saved). Lines print as they go;
the table (TFLOP/s = 4 B H S^2 D / t, halved when causal; backward counts 2.5x that) prints last and
the rows are written to OUT.json (after each config too). Expected run time on an H100: ~4-5 min,
most of it compiling.
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from triforge import launch  # noqa: E402
from triforge.ops import attention as A  # noqa: E402

SHAPES = [(16, 16, 2048, 64), (8, 16, 4096, 64), (4, 16, 8192, 128), (2, 16, 16384, 128)]
TOL = 1e-2


def c(bm, bn, w, s, **kw):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, **kw}


# forward: the configs before this change (plain loads, 128 x 64 tiles), the new fallback (TMA,
# 128 x 128), and Triton's Hopper warp specialization (producer + 2 consumer warpgroups) at two tiles
FWD = {
    "ptr_128x64": {64: c(128, 64, 4, 3), 128: c(128, 64, 8, 3)},
    "tma_128x128": {64: c(128, 128, 8, 3, TMA=1), 128: c(128, 128, 8, 2, TMA=1)},
    "ws_128x128": {64: c(128, 128, 8, 3, TMA=1, WARP_SPEC=1), 128: c(128, 128, 8, 2, TMA=1, WARP_SPEC=1)},
    "ws_128x64": {64: c(128, 64, 8, 3, TMA=1, WARP_SPEC=1), 128: c(128, 64, 8, 3, TMA=1, WARP_SPEC=1)},
}
FWD_LAST = ("ws_128x128", "ws_128x64")
# backward: (dK/dV config, dQ config). 7 matmuls per block pair with a separate dQ kernel; 5 with
# ATOMIC_DQ (1: red.global atomics, 2: TMA bulk reductions)
OLD_DQ = c(128, 64, 8, 2)
TMA_DQ = c(128, 64, 8, 2, TMA=1)
BWD = {
    "ptr_twokernel": {64: (c(32, 128, 8, 2), OLD_DQ), 128: (c(32, 64, 8, 2), OLD_DQ)},
    "tma_twokernel": {64: (c(32, 128, 8, 2, TMA=1), TMA_DQ), 128: (c(32, 128, 8, 1, TMA=1), TMA_DQ)},
    "tma_atomic_reduce": {64: (c(32, 128, 8, 2, TMA=1, ATOMIC_DQ=2), None),
                          128: (c(32, 128, 8, 1, TMA=1, ATOMIC_DQ=2), None)},
    # 64-query tiles: the dQ matmul on wgmma too (32 rows is below its 64, mma.sync then); at D = 128
    # it spills (32-76 bytes), so no grid or fallback has it: timed to see what the spill costs
    "tma_atomic_m64": {64: (c(64, 128, 8, 1, TMA=1, ATOMIC_DQ=2), None),
                       128: (c(64, 128, 8, 1, TMA=1, ATOMIC_DQ=2), None)},
}


def flops(B, H, S, D, causal, mode):
    f = 4 * B * H * S * S * D / (2 if causal else 1)
    return f * (2.5 if mode == "bwd" else 1.0)


def bench_ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel_rms(got, ref):
    got, ref = got.double(), ref.double()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def math_reference(q, k, v, do, causal, heads=2):
    """fp32 SDPA math on batch 0, heads [0, heads): o [S, h, D] and dq, dk, dv in the same layout."""
    sl = [t[0, :, :heads].float().transpose(0, 1).contiguous().requires_grad_(True) for t in (q, k, v)]  # [h, S, D]
    with sdpa_kernel(SDPBackend.MATH):
        o = F.scaled_dot_product_attention(*sl, is_causal=causal)
    g = torch.autograd.grad(o, sl, do[0, :, :heads].float().transpose(0, 1))
    back = lambda t: t.detach().transpose(0, 1)  # noqa: E731  [S, h, D]
    return back(o), [back(x) for x in g]


def sdpa_peer(backend, q, k, v, do, causal):
    """(forward fn, backward fn) of an SDPA backend on our [B, S, H, D] tensors (seen as [B, H, S, D])."""
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
    dot = do.transpose(1, 2)

    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    o = fwd()

    def bwd():
        return torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True)

    return fwd, bwd


def resources(kernel):
    """'<registers>r <spills>sp <shared KiB>K <warps>w' of the kernel's latest launch."""
    r = launch.kernel_resources(kernel) or {}
    shared = r.get("shared_bytes")
    return f"{r.get('registers')}r {r.get('spills')}sp {shared // 1024 if shared else shared}K {r.get('num_warps')}w"


class Run:
    def __init__(self, out_path):
        self.rows, self.out_path, self.t0 = [], out_path, time.time()

    def add(self, row):
        self.rows.append(row)
        msg = f"[{time.time() - self.t0:6.1f}s] {row['shape']:<22} {row['mode']} {row['variant']:<18} "
        if row.get("error"):
            msg += "ERROR " + row["error"]
        elif not row.get("ok", True):
            msg += f"WRONG rel_rms={row['rel_rms']}"
        else:
            msg += f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s"
            if "rel_rms" in row:
                msg += f"  rel_rms={row['rel_rms']}"
            if row.get("res"):
                msg += "  " + ", ".join(f"{k.replace('flash_attn_', '')}: {v}" for k, v in row["res"].items())
        print(msg, flush=True)

    def save(self):
        with open(self.out_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "rows": self.rows}, f, indent=1)


def time_row(run, shape, causal, mode, variant, fn, check=None, res_kernels=()):
    B, H, S, D = shape
    row = {"shape": f"{B}x{H}x{S}x{D}{' causal' if causal else ''}", "B": B, "H": H, "S": S, "D": D,
           "causal": causal, "mode": mode, "variant": variant}
    try:
        if check is not None:
            err = check()
            errs = err if isinstance(err, list) else [err]
            row["rel_rms"] = [round(e, 5) for e in errs] if isinstance(err, list) else round(err, 5)
            row["ok"] = all(math.isfinite(e) and e < TOL for e in errs)
            if not row["ok"]:
                run.add(row)
                return row
        ms = bench_ms(fn)
        row.update(ms=ms, tflops=flops(B, H, S, D, causal, mode) / ms * 1e-9)
        if res_kernels:
            row["res"] = {k: resources(k) for k in res_kernels}
    except Exception as e:  # a variant that fails to compile or launch is reported, not fatal
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    run.add(row)
    return row


def run_shape(run, shape, fwd_variants, bwd_variants, peers):
    """Check and time the given variants (and the SDPA peers) at one shape, non-causal then causal."""
    B, H, S, D = shape
    torch.manual_seed(S + D)
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = D**-0.5
    for causal in (False, True):
        ref_o, ref_g = math_reference(q, k, v, do, causal)
        for name, backend in peers:
            try:
                pf, pb = sdpa_peer(backend, q, k, v, do, causal)
            except Exception as e:  # a backend this build lacks
                print(f"sdpa_{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            if fwd_variants is not None:
                time_row(run, shape, causal, "fwd", "sdpa_" + name, pf)
            if bwd_variants is not None:
                time_row(run, shape, causal, "bwd", "sdpa_" + name, pb)
        for variant in fwd_variants or ():
            cfg = FWD[variant][D]

            def fwd(cfg=cfg):
                return A.attn_fwd(q, k, v, causal, scale, cfg, residual=False)

            def check(fwd=fwd):
                return rel_rms(fwd()[0][0, :, :2], ref_o)

            time_row(run, shape, causal, "fwd", variant, fwd, check, ("flash_attn_fwd",))
        if bwd_variants:
            o, lse, o_res = A.attn_fwd(q, k, v, causal, scale, FWD["tma_128x128"][D], residual=True)
            for variant in bwd_variants:
                cfg_dkdv, cfg_dq = BWD[variant][D]

                def bwd(cfg_dkdv=cfg_dkdv, cfg_dq=cfg_dq):
                    return A.attn_bwd(do, q, k, v, o, o_res, lse, None, causal, scale, cfg_dkdv=cfg_dkdv,
                                      cfg_dq=cfg_dq)

                def check(bwd=bwd):
                    return [rel_rms(g[0, :, :2], r) for g, r in zip(bwd(), ref_g)]

                kernels = ("flash_attn_bwd_dkdv",) + (("flash_attn_bwd_dq",) if cfg_dq else ())
                time_row(run, shape, causal, "bwd", variant, bwd, check, kernels)
            del o, lse, o_res
        run.save()
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--only", choices=("fwd", "bwd"))
    ap.add_argument("--shapes", help="indices into the shape list, e.g. 0,2")
    args = ap.parse_args()
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    run = Run(args.out)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    peers = (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION))
    first = [v for v in FWD if v not in FWD_LAST] if args.only != "bwd" else None
    bwd = list(BWD) if args.only != "fwd" else None
    for shape in shapes:
        run_shape(run, shape, first, bwd, peers)
    if args.only != "bwd":  # warp specialization last
        for shape in shapes:
            run_shape(run, shape, list(FWD_LAST), None, ())
    run.save()
    table(run.rows)


def table(rows):
    peers = {(r["shape"], r["mode"], r["variant"]): r.get("ms") for r in rows if r["variant"].startswith("sdpa_")}
    print("\n| shape | mode | variant | ms | TFLOP/s | vs cuDNN | vs FA2 | rel_rms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["D"], r["S"], r["causal"], r["mode"], r["variant"])):
        if r.get("error"):
            print(f"| {r['shape']} | {r['mode']} | {r['variant']} | error | | | | {r['error'][:60]} |")
            continue
        if "ms" not in r:
            print(f"| {r['shape']} | {r['mode']} | {r['variant']} | WRONG | | | | {r.get('rel_rms')} |")
            continue
        cud = peers.get((r["shape"], r["mode"], "sdpa_cudnn"))
        fa2 = peers.get((r["shape"], r["mode"], "sdpa_fa2"))
        rc = f"{cud / r['ms']:.2f}x" if cud else ""
        rf = f"{fa2 / r['ms']:.2f}x" if fa2 else ""
        print(f"| {r['shape']} | {r['mode']} | {r['variant']} | {r['ms']:.3f} | {r['tflops']:.0f} | {rc} | {rf} | "
              f"{r.get('rel_rms', '')} |")


if __name__ == "__main__":
    main()
