"""A/B of the Qwen2 decode step's options, in one process, timed where they run: the engine's CUDA-graph decode
step (Qwen2.5-0.5B-sized, 24 layers, bf16, random weights; batch 1, 16-token prompt + 256 new tokens as the
issue's benchmark, so the cache holds 512 rows and the split heuristic gives 2 splits).

A variant sets engine attributes and launch configs:
- pre:        the multi-K-step GEMV (down_proj, K = 4864) loads its first weight step before griddepcontrol.wait
- splits:     forced KV splits (0: the heuristic; 1: the split kernel writes o and lse itself, no merge launch)
- cfg:        launch configs patched in: {(kernel, key): config}
- fused_attn: attention + o_proj + residual as one launch (decode_oproj; default True) or flash-decoding + GEMV

Each variant: steps/s of the plain step graph (median of 5 x 50 replays, CUDA events, same cache length) and
tokens/s of generate() itself (median of 3 timed calls, as benchmarks/qwen2_decode.py times it); tokens are
compared with the first variant's (another split count changes the reduction order: bf16 near-ties may flip).
Then a sweep of flash_decode_oproj's launch configs (with the fused path on).

    PYTHONPATH=. python benchmarks/decode_ab.py [--json PATH] [--no-sweep]
"""

import argparse
import json
import statistics
import time

import torch

from decode_tune import replay_engine, setup_engine  # noqa: E402  (this script runs from benchmarks/)

from triforge import _runtime, launch  # noqa: E402
from triforge.ops import gemv as G  # noqa: E402
from triforge.ops.attention import decode as dec  # noqa: E402
from triforge.ops.attention import decode_oproj  # noqa: E402

