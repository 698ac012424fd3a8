"""The Gated DeltaNet forward's kernels one by one at the bench shapes (issue 4): configs, variants, ablations.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/deltanet_fwd_probe.py OUT.json [--shapes 1x32768x16x32 ...]
            [--intra V_LATE:warps:stages[:kn][:t][:rN] ...] [--ablate solve,l2norm] [--grids h,o,h_o]

At each (B, T, H, HV) shape (bf16, K = V = 128, q/k l2-normalised in the kernels, the bench's inputs):
  - the intra kernel at each --intra config (":kn": storing the normalised k too, as the forward does): time
    (triton do_bench median; every input is larger than the L2), registers / spills / shared memory, and its w,
    u, gamma against the first config's (relative RMS);
  - the unfused recurrence (h and v_new stored), the output kernel and the fused recurrence (o), each with its
    default config on raw k (normalised in the kernel, as before) and on the intra kernel's kn, then over a grid
    of V-blocks / warps / stages on kn (--grids selects which), outputs against the first run's;
  - with --ablate, the intra kernel again in a child process where one stage is replaced by a stand-in of the
    same shapes (solve: T = I + A; l2norm: rows left as they are): the time it saves bounds what that stage
    costs. Ablated outputs are wrong by construction and never compared.
The table printed last has one row per shape and kernel.
"""

import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_bwd_sweep import bench_ms, rel_rms, resources  # noqa: E402  (the same timing and checks)

SHAPES = ["1x32768x16x32", "8x4096x16x32", "4x8192x16x16", "1x8192x32x32"]
INTRA = ["1:4:2", "1:4:2:kn"]


def bench_us(fn):
    return 1e3 * bench_ms(fn)


def make(shape):
    from triforge.ops import deltanet as D

    B, T, H, HV = (int(v) for v in shape.split("x"))
    return D._make_inputs("real", torch.bfloat16, "cuda", torch.Generator().manual_seed(0),
                          ((B, T, H, HV, 128, 128), (B, T, H, HV, 128, 128)))


def intra_cfg(spec):
    """V_LATE:warps:stages[:kn][:t][:rN][:p][:dN][:oN] (p: DIAG_PRODUCT 1; dN: DIAG_PRODUCT N; oN: ORDER N;
    kn: the normalised k stored too, as the forward runs it now; t: T stored
    too, as the training forward runs it; rN: a register cap of N per thread, maxnreg; since session 25 the launcher
    applies the cap only without T stored, so ":t:rN" times the uncapped kernel)."""
    parts = spec.split(":")
    v_late, warps, stages = (int(x) for x in parts[:3])
    cfg = {"V_LATE": v_late, "num_warps": warps, "num_stages": stages}
    cfg.update({"maxnreg": int(p[1:]) for p in parts[3:] if p.startswith("r")})
    if "p" in parts[3:]:  # the solve's diagonal blocks by tensor-core products (chunk._solve_unit_lower)
        cfg["DIAG_PRODUCT"] = 1
    # dN: DIAG_PRODUCT N (0 substitution, 1 dense products, 2 batched [4, 16, 16] products: session 44)
    cfg.update({"DIAG_PRODUCT": int(p[1:]) for p in parts[3:] if p[:1] == "d" and p[1:].isdigit()})
    # oN: ORDER N (1: the value heads of one k head as neighbouring programs; session 45)
    cfg.update({"ORDER": int(p[1:]) for p in parts[3:] if p[:1] == "o" and p[1:].isdigit()})
    return cfg


def intra_call(i, spec):
    return lambda: chunk_intra()(i["k"], i["v"], i["g"], i["beta"], l2norm=True, cfg=intra_cfg(spec),
                                 store_kn=":kn" in spec, store_t=":t" in spec.replace(":kn", ""))


def chunk_intra():
    from triforge.ops.deltanet import chunk

    return chunk.chunk_fwd_intra


