"""Where flash-decoding's time goes at the decode shapes that miss 70% of copy (issue 3).

At each (B, S) (16 q / 2 kv heads, D 128, bf16, one appended token, full caches), CUDA-graph time per call
(``bench.graph_time_ms`` over enough cache sets to exceed the L2 four times) of:

- ``op``: ``flash_attn_with_kvcache`` as shipped (split + merge, PDL);
- ``split``: the split kernel alone (its partials), the same split count;
- ``merge``: the merge kernel alone, on one set's partials (they sit in L2, as after the split kernel);
- ``dot_floor``: the split kernel's loop without its softmax (S = Q K^T, acc += S V), same grid and tiles;
- ``sum_floor``: the same grid streaming the same K / V tiles into a sum (no tensor cores);
- ``empty``: a one-program kernel that does nothing (the graph's per-launch cost).

Each time is also given as % of 3.02 TB/s on the K/V bytes. The floors bound what the split loop can reach:
if ``sum_floor`` is far from 70%, no softmax or merge change can meet the target at that shape.

    PYTHONPATH=. python benchmarks/decode_floor_probe.py [--json PATH] [--shapes 1x4096 1x32768 8x4096]
"""

import argparse
import json

import torch
import triton
import triton.language as tl

from triforge import bench, launch
from triforge.ops.attention import decode

COPY_TBPS = 3.02


@triton.jit
def _floor_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, S_cache, NUM_SPLITS, stride_kb, stride_ks, stride_kh,
                  HKV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    i_s = tl.program_id(0)
    i_bg = tl.program_id(1)
    i_b = (i_bg // HKV).to(tl.int64)
    i_g = (i_bg % HKV).to(tl.int64)
    o_r = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, HEAD_DIM)
    b_q = tl.load(q_ptr + (i_b * HKV * GROUP + i_g * GROUP + o_r % GROUP)[:, None] * HEAD_DIM + o_d[None, :])
    chunk = tl.cdiv(tl.cdiv(S_cache, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = i_s * chunk
    hi = tl.minimum(lo + chunk, S_cache)
    p_k = kc_ptr + i_b * stride_kb + i_g * stride_kh
    p_v = vc_ptr + i_b * stride_kb + i_g * stride_kh
    o_n = tl.arange(0, BLOCK_N)
    if DOT:
        b_acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    else:
        b_acc = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        o_pos = (start + o_n).to(tl.int64)
        m_n = (start + o_n) < hi
        b_k = tl.load(p_k + o_pos[:, None] * stride_ks + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_v = tl.load(p_v + o_pos[:, None] * stride_ks + o_d[None, :], mask=m_n[:, None], other=0.0)
        if DOT:
            b_s = tl.dot(b_q, tl.trans(b_k))
            b_acc = tl.dot(b_s.to(b_v.dtype), b_v, b_acc)
        else:
            b_acc += b_k.to(tl.float32) + b_v.to(tl.float32)
    tl.store(out_ptr + (i_bg * NUM_SPLITS + i_s) * HEAD_DIM + o_d, tl.sum(b_acc, 0))


@triton.jit
def _empty_kernel(x_ptr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def graph_us(call, sets):
    return bench.graph_us_over(call, sets)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--shapes", nargs="*", default=["1x4096", "1x32768", "8x4096", "1x131072"])
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    scale = 128 ** -0.5
    pdl = launch.pdl_options(True)
    rows = []
    dummy = torch.empty(1, device="cuda")
    empty_us = graph_us(lambda inp: _empty_kernel[(1,)](dummy, **pdl), [None])
    print(f"empty kernel (PDL): {empty_us:.2f} us per launch", flush=True)
    for shape in args.shapes:
        B, S = (int(v) for v in shape.split("x"))
        one = decode._make_inputs({"B": B, "S": S}, torch.bfloat16, "cuda", gen)
        n = bench.rotation_count(bench.set_bytes(one), l2)
        sets = [one] + [decode._make_inputs({"B": B, "S": S}, torch.bfloat16, "cuda", gen) for _ in range(n - 1)]
        H, Hkv, D = 16, 2, 128
        cfg = decode._split_config(D, torch.bfloat16, 16)
        splits = decode.choose_num_splits(B, Hkv, S, 1, cfg["BLOCK_N"], cfg["programs_per_sm"],
                                          cfg["min_blocks_per_split"])
        kv_bytes = 2 * B * S * Hkv * D * 2
        row = {"B": B, "S": S, "sets": n, "splits": splits, "cfg": cfg, "us": {}}

        def op(inp):
            return decode.flash_attn_with_kvcache(inp["q"], inp["k_cache"], inp["v_cache"], inp["cache_seqlens"],
                                                  inp["k"], inp["v"], check_lengths=False)

        def split(inp, ns=splits):
            return decode.flash_decode_split(inp["q"], inp["k_cache"], inp["v_cache"], inp["cache_seqlens"], inp["k"],
                                             inp["v"], True, scale, ns, pdl=True)

        parts = split(sets[0])

        def merge(inp):
            return decode.flash_decode_merge(sets[0]["q"], sets[0]["k_cache"], parts, pdl=True)

        out = torch.empty(B * Hkv * splits * D, device="cuda", dtype=torch.float32)

        def floor(dot, ns=splits, warps=cfg["num_warps"], stages=cfg["num_stages"]):
            def call(inp):
                kc = inp["k_cache"]
                o = out if ns == splits else torch.empty(B * Hkv * ns * D, device="cuda", dtype=torch.float32)
                _floor_kernel[(ns, B * Hkv)](inp["q"], kc, inp["v_cache"], o, S, ns, kc.stride(0), kc.stride(1),
                                             kc.stride(2), HKV=Hkv, GROUP=H // Hkv, HEAD_DIM=D, BLOCK_M=16,
                                             BLOCK_N=cfg["BLOCK_N"], DOT=dot, num_warps=warps, num_stages=stages, **pdl)
            return call

        timed = {"op": op, "split": split, "merge": merge, "dot_floor": floor(True), "sum_floor": floor(False),
                 "dot_floor_2x": floor(True, 2 * splits), "sum_floor_2x": floor(False, 2 * splits),
                 "dot_floor_8w": floor(True, warps=8), "sum_floor_8w": floor(False, warps=8),
                 "dot_floor_4st": floor(True, stages=4)}
        for name, call in timed.items():
            try:
                us = graph_us(call, sets)
                row["us"][name] = us
            except Exception as e:  # out of resources and the like: reported
                row["us"][name] = None
                print(f"  {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        print(f"B={B} S={S} ({kv_bytes / 1e6:.1f} MB, {splits} splits x {B * Hkv}): " + "; ".join(
            f"{k} {v:.2f} us ({kv_bytes / (v * 1e-6) / (COPY_TBPS * 1e12):.0%})" for k, v in row["us"].items() if v),
            flush=True)
        rows.append(row)
        del sets, parts
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "empty_us": empty_us, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
