"""Flash-decoding's split count at the issue's decode shapes (issue 3): CUDA-graph time per num_splits.

For (B, S) in the issue's grid (16 q / 2 kv heads, D 128, bf16, one appended token, full caches), the op
(``flash_attn_with_kvcache``, PDL as by default) is timed as ``bench.graph_time_ms`` over enough cache sets to
exceed the L2 four times, at the heuristic's split count and at a range of fixed counts; every count's output is
checked against the heuristic's (same math, a different split of the sum: compared by testing.compare against
float64 attention on the first set). Prints one line per shape; writes JSON.

    PYTHONPATH=. python benchmarks/decode_splits_probe.py [--json PATH] [--shapes 1x32768 8x4096 ...]

``--configs``: instead, the split kernel's launch configs (BLOCK_N x stages x warps, one program per SM in all,
the heuristic's split count for each BLOCK_N) through ``flash_decode_fwd`` with PDL, each checked the same way.
``--l2pf``: the same, over the fallback config's L2 prefetch depth (L2PF key blocks asked of L2 before the PDL wait)
at one and two programs per SM.
"""

import argparse
import json

import torch

from triforge import bench
from triforge.ops.attention import decode
from triforge.ops.attention.reference import kvcache_attention_ref
from triforge.testing import compare

SPLITS = [8, 16, 24, 32, 48, 64, 96, 128, 160, 198, 256]


CONFIGS = [{"BLOCK_N": bn, "num_stages": st, "num_warps": w, "programs_per_sm": 1, "min_blocks_per_split": 2}
           for bn in (32, 64, 128) for st in (2, 3, 4) for w in (4, 8)]


def check_and_time(call, sets, ref):
    """(output of ``call`` on the first set within bf16 tolerance of ``ref``, us per call as CUDA-graph replay over
    the sets): the check's append into the first set's caches is undone before timing."""
    i0 = sets[0]
    kc0, vc0 = i0["k_cache"].clone(), i0["v_cache"].clone()
    ok = compare("o", ref, call(i0), dtype=torch.bfloat16, verbose=False).ok
    i0["k_cache"].copy_(kc0)
    i0["v_cache"].copy_(vc0)
    del kc0, vc0
    state = {"i": 0}

    def run():
        inp = sets[state["i"] % len(sets)]
        state["i"] += 1
        return call(inp)

    return ok, bench.graph_time_ms(run, calls=max(16, 2 * len(sets)))["median_ms"] * 1e3


# the fallback config with its first L2PF key blocks prefetched into L2 before the PDL wait, at 1 and 2 programs per SM
L2PF_CONFIGS = [dict(CONFIGS[0], BLOCK_N=64, num_stages=3, num_warps=4, programs_per_sm=pps, L2PF=n)
                for pps in (1, 2) for n in (0, 1, 2, 4, 8, 64)]


def config_sweep(B, S, sets, ref, configs=None):
    """Graph time of each split-kernel config (its own heuristic split count) at one shape."""
    scale = 128 ** -0.5
    out = {"B": B, "S": S, "sets": len(sets), "configs": []}
    for cfg in configs or CONFIGS:
        def call(inp, cfg=cfg):
            return decode.flash_decode_fwd(inp["q"], inp["k_cache"], inp["v_cache"], inp["cache_seqlens"], inp["k"],
                                           inp["v"], True, scale, 0, cfg=cfg, pdl=True)[0]
        try:
            ok, us = check_and_time(call, sets, ref)
        except Exception as e:  # out of resources: reported
            ok, us = False, None
            print(f"  {cfg}: {type(e).__name__}", flush=True)
        out["configs"].append({"config": cfg, "us": us, "ok": ok,
                               "splits": decode.choose_num_splits(B, 2, S, 1, cfg["BLOCK_N"], cfg["programs_per_sm"],
                                                                  2)})
    good = sorted((c for c in out["configs"] if c["us"]), key=lambda c: c["us"])
    cur = next(c for c in out["configs"] if c["config"]["BLOCK_N"] == 64 and c["config"]["num_stages"] == 3
               and c["config"]["num_warps"] == 4 and c["config"]["programs_per_sm"] == 1
               and not c["config"].get("L2PF"))
    kv_bytes = 2 * B * S * 2 * 128 * 2
    print(f"B={B} S={S}: fallback (64, 3 stages, 4 warps) {cur['us']:.1f} us; best "
          + "; ".join(f"{c['config']['BLOCK_N']}/{c['config']['num_stages']}/{c['config']['num_warps']}"
                      f"/pps {c['config']['programs_per_sm']}/L2PF {c['config'].get('L2PF', 0)} "
                      f"{c['us']:.1f} us ({kv_bytes / c['us'] / 3e6:.0%}){'' if c['ok'] else ' FAIL'}" for c in good[:5]),
          flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--shapes", nargs="*", default=["1x4096", "1x32768", "1x131072", "8x4096", "8x32768"])
    ap.add_argument("--splits", nargs="*", type=int, default=SPLITS, help="fixed split counts timed beside the heuristic's")
    ap.add_argument("--ppsm", type=int, default=3, help="the heuristic's programs per SM (the config's)")
    ap.add_argument("--configs", action="store_true", help="sweep the split kernel's configs instead")
    ap.add_argument("--l2pf", action="store_true", help="sweep the L2 prefetch depth before the PDL wait instead")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for shape in args.shapes:
        B, S = (int(v) for v in shape.split("x"))
        one = decode._make_inputs({"B": B, "S": S}, torch.bfloat16, "cuda", gen)
        n = bench.rotation_count(bench.set_bytes(one), l2)
        sets = [one] + [decode._make_inputs({"B": B, "S": S}, torch.bfloat16, "cuda", gen) for _ in range(n - 1)]
        i0 = sets[0]
        ref = kvcache_attention_ref(i0["q"].double(), i0["k_cache"].double(), i0["v_cache"].double(),
                                    i0["cache_seqlens"], i0["k"].double(), i0["v"].double(), causal=True)[0]["o"]
        if args.configs or args.l2pf:
            rows.append(config_sweep(B, S, sets, ref, L2PF_CONFIGS if args.l2pf else None))
            del sets
            torch.cuda.empty_cache()
            continue
        heur = decode.choose_num_splits(B, 2, S, 1, 64, args.ppsm, 2)
        row = {"B": B, "S": S, "sets": n, "heuristic": heur, "us": {}}
        for ns in [0] + [s for s in args.splits if s != heur]:
            def call(inp, ns=ns):
                return decode.flash_attn_with_kvcache(inp["q"], inp["k_cache"], inp["v_cache"], inp["cache_seqlens"],
                                                      inp["k"], inp["v"], num_splits=ns, check_lengths=False)
            ok, us = check_and_time(call, sets, ref)
            row["us"][str(ns or f"heuristic ({heur})")] = {"us": us, "ok": ok}
        best = min(row["us"].items(), key=lambda kv: kv[1]["us"])
        kv_bytes = 2 * B * S * 2 * 128 * 2
        print(f"B={B} S={S}: heuristic {heur} splits {row['us'][f'heuristic ({heur})']['us']:.1f} us; best {best[0]} "
              f"{best[1]['us']:.1f} us ({kv_bytes / best[1]['us'] / 1e6 / 3.0:.1%} of 3.0 TB/s); "
              + " ".join(f"{k}:{v['us']:.1f}{'' if v['ok'] else '(FAIL)'}" for k, v in row["us"].items()), flush=True)
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