def intra_rows(shape, specs):
    i = make(shape)
    rows, ref = [], None
    for spec in specs:
        run = intra_call(i, spec)
        out = run()
        torch.cuda.synchronize()
        row = {"shape": shape, "kernel": "intra", "config": spec, **resources("gated_delta_rule_fwd_intra")}
        if ref is None:
            ref = out
        row["err"] = max(rel_rms(out[n], ref[n]) for n in ("w", "u", "gamma"))
        row["finite"] = all(bool(torch.isfinite(out[n]).all()) for n in ("w", "u", "gamma"))
        row["us"] = bench_us(run)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _grid(bvs, warps, stages):
    return [{"BV": bv, "num_warps": w, "num_stages": st} for bv in bvs for w in warps for st in stages]


H_GRID = _grid((32, 64), (4, 8), (2, 3))
H_O_GRID = _grid((64,), (4, 8), (1, 2))
O_GRID = _grid((64, 128), (4, 8), (2, 3))


def cfg_name(cfg):
    return f"BV{cfg['BV']}w{cfg['num_warps']}s{cfg['num_stages']}"


def recurrence_rows(shape, grids):
    """The recurrence (unfused: h and v_new stored; fused: o) and the output kernel at each config of their
    grids, k as the forward now passes it (the intra kernel's normalised kn) and, for the default config,
    as before (raw k, normalised in every program); outputs against the default config's."""
    from triforge.ops.deltanet import chunk

    i = make(shape)
    q, k, g, beta, h0 = i["q"], i["k"], i["g"], i["beta"], i["initial_state"]
    B, T, H, K = q.shape
    HV = i["v"].shape[2]
    scale = K**-0.5
    intra = chunk.chunk_fwd_intra(k, i["v"], g, beta, l2norm=True, store_kn=True)
    w, u, gamma, kn = intra["w"], intra["u"], intra["gamma"], intra["kn"]
    fused = chunk.use_fused(K, 128, B * HV)
    h, v_new, _ = chunk.chunk_fwd_h(kn, w, u, gamma, h0, l2norm=True, k_normed=True)
    runs = [("h", "raw k", None, lambda cfg: chunk.chunk_fwd_h(k, w, u, gamma, h0, l2norm=True, cfg=cfg)),
            ("o", "raw k", None, lambda cfg: chunk.chunk_fwd_o(q, k, v_new, h, gamma, scale, l2norm=True, cfg=cfg)),
            ("h_o", "raw k", None, lambda cfg: chunk.chunk_fwd_h_o(q, k, w, u, gamma, h0, scale, l2norm=True,
                                                                    cfg=cfg)["o"])]
    fns = {"h": lambda cfg: chunk.chunk_fwd_h(kn, w, u, gamma, h0, l2norm=True, cfg=cfg, k_normed=True),
           "o": lambda cfg: chunk.chunk_fwd_o(q, kn, v_new, h, gamma, scale, l2norm=True, cfg=cfg, k_normed=True),
           "h_o": lambda cfg: chunk.chunk_fwd_h_o(q, kn, w, u, gamma, h0, scale, l2norm=True, cfg=cfg,
                                                  k_normed=True)["o"]}
    for kind in ("h", "o", "h_o"):
        runs.append((kind, "kn", None, fns[kind]))
        runs += [(kind, "kn", cfg, fns[kind]) for cfg in grids[kind]]
    kernel = {"h": "gated_delta_rule_fwd_h", "o": "gated_delta_rule_fwd_o", "h_o": "gated_delta_rule_fwd_h_o"}
    rows, ref = [], {}
    for kind, kvar, cfg, fn in runs:
        run = lambda: fn(cfg)  # noqa: E731
        row = {"shape": shape, "kernel": kind, "k": kvar, "config": cfg_name(cfg) if cfg else "default",
               "forward_uses_fused": fused}
        try:
            out = run()
            torch.cuda.synchronize()
            out = out if isinstance(out, tuple) else (out,)
            out = [t for t in out if t is not None and t.numel()]
            if kind not in ref:
                ref[kind] = out
            row["err"] = max(rel_rms(a, b) for a, b in zip(out, ref[kind]))
            row.update(resources(kernel[kind]))
            row["us"] = bench_us(run)
        except Exception as e:  # noqa: BLE001  (recorded: a config that does not compile or launch)
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


