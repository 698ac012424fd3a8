"""Host time and bench-shaped per-call time of the mHC ops through the custom op and through the eager twin
(launch.eager: an autograd.Function calling the launcher). The bench times each call after an L2-flushing
memset (do_bench); when the host path of a call outlasts that memset, the GPU idles inside the timed window.

    PYTHONPATH=. python benchmarks/mhc_host_probe.py [--json PATH]

Host time: perf_counter over many calls at T=64 (the GPU never limits). GPU: median / p95 of do_bench at
T=65536, C=1024 and 2560, forward and autograd backward, both paths in this process, alternated twice.
"""

import argparse
import json

import torch
from host_overhead_probe import gpu_ms, host_us  # benchmarks/: the script's own folder

from triforge.ops import mhc as M


def gpu(fn):
    t = gpu_ms(fn)
    return {"median_ms": t["median"], "p95_ms": t["p95"], "min_ms": t["min"]}


def inputs(T, C, grad=False):
    x = torch.randn(T, 4 * C, device="cuda", dtype=torch.bfloat16).requires_grad_(grad)
    W = (torch.randn(32, 4 * C, device="cuda") / (4 * C) ** 0.5).requires_grad_(grad)
    return x, W


def paths():
    return {"op": lambda x, W: torch.ops.triforge.fused_rmsnorm_project(x, W, M.EPS),
            "eager": lambda x, W: M.fused_rmsnorm_project(x, W)}


def backward_fn(path, T, C):
    x, W = inputs(T, C, grad=True)
    proj, inv = paths()[path](x, W)
    g = (torch.randn_like(proj), torch.randn_like(inv))
    return lambda: torch.autograd.grad((proj, inv), (x, W), g, retain_graph=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    x, W = inputs(64, 1024)
    for path, f in paths().items():
        with torch.no_grad():
            rows.append({"what": f"host fwd {path}", "us": host_us(lambda: f(x, W))})
        rows.append({"what": f"host bwd {path}", "us": host_us(backward_fn(path, 64, 1024), n=1000)})
    for C in (1024, 2560):
        x, W = inputs(65536, C)
        nbytes_fwd = x.numel() * 2 + 65536 * 33 * 4
        nbytes_bwd = 2 * x.numel() * 2 + 65536 * 33 * 4
        bwd = {p: backward_fn(p, 65536, C) for p in paths()}
        for rep in range(2):
            for path, f in paths().items():
                with torch.no_grad():
                    r = gpu(lambda: f(x, W))
                rows.append({"what": f"fwd C={C} {path} #{rep}", **r, "GBps": nbytes_fwd / r["median_ms"] / 1e6})
                r = gpu(bwd[path])
                rows.append({"what": f"bwd C={C} {path} #{rep}", **r, "GBps": nbytes_bwd / r["median_ms"] / 1e6})
        del bwd
    for r in rows:
        if "us" in r:
            print(f"{r['what']:<24} {r['us']:8.1f} us per call")
        else:
            print(f"{r['what']:<24} {r['median_ms'] * 1e3:8.1f} us median {r['p95_ms'] * 1e3:8.1f} p95 "
                  f"{r['GBps']:7.0f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