C, I = 896, 4864


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--write", action="store_true", help="store the best flash_decode_oproj config (by generate "
                   "tokens/s, if it beats the current by more than 0.5%%) in triforge/configs/<arch>.json")
    p.add_argument("--for-device", action="store_true", help="with --write: into configs/<arch>.<device>.json (read on "
                   "this device model only), not <arch>.json")
    args = p.parse_args()
    _runtime.require_gpu("benchmarks/decode_ab.py")
    engine, ids, table = setup_engine()
    key = G._config_key(1, C, I, torch.bfloat16)

    def run():
        engine._states.clear()  # a fresh state: the graphs are re-captured with the current options
        out = engine.generate(ids, args.new)
        torch.cuda.synchronize()
        sps = replay_engine(engine, args.runs)
        gen = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.generate(ids, args.new)
            torch.cuda.synchronize()
            gen.append(time.perf_counter() - t0)
        return out, sps, args.new / statistics.median(gen)

    gu_key = G._config_key(1, 2 * I, C, torch.bfloat16)
    o_key = G._config_key(1, C, C, torch.bfloat16)
    mlp_key = launch.config_key(m=1, c=C, i=I, dtype=launch.dtype_tag(torch.bfloat16))
    sp_key = dec._split_key(64, torch.bfloat16, 16)
    op_key = launch.config_key(h=14, hkv=2, d=64, n=C, dtype="bf16")
    base_cfg = {
        ("gemv", key): dict(G._config("plain", 1, C, I, torch.bfloat16)),
        ("gemv", o_key): dict(G._config("plain", 1, C, C, torch.bfloat16)),
        ("gemv_qkv_rope", G._config_key(1, 1152, C, torch.bfloat16)): dict(G._config("qkv", 1, 1152, C, torch.bfloat16)),
        ("gemv_gate_up", gu_key): dict(G._config("gate_up", 1, 2 * I, C, torch.bfloat16)),
        ("flash_decode_split", sp_key): dict(dec._split_config(64, torch.bfloat16, 16)),
        ("flash_decode_oproj", op_key): dict(decode_oproj.config(14, 2, 64, C, torch.bfloat16)),
    }

    def setup(v, patch=None):
        for (kernel, k), cfg in base_cfg.items():
            table.setdefault(kernel, {})[k] = dict(cfg)
        table.setdefault("gemv_mlp", {}).pop(mlp_key, None)
        if "pre" in v:
            table["gemv"][key]["PRE"] = int(v["pre"])
        for (kernel, k), cfg in list(v.get("cfg", {}).items()) + list((patch or {}).items()):
            table.setdefault(kernel, {})[k] = dict(cfg)
        engine._num_splits = v.get("splits", 0)
        engine.fused_attn = v.get("fused_attn", True)

    # session 26: attention + o_proj + residual as one launch (decode_oproj) against flash-decoding + the o_proj GEMV
    no_pf = {("flash_decode_oproj", op_key): {**base_cfg[("flash_decode_oproj", op_key)], "PF": 0}}
    qkv_key = G._config_key(1, 1152, C, torch.bfloat16)
    old = {("gemv", key): {"BLOCK_N": 2, "BLOCK_K": 2048, "num_warps": 8, "num_stages": 2},  # sm90.json before the
           ("gemv_gate_up", gu_key): {"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1},  # session-26
           ("gemv_qkv_rope", qkv_key): {"BLOCK_N": 1, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 2}}  # decode_tune
    variants = [
        ("GEMV configs before session 26", {"fused_attn": True, "cfg": old}),
        ("GEMV configs of the table", {"fused_attn": True}),
        ("GEMV configs before session 26 again", {"fused_attn": True, "cfg": old}),
        ("GEMV configs of the table again", {"fused_attn": True}),
        ("flash-decoding + o_proj", {"fused_attn": False}),
        ("fused attention + o_proj", {"fused_attn": True}),
        ("fused, no K/V L2 prefetch", {"fused_attn": True, "cfg": no_pf}),
    ]
    rows, ref, best = [], None, (0.0, None)
    for name, v in variants:
        setup(v)
        out, sps, tps = run()
        ref = out if ref is None else ref
        v_json = {k: ({f"{kk[0]}[{kk[1]}]": c for kk, c in x.items()} if k == "cfg" else x) for k, x in v.items()}
        rows.append({"variant": name, **v_json, "steps_per_s": sps, "step_us": 1e6 / sps, "generate_tokens_per_s": tps,
                     "tokens_equal_first": bool(torch.equal(out, ref))})
        print(f"{name:<32} replay {sps:7.1f} steps/s ({1e6 / sps:6.1f} us)  generate {tps:7.1f} tok/s  "
              f"tokens_equal_first={rows[-1]['tokens_equal_first']}")
        if tps > best[0]:
            best = (tps, v)
    print(f"best variant: {best[1]} {best[0]:.1f} tokens/s")
    if not args.no_sweep:
        sweeps = [(("flash_decode_oproj", op_key), {"BLOCK_R": r, "BLOCK_N": n, "num_warps": w, "num_stages": st})
                  for r, n, w, st in [(32, 128, 8, 3), (32, 128, 8, 4), (32, 128, 16, 3), (64, 128, 16, 3), (64, 128, 8, 3),
                                      (32, 256, 8, 2), (32, 256, 8, 1), (16, 128, 8, 4), (32, 64, 8, 4), (64, 64, 16, 3),
                                      (32, 128, 8, 3)]]
        for (kernel, k), cfg in sweeps:
            setup({"fused_attn": True}, {(kernel, k): cfg})  # the kernel these configs are for
            try:
                out, sps, tps = run()
            except Exception as e:  # out of resources
                rows.append({"variant": f"{kernel} sweep", "config": cfg, "error": repr(e)[:160]})
                continue
            rows.append({"variant": f"{kernel} sweep", "config": cfg, "steps_per_s": sps, "step_us": 1e6 / sps,
                         "generate_tokens_per_s": tps})
            print(f"{kernel:<18} {json.dumps(cfg):<100} replay {sps:7.1f}  generate {tps:7.1f} tok/s")
    setup({})
    split_rows = [r for r in rows if r["variant"] == "flash_decode_oproj sweep" and "generate_tokens_per_s" in r]
    if args.write and split_rows:
        top = max(split_rows, key=lambda r: r["generate_tokens_per_s"])
        if top["generate_tokens_per_s"] > 1.005 * best[0]:
            path = launch.configs_file(_runtime.arch(), _runtime.device_tag() if args.for_device else None)
            data = json.loads(path.read_text()) if path.exists() else {"arch": _runtime.arch(), "kernels": {}}
            data["kernels"].setdefault("flash_decode_oproj", {})[op_key] = top["config"]
            data.setdefault("provenance", {})[f"flash_decode_oproj[{op_key}]"] = {
                "device": _runtime.device_name(), "shape": {"role": "Qwen2 decode attention + o_proj", "B": 1},
                "generate_tokens_per_s": top["generate_tokens_per_s"],
                "method": "benchmarks/decode_ab.py (generate, 16 + 256 tokens, graph-replayed decode)"}
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
            print(f"wrote flash_decode_oproj[{op_key}] = {top['config']} ({top['generate_tokens_per_s']:.1f} tok/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "device": _runtime.device_name(), "new": args.new,
                       "base_configs": {f"{k[0]}[{k[1]}]": c for k, c in base_cfg.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
