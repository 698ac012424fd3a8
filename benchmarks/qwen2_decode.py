"""Qwen2.5-0.5B-sized decode throughput: the triforge engine against Hugging Face, and one decode
step kernel by kernel against its byte model (GPU only; random bf16 weights, no hub access).

    PYTHONPATH=. python benchmarks/qwen2_decode.py --json benchmarks/results/qwen2-decode.json

For each batch size (default 1, 8, 32): prompt of 16 random tokens + 256 new tokens, greedy.
    triforge             Qwen2Engine.generate (prefill on cuBLAS + FlashAttention, decode step in a CUDA graph)
    hf_eager             Qwen2ForCausalLM.generate in eager PyTorch (transformers' default sdpa attention),
                         dynamic cache
    hf_static_compile    Qwen2ForCausalLM.generate(cache_implementation="static"): transformers compiles
                         the decode forward (torch.compile, mode="reduce-overhead": CUDA graphs) itself
    hf_patched           the same model with triforge.nn.patch_hf_model (RMSNorm, SwiGLU, RoPE, attention:
                         flash-decoding over HF's dynamic cache), eager generate: the drop-in's gain for HF users
                         (the RoPE patch is module-wide, so it is applied only around this peer's runs)
tokens/s = batch * new tokens / wall time of generate (prefill included), the median of --runs runs
after a warm-up run (which captures the engine's graph / compiles HF's forward).

Then one decode step at batch 1 (position 16 + 128) runs eagerly under torch.profiler: each kernel's
GPU time against its byte model (weights + activations + the KV rows it reads), as GB/s and % of the
measured copy bandwidth, and the sum against the graph-replayed step time.

Correctness gate (numbers count only behind it): the engine's greedy tokens at batch 1 are checked
teacher-forced against Hugging Face bf16 (argmax agreement over every generated position) and
against the engine without CUDA graph (identical). The script stops a peer (not the engine) once
--budget-s seconds have passed, so one call fits a short device lease.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from triforge import _runtime, bench  # noqa: E402
from triforge.models import parity  # noqa: E402
from triforge.models.parity import QWEN25_05B  # noqa: E402
from triforge.models.qwen2 import Qwen2Engine  # noqa: E402

KERNEL_ROLES = (  # one decode step, per layer, in launch order
    ("gemv_qkv_rope_kernel", "qkv_rope (norm + QKV + bias + RoPE + cache write)"),
    ("flash_decode_split_kernel", "attention split (flash-decoding)"),
    ("flash_decode_merge_kernel", "attention merge"),
    (("gemv_kernel", "gemv_stream_kernel"), "o_proj + residual"),
    (("gemv_gate_up_kernel", "gemv_stream_kernel"), "gate_up + SwiGLU (norm prologue)"),
    (("gemv_kernel", "gemv_stream_kernel"), "down_proj + residual"),
)  # (a kernel name prefix, or a tuple of them: a GEMV's config may pick the persistent streaming kernel)
LM_HEAD = (("gemv_kernel", "gemv_stream_kernel"), "lm_head (final norm prologue)")
FUSED_ATTN_ROLES = (  # the step where attention + o_proj + residual is one launch (decode_oproj, batch <= 2)
    KERNEL_ROLES[0],
    ("flash_decode_oproj_kernel", "attention + o_proj + residual (one launch)"),
    KERNEL_ROLES[4],
    KERNEL_ROLES[5],
)


def build_model(layers: int, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = {k: v for k, v in QWEN25_05B.items() if k != "model_type"}
    cfg["num_hidden_layers"] = layers
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
    return model.to(torch.bfloat16).eval()  # transformers' default attention (sdpa) for the peers


def timed(fn, runs, warmup=None):
    out = (warmup or fn)()  # warm-up: graph capture / compilation
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return out, times


def throughput_row(impl, batch, new, times, **extra):
    s = statistics.median(times)
    return {"impl": impl, "batch": batch, "new_tokens": new, "seconds": s, "runs_s": times,
            "tokens_per_s": batch * new / s, "ms_per_step": 1e3 * s / new, **extra}


def hf_generate(model, ids, new, static):
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        return model.generate(ids, **kw)


def correctness(model, engine, ids, new):
    """Engine greedy tokens (graph) == engine without graph; teacher-forced argmax agreement with HF
    bf16 on the engine's tokens, gated as the parity tool gates it (>= 99% on the positions whose
    fp32 top-2 gap is beyond rounding noise; random weights leave many near-ties)."""
    out = engine.generate(ids, new)
    eager = Qwen2Engine.from_hf(model, max_seq_len=engine.max_seq_len, use_cuda_graph=False)
    same = bool(torch.equal(out, eager.generate(ids, new)))
    del eager
    P = ids.shape[1]
    with torch.no_grad():
        logits = model(out, use_cache=False).logits[:, P - 1:-1]
        golden = copy.deepcopy(model).float()
        gold = golden(out, use_cache=False).logits[:, P - 1:-1]
        del golden
    agree = parity.argmax_agreement(out[:, P:], logits, gold)
    return {"graph_equals_eager": same, **agree, "ok": same and agree["gated"] >= parity.MIN_AGREEMENT}


def byte_model(spec, batch, keys, dtype) -> dict:
    """Bytes each launch of a decode step must move at least: weights, activations in and out, the
    K/V rows attention reads (``keys`` per row)."""
    e = torch.finfo(dtype).bits // 8
    C, I, D = spec.hidden_size, spec.intermediate_size, spec.head_dim
    qd = spec.num_heads * D
    kv = 2 * batch * keys * spec.num_kv_heads * D * e
    return {
        "qkv_rope": e * (spec.qkv_size * C + spec.qkv_size + batch * (C + C + spec.qkv_size)) + 4 * batch * 2 * D,
        "attention split": kv + e * batch * qd,
        "attention merge": e * batch * qd,
        "attention + o_proj": kv + e * (batch * qd + C * qd + 2 * batch * C),
        "o_proj": e * (C * qd + batch * (qd + 2 * C)),
        "gate_up": e * (2 * I * C + C + batch * (C + I)),
        "down_proj": e * (C * I + batch * (I + 2 * C)),
        "lm_head": e * (spec.vocab_size * C + C + batch * (C + spec.vocab_size)),
    }


def kernel_rows(kernels, spec, batch, keys, dtype, copy_tbps):
    """Profiler kernel events of one decode step (time order) -> rows per role of the step: our
    kernels matched in launch order to KERNEL_ROLES (per layer) and LM_HEAD, any other kernel by name."""
    model_bytes = byte_model(spec, batch, keys, dtype)
    fused = any(ev["name"].startswith("flash_decode_oproj_kernel") for ev in kernels)
    role_set = FUSED_ATTN_ROLES if fused else KERNEL_ROLES
    ours = [ev for ev in kernels if any(ev["name"].startswith(k) for k, _ in role_set)]
    # one KV split: the split kernel writes the output itself and there is no merge launch
    merge = any(ev["name"].startswith("flash_decode_merge_kernel") for ev in ours)
    roles = [r for r in role_set if merge or r[0] != "flash_decode_merge_kernel"]
    expected = [k for _ in range(spec.num_layers) for k in roles] + [LM_HEAD]
    matched = len(ours) == len(expected) and all(ev["name"].startswith(k) for ev, (k, _) in zip(ours, expected))
    rows = {}
    if matched:
        for ev, (_, role) in zip(ours, expected):
            key = next(k for k in model_bytes if role.startswith(k))
            r = rows.setdefault(role, {"role": role, "kernel": ev["name"], "calls": 0, "total_us": 0.0,
                                       "bytes": model_bytes[key]})
            r["calls"] += 1
            r["total_us"] += float(ev["dur"])
    for ev in kernels:
        if matched and any(ev is o for o in ours):
            continue
        r = rows.setdefault(ev["name"], {"role": "(other) " + ev["name"][:60], "kernel": ev["name"], "calls": 0,
                                         "total_us": 0.0, "bytes": None})
        r["calls"] += 1
        r["total_us"] += float(ev["dur"])
    out = []
    for r in rows.values():
        r["mean_us"] = r["total_us"] / r["calls"]
        if r["bytes"]:
            r["gbps"] = r["bytes"] / (r["mean_us"] * 1e-6) / 1e9
            r["pct_copy"] = 100 * r["gbps"] / (copy_tbps * 1e3) if copy_tbps else None
        out.append(r)
    return matched, out


def profile_step(engine, batch, prompt, steps_before, copy_tbps, trace_path):
    """One eager decode step under torch.profiler; per-kernel GPU time against the byte model."""
    from torch.profiler import ProfilerActivity, profile

    s = engine.spec
    state = engine.new_state(batch, prompt + steps_before + 16)
    ids = torch.randint(0, s.vocab_size, (batch, prompt), device="cuda")
    engine.prefill(state, ids)
    tok = ids[:, -1]
    for _ in range(steps_before - 8):
        engine.step(state, tok)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(8):  # CUDA-graph steps around the profiled position
        engine.step(state, tok)
    torch.cuda.synchronize()
    graph_step_us = (time.perf_counter() - t0) / 8 * 1e6
    state.ids.copy_(tok)
    L = state.length + 1  # keys attended in the profiled step (it does not advance the state)
    engine._decode(state)  # warm: every kernel compiled before the profiled step
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine._decode(state)
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((ev for ev in events if ev.get("ph") == "X" and str(ev.get("cat", "")).lower() == "kernel"),
                     key=lambda ev: ev["ts"])
    matched, out = kernel_rows(kernels, s, batch, L, engine.dtype, copy_tbps)
    total_bytes = sum(r["bytes"] * r["calls"] for r in out if r["bytes"])
    return {
        "batch": batch, "keys_attended": L, "kernels_matched_roles": matched, "kernels": out,
        "sum_kernel_us": sum(r["total_us"] for r in out), "graph_step_us": graph_step_us,
        "bytes_per_step": total_bytes,
        "ideal_us_at_copy_bw": total_bytes / (copy_tbps * 1e12) * 1e6 if copy_tbps else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="FILE", help="write the results here")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--runs", type=int, default=3, help="timed runs per engine measurement (median)")
    p.add_argument("--peers", default="hf_eager,hf_static_compile,hf_patched", help="comma list, or 'none'")
    p.add_argument("--budget-s", type=float, default=150.0, help="start no peer run after this many seconds")
    p.add_argument("--trace", default="/tmp/qwen2_decode_step.json", help="Chrome trace of the profiled step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-pdl", action="store_true", help="launch the decode kernels without programmatic dependent launch")
    args = p.parse_args(argv)
    _runtime.require_gpu("benchmarks/qwen2_decode.py")
    start = time.perf_counter()
    import transformers
    import triton

    peaks = bench.peaks()
    copy_tbps = peaks["copy_tbps"]
    model = build_model(args.layers, args.seed)
    engine = Qwen2Engine.from_hf(model, max_seq_len=4096)
    engine.use_pdl = not args.no_pdl
    batches = [int(b) for b in args.batches.split(",")]
    peers = [] if args.peers == "none" else args.peers.split(",")
    gen = torch.Generator().manual_seed(args.seed + 1)
    result = {
        "benchmark": "qwen2_decode", "device": _runtime.device_name(), "commit": bench.git_commit(),
        "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "dtype": "bfloat16", "layers": args.layers,
        "prompt": args.prompt, "new_tokens": args.new, "copy_tbps": copy_tbps, "throughput": [], "skipped": [],
        "hf_attn_implementation": model.config._attn_implementation, "pdl": engine.use_pdl,
    }

    def save():
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)

    prompts = {b: torch.randint(0, QWEN25_05B["vocab_size"], (b, args.prompt), generator=gen).cuda() for b in batches}
    result["correctness"] = correctness(model, engine, prompts[batches[0]], min(args.new, 64))
    print(f"correctness: {result['correctness']}", flush=True)
    save()
    for b in batches:
        _, times = timed(lambda: engine.generate(prompts[b], args.new), args.runs)
        result["throughput"].append(throughput_row("triforge", b, args.new, times))
        print(f"triforge batch {b}: {result['throughput'][-1]['tokens_per_s']:.0f} tokens/s", flush=True)
        save()
    patched = None
    if "hf_patched" in peers:  # set up after the engine's numbers are saved: a failure here costs this peer only
        from triforge.nn import patch_hf_model, patch_hf_rope, unpatch_hf_rope

        try:
            patched = copy.deepcopy(model)
            result["hf_patched_counts"] = patch_hf_model(patched)
            unpatch_hf_rope(patched)  # (module-wide: HF's own model must not run it)
            # greedy tokens against HF's own (bf16 both, other rounding: they may part where the top two nearly tie)
            want = hf_generate(model, prompts[batches[0]][:1], 32, False)
            if patch_hf_rope(patched) != 1:
                raise RuntimeError("patch_hf_rope did not patch modeling_qwen2's apply_rotary_pos_emb")
            try:
                got = hf_generate(patched, prompts[batches[0]][:1], 32, False)
            finally:
                unpatch_hf_rope(patched)
            differ = (want != got)[0, args.prompt:].nonzero()
            result["hf_patched_first_divergence"] = int(differ[0]) if len(differ) else None
            print(f"hf_patched: {result['hf_patched_counts']}, greedy tokens equal HF's up to "
                  f"{result['hf_patched_first_divergence'] if differ.numel() else 'all 32'}", flush=True)
        except Exception as e:  # reported, not fatal (as every peer)
            if patched is not None:
                unpatch_hf_rope(patched)
            patched = None
            peers = [p for p in peers if p != "hf_patched"]
            result["skipped"].append({"impl": "hf_patched", "batch": None, "reason": f"set-up: {type(e).__name__}: {e}"[:300]})
        save()
    for b in batches:
        for peer in peers:
            if time.perf_counter() - start > args.budget_s:
                result["skipped"].append({"impl": peer, "batch": b, "reason": "time budget"})
                continue
            try:
                static = peer == "hf_static_compile"
                which = patched if peer == "hf_patched" else model
                if peer == "hf_patched" and patch_hf_rope(patched) != 1:  # (imported with patch_hf_model above)
                    raise RuntimeError("patch_hf_rope did not patch modeling_qwen2's apply_rotary_pos_emb")
                # eager warms up on a short run; the static cache's compiled forward needs the same shapes
                warm = None if static else (lambda: hf_generate(which, prompts[b], 8, False))
                try:
                    _, times = timed(lambda: hf_generate(which, prompts[b], args.new, static), 1, warm)
                finally:
                    if peer == "hf_patched":
                        unpatch_hf_rope(patched)
                result["throughput"].append(throughput_row(peer, b, args.new, times))
                print(f"{peer} batch {b}: {result['throughput'][-1]['tokens_per_s']:.0f} tokens/s", flush=True)
            except Exception as e:  # a peer that fails is reported, not fatal
                result["skipped"].append({"impl": peer, "batch": b, "reason": f"{type(e).__name__}: {e}"[:300]})
            save()
    for row in result["throughput"]:
        base = next((r for r in result["throughput"] if r["impl"] == "triforge" and r["batch"] == row["batch"]), None)
        row["triforge_speedup"] = row["seconds"] / base["seconds"] if base else None
    result["step_profile"] = profile_step(engine, 1, args.prompt, 128, copy_tbps, args.trace)
    save()
    _print(result)
    return 0 if result["correctness"]["ok"] else 1


def _print(result):
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    t = Table(title=f"Qwen2.5-0.5B-sized decode, bf16, prompt {result['prompt']} + {result['new_tokens']} new tokens "
                    f"— {result['device']} ({result['commit']})")
    for col in ("impl", "batch", "tokens/s", "ms/step", "triforge speedup"):
        t.add_column(col, justify="left" if col == "impl" else "right")
    for r in sorted(result["throughput"], key=lambda r: (r["batch"], r["impl"] != "triforge")):
        sp = r.get("triforge_speedup")
        t.add_row(r["impl"], str(r["batch"]), f"{r['tokens_per_s']:.0f}", f"{r['ms_per_step']:.3f}",
                  "-" if sp is None else f"{sp:.2f}x")
    console.print(t)
    for s in result["skipped"]:
        console.print(f"skipped {s['impl']} batch {s['batch']}: {s['reason']}")
    sp = result["step_profile"]
    t = Table(title=f"one decode step, batch {sp['batch']}, {sp['keys_attended']} keys: kernels vs byte model "
                    f"(copy {result['copy_tbps']:.2f} TB/s)")
    for col in ("role", "calls", "mean us", "total us", "MB", "GB/s", "% copy"):
        t.add_column(col, justify="left" if col == "role" else "right")
    for r in sorted(sp["kernels"], key=lambda r: -r["total_us"]):
        t.add_row(r["role"], str(r["calls"]), f"{r['mean_us']:.2f}", f"{r['total_us']:.1f}",
                  f"{r['bytes'] / 1e6:.2f}" if r["bytes"] else "", f"{r['gbps']:.0f}" if r.get("gbps") else "",
                  f"{r['pct_copy']:.1f}" if r.get("pct_copy") else "")
    console.print(t)
    console.print(f"sum of kernel times {sp['sum_kernel_us']:.0f} us; graph-replayed step {sp['graph_step_us']:.0f} us; "
                  f"{sp['bytes_per_step'] / 1e6:.0f} MB per step = {sp['ideal_us_at_copy_bw']:.0f} us at copy bandwidth")
    console.print(f"correctness: {result['correctness']}")


if __name__ == "__main__":
    sys.exit(main())
