"""Host time of the DeltaNet backward's paths, and the backward's GPU time where host time may limit it.

The bench's backward at (1, 8192, 32, 32) on the H200 (5503232) spread 1.016 / 1.354 / 1.592 ms (min / median / p95)
where the Triton dqkw kernel's backward had been tight at 1.149-1.159 (cdd0b44): a backward whose GPU time fell to
~1.0 ms while its host path grew (the Gluon kernel's launch took the JIT's path: descriptors had no fast-path key, three
shared layouts were built per call). Measures per call:
  host us (perf_counter over many calls at a tiny shape, so the GPU never limits): dqkw_ws through the fast path and
  through the JIT's, the Triton dqkw kernel, the whole backward (autograd.grad);
  GPU ms (CUDA events per call, as the bench) of the backward at the bench shape, fast path on and off.
    PYTHONPATH=. python benchmarks/deltanet_host_probe.py [--json PATH]"""
import argparse
import cProfile
import io
import json
import os
import pstats

import torch
import torch.nn.functional as F

import triforge
from triforge import launch
from triforge.ops.deltanet import chunk

from gdn_dqkw_ws_probe import event_times, inputs, quantiles, run_triton, run_ws  # noqa: E402  (benchmarks/)
from host_overhead_probe import host_us  # noqa: E402


def event_ms(fn):
    """min / median / p95 of ``fn``'s time per call (ms; CUDA events per call, as the bench times)."""
    return quantiles(event_times([fn], rounds=15, n=10)[0])


def backward_fn(B, T, H, HV, K=128, V=128, dtype=torch.bfloat16):
    r = lambda *s: torch.randn(*s, device="cuda")
    q = r(B, T, H, K).to(dtype).requires_grad_(True)
    k = r(B, T, H, K).to(dtype).requires_grad_(True)
    v = r(B, T, HV, V).to(dtype).requires_grad_(True)
    g = F.logsigmoid(r(B, T, HV) + 2.0).requires_grad_(True)
    beta = torch.sigmoid(r(B, T, HV)).to(dtype).requires_grad_(True)
    o, _ = triforge.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    do = r(*o.shape).to(dtype)
    return lambda: torch.autograd.grad(o, (q, k, v, g, beta), do, retain_graph=True)


def fast(on):
    launch._FAST_ON = on


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    res = {"host_us": {}, "gpu_ms": {}}
    x = inputs(1, 64, 2, 4)
    scale = 128 ** -0.5
    tiny_bwd = backward_fn(1, 64, 2, 4)
    for on in (True, False):
        fast(on)
        tag = "fast" if on else "jit"
        res["host_us"][f"dqkw_ws ({tag})"] = host_us(lambda: run_ws(x, scale, None), n=300)
        res["host_us"][f"dqkw triton ({tag})"] = host_us(lambda: run_triton(x, scale), n=300)
        res["host_us"][f"backward autograd.grad ({tag})"] = host_us(tiny_bwd, n=300)
    os.environ[chunk.GLUON_ENV] = "0"
    fast(True)
    res["host_us"]["backward autograd.grad (fast, Gluon off)"] = host_us(tiny_bwd, n=300)
    del os.environ[chunk.GLUON_ENV]
    for k_, v_ in res["host_us"].items():
        print(f"host {k_:45s} {v_:8.1f} us")
    for gluon in ("1", "0"):  # where the backward's host time goes, with the Gluon kernels and without
        os.environ[chunk.GLUON_ENV] = gluon
        prof = cProfile.Profile()
        prof.runcall(lambda: [tiny_bwd() for _ in range(200)])
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
        res[f"profile_gluon{gluon}"] = out.getvalue()
        print(f"--- cProfile of 200 backwards, Gluon {gluon} (by own time) ---")
        print("\n".join(out.getvalue().splitlines()[6:28]))
    del os.environ[chunk.GLUON_ENV]
    for shp in [(1, 8192, 32, 32), (4, 8192, 16, 16)]:
        bwd = backward_fn(*shp)
        for on in (True, False):
            fast(on)
            t = event_ms(bwd)
            res["gpu_ms"][f"{shp} {'fast' if on else 'jit'}"] = t
            print(f"gpu  {str(shp):20s} {'fast' if on else 'jit ':4s} min {t['min']:.3f} median {t['median']:.3f} "
                  f"p95 {t['p95']:.3f} ms")
        fast(True)
        del bwd
        torch.cuda.empty_cache()
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
