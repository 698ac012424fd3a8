"""The Gluon attention forward (triforge/ops/attention/forward_ws.py) against the Triton kernel and cuDNN (issue 3).

At the bench's (B, H, S, D) shapes, causal and not, bf16: each Gluon config checked against the Triton kernel's
output, then timed with CUDA events beside the Triton path (TRIFORGE_ATTN_GLUON=0) and torch SDPA's cuDNN backend,
interleaved round by round (``time_all``); TFLOP/s = 4 B H S^2 D / t (half causal). Session 38: both kernels with
EMU of every 8 exponentials of unmasked tiles computed on the FMA pipes (triforge.ops._tl.exp2_emu). (Session 37 calls 4-9 also timed
the first form of the kernel and three consumer warpgroups at D = 64: code at 6d0f533.)

    PYTHONPATH=. python benchmarks/attn_ws_probe.py [--json PATH] [--shapes 4x16x8192x128 ...]
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F

import triforge
from triforge.ops import attention
from triforge.ops.attention.forward_ws import attn_fwd_ws

SHAPES = ["16x16x2048x64", "8x16x4096x64", "4x16x8192x128", "2x16x16384x128"]


def time_all(fns, rounds=12, calls=5):
    """Per-call ms of each fn: rounds of ``calls`` back-to-back calls, the candidates interleaved round by round (clock
    drift spreads over all of them); median over rounds. Every input here exceeds the L2. Each round starts on an idle
    GPU, so a call's host time beyond its kernel's shows in the first call of a round (benchmarks/attn_overhead_probe.py:
    compare candidates through the same entry point)."""
    for f in fns.values():
        f()
    per = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(calls):
                f()
            b.record()
            b.synchronize()
            per[k].append(a.elapsed_time(b) / calls)
    return {k: sorted(v)[len(v) // 2] for k, v in per.items()}


def grid(D):
    """Gluon configs (the entries in use). Session 52: at D = 64 FlashAttention-3's three consumer warpgroups (192-row
    tiles, 128-key tiles, P carried in 16 bits) with SCHED, the warpgroups taking turns at the tensor cores (call 2:
    EMU 1-2, 2 stages and 64-key tiles slower; call 4: SCHED 1.03-1.04x at three warpgroups, none at two; call 5: EMU
    1-2 slower with SCHED); two warpgroups for comparison."""
    if D == 128:
        return [{"BLOCK_N": 128, "num_stages": 3, "EMU": 0}]
    return [{"BLOCK_N": 128, "num_stages": 4, "EMU": 0, "NUM_WG": 3, "SCHED": 1},
            {"BLOCK_N": 128, "num_stages": 4, "EMU": 0}]


def triton_grid(D, causal):
    """The Triton kernel's config in use (without GLUON) with EMU 0-2, and at D = 64 other tiles with EMU 0 / 1."""
    base = {k: v for k, v in attention._cfg("flash_attn_fwd", D, causal, torch.bfloat16).items() if k != "GLUON"}
    if D != 64:
        return []
    out = [dict(base, EMU=e) for e in (0, 1, 2) if e != base.get("EMU", 0)]
    tiles = [dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, TMA=0),
             dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, TMA=0),
             dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, TMA=1)]
    if causal:
        tiles.append(dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, TMA=0))
    return out + [dict(t, EMU=e) for t in tiles for e in (0, 1)]


def run(B, H, S, D, causal, gluon=True, triton_tiles=True):
    torch.manual_seed(1)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * B * H * S * S * D // (2 if causal else 1)
    os.environ["TRIFORGE_ATTN_GLUON"] = "0"
    o_tri = triforge.flash_attn_func(q, k, v, causal=causal)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    row = {"shape": [B, H, S, D], "causal": causal, "checks": []}
    scale = D ** -0.5

    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    fns = {"cudnn": cudnn, "triton": lambda: triforge.flash_attn_func(q, k, v, causal=causal)}
    cands = []
    for c in (grid(D) if gluon else []):
        # pe1: the persistent kernel (two Q buffers: one slot fewer at D = 128); x1 / x2: XITEM (an item's first S
        # product issued with the previous item's last P V: S first / P V first)
        for pe, xi in ((0, 0), (1, 0), (1, 1), (1, 2)):
            cp = dict(c, PERSIST=pe, XITEM=xi, num_stages=c["num_stages"] - (pe and D == 128))
            cands.append((f"gluon w{c.get('NUM_WG', 2)} n{c['BLOCK_N']} s{cp['num_stages']} e{c['EMU']} "
                          f"sc{c.get('SCHED', 0)} pe{pe}{f'x{xi}' if xi else ''}", cp, attn_fwd_ws))
    cands += [(f"triton {c['BLOCK_M']}x{c['BLOCK_N']}w{c['num_warps']}s{c['num_stages']}t{c.get('TMA', 0)}"
               f"g{c.get('GUARD', 1)} e{c['EMU']}", c, attention.attn_fwd)
              for c in (triton_grid(D, causal) if triton_tiles else [])]
    for name, cfg, fn in cands:
        try:
            o, _, _ = fn(q, k, v, causal, scale, cfg)
            diff = (o.float() - o_tri.float()).abs().max().item()
            ok = bool(torch.isfinite(o).all()) and diff < 2e-2
            row["checks"].append({"name": name, "config": cfg, "max_diff_vs_triton": diff, "ok": ok})
            if ok:
                fns[name] = lambda cfg=cfg, fn=fn: fn(q, k, v, causal, scale, cfg)
        except Exception as e:
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            row["checks"].append({"name": name, "config": cfg, "error": f"{type(e).__name__}: {str(e)[:300]}",
                                  "ok": False})
    ms = time_all(fns)
    row["ms"] = ms
    c = ms["cudnn"]
    print(f"({B},{H},{S},{D}) {'causal' if causal else 'full'}:", flush=True)
    for name, t in sorted(ms.items(), key=lambda kv: kv[1]):
        print(f"   {name:30s} {t:.3f} ms {flops / t / 1e9:4.0f} TFLOP/s {c / t:.3f}x cuDNN {ms['triton'] / t:.3f}x Triton",
              flush=True)
    bad = [t for t in row["checks"] if not t["ok"]]
    if bad:
        print(f"   FAILED: {bad}", flush=True)
    os.environ.pop("TRIFORGE_ATTN_GLUON")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--no-gluon", action="store_true", help="time the Triton kernel's configs and cuDNN only")
    ap.add_argument("--causal", nargs="*", type=int, default=[0, 1], help="0: non-causal, 1: causal")
    ap.add_argument("--no-triton-grid", action="store_true", help="time the Triton kernel's entry only (no other tiles)")
    args = ap.parse_args()
    out = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__}, "rows": []}
    for s in args.shapes:
        B, H, S, D = (int(x) for x in s.split("x"))
        for causal in (bool(c) for c in args.causal):
            out["rows"].append(run(B, H, S, D, causal, gluon=not args.no_gluon, triton_tiles=not args.no_triton_grid))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
