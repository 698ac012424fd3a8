"""The Gated DeltaNet backward's kernels at configs outside their tune grids (issue 4).

For one kernel (dqkw, wy or dh) at each bench shape: the library's setup of its inputs (the tunable's), the config in
use and the configs given, each checked against the one in use (max abs difference over the outputs) and timed
(bench.time_ms, median). One process per call, so a faulting config loses only its own run.

    PYTHONPATH=. python benchmarks/deltanet_bwd_cfg_probe.py dqkw --cfg BK=64,BV=64,num_warps=8,num_stages=3 ... \
        [--shapes 8x4096x16x32 ...] [--json PATH]
"""

import argparse
import json
from pathlib import Path

import torch

from triforge import bench
from triforge.ops import deltanet as D
from triforge.ops.deltanet import chunk_bwd
from deltanet_dh_probe import parse_cfg  # benchmarks/ is on sys.path as the script's own directory

SHAPES = ["1x32768x16x32", "8x4096x16x32", "4x8192x16x16", "1x8192x32x32"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", choices=["dqkw", "wy", "dh"])
    ap.add_argument("--cfg", nargs="+", required=True)
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--json")
    args = ap.parse_args()
    name = "gated_delta_rule_bwd_" + args.kernel
    rows = []
    for s in args.shapes:
        B, T, H, HV = (int(v) for v in s.split("x"))
        shape = {"B": B, "T": T, "H": H, "HV": HV, "K": 128, "V": 128}
        run, key = D._tune_bwd_setup(name)(shape, torch.bfloat16, "cuda")
        in_use = chunk_bwd.bwd_config(name, 128, 128, torch.bfloat16, B * HV)
        ref = run(None)
        torch.cuda.synchronize()
        base = bench.time_ms(lambda: run(None))["median_ms"]
        print(f"{s} in use {in_use}: {base * 1e3:.1f} us", flush=True)
        rows.append({"shape": s, "cfg": in_use, "us": base * 1e3, "in_use": True})
        for text in args.cfg:
            cfg = parse_cfg(text)
            out = run(cfg)
            torch.cuda.synchronize()
            diff = max(float((out[n].float() - ref[n].float()).abs().max()) for n in ref if torch.is_tensor(ref[n]))
            us = bench.time_ms(lambda: run(cfg))["median_ms"] * 1e3
            print(f"{s} {cfg}: {us:.1f} us ({us / (base * 1e3):.3f} of in use), max diff {diff:.3e}", flush=True)
            rows.append({"shape": s, "cfg": cfg, "us": us, "max_diff": diff})
        del run, ref
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "kernel": name, "rows": rows}))


if __name__ == "__main__":
    main()
