"""A/B of the Qwen2 decode step's launch-level options, in one process, timed where they run: the engine's
CUDA-graph decode step (Qwen2.5-0.5B-sized, 24 layers, bf16, random weights; batch 1, 16-token prompt +
256 new tokens as the issue's benchmark, so the cache holds 512 rows and the split heuristic gives 2 splits).

A variant sets engine attributes and launch configs:
- pre:       the multi-K-step GEMV (down_proj, K = 4864) loads its first weight step before griddepcontrol.wait
- splits:    forced KV splits (0: heuristic; 1: the split kernel writes o and lse itself, no merge launch)
- prefetch:  the attention kernel reads the lengths and the cached keys but the newest before the wait
- l2:        the L2 prefetch plan (role -> weights asked into L2 at that GEMV's start)

Then launch-config sweeps (gate_up, down) under the best variant. Replay timing as benchmarks/decode_tune.py:
median of 5 x 50 replays with CUDA events, from the same cache length for every variant; tokens are compared
with the first variant's (another split count changes the reduction order: bf16 near-ties may flip).

    PYTHONPATH=. python benchmarks/decode_ab.py [--json PATH] [--no-sweep]
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

    gu_key = G._config_key(1, 2 * I, C, torch.bfloat16)
    gu0 = dict(G._config("gate_up", 1, 2 * I, C, torch.bfloat16))
    both = {"qkv": ("w_gate_up", "w_down")}

    def setup(v, down=None, gate_up=None):
        table.setdefault("gemv", {})[key] = dict(down or down0, PRE=int(v.get("pre", 1)))
        table.setdefault("gemv_gate_up", {})[gu_key] = dict(gate_up or gu0)
        engine._num_splits = v.get("splits", 0)
        engine.attn_prefetch = bool(v.get("prefetch", 0))
        engine.l2_plan = v.get("l2", {})

    variants = [
        ("no pre", {"pre": 0}),
        ("pre", {}),
        ("pre+attn prefetch", {"prefetch": 1}),
        ("L2 qkv:gu+down", {"l2": both}),
        ("L2 qkv:gu, gu:down", {"l2": {"qkv": ("w_gate_up",), "gate_up": ("w_down",)}}),
        ("L2 o:gu+down", {"l2": {"o_proj": ("w_gate_up", "w_down")}}),
        ("L2 qkv:gu+down, down:next qkv+o", {"l2": dict(both, down=("next.w_qkv", "next.w_o"))}),
        ("L2 qkv:gu+down +prefetch", {"l2": both, "prefetch": 1}),
        ("L2 qkv:gu+down splits 1", {"l2": both, "splits": 1}),
        ("L2 qkv:gu+down splits 3", {"l2": both, "splits": 3}),
        ("pre again", {}),
        ("L2 qkv:gu+down again", {"l2": both}),
    ]
    rows, ref, best = [], None, (0.0, None)
    for name, v in variants:
        setup(v)
        out, sps = run()
        ref = out if ref is None else ref
        rows.append({"variant": name, **{k: (dict(x) if isinstance(x, dict) else x) for k, x in v.items()},
                     "steps_per_s": sps, "step_us": 1e6 / sps, "tokens_equal_first": bool(torch.equal(out, ref))})
        print(f"{name:<36} {sps:7.1f} steps/s {1e6 / sps:7.1f} us/step tokens_equal_first={rows[-1]['tokens_equal_first']}")
        if sps > best[0]:
            best = (sps, v)
    print(f"best variant: {best[1]} {best[0]:.1f} steps/s")
    if not args.no_sweep:
        sweeps = [("gate_up", {"BLOCK_N": n, "BLOCK_K": 1024, "num_warps": w, "num_stages": 1})
                  for n, w in itertools.product((1, 2, 4, 8), (4, 8))]
        sweeps += [("down", {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": 2})
                   for n, k, w in itertools.product((1, 2, 4), (1024, 2048), (4,))]
        for role, cfg in sweeps:
            setup(best[1], **{role: cfg})
            try:
                out, sps = run()
            except Exception as e:  # out of resources
                rows.append({"variant": f"{role} sweep", "config": cfg, "error": repr(e)[:160]})
                continue
            rows.append({"variant": f"{role} sweep", "config": cfg, "steps_per_s": sps, "step_us": 1e6 / sps})
            print(f"{role:<8} {json.dumps(cfg):<70} {sps:7.1f} steps/s")
    setup({})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "device": _runtime.device_name(), "down_config": down0, "gate_up_config": gu0,
                       "new": args.new}, f, indent=1)


if __name__ == "__main__":
    main()
