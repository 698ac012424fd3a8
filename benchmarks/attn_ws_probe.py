"""The Gluon attention forward (triforge/ops/attention/forward_ws.py) against the Triton kernel and cuDNN (issue 3).

At the bench's (B, H, S, D) shapes, causal and not, bf16: each Gluon config checked against the Triton kernel's
output, then timed with CUDA events (median of 20 calls, the L2 flushed before each) beside the Triton path
(TRIFORGE_ATTN_GLUON=0) and torch SDPA's cuDNN backend in the same process; TFLOP/s = 4 B H S^2 D / t (half causal).

    PYTHONPATH=. python benchmarks/attn_ws_probe.py [--json PATH] [--shapes 4x16x8192x128 ...]
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

import triforge
from triforge.ops.attention.forward_ws import attn_fwd_ws

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_ws_kernel import attn_fwd_ws as probe_fwd  # noqa: E402  (session 37 call 4's kernel: no masks)

SHAPES = ["16x16x2048x64", "8x16x4096x64", "4x16x8192x128", "2x16x16384x128"]


def time_ms(fn, reps=20):
    flush = torch.empty(64 << 20, dtype=torch.int8, device="cuda")
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def grid(D):
    if D == 128:
        return [{"BLOCK_N": 128, "num_stages": 3}, {"BLOCK_N": 128, "num_stages": 2}, {"BLOCK_N": 64, "num_stages": 6}]
    return [{"BLOCK_N": 128, "num_stages": s} for s in (3, 4)]


def run(B, H, S, D, causal):
    torch.manual_seed(1)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * B * H * S * S * D // (2 if causal else 1)
    os.environ["TRIFORGE_ATTN_GLUON"] = "0"
    o_tri = triforge.flash_attn_func(q, k, v, causal=causal)
    row = {"shape": [B, H, S, D], "causal": causal}
    row["triton_ms"] = time_ms(lambda: triforge.flash_attn_func(q, k, v, causal=causal))
    os.environ.pop("TRIFORGE_ATTN_GLUON")
    row["default_ms"] = time_ms(lambda: triforge.flash_attn_func(q, k, v, causal=causal))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        row["cudnn_ms"] = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
    row["timed"] = []
    if not causal:  # the first form (no masks, no guards), for comparison
        row["probe_ms"] = time_ms(lambda: probe_fwd(q, k, v, cfg={"STAGES": 3, "PIPE": 1}))
        print(f"   call-4 probe kernel (no masks) {row['probe_ms']:.3f} ms", flush=True)
    for cfg in grid(D):
        try:
            o, _, _ = attn_fwd_ws(q, k, v, causal, D ** -0.5, cfg)
            diff = (o.float() - o_tri.float()).abs().max().item()
            ok = bool(torch.isfinite(o).all()) and diff < 2e-2
            ms = time_ms(lambda: attn_fwd_ws(q, k, v, causal, D ** -0.5, cfg)) if ok else None
            row["timed"].append({"config": cfg, "ms": ms, "max_diff_vs_triton": diff, "ok": ok})
        except Exception as e:
            print(f"  {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            row["timed"].append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:300]}", "ok": False})
    tf = lambda ms: flops / ms / 1e9  # noqa: E731
    c = row["cudnn_ms"]
    print(f"({B},{H},{S},{D}) {'causal' if causal else 'full'}: cuDNN {c:.3f} ms ({tf(c):.0f} TFLOP/s); Triton "
          f"{row['triton_ms']:.3f} ({c / row['triton_ms']:.3f}x cuDNN); default path {row['default_ms']:.3f} "
          f"({c / row['default_ms']:.3f}x)", flush=True)
    for t in sorted((t for t in row["timed"] if t.get("ms")), key=lambda t: t["ms"]):
        print(f"   {t['ms']:.3f} ms {tf(t['ms']):4.0f} TFLOP/s {c / t['ms']:.3f}x cuDNN "
              f"{row['triton_ms'] / t['ms']:.3f}x Triton, max diff {t['max_diff_vs_triton']:.1e}  {t['config']}", flush=True)
    bad = [t for t in row["timed"] if not t["ok"]]
    if bad:
        print(f"   FAILED: {[(t['config'], t.get('max_diff_vs_triton'), t.get('error')) for t in bad]}", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    args = ap.parse_args()
    out = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__}, "rows": []}
    for s in args.shapes:
        B, H, S, D = (int(x) for x in s.split("x"))
        for causal in (False, True):
            out["rows"].append(run(B, H, S, D, causal))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
