"""The Gated DeltaNet forward's kernels one by one at the bench shapes (issue 4): configs, variants, ablations.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/deltanet_fwd_probe.py OUT.json [--shapes 1x32768x16x32 ...]
        [--intra V_LATE:warps:stages ...] [--ablate solve,l2norm]

At each (B, T, H, HV) shape (bf16, K = V = 128, q/k l2-normalised in the kernels, the bench's inputs):
  - the intra kernel at each --intra config: time (triton do_bench median; every input is larger than the L2),
    registers / spills / shared memory, and its w, u, gamma against the first config's (relative RMS);
  - the recurrence as the forward runs it at that shape (fused with the output, or not), the unfused recurrence
    with and without its h store, the output kernel, and the fused recurrence at each of its V-blocks;
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

SHAPES = ["1x32768x16x32", "8x4096x16x32", "4x8192x16x16", "1x8192x32x32"]
INTRA = ["1:4:2", "2:4:2", "2:8:2", "1:8:2"]


def bench_us(fn):
    import triton

    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def rel_rms(got, ref):
    got, ref = got.double(), ref.double()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def resources(kernel):
    from triforge import launch

    r = launch.kernel_resources(kernel) or {}
    return {"registers": r.get("registers"), "spills": r.get("spills"), "shared": r.get("shared_bytes")}


def make(shape):
    from triforge.ops import deltanet as D

    B, T, H, HV = (int(v) for v in shape.split("x"))
    return D._make_inputs("real", torch.bfloat16, "cuda", torch.Generator().manual_seed(0),
                          ((B, T, H, HV, 128, 128), (B, T, H, HV, 128, 128)))


def intra_cfg(spec):
    v_late, warps, stages = (int(x) for x in spec.split(":"))
    return {"V_LATE": v_late, "num_warps": warps, "num_stages": stages}


def intra_rows(shape, specs):
    from triforge.ops.deltanet import chunk

    i = make(shape)
    rows, ref = [], None
    for spec in specs:
        cfg = intra_cfg(spec)
        run = lambda: chunk.chunk_fwd_intra(i["k"], i["v"], i["g"], i["beta"], l2norm=True, cfg=cfg)  # noqa: E731
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


def recurrence_rows(shape):
    from triforge.ops.deltanet import chunk

    i = make(shape)
    q, k, g, beta, h0 = i["q"], i["k"], i["g"], i["beta"], i["initial_state"]
    B, T, H, K = q.shape
    HV = i["v"].shape[2]
    scale = K**-0.5
    intra = chunk.chunk_fwd_intra(k, i["v"], g, beta, l2norm=True)
    w, u, gamma = intra["w"], intra["u"], intra["gamma"]
    fused = chunk.use_fused(K, 128, B * HV)
    runs = {
        "h(+h,+v_new)": lambda: chunk.chunk_fwd_h(k, w, u, gamma, h0, l2norm=True),
        "h(+v_new only)": lambda: chunk._fwd_h_launch(None, k, w, u, gamma, h0, 1.0, l2norm=True, varlen=None,
                                                      fuse_o=False, store_h=False, store_v_new=True,
                                                      output_final_state=True, cfg=None),
    }
    h, v_new, _ = chunk.chunk_fwd_h(k, w, u, gamma, h0, l2norm=True)
    runs["o"] = lambda: chunk.chunk_fwd_o(q, k, v_new, h, gamma, scale, l2norm=True)
    for bv in chunk.FUSED_BV:
        for warps in (4, 8):
            cfg = {"BV": bv, "num_warps": warps, "num_stages": 1}
            runs[f"h_o BV{bv} w{warps}"] = (lambda cfg=cfg: chunk.chunk_fwd_h_o(q, k, w, u, gamma, h0, scale,
                                                                                 l2norm=True, cfg=cfg))
    runs["h_o default"] = lambda: chunk.chunk_fwd_h_o(q, k, w, u, gamma, h0, scale, l2norm=True)
    rows = []
    for name, run in runs.items():
        try:
            run()
            torch.cuda.synchronize()
            kern = "gated_delta_rule_fwd_h_o" if name.startswith("h_o") else (
                "gated_delta_rule_fwd_o" if name == "o" else "gated_delta_rule_fwd_h")
            row = {"shape": shape, "kernel": name, "forward_uses_fused": fused, **resources(kern), "us": bench_us(run)}
        except Exception as e:  # noqa: BLE001  (recorded: a config that does not compile or launch)
            row = {"shape": shape, "kernel": name, "error": f"{type(e).__name__}: {str(e)[:160]}"}
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
        cfg = intra_cfg(spec)
        run = lambda: chunk.chunk_fwd_intra(i["k"], i["v"], i["g"], i["beta"], l2norm=True, cfg=cfg)  # noqa: E731
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
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.cuda.init()
    if args.child:
        ablated_child(args.child, args.shapes, args.intra[0])
        return
    rows = []
    for shape in args.shapes:
        rows += intra_rows(shape, args.intra)
        rows += recurrence_rows(shape)
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
    print(f"\n{'shape':>15} {'kernel':>22} {'config':>7} {'us':>9} {'regs':>5} {'spill':>5} {'err':>8}")
    for r in rows:
        us = f"{r['us']:9.1f}" if "us" in r else r.get("error", "")[:40]
        err = f"{r['err']:8.1e}" if "err" in r else ""
        print(f"{r['shape']:>15} {r['kernel']:>22} {r.get('config', ''):>7} {us} {r.get('registers') or '':>5} "
              f"{r.get('spills') if r.get('spills') is not None else '':>5} {err}")


if __name__ == "__main__":
    main()
