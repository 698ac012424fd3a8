"""The tensor-core ternary prototype (triforge/ops/ternary/tc.py) against the kernels in use and cuBLAS fp16 (issue 6).

For each (N, K) of the issue and batch M in {1, 4, 16, 64, 256}, bf16 activations:
- checks the prototype against the float64 product (testing.compare) and against ``ternary.matmul``;
- times, per call, cuBLAS fp16 (x16 @ w16.T), ``ternary.matmul`` (the dispatch in use) and the prototype
  (tc codes packed once), each as CUDA-graph replay of 16 calls over weight sets that together exceed the
  50 MB L2 (host time taken out; the kernels' own time), median of 20 replays; and the prototype eager
  (CUDA events around 50 calls: host included, as a user calls it).

    PYTHONPATH=. python benchmarks/ternary_tc_probe.py [--json PATH] [--shapes 8192x8192 ...] [--m 1 16 ...]

``--sweep``: instead, every launch config of ``sweep_configs()`` (PREFETCH depth, tile, split target, stages)
checked and timed the same way (CUDA graphs) at each shape and M, with the config in use and the fallback
first; the five fastest printed per shape. ``--sweep tiles``: the storage tile height too (16 and 128 rows; the
two configs above on 128-row tiles as well). ``--sweep pdl``: the config in use with the fix-up's partials read
four at a time (FIX4) or one at a time, launched as programmatic dependents (PDL) or not; then at M <= 16 its
split target under PDL, at M >= 64 a small grid of tiles, stages and split targets under PDL. ``--sweep m1``:
deeper word prefetch at M = 1 under a register cap (maxnreg), and 64-row tiles at 5-6 programs per SM. ``--sweep m8``:
x tiles of 8 rows (mma.sync instead of wgmma, fewer registers) at M <= 8. ``--sweep wait``: the config in use with the
split-K fix-up by the tile's last split waiting for the others (WAIT 1: Triton atomics; 2: PTX, per-warp arrivals and
per-thread polls) instead of the last to arrive summing (WAIT 0), at split targets 2..8. ``--sweep red``: the split-K sum
as a second launch (FIXUP 0): elements per program, all partials loaded at once, launched as a programmatic dependent.
"""

import argparse
import json

import torch

from triforge.bench import graph_time_ms
from triforge.ops import ternary as T
from triforge.ops.ternary import tc
from triforge.ops.ternary.reference import matmul_dense_ref
from triforge.ops.ternary.tensor import TernaryTensor
from triforge.testing import compare

SHAPES = [(8192, 8192), (28672, 8192), (8192, 28672), (4864, 896), (896, 4864)]
MS = [1, 4, 16, 64, 256]
L2_BYTES = 50 << 20


def graph_us(fns, calls=16, replays=20):
    """Per-call microseconds of ``calls`` calls cycling over ``fns`` (one per weight set), captured in a
    CUDA graph and replayed (``bench.graph_time_ms``): median over ``replays``."""
    state = {"i": 0}

    def cycle():
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    return graph_time_ms(cycle, calls=calls, replays=replays)["median_ms"] * 1e3


def eager_us(fns, calls=50):
    for f in fns:
        f()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for i in range(calls):
        fns[i % len(fns)]()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / calls


