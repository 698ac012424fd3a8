"""The ternary bench's calls at the 0.5B shapes, for compute-sanitizer: the tc kernel at every M bucket (split-K
fix-up, PDL, TMA x tiles) per call and as CUDA-graph replay over rotated weight sets, as `triforge bench` runs
them, and (--peers) the gemlite 2-bit peer on the same sets.

    compute-sanitizer --tool memcheck python3 benchmarks/ternary_memcheck.py [--peers]

One full ternary sweep at 6039aec hit an illegal memory access at 4864 x 896, M = 1 (its failing call was not
recorded); the rerun at 9531f3c passed all 25 shapes. Each result is compared with float64 (relative RMS); exit 1
if any is off or non-finite.
"""

import argparse
import sys

import torch

import triforge.ops.ternary as T
from triforge import registry
from triforge.bench import graph_time_ms


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", action="store_true")
    args = ap.parse_args()
    spec = registry.get("ternary_matmul")
    gen = torch.Generator().manual_seed(0)
    ok = True
    for N, K in ((4864, 896), (896, 4864)):
        for M in (1, 4, 16, 64, 256):
            sets = [spec.make_inputs({"M": M, "N": N, "K": K}, torch.bfloat16, "cuda", gen) for _ in range(4)]
            impls = {"triforge": spec.call}
            if args.peers:
                impls["gemlite"] = T._gemlite_2bit_peer(sets[0])
            for name, impl in impls.items():
                if impl is None:
                    continue
                state = {"i": 0}

                def fn():
                    s = sets[state["i"] % len(sets)]
                    state["i"] += 1
                    return impl(**s)

                outs = [fn() for _ in range(len(sets))]  # first calls (no PDL on fresh codes), then settled ones
                outs += [fn() for _ in range(len(sets))]
                graph_time_ms(fn, calls=8, replays=2)
                torch.cuda.synchronize()
                for i, o in enumerate(outs):
                    s = sets[i % len(sets)]
                    y = o[0] if isinstance(o, (tuple, list)) else o
                    ref = s["x"].double() @ s["tt"].to_float(torch.float64).T
                    e = rel(y, ref)
                    good = e == e and e < 2e-2
                    ok &= good
                    if not good:
                        print(f"{name} M={M} N={N} K={K} call {i} (set {i % len(sets)}): WRONG rel {e:.1e}", flush=True)
                print(f"{name} M={M} N={N} K={K}: last call rel {e:.1e}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