ABLATE_SRC = {
    "solve": '''
@triton.jit
def stand_in(b_A, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    o_i = tl.arange(0, BT)
    return tl.where(o_i[:, None] == o_i[None, :], 1.0, b_A)
''',
    "l2norm": '''
@triton.jit
def stand_in(b_x):
    return b_x.to(tl.float32)
''',
}
ABLATE_TARGET = {"solve": "_solve_unit_lower", "l2norm": "_l2norm_rows"}


def ablated_child(stage, shapes, spec):
    """In this process only: chunk's ``stage`` helper replaced before any kernel compiles, then the intra
    kernel timed at each shape (a stand-in's source is part of the kernel's cache key)."""
    import importlib.util
    import tempfile

    from triforge.ops.deltanet import chunk

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:  # @triton.jit needs a source file
        fh.write("import triton\nimport triton.language as tl\n" + ABLATE_SRC[stage])
    spec_mod = importlib.util.spec_from_file_location("ablate_" + stage, fh.name)
    mod = importlib.util.module_from_spec(spec_mod)
    spec_mod.loader.exec_module(mod)
    setattr(chunk, ABLATE_TARGET[stage], mod.stand_in)
    rows = []
    for shape in shapes:
        i = make(shape)
        run = intra_call(i, spec)
        run()
        torch.cuda.synchronize()
        row = {"shape": shape, "kernel": f"intra without {stage}", "config": spec,
               **resources("gated_delta_rule_fwd_intra"), "us": bench_us(run)}
        print("ROW" + json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--intra", nargs="*", default=INTRA, help="V_LATE:warps:stages, the first is the reference")
    ap.add_argument("--ablate", default="", help="comma-separated stages of the intra kernel: solve, l2norm")
    ap.add_argument("--grids", default="h,o,h_o", help="which recurrence / output grids to run (none: defaults only)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.cuda.init()
    if args.child:
        ablated_child(args.child, args.shapes, args.intra[0])
        return
    rows = []
    for shape in args.shapes:
        rows += intra_rows(shape, args.intra)
        sel = set(args.grids.split(","))
        if "skip" not in sel:  # (skip: the intra kernel alone)
            rows += recurrence_rows(shape, {"h": H_GRID if "h" in sel else [], "o": O_GRID if "o" in sel else [],
                                            "h_o": H_O_GRID if "h_o" in sel else []})
        torch.cuda.empty_cache()
    for stage in filter(None, args.ablate.split(",")):
        out = subprocess.run([sys.executable, __file__, args.out, "--child", stage, "--shapes", *args.shapes,
                              "--intra", args.intra[0]], capture_output=True, text=True)
        got = [json.loads(line[3:]) for line in out.stdout.splitlines() if line.startswith("ROW")]
        if out.returncode:
            print(f"ablation {stage} failed: {out.stderr[-1500:]}", flush=True)
        rows += got
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)
    print(f"\n{'shape':>15} {'kernel':>22} {'k':>5} {'config':>13} {'us':>9} {'regs':>5} {'spill':>5} {'err':>8}")
    for r in rows:
        us = f"{r['us']:9.1f}" if "us" in r else r.get("error", "")[:40]
        err = f"{r['err']:8.1e}" if "err" in r else ""
        print(f"{r['shape']:>15} {r['kernel']:>22} {r.get('k', ''):>5} {r.get('config', ''):>13} {us} "
              f"{r.get('registers') or '':>5} {r.get('spills') if r.get('spills') is not None else '':>5} {err}")


if __name__ == "__main__":
    main()
