"""Decode GEMV launch configs chosen where they run: in the Qwen2 engine's CUDA-graph decode step.

`triforge tune gemv*` times one launch per call (do_bench): for 3-10 us decode kernels that ranks configs
differently from the graph-replayed, PDL-chained step (a down_proj config it ranked first was 22% slower
in the step). This script builds the Qwen2.5-0.5B-sized engine (24 layers, bf16, random weights), and for
each decode GEMV in turn (coordinate descent: the others at their current configs) captures the decode
step's graph with each candidate (greedy generation of 128 tokens after a 16-token prompt, batch 1) and
times replays of it with CUDA events (median of 5 x 50 replays, from the same cache length for every
candidate; timing generate() itself swung +-10% run to run). Whether the candidate's tokens equal the
reference config's is recorded (other reduction orders flip bf16 near-ties on random weights; the
kernels' correctness at every config is the tests' job). With --write the winners go to
triforge/configs/<arch>.json with provenance.

    PYTHONPATH=. python benchmarks/decode_tune.py [--json PATH] [--write]
"""

import argparse
import itertools
import json
import statistics
import torch

from qwen2_decode import build_model  # noqa: E402  (this script runs from benchmarks/)

from triforge import _runtime, launch  # noqa: E402
from triforge.models.qwen2 import Qwen2Engine  # noqa: E402
from triforge.ops import gemv as G  # noqa: E402

C, I, QKV = 896, 4864, 1152
TARGETS = {  # role: (kernel, kind, N, K)
    "gate_up": ("gemv_gate_up", "gate_up", 2 * I, C),
    "down": ("gemv", "plain", C, I),
    "qkv": ("gemv_qkv_rope", "qkv", QKV, C),
    "o_proj": ("gemv", "plain", C, C),
    "mlp": ("gemv_mlp", "mlp", C, I),  # the fused MLP: gate/up + SwiGLU and down + residual, one launch
}


def mlp_candidates():
    """The fused MLP kernel (gate/up, grid barrier, down in one persistent launch); the baseline is the
    two-kernel MLP at the current configs (no gemv_mlp entry)."""
    return [{"BN_GU": g, "BK_GU": 1024, "BN_D": 2, "BK_D": 2048, "PPS": p, "num_warps": w}
            for g, p, w in itertools.product((1, 2), (4, 8, 16), (2, 4, 8))]


def stream_candidates(role):
    """The persistent streaming kernel (cfg PPS: programs per SM): balanced row-block ranges, next tiles
    prefetched. gate_up: one K step (C = 896 in a 1024-wide tile); down: K = 4864 in 1024/2048-wide steps."""
    if role == "gate_up":
        return [{"BLOCK_N": n, "BLOCK_K": 1024, "num_warps": w, "num_stages": 1, "PPS": p}
                for n, p, w in itertools.product((1, 2, 4), (2, 4, 8), (2, 4))]
    if role == "down":
        return [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": 1, "PPS": p}
                for n, k, p, w in itertools.product((1, 2), (1024, 2048), (2, 4, 8), (4, 8))]
    return [{"BLOCK_N": n, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1, "PPS": p}
            for n, p in itertools.product((1, 2), (1, 2, 4))]


def candidates(role):
    # fewer warps per program: more programs resident per SM (gate_up's 2432 two-row programs are 1.15
    # waves at 4 warps, one at 2)
    if role == "down":
        return [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": 2}
                for n, k, w in itertools.product((1, 2, 4), (1024, 2048, 4096, 8192), (2, 4, 8))]
    if role == "gate_up":
        return [{"BLOCK_N": n, "BLOCK_K": 1024, "num_warps": w, "num_stages": 1}
                for n, w in itertools.product((1, 2, 4, 8), (1, 2, 4, 8))]
    return [{"BLOCK_N": n, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1} for n in (1, 2, 4, 8)]


