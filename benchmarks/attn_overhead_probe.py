"""Host overhead of the attention forward's entry points and what the timers see of it (issue 3, session 38).

Session 38's interleaved probe (attn_ws_probe.time_all: rounds of 5 back-to-back calls, each round started on an idle
GPU) timed ``flash_attn_func`` 7-10% slower than ``attention.attn_fwd`` with the same config at D = 64. This measures,
per entry point (the public function, the custom op, the launcher, torch SDPA's cuDNN backend):
- host time per call: 200 calls enqueued back to back on a tiny input (the GPU keeps up), perf_counter;
- GPU time per call at a bench shape three ways: rounds of 5 and of 50 back-to-back calls (CUDA events around each
  round) and triton's do_bench (the bench's timer: L2 flush, then events around each call).

    PYTHONPATH=. python benchmarks/attn_overhead_probe.py [--json PATH]
"""

import argparse
import json
import torch
import torch.nn.functional as F

import triforge
from triforge import bench
from triforge.ops import attention

from attn_ws_probe import time_all  # noqa: E402  (benchmarks/ is the script's directory)
from host_overhead_probe import host_us  # noqa: E402


def entry_points(q, k, v, causal):
    scale = q.shape[-1] ** -0.5
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return {
        "flash_attn_func": lambda: triforge.flash_attn_func(q, k, v, causal=causal),
        "custom op": lambda: torch.ops.triforge.flash_attn_fwd(q, k, v, causal, scale, False, False),
        "attn_fwd": lambda: attention.attn_fwd(q, k, v, causal, scale),
        "cudnn": cudnn,
    }


def rounds_ms(fn, calls, rounds=10):
    """Per-call ms over rounds of ``calls`` back-to-back calls, each round started on an idle GPU (time_all's timer)."""
    return time_all({"fn": fn}, rounds=rounds, calls=calls)["fn"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name(), "host_us": {}, "gpu_ms": []}
    mk = lambda B, S, H, D: [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]  # noqa: E731
    tiny = mk(1, 128, 2, 64)
    for name, fn in entry_points(*tiny, False).items():
        out["host_us"][name] = host_us(fn, n=200)
    print("host us per call (tiny input, 200 calls enqueued): "
          + ", ".join(f"{n} {t:.1f}" for n, t in out["host_us"].items()), flush=True)
    for B, S, D in ((16, 2048, 64), (8, 4096, 64), (4, 8192, 128)):
        q, k, v = mk(B, S, 16, D)
        for causal in (False, True):
            row = {"shape": [B, 16, S, D], "causal": causal}
            for name, fn in entry_points(q, k, v, causal).items():
                row[name] = {"rounds5": rounds_ms(fn, 5), "rounds50": rounds_ms(fn, 50, rounds=4),
                             "do_bench": bench.time_ms(fn)["median_ms"]}
            out["gpu_ms"].append(row)
            print(f"({B},16,{S},{D}) {'causal' if causal else 'full'}: " + "; ".join(
                f"{n} {r['rounds5']:.3f}/{r['rounds50']:.3f}/{r['do_bench']:.3f}"
                for n, r in row.items() if isinstance(r, dict)) + "  (ms: rounds of 5 / of 50 / do_bench)", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
