"""Gated DeltaNet decode at batch 1: where the time goes when the kernel is tiny.

    PYTHONPATH=. python3 benchmarks/deltanet_decode_graph.py [OUT.json]

One decode step (T = 1, H = 16, HV = 32, K = V = 128, bf16 q/k/v, fp32 state, l2norm in kernel) at
B = 1, 64, 256, timed four ways with CUDA events (median of 200, inputs rotated over 8 sets):
  eager      the public ``fused_recurrent_gated_delta_rule`` as a user calls it;
  graph      the same call captured once in a CUDA graph and replayed (no Python, no launch cost:
             what a serving engine that graphs its decode step pays);
  fla        fla's fused_recurrent_gated_delta_rule eager, where it runs (B = 1 only: fla 0.6.0
             faults at B = 64 with grouped value heads);
  host       the eager call's CPU time alone (wall clock of the Python call, no synchronisation):
             validation + custom-op dispatch + launch.
A line per case, then the table; rows go to OUT.json.
"""

import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from triforge.ops.deltanet import fused_recurrent_gated_delta_rule  # noqa: E402


def _inputs(B, gen):
    H, HV, K, V = 16, 32, 128, 128

    def r(*s, dtype=torch.bfloat16):
        return torch.randn(s, generator=gen).to("cuda", dtype)

    return dict(q=r(B, 1, H, K), k=r(B, 1, H, K), v=r(B, 1, HV, V),
                g=torch.nn.functional.logsigmoid(torch.randn(B, 1, HV, generator=gen) + 2).cuda(),
                beta=torch.rand(B, 1, HV, generator=gen).to("cuda", torch.bfloat16),
                initial_state=torch.randn(B, HV, K, V, generator=gen).cuda() * 0.1)


def _time(fn, sets, reps=200):
    for i in range(10):
        fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    ts = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(sets[i % len(sets)])
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else None
    gen = torch.Generator().manual_seed(0)
    rows = []
    for B in (1, 64, 256):
        sets = [_inputs(B, gen) for _ in range(8)]
        call = lambda x: fused_recurrent_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)  # noqa: E731
        row = {"B": B, "eager_ms": _time(call, sets)}
        # host time: the Python call alone, the GPU kept busy enough not to block it
        call(sets[0])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(200):
            call(sets[i % 8])
        row["host_ms"] = (time.perf_counter() - t0) / 200 * 1e3
        torch.cuda.synchronize()
        try:  # one graph per input set: replaying graph i reads set i
            graphs = []
            for x in sets:
                call(x)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    call(x)
                graphs.append(g)
            row["graph_ms"] = _time(lambda i: graphs[i].replay(), list(range(8)))
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            row["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        if B == 1:
            try:
                from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fn

                row["fla_ms"] = _time(lambda x: fla_fn(**x, output_final_state=True, use_qk_l2norm_in_kernel=True), sets)
            except Exception as e:  # noqa: BLE001
                row["fla_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        state_bytes = 2 * B * 32 * 128 * 128 * 4
        row["state_gbps_graph"] = state_bytes / (row.get("graph_ms", row["eager_ms"]) * 1e-3) / 1e9
        print("ROW", json.dumps(row), flush=True)
        rows.append(row)
    print(f"{'B':>4} {'eager ms':>9} {'graph ms':>9} {'host ms':>8} {'fla ms':>8} {'GB/s graph':>10}")
    for r in rows:
        print(f"{r['B']:>4} {r['eager_ms']:9.4f} {r.get('graph_ms', float('nan')):9.4f} {r['host_ms']:8.4f} "
              f"{r.get('fla_ms', float('nan')):8.4f} {r['state_gbps_graph']:10.0f}")
    if out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        with open(out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
