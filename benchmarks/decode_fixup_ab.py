"""Flash-decoding's merge: the merge launch against the split kernel merging its own splits (cfg FIXUP 1: each
row block's last-arriving split merges), at the attention issue's decode shapes (B = 1, 8, 64; 16 q heads / 2 kv
heads; D = 128; caches 4k, 32k, 128k; one new token appended), bf16, CUDA-graph replay (bench.graph_time_ms),
one input set (the 4k caches at B = 1 and 8 fit in L2: those rows are cache numbers for both forms alike). The
two outputs are compared. Prints us per call and the ratio.

    PYTHONPATH=. python benchmarks/decode_fixup_ab.py [--json PATH]
"""

import argparse
import json

import torch

from triforge import _runtime, bench
from triforge.ops.attention import decode as dec


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    _runtime.require_gpu("benchmarks/decode_fixup_ab.py")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for B in (1, 8, 64):
        for S in (4096, 32768, 131072):
            x = dec._make_inputs({"B": B, "S": S}, torch.bfloat16, torch.device("cuda"), gen)
            q, kc, vc, sl = x["q"], x["k_cache"], x["v_cache"], x["cache_seqlens"]
            k, v = x["k"], x["v"]
            D = q.shape[-1]
            base = dict(dec._split_config(D, q.dtype, dec._block_m(q.shape[2] // kc.shape[2])))
            row = {"B": B, "S": S}
            outs = {}
            for name, fix in (("merge_launch", 0), ("fixup", 1)):
                cfg = dict(base, FIXUP=fix)

                def call():
                    sl.fill_(S - 1)  # the append leaves the lengths as they were: every call sees the same cache
                    return dec.flash_decode_fwd(q, kc, vc, sl, k, v, True, D ** -0.5, cfg=cfg)

                outs[name] = call()[0].clone()
                t = bench.graph_time_ms(call, calls=4, replays=20)
                row[name + "_us"] = 1e3 * t["median_ms"]
            row["fixup_speedup"] = row["merge_launch_us"] / row["fixup_us"]
            row["max_abs_diff"] = float((outs["fixup"].float() - outs["merge_launch"].float()).abs().max())
            rows.append(row)
            print(f"B={B:3d} S={S:6d}  merge launch {row['merge_launch_us']:8.1f} us  fixup {row['fixup_us']:8.1f} us  "
                  f"{row['fixup_speedup']:.3f}x  max|diff| {row['max_abs_diff']:.1e}")
            del x, q, kc, vc
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "device": _runtime.device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
