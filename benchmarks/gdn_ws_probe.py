"""Probe (issue 4): the warp-specialized Gluon recurrence + output (triforge/ops/deltanet/fused_ws.py) on the H100.

    PYTHONPATH=. python3 benchmarks/gdn_ws_probe.py OUT.json [--cfgs NOUT:NB:STAGES[:noftz] ...] [--shapes ...]

Checks every config against the float64 recurrent reference and the library's Triton forward at small shapes (an
initial state, grouped heads, T not a multiple of 64, T < 64, packed sequences), then times the forward (the library's
intra kernel + this kernel; and this kernel alone on the intra kernel's outputs) against the library's forward
(chunk.chunk_fwd) at the bench shapes, triton do_bench medians with inputs past the L2.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_bwd_sweep import rel_rms  # noqa: E402


def parse(spec):
    p = spec.split(":")
    assert p[0] == "2", "two output warpgroups (one measured slower: NOUT left the kernel in session 40)"
    return dict(NB=int(p[1]), STAGES=int(p[2]), FTZ=int("noftz" not in p[3:]),
                SKIP=int("skip" in p[3:]), QN=int("qn" in p[3:]),
                L2NORM=3 if "ldn" in p[3:] else 2 if "post" in p[3:] else 1, BV=64 if "bv64" in p[3:] else 32,
                **({"OUT_REGS": 152, "LOAD_REGS": 80} if "ldn" in p[3:] else {}))


def ws_forward(q, k, v, g, beta, scale, h0, cfg, cu_seqlens=None, l2norm=True, qn=None):
    from triforge.ops.deltanet import chunk as C
    from triforge.ops.deltanet import fused_ws as W

    varlen = C.prepare_varlen(cu_seqlens)
    intra = C.chunk_fwd_intra(k, v, g, beta, l2norm=l2norm, varlen=varlen, store_kn=l2norm)
    if qn is not None:  # q normalised beforehand (untimed: a bound)
        q, l2norm = qn, False
    return W.fwd_ws(q, intra.get("kn", k), intra["w"], intra["u"], intra["gamma"], h0, scale, l2norm=l2norm,
                    cu_seqlens=None if varlen is None else varlen.cu_seqlens, cfg=cfg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", nargs="*", default=["1x32768x16x32", "8x4096x16x32", "4x8192x16x16", "1x8192x32x32"])
    ap.add_argument("--cfgs", nargs="*", default=["2:3:3", "1:2:3", "1:3:3", "2:2:3", "2:3:2"])
    args = ap.parse_args()
    from triton.testing import do_bench

    from triforge.ops import deltanet as D
    from triforge.ops.deltanet import chunk as C
    from triforge.ops.deltanet import reference as R

    rows = []
    torch.manual_seed(0)
    dev = "cuda"
    checks = [  # (B, T, H, HV, h0, cu_seqlens)
        (2, 256, 2, 4, True, None), (2, 200, 2, 4, True, None), (3, 37, 1, 2, False, None), (1, 64, 2, 2, True, None),
        (1, 1000, 2, 4, True, [0, 63, 200, 201, 329, 1000]), (1, 700, 1, 1, False, [0, 0, 64, 700]),
    ]
    for spec in args.cfgs:
        cfg = parse(spec)
        if cfg["SKIP"] or cfg["QN"]:
            continue
        for B, T, H, HV, use_h0, cu in checks:
            q = torch.randn(B, T, H, 128, device=dev, dtype=torch.bfloat16)
            k = torch.randn(B, T, H, 128, device=dev, dtype=torch.bfloat16)
            v = torch.randn(B, T, HV, 128, device=dev, dtype=torch.bfloat16)
            g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device=dev) + 2.0)
            beta = torch.sigmoid(torch.randn(B, T, HV, device=dev)).to(torch.bfloat16)
            N = B if cu is None else len(cu) - 1
            h0 = 0.1 * torch.randn(N, HV, 128, 128, device=dev) if use_h0 else None
            cut = None if cu is None else torch.tensor(cu, device=dev, dtype=torch.int32)
            r = {"check": f"{B}x{T}x{H}x{HV} h0={use_h0} cu={cu}", "cfg": spec}
            try:
                ref_o, ref_s = C.chunk_fwd(q, k, v, g, beta, 128 ** -0.5, h0, l2norm=True, cu_seqlens=cut)
                f64 = R.recurrent_ref(q, k, v, g, beta, 128 ** -0.5, h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cut)
                o, s = ws_forward(q, k, v, g, beta, 128 ** -0.5, h0, cfg, cu_seqlens=cut)
                torch.cuda.synchronize()
                r.update(o_vs_lib=rel_rms(o, ref_o), s_vs_lib=rel_rms(s, ref_s), o_vs_f64=rel_rms(o, f64[0]),
                         lib_o_vs_f64=rel_rms(ref_o, f64[0]), s_vs_f64=rel_rms(s, f64[1]),
                         lib_s_vs_f64=rel_rms(ref_s, f64[1]),
                         nan=bool(torch.isnan(o).any() or torch.isnan(s).any()))
                r["ok"] = (not r["nan"] and r["o_vs_f64"] <= 1.5 * r["lib_o_vs_f64"] + 1e-3
                           and r["s_vs_f64"] <= 1.5 * r["lib_s_vs_f64"] + 1e-3)
            except Exception as e:  # noqa: BLE001 (a probe: report and go on)
                r.update(error=f"{type(e).__name__}: {str(e)[:600]}", ok=False)
            print(r, flush=True)
            rows.append(r)
    for shape in args.shapes:
        B, T, H, HV = (int(x) for x in shape.split("x"))
        inp = D._make_inputs("real", torch.bfloat16, dev, torch.Generator().manual_seed(0),
                             ((B, T, H, HV, 128, 128), (B, T, H, HV, 128, 128)))
        q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
        scale = 128 ** -0.5
        ref_o, ref_s = C.chunk_fwd(q, k, v, g, beta, scale, None, l2norm=True)
        base_ms = do_bench(lambda: C.chunk_fwd(q, k, v, g, beta, scale, None, l2norm=True), warmup=25, rep=300,
                           return_mode="median")
        intra_ms = do_bench(lambda: C.chunk_fwd_intra(k, v, g, beta, l2norm=True, store_kn=True), warmup=25,
                            rep=300, return_mode="median")
        intra = C.chunk_fwd_intra(k, v, g, beta, l2norm=True, store_kn=True)
        row = {"shape": shape, "library_ms": base_ms, "intra_ms": intra_ms, "cfgs": []}
        from triforge.ops.deltanet import fused_ws as W
        qn = R.l2norm(q.float()).to(q.dtype)
        for spec in args.cfgs:
            cfg = parse(spec)
            qx = qn if cfg["QN"] else None
            try:
                o, s = ws_forward(q, k, v, g, beta, scale, None, cfg, qn=qx)
                torch.cuda.synchronize()
                ms = do_bench(lambda: ws_forward(q, k, v, g, beta, scale, None, cfg, qn=qx), warmup=25, rep=300,
                              return_mode="median")
                kern_ms = do_bench(lambda: W.fwd_ws(q if qx is None else qx, intra["kn"], intra["w"], intra["u"],
                                                    intra["gamma"], None, scale, l2norm=qx is None, cfg=cfg),
                                   warmup=25, rep=300, return_mode="median")
                c = {"cfg": spec, "ms": ms, "kernel_ms": kern_ms, "o_vs_lib": rel_rms(o, ref_o),
                     "s_vs_lib": rel_rms(s, ref_s), "nan": bool(torch.isnan(o).any())}
            except Exception as e:  # noqa: BLE001
                c = {"cfg": spec, "error": f"{type(e).__name__}: {str(e)[:600]}"}
            row["cfgs"].append(c)
            print(shape, c, flush=True)
        rows.append(row)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    bad = [r for r in rows if "check" in r and not r["ok"]]
    print(f"\nchecks: {sum(1 for r in rows if 'check' in r) - len(bad)} ok, {len(bad)} failed")
    print("shape            library ms  intra ms   best ws fwd ms (cfg)  kernel ms   vs library")
    for row in rows:
        if "shape" not in row:
            continue
        good = [c for c in row["cfgs"] if "ms" in c and not c["nan"] and c["o_vs_lib"] < 2e-2
                and not any(x in c["cfg"] for x in ("skip", "qn"))]
        if good:
            b = min(good, key=lambda c: c["ms"])
            print(f"{row['shape']:16s} {row['library_ms']:9.3f} {row['intra_ms']:9.3f}   {b['ms']:9.3f} ({b['cfg']})"
                  f"  {b['kernel_ms']:8.3f}   {row['library_ms'] / b['ms']:.2f}x")
        else:
            print(f"{row['shape']:16s} {row['library_ms']:9.3f}  no passing config")


if __name__ == "__main__":
    main()
