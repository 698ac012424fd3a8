"""Does the decoder MLP as one split-K launch (gemv_mlp_reduce_kernel: gate/up + SwiGLU + each program's
share of down, summed into the residual with atomics) beat the two-kernel form on the H100?

A chain shaped like Qwen2.5-0.5B's decode step minus attention: 24 x [o_proj 896 x 896 + residual, then
the MLP (gate/up 9728 x 896, down 896 x 4864)], bf16, M = 1, PDL on, captured in one CUDA graph and timed by
replaying it (median of 5 x 50 replays, CUDA events). Forms:
  two        gemv_gate_up_launch + gemv_launch(down, residual): the engine's current MLP
  reduce     gemv_mlp_reduce_launch into an fp32 (fix 1) or int64 fixed-point (fix 2) accumulator, per
             BLOCK_I / num_warps
Checks (eager, one layer): the reduce form's y against the two-kernel y (bf16 tolerance); fix 2 gives the
same bits in 20 runs; how many distinct results fp32 atomics give in 20 runs. Byte floor: the weights at the
measured copy bandwidth.

    PYTHONPATH=. python benchmarks/mlp_reduce_probe.py [--json PATH]
"""

import argparse
import json
import statistics

import torch

from triforge import _runtime, bench
from triforge.ops import gemv as G

C, I = 896, 4864


def graph_us(fn, runs=5, per_run=50):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(20):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(runs):
        start.record()
        for _ in range(per_run):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(1e3 * start.elapsed_time(end) / per_run)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--layers", type=int, default=24)
    args = p.parse_args()
    _runtime.require_gpu("benchmarks/mlp_reduce_probe.py")
    dt, L, dev = torch.bfloat16, args.layers, "cuda"
    gen = torch.Generator(dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(shape, device=dev, generator=gen) * scale).to(dt)

    wo = [rnd(C, C, scale=C ** -0.5) for _ in range(L)]
    wgu = [rnd(2 * I, C, scale=C ** -0.5) for _ in range(L)]
    wd = [rnd(C, I, scale=I ** -0.5) for _ in range(L)]
    wdt = [w.t().contiguous() for w in wd]
    nw = [(1 + 0.1 * torch.randn(C, device=dev, generator=gen)).to(dt) for _ in range(L)]
    x0, o_in = rnd(1, C), rnd(1, C)
    copy = bench.peaks()["copy_tbps"] * 1e12
    wbytes = L * 2 * (C * C + 3 * I * C)
    rows, checks = [], {}

    # one layer, eager: reduce vs two-kernel; determinism
    h = G.gemv_launch(o_in, wo[0], residual=x0)[0]
    act, _ = G.gemv_gate_up_launch(h, wgu[0], nw[0], 1e-6)
    y_two, _ = G.gemv_launch(act, wd[0], residual=h)
    for fix in (1, 2):
        outs = []
        for _ in range(20):
            acc = G.acc_from(h, fix)
            G.gemv_mlp_reduce_launch(h, wgu[0], nw[0], wdt[0], acc, 1e-6)
            outs.append(acc.clone())
        y = G.acc_value(outs[0], dt)
        distinct = len({o.cpu().numpy().tobytes() for o in outs})
        diff = (y.float() - y_two.float()).abs()
        checks[f"fix{fix}"] = {"max_abs_vs_two": diff.max().item(), "max_ref": y_two.float().abs().max().item(),
                               "distinct_of_20": distinct}
        print(f"fix {fix}: max |y - y_two| {diff.max().item():.3e} (|y| max {y_two.float().abs().max().item():.2f}), "
              f"{distinct} distinct result(s) in 20 runs")

    # the chain
    hs = [torch.empty(1, C, device=dev, dtype=dt) for _ in range(L)]
    ys = [torch.empty(1, C, device=dev, dtype=dt) for _ in range(L)]

    def two():
        x = x0
        for i in range(L):
            h_attn, _ = G.gemv_launch(o_in, wo[i], residual=x, pdl=True)
            a, _ = G.gemv_gate_up_launch(h_attn, wgu[i], nw[i], 1e-6, pdl=True)
            x, _ = G.gemv_launch(a, wd[i], residual=h_attn, pdl=True)
        return x

    t = graph_us(two)
    rows.append({"form": "two", "us": t})
    print(f"two-kernel MLP: {t:.1f} us per step ({t / L:.2f} us/layer, {100 * wbytes / (t * 1e-6) / copy:.1f}% copy)")
    for fix in (2, 1):
        accs = [G.acc_from(x0, fix) for _ in range(L)]
        for bi in (8, 16, 32):
            for w in (4, 8):
                cfg = {"BLOCK_I": bi, "num_warps": w}

                def red():
                    x = x0
                    for i in range(L):
                        h_attn, _ = G.gemv_launch(o_in, wo[i], residual=x, pdl=True)
                        G.gemv_mlp_reduce_launch(h_attn, wgu[i], nw[i], wdt[i], accs[i], 1e-6, cfg=cfg, pdl=True)
                        x = h_attn  # (the engine's next kernels read the accumulator itself)
                    return x
                try:
                    t = graph_us(red)
                    rows.append({"form": "reduce", "fix": fix, **cfg, "us": t})
                    print(f"reduce fix {fix} BLOCK_I {bi:2d} warps {w}: {t:.1f} us per step ({t / L:.2f} us/layer, "
                          f"{100 * wbytes / (t * 1e-6) / copy:.1f}% copy)")
                except Exception as e:  # a config that does not compile or fit
                    rows.append({"form": "reduce", "fix": fix, **cfg, "error": repr(e)[:300]})
                    print(f"reduce fix {fix} {cfg}: ERROR {repr(e)[:200]}")
    for r in rows:
        if "us" in r:
            r["us_per_layer"] = r["us"] / L
            r["pct_copy"] = 100 * wbytes / (r["us"] * 1e-6) / copy
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "checks": checks, "weight_bytes": wbytes, "copy_Bps": copy,
                       "device": torch.cuda.get_device_name(), "layers": L}, f, indent=1)


if __name__ == "__main__":
    main()