def weight_sets(N, K, gen):
    """Absmean ternary weight sets (N, K) whose 2-bit codes exceed the L2 twice over (2..8), with their codes."""
    sets = max(2, -(-2 * L2_BYTES // (N * K // 4)))
    tts = [TernaryTensor.from_float(torch.randn(N, K, generator=gen).cuda(), method="absmean", per_row=True)
           for _ in range(min(sets, 8))]
    return tts, [tc.pack_tc(t.plus, t.minus, t.in_features) for t in tts]


def run_shape(N, K, ms, gen):
    tts, codes = weight_sets(N, K, gen)
    w16 = [t.to_float(torch.float16) for t in tts[:2]]  # 2 x N K x 2 bytes already exceed the L2
    rows = []
    for M in ms:
        x = torch.randn(M, K, generator=gen).cuda().to(torch.bfloat16)
        x16 = x.to(torch.float16)
        ref = matmul_dense_ref(x, tts[0])
        y_tc = tc.ternary_matmul_tc(x, tts[0], codes=codes[0])
        y_cur = T.matmul(x, tts[0])
        ok_tc = compare(f"tc N={N} K={K} M={M}", ref, y_tc, dtype=torch.bfloat16, verbose=False)
        ok_cur = compare(f"cur N={N} K={K} M={M}", ref, y_cur, dtype=torch.bfloat16, verbose=False)
        row = {"N": N, "K": K, "M": M, "tc_ok": ok_tc.ok, "tc_max_abs": ok_tc.max_abs, "cur_ok": ok_cur.ok}
        if ok_tc.ok:
            tc_fns = [lambda t=t, c=c: tc.ternary_matmul_tc(x, t, codes=c) for t, c in zip(tts, codes)]
            row["tc_graph_us"] = graph_us(tc_fns)
            row["tc_eager_us"] = eager_us(tc_fns)
            # the split-K sum as a second launch (FIXUP 0) instead of the last-arriving program's fix-up
            row["tc_reduce_graph_us"] = graph_us([lambda t=t, c=c: tc.ternary_matmul_tc(x, t, codes=c, cfg={"FIXUP": 0})
                                                  for t, c in zip(tts, codes)])
        row["cur_graph_us"] = graph_us([lambda t=t: T.matmul(x, t) for t in tts])
        row["cublas_graph_us"] = graph_us([lambda w=w: x16 @ w.T for w in w16])
        row["tc_vs_cublas"] = row["cublas_graph_us"] / row["tc_graph_us"] if ok_tc.ok else None
        row["cur_vs_cublas"] = row["cublas_graph_us"] / row["cur_graph_us"]
        row["tc_floor_us"] = (N * K / 4 + 2 * M * K + 2 * M * N) / 3.0e12 * 1e6  # codes + x + y at 3.0 TB/s
        rows.append(row)
        print(f"N={N:6d} K={K:6d} M={M:4d}  tc {'ok' if ok_tc.ok else 'FAIL'} "
              f"{row.get('tc_graph_us', float('nan')):8.1f} us (eager {row.get('tc_eager_us', float('nan')):7.1f}, "
              f"reduce launch {row.get('tc_reduce_graph_us', float('nan')):7.1f})  "
              f"current {row['cur_graph_us']:8.1f}  cuBLAS fp16 {row['cublas_graph_us']:8.1f}  "
              f"tc/cuBLAS {row['tc_vs_cublas'] or float('nan'):5.2f}x  current/cuBLAS {row['cur_vs_cublas']:5.2f}x",
              flush=True)
    del tts, codes, w16
    torch.cuda.empty_cache()
    return rows


def sweep_configs(which="main"):
    """The launch configs the sweep times. main: PREFETCH depth x tile shape x split target x pipelining
    (x by TMA); xpre: x by pointer loads, prefetched with the words (XPRE)."""
    if which == "tiles":  # tile heights of the codes' storage (TR rows x 8 words per tile) x tile shape x split target
        tiles = [(1, 1, 4), (2, 1, 4), (1, 2, 4), (2, 2, 4), (1, 2, 8)]
        return [{"ROW_REPS": r, "BLOCKS_K": b, "num_warps": w, "num_stages": 1, "programs_per_sm": pps, "TR": tr,
                 "PREFETCH": p, "XPRE": xp} for tr in (16, 128) for r, b, w in tiles for pps in (2, 4, 8)
                for p, xp in ((1, 0), (2, 0), (1, 1))]
    if which == "pdl":  # (the M >= 64 grid; the flags themselves are crossed with the config in use by run_sweep)
        return [{"ROW_REPS": r, "BLOCKS_K": b, "num_warps": w, "num_stages": st, "programs_per_sm": pps, "FIX4": 1,
                 "PDL": True} for r in (1, 2) for b in (1, 2) for w in (4, 8) for st in (1, 2) for pps in (1, 2, 4)
                if not (w == 8 and r == 2)]
    if which == "m256":  # x tiles of 64 and 256 rows at M = 256 (the pdl grid has 128), PDL allowed
        return [{"BLOCK_M": bm, "ROW_REPS": r, "BLOCKS_K": b, "num_warps": w, "num_stages": st, "programs_per_sm": pps,
                 "PDL": True} for bm in (64, 256) for r in (1, 2) for b in (1, 2) for w in (4, 8) for st in (1, 2)
                for pps in (1, 2, 4) if not (w == 8 and r == 2) and not (bm == 256 and r == 2)]
    if which == "m1":  # more code words in flight per SM at M = 1 (x by pointer loads): the 128-row tile two or three
        # steps ahead under a register cap (168/167 registers uncapped: 3 programs per SM), 64-row tiles (79-103
        # registers) at 5-6 programs per SM, 8-warp 128-row tiles
        grid = [(2, 4, p, 4, 128) for p in (2, 3)] + [(2, 4, 1, 4, 120)]
        grid += [(1, 4, p, pps, None) for p in (1, 2, 3) for pps in (5, 6)]
        grid += [(1, 8, p, pps, None) for p in (1, 2) for pps in (2, 3)]
        return [dict({"ROW_REPS": r, "BLOCKS_K": 1, "num_warps": w, "PREFETCH": p, "programs_per_sm": pps,
                      "num_stages": 1, "XPRE": 1}, **({"maxnreg": reg} if reg else {})) for r, w, p, pps, reg in grid]
    if which == "m8":  # x tiles of 8 rows at M <= 8: Triton builds the dot from mma.sync m16n8k16 (no wgmma; 64-168
        # registers on the local sm90 compile against 161-168 for 16-row tiles), at more programs per SM
        grid = [(r, b, 4, p, pps) for r, b in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2)) for p in (1, 2) for pps in (4, 6)]
        grid += [(r, 1, 8, 1, pps) for r in (1, 2) for pps in (2, 3, 4)]
        return [{"BLOCK_M": 8, "ROW_REPS": r, "BLOCKS_K": b, "num_warps": w, "PREFETCH": p, "programs_per_sm": pps,
                 "num_stages": 1, "XPRE": 1} for r, b, w, p, pps in grid]
    if which == "xpre":
        tiles = [(1, 1, 4), (1, 2, 4), (2, 1, 4), (1, 2, 8)]
        return [{"ROW_REPS": r, "BLOCKS_K": b, "num_warps": w, "PREFETCH": p, "programs_per_sm": pps, "num_stages": 1,
                 "XPRE": 1} for r, b, w in tiles for p in (1, 2, 3) for pps in (2, 4)]
    tiles = [(1, 1, 4), (1, 2, 4), (2, 1, 4), (1, 4, 4), (2, 2, 4), (1, 2, 8)]  # ROW_REPS, BLOCKS_K, num_warps
    return [{"ROW_REPS": r, "BLOCKS_K": b, "num_warps": w, "PREFETCH": p, "programs_per_sm": pps, "num_stages": st}
            for r, b, w in tiles for p in (1, 2, 3) for pps in (2, 4, 8) for st in (1, 2)]