def replay_steps_per_s(graph, runs, per_run=50, warmup=20, state=None):
    """Steps (tokens at batch 1) per second of a captured decode-step graph: the median over ``runs``
    timings (CUDA events) of ``per_run`` back-to-back replays, after ``warmup`` replays. The graph advances
    the positions itself: with ``state`` every run (and the warmup) starts from the state's positions as they
    were (the same cache length for every run and candidate), and the replays must stay inside the cache
    (without it, replays past the capacity write k/v rows beyond the cache: sessions 9-12 timed that way)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    p0 = None
    if state is not None:
        p0 = state.positions.clone()
        room = state.max_seq_len - int(p0.max())
        if room < max(per_run, warmup):
            raise ValueError(f"{max(per_run, warmup)} replays from position {int(p0.max())} overrun the cache "
                             f"({state.max_seq_len} rows)")
        state.positions.copy_(p0)
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(runs):
        if p0 is not None:
            state.positions.copy_(p0)
        start.record()
        for _ in range(per_run):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / per_run)
    if p0 is not None:
        state.positions.copy_(p0)
    return 1e3 / statistics.median(times)


def replay_engine(engine, runs):
    """replay_steps_per_s of the engine's (only) captured decode-step graph, from its state's positions."""
    st = next(iter(engine._states.values()))
    return replay_steps_per_s(st.graph, runs, state=st)


def setup_engine():
    """The Qwen2.5-0.5B-sized engine (24 layers, bf16, random weights), a 16-token prompt, and the loaded
    launch-config table (a dict: candidates are patched into it in place)."""
    model = build_model(24, 0)
    engine = Qwen2Engine.from_hf(model, max_seq_len=4096)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    return engine, ids, launch._table(_runtime.arch(), _runtime.device_tag())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--write", action="store_true")
    p.add_argument("--for-device", action="store_true", help="with --write: into configs/<arch>.<device>.json (read on "
                   "this device model only), not <arch>.json")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--roles", default="gate_up,down,qkv,o_proj")
    p.add_argument("--stream", action="store_true", help="the persistent streaming kernel's candidates (gate_up, "
                   "down, o_proj) instead of the one-shot kernels'")
    args = p.parse_args()
    _runtime.require_gpu("benchmarks/decode_tune.py")
    engine, ids, table = setup_engine()

    def run():
        engine._states.clear()  # a fresh state: the graph is re-captured with the current configs
        out = engine.generate(ids, args.new)
        torch.cuda.synchronize()
        return out, replay_engine(engine, args.runs)

    ref, tps0 = run()
    rows = [{"role": "baseline", "tokens_per_s": tps0}]
    print(f"baseline {tps0:.0f} steps/s (graph replay)")
    best_all = {}
    for role in args.roles.split(","):
        kernel, kind, N, K = TARGETS[role]
        if role == "mlp":
            key = launch.config_key(m=1, c=C, i=I, dtype=launch.dtype_tag(torch.bfloat16))
            current = G.mlp_config(1, C, I, torch.bfloat16)  # None: the two kernels
            cands = mlp_candidates()
        else:
            key = G._config_key(1, N, K, torch.bfloat16)
            current = G._config(kind, 1, N, K, torch.bfloat16)
            cands = stream_candidates(role) if args.stream else candidates(role)
        best = (tps0, current)
        for cfg in cands:
            table.setdefault(kernel, {})[key] = cfg
            try:
                out, tps = run()
            except Exception as e:  # out of resources
                rows.append({"role": role, "config": cfg, "error": repr(e)[:160]})
                continue
            same = bool(torch.equal(out, ref))
            rows.append({"role": role, "config": cfg, "tokens_per_s": tps, "tokens_equal": same})
            print(f"{role:<8} {json.dumps(cfg):<75} {tps:7.0f} steps/s {'' if same else '(other tokens)'}")
            if tps > best[0]:
                best = (tps, cfg)
        if best[1] is None:  # the two-kernel MLP stays
            table[kernel].pop(key, None)
        else:
            table[kernel][key] = best[1]  # keep the winner while tuning the next role
        tps0 = best[0]
        best_all[role] = {"kernel": kernel, "key": key, "config": best[1], "tokens_per_s": best[0]}
        print(f"{role}: best {json.dumps(best[1])} {best[0]:.0f} steps/s")
    if args.write:
        path = launch.configs_file(_runtime.arch(), _runtime.device_tag() if args.for_device else None)
        data = json.loads(path.read_text()) if path.exists() else {"arch": _runtime.arch(), "kernels": {}}
        for role, b in best_all.items():
            if b["config"] is None:
                continue
            data["kernels"].setdefault(b["kernel"], {})[b["key"]] = b["config"]
            data.setdefault("provenance", {})[f"{b['kernel']}[{b['key']}]"] = {
                "device": _runtime.device_name(), "shape": {"role": role, "M": 1},
                "graph_steps_per_s": b["tokens_per_s"], "method": "benchmarks/decode_tune.py (graph-replayed decode)"}
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "best": best_all, "device": _runtime.device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
