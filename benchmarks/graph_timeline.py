"""Where a captured call's time goes: torch.profiler over CUDA-graph replays of one op at one shape, captured as
`triforge bench` times bench_graph ops (the input sets rotated, whole rotations per replay), then the kernels and the
idle gaps between them (triforge.trace: summarize, timeline).

The question it answers (session 50, issue 6): the M = 1 ternary matmul takes 10.3 us at 8192^2 on the H200 and reads
its 16.8 MB at 38% of the copy rate; configs with 2-4x the bytes in flight were no faster. How much of a call is the
main kernel, how much the split-K reduce launch, how much the gaps between launches?

    PYTHONPATH=. python benchmarks/graph_timeline.py ternary_matmul --shape M=1,N=8192,K=8192 [--out DIR]
    (GPU only; the Chrome trace is written to DIR/timeline.json for `triforge trace`)
"""

import argparse
import json
from pathlib import Path

import triforge  # noqa: F401,I001  (first: sets the interpreter up before triton is imported)
import torch

from triforge import _runtime, bench, registry, trace


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("op", help="a registered op, e.g. ternary_matmul")
    ap.add_argument("--shape", required=True, help="NAME=VALUE pairs, e.g. M=1,N=8192,K=8192")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--out", default=".", help="folder for timeline.json (the Chrome trace) and timeline-summary.json")
    args = ap.parse_args()
    _runtime.require_gpu("graph_timeline")
    import triforge.ops  # noqa: F401  (registers the ops)

    spec = registry.get(args.op)
    shape = {k: int(v) for k, v in (kv.split("=") for kv in args.shape.split(","))}
    dtype = getattr(torch, args.dtype)
    sets = bench._rotation(spec, dtype, 0, shape)
    calls = bench.graph_calls(len(sets))
    g = bench.capture_graph(bench._fwd_fn(spec.call, sets), calls)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "timeline.json"
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.replays):
            g.replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    rows = trace.summarize(path)
    lines = trace.timeline(path, top=5)
    per_call = {r["kernel"]: r["total_us"] / (args.replays * calls) for r in rows}
    summary = {"op": args.op, "shape": shape, "dtype": args.dtype, "device": _runtime.device_name(),
               "n_sets": len(sets), "calls_per_replay": calls, "replays": args.replays,
               "kernel_us_per_call": per_call, "timeline": lines}
    (out / "timeline-summary.json").write_text(json.dumps(summary, indent=2))
    print(f"{args.op} {shape} {args.dtype} on {summary['device']}: {len(sets)} input sets, {calls} calls per replay")
    for name, us in per_call.items():
        print(f"  {us:8.2f} us per call  {name[:90]}")
    for t in lines:
        n_calls = args.replays * calls
        print(f"GPU {t['gpu']}: span {t['span_us'] / n_calls:.2f} us per call, kernels running "
              f"{t['busy_us'] / n_calls:.2f} us of it ({100 * t['busy_us'] / max(t['span_us'], 1e-9):.1f}%)")
        for gap in t["gaps"]:
            print(f"  gap {gap['us']:7.2f} us after {gap['after'][:50]} before {gap['before'][:50]}")


if __name__ == "__main__":
    main()
