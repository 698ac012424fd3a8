"""The Gated DeltaNet training forward (a forward that keeps residuals for the backward) with the Triton kernels
against the Gluon kernel's SAVE variant (TRIFORGE_DELTANET_GLUON_SAVE=0 / 1), in one process (issue 4).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/deltanet_train_fwd_probe.py [--json OUT] [--shapes 8x4096x16x32 ...]

At each (B, T, H, HV) shape (bf16, K = V = 128, q/k l2-normalised in the kernels): the differentiable forward alone,
the inference forward (no grad: the Gluon kernel without SAVE) and forward + backward, each under both settings,
timed per call with CUDA events in interleaved rounds (min / median / p95 ms); and, before timing, the gradients of
the two settings against each other (relative RMS: both are within rounding of float64 by the GPU tests; here a
gross difference would show). Every input is larger than the L2 at the bench shapes. The table printed last has
one row per shape and setting.
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triforge  # noqa: E402
from triforge.ops.deltanet import chunk  # noqa: E402

from gdn_dqkw_ws_probe import event_times, quantiles  # noqa: E402  (the same CUDA-event timer)

SHAPES = ["1x32768x16x32", "8x4096x16x32", "4x8192x16x16", "1x8192x32x32"]
NAMES = ("q", "k", "v", "g", "beta")


def make(shape, dtype=torch.bfloat16):
    B, T, H, HV = (int(s) for s in shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    x = {"q": r(B, T, H, 128).to(dtype), "k": r(B, T, H, 128).to(dtype), "v": r(B, T, HV, 128).to(dtype),
         "g": F.logsigmoid(r(B, T, HV) + 2.0), "beta": torch.sigmoid(r(B, T, HV)).to(dtype)}
    return {n: t.requires_grad_(True) for n, t in x.items()}, r(B, T, HV, 128).to(dtype)


def with_save(flag, fn):
    def run():
        os.environ[chunk.GLUON_SAVE_ENV] = flag
        return fn()
    return run


def rel_rms(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    a = ap.parse_args()
    rows = []
    for shape in a.shapes:
        x, do = make(shape)
        fwd = lambda: triforge.chunk_gated_delta_rule(**x, use_qk_l2norm_in_kernel=True)  # noqa: E731

        def infer():
            with torch.no_grad():
                return fwd()

        def step():
            o, _ = fwd()
            return torch.autograd.grad(o, [x[n] for n in NAMES], do)

        grads = {f: with_save(f, step)() for f in ("0", "1")}
        diff = {n: rel_rms(g1, g0) for n, g0, g1 in zip(NAMES, grads["0"], grads["1"])}
        fns = [with_save(f, fn) for f in ("0", "1") for fn in (fwd, infer, step)]
        ts = event_times(fns, rounds=8, n=10)
        for i, (flag, what) in enumerate((f, w) for f in ("0", "1") for w in ("train fwd", "inference fwd", "fwd+bwd")):
            row = {"shape": shape, "gluon_save": flag, "what": what, **quantiles(ts[i])}
            if what == "fwd+bwd":
                row["grad_rel_rms_vs_triton"] = diff if flag == "1" else None
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.environ.pop(chunk.GLUON_SAVE_ENV, None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{'shape':>15} {'save':>4} {'what':>14} {'min':>8} {'median':>8} {'p95':>8}  grads vs Triton (rel rms)")
    for r in rows:
        g = r.get("grad_rel_rms_vs_triton")
        gs = " ".join(f"{n}={v:.1e}" for n, v in g.items()) if g else ""
        print(f"{r['shape']:>15} {r['gluon_save']:>4} {r['what']:>14} {r['min']:8.3f} {r['median']:8.3f} "
              f"{r['p95']:8.3f}  {gs}")


if __name__ == "__main__":
    main()
