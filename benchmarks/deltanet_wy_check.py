"""Gated DeltaNet backward on the GPU: the stage tests' varlen cases under several WY launch configs,
and the forward's fused vs unfused recurrence (time and agreement) at the bench shapes.

    PYTHONPATH=. python3 benchmarks/deltanet_wy_check.py OUT.json

1. tests/ops/deltanet/test_deltanet_bwd.py's varlen stage check (lengths 200, 1, 64, 135; bf16) at each
   (K, V) and seed, with the WY kernel at its fallback and at 2 / 8 warps (1 stage): the first failing
   stage or ok, and the relative RMS error of dT, dA, dbeta, dg against the float64 reference. A
   failure that follows the config is the compiler's; one that follows the inputs is the kernel's.
2. chunk_fwd with fuse_o True / False: do_bench median (ms), and o's relative difference.
"""

import json
import sys

import torch

sys.path.insert(0, ".")

from tests.ops.deltanet import test_deltanet_bwd as T  # noqa: E402
from triforge.ops.deltanet import chunk, chunk_bwd  # noqa: E402

WY = "gated_delta_rule_bwd_wy"


def stage_runs(rows):
    real_cfg = chunk_bwd.bwd_config
    for K, V in ((32, 128), (64, 128), (64, 64), (128, 256), (128, 128)):
        for seed in range(3):
            for over in (None, {"num_warps": 2, "num_stages": 1}, {"num_warps": 8, "num_stages": 1}):
                def patched(kernel, *a, _over=over, **kw):
                    cfg = real_cfg(kernel, *a, **kw)
                    return dict(cfg, **_over) if (kernel == WY and _over) else cfg

                chunk_bwd.bwd_config = patched
                gen = torch.Generator().manual_seed(seed)
                lengths = [200, 1, 64, 135]
                cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda")
                x = T._cuda(T._bwd_inputs(1, sum(lengths), 2, 4, K, V, torch.bfloat16, gen, N=len(lengths)))
                ref, got, scales = T._bwd_stages(x, True, cu=cu)
                try:
                    T._assert_stages(ref, got, torch.bfloat16, scales)
                    verdict = "ok"
                except AssertionError as e:
                    verdict = str(e).splitlines()[0][:110]
                rel = {n: float((got[n].double() - ref[n]).norm() / ref[n].norm()) for n in ("dT", "dA", "dbeta", "dg")}
                wy = dict(real_cfg(WY, K, V, torch.bfloat16), **(over or {}))
                row = {"K": K, "V": V, "seed": seed, "wy": {k: wy[k] for k in ("BK", "BV", "num_warps", "num_stages")},
                       "verdict": verdict, "rel": rel}
                rows.append(row)
                print(f"STAGES K={K:3d} V={V:3d} seed={seed} wy={row['wy']} {verdict} | "
                      + " ".join(f"{n} {r:.1e}" for n, r in rel.items()), flush=True)
                del ref, got, scales, x
                torch.cuda.empty_cache()
    chunk_bwd.bwd_config = real_cfg


def fused_runs(rows):
    from triton.testing import do_bench

    from triforge import registry

    spec = registry.get("gated_delta_rule")
    for B, Tn, H, HV in ((8, 4096, 16, 32), (1, 8192, 32, 32), (4, 8192, 16, 16), (1, 32768, 16, 32)):
        x = spec.make_inputs({"B": B, "T": Tn, "H": H, "HV": HV, "K": 128, "V": 128}, torch.bfloat16,
                             torch.device("cuda"), torch.Generator().manual_seed(0))
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5, x["initial_state"])
        out = {}
        for fuse in (True, False):
            def run(f=fuse):
                return chunk.chunk_fwd(*args, l2norm=True, output_final_state=True, fuse_o=f)
            out[fuse] = run()[0].double()
            out[f"ms{fuse}"] = do_bench(run, warmup=25, rep=200, return_mode="median")
        diff = float((out[True] - out[False]).norm() / out[False].norm())
        row = {"shape": [B, Tn, H, HV], "fused_ms": out["msTrue"], "unfused_ms": out["msFalse"], "o_rel_diff": diff,
               "default_fused": chunk.use_fused(128, 128, B * HV)}
        rows.append(row)
        print(f"FUSED {B}x{Tn}x{H}x{HV}: fused {out['msTrue']:.3f} ms, unfused {out['msFalse']:.3f} ms, "
              f"o rel diff {diff:.1e}, default fused={row['default_fused']}", flush=True)
        del x, out
        torch.cuda.empty_cache()


def main():
    rows = {"stages": [], "fused": []}
    fused_runs(rows["fused"])
    stage_runs(rows["stages"])
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
