"""A/B of the Qwen2 decode step's launch-level options, in one process, timed where they run: the engine's
CUDA-graph decode step (Qwen2.5-0.5B-sized, 24 layers, bf16, random weights; batch 1, 16-token prompt +
256 new tokens as the issue's benchmark, so the cache holds 512 rows and the split heuristic gives 2 splits).

Options (each variant sets all three):
- pre:      the multi-K-step GEMV (down_proj, K = 4864) loads its first weight step before griddepcontrol.wait
- direct:   one KV split per kv head; the split kernel writes o and lse itself (no merge launch)
- prefetch: the attention kernel reads the lengths and the cached keys but the newest before the wait

Then the down_proj configs again with every option on. Replay timing as benchmarks/decode_tune.py: median of
5 x 50 replays with CUDA events, from the same cache length for every variant; the variants' tokens are
compared with the first's (the split form changes the reduction order: bf16 near-ties may flip).

    cd benchmarks && PYTHONPATH=.. python decode_ab.py [--json PATH]
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

C, I = 896, 4864


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--no-sweep", action="store_true")
    args = p.parse_args()
    _runtime.require_gpu("benchmarks/decode_ab.py")
    model = build_model(24, 0)
    engine = Qwen2Engine.from_hf(model, max_seq_len=4096)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    table = launch._table(_runtime.arch())
    key = G._config_key(1, C, I, torch.bfloat16)
    down0 = dict(G._config("plain", 1, C, I, torch.bfloat16))

    def run():
        engine._states.clear()  # a fresh state: the graph is re-captured with the current options
        out = engine.generate(ids, args.new)
        torch.cuda.synchronize()
        graph = next(iter(engine._states.values())).graph
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(20):
            graph.replay()
        times = []
        for _ in range(args.runs):
            start.record()
            for _ in range(50):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 50)
        return out, 1e3 / statistics.median(times)

    def setup(pre, direct, prefetch, down=None):
        table.setdefault("gemv", {})[key] = dict(down or down0, PRE=int(pre))
        engine.one_split_tokens = 1024 if direct else 0
        engine.attn_prefetch = prefetch

    rows, ref = [], None
    variants = [("base", 0, 0, 0), ("pre", 1, 0, 0), ("direct", 0, 1, 0), ("direct+prefetch", 0, 1, 1),
                ("split2+prefetch", 0, 0, 1), ("all", 1, 1, 1), ("base again", 0, 0, 0), ("all again", 1, 1, 1)]
    for name, pre, direct, prefetch in variants:
        setup(pre, direct, prefetch)
        out, sps = run()
        ref = out if ref is None else ref
        rows.append({"variant": name, "pre": pre, "direct": direct, "prefetch": prefetch, "steps_per_s": sps,
                     "step_us": 1e3 / sps * 1e3, "tokens_equal_base": bool(torch.equal(out, ref))})
        print(f"{name:<18} {sps:7.1f} steps/s {1e6 / sps:7.1f} us/step tokens_equal_base={rows[-1]['tokens_equal_base']}")
    if not args.no_sweep:
        for n, k, w in itertools.product((1, 2, 4), (1024, 2048), (4, 8)):
            cfg = {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": 2}
            setup(1, 1, 1, cfg)
            try:
                out, sps = run()
            except Exception as e:  # out of resources
                rows.append({"variant": "down sweep", "config": cfg, "error": repr(e)[:160]})
                continue
            rows.append({"variant": "down sweep", "config": cfg, "steps_per_s": sps, "step_us": 1e6 / sps})
            print(f"down {json.dumps(cfg):<70} {sps:7.1f} steps/s")
    table.setdefault("gemv", {})[key] = down0
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "device": _runtime.device_name(), "down_config": down0, "new": args.new}, f,
                      indent=1)


if __name__ == "__main__":
    main()