def run_sweep(N, K, ms, gen, which="main", base_only=False, rotate_x=False):
    """CUDA-graph time of every sweep config at (N, K) and each M (weights rotated past the L2; with ``rotate_x`` each
    weight set has its own x, as in ``triforge bench``, else one x serves every call and stays in L2)."""
    tts, codes = weight_sets(N, K, gen)
    by_tr = {tc.TILE_ROWS: codes}  # codes per tile height
    rows = []
    for M in ms:
        x = torch.randn(M, K, generator=gen).cuda().to(torch.bfloat16)
        xs = [x] * len(tts)
        if rotate_x:
            xs = [x] + [torch.randn(M, K, generator=gen).cuda().to(torch.bfloat16) for _ in tts[1:]]
        ref = matmul_dense_ref(x, tts[0])
        timed = []
        # the config in use and the untuned fallback, timed beside the sweep (same process, same inputs)
        base = [dict(tc.tc_config(M, N, K)), dict(tc.tc_fallback_config(M, N, K))]
        if which == "tiles":  # the same two configs on 128-row tiles (the default is 16)
            base += [dict(b, TR=128) for b in base]
        extra = [] if base_only else sweep_configs(which)
        if which == "wait":  # the config in use with each fix-up (WAIT 0 / 1 / 2) at split targets 2..8
            cur = base[0]
            extra = [dict(cur, WAIT=w, programs_per_sm=pps) for w in (1, 2) for pps in (2, 4, 6, 8)]
            extra += [dict(cur, WAIT=0, programs_per_sm=pps) for pps in (2, 4, 6, 8)]  # (the current one re-timed)
        if which == "red":  # the config in use with the split-K sum in the kernel (FIXUP 1; the default eagerly) and as
            # a second launch (FIXUP 0; the default under graph capture): (elements per program, all partials loaded at
            # once, PDL). (One program per tile, after the first launch or polling the tile's arrivals, measured
            # 13.2-13.3 us at 8192^2 M = 1 against 10.4-10.6: removed.)
            cur = base[0]
            extra = [dict(cur, FIXUP=0, RED=r) for r in ((256, True, True), (128, True, True), (1024, False, False))]
            extra += [dict(cur, FIXUP=1), dict(cur)]
        if which == "pdl":
            # the config in use with the split-K sum read one partial (FIX4 0) or four (1) at a time, launched
            # with PDL or not; then its split targets under PDL (M <= 16), or the M >= 64 grid under PDL
            cur = base[0]
            base = [dict(cur, FIX4=f4, PDL=pdl) for pdl in (False, True) for f4 in (0, 1)] + [base[1]]
            extra = ([dict(cur, FIX4=1, PDL=True, programs_per_sm=pps) for pps in (2, 3, 4, 6, 8)
                      if pps != cur.get("programs_per_sm")] if M <= 16 else extra)
        for cfg in base + extra:
            tr = cfg.get("TR", tc.TILE_ROWS)
            if tr not in by_tr:
                by_tr[tr] = [tc.pack_tc(t.plus, t.minus, t.in_features, tr) for t in tts]
            cs = by_tr[tr]
            try:
                y = tc.ternary_matmul_tc(x, tts[0], codes=cs[0], cfg=cfg)
                ok = compare("sweep", ref, y, dtype=torch.bfloat16, verbose=False).ok
                us = graph_us([lambda t=t, c=c, xi=xi: tc.ternary_matmul_tc(xi, t, codes=c, cfg=cfg)
                               for t, c, xi in zip(tts, cs, xs)]) if ok else None
            except Exception as e:  # out of resources: reported, skipped
                ok, us = False, None
                print(f"  {cfg}: {type(e).__name__}", flush=True)
            timed.append({"config": cfg, "ok": ok, "us": us})
        if which == "pdl":
            for t, lab in zip(timed, ["current", "current FIX4", "current PDL", "current FIX4 PDL", "fallback"]):
                t["label"] = lab
            print(f"N={N} K={K} M={M}: " + ", ".join(f"{t['label']} {t['us']}" for t in timed[:5]), flush=True)
            i_fb = 4
        else:
            i_fb = 1
            timed[0]["label"], timed[1]["label"] = "current", "fallback"
        if which == "tiles":
            timed[2]["label"], timed[3]["label"] = "current TR128", "fallback TR128"
            print(f"N={N} K={K} M={M}: 128-row tiles, current config {timed[2]['us']} us, fallback {timed[3]['us']} us",
                  flush=True)
        good = sorted((t for t in timed if t["us"] is not None), key=lambda t: t["us"])
        print(f"N={N} K={K} M={M}: {len(good)} configs, parity failures {sum(not t['ok'] for t in timed)}; "
              f"current {timed[0]['us']} us {timed[0]['config']}; fallback {timed[i_fb]['us']} us", flush=True)
        for t in good[:5]:
            print(f"   {t['us']:7.2f} us  {t['config']}", flush=True)
        rows.append({"N": N, "K": K, "M": M, "timed": timed, "best": good[0] if good else None,
                     "current": timed[0], "fallback": timed[i_fb]})
    del tts, codes, by_tr
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--shapes", nargs="*", help="NxK, e.g. 8192x8192 (default: the issue's five)")
    ap.add_argument("--m", nargs="*", type=int, default=MS)
    ap.add_argument("--sweep", nargs="?", const="main", choices=["main", "xpre", "tiles", "pdl", "m256", "m1", "m8", "wait", "red"],
                    help="time the sweep's launch configs instead (CUDA graphs)")
    ap.add_argument("--base-only", action="store_true", help="with --sweep: the config in use and the fallback only")
    ap.add_argument("--rotate-x", action="store_true", help="with --sweep: an x per weight set (as triforge bench)")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    gen = torch.Generator().manual_seed(0)
    rows = []
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for N, K in shapes:
        rows += run_sweep(N, K, args.m, gen, args.sweep, args.base_only, args.rotate_x) if args.sweep else run_shape(N, K, args.m, gen)
        if args.json:  # after every shape: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.sweep:  # parity failures are printed per shape and kept in the JSON
        return
    failed = [r for r in rows if not r["tc_ok"] or not r["cur_ok"]]
    if failed:
        raise SystemExit(f"{len(failed)} parity failures: {[(r['N'], r['K'], r['M']) for r in failed]}")


if __name__ == "__main__":
    main()
