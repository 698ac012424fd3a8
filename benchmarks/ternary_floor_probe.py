"""How fast can anything read the M = 1 ternary product's code bytes (issue 6)?

The M = 1 tensor-core product takes 10.3 us at 8192^2 on the H200 (16.8 MB of codes: 38% of the copy rate) and its
5x target against cuBLAS fp16 asks for 8.3 us. Configs with 2-4x the bytes in flight did not help (session 50). This
probe measures, per (N, K), as CUDA-graph replay over code copies that exceed the L2 four times (``bench.graph_time_ms``):

- ``op``: ``ternary.matmul`` as shipped (main kernel + the split-K reduce launch under capture);
- ``op_fixup``: the same config with the split-K sum done by each tile's last split (one launch);
- ``op[p=P]`` / ``op[pps=S]``: the entry with PREFETCH P / S programs per SM;
- ``reduce``: the reduce launch alone on one set's partials;
- ``empty``: a one-program kernel (a graph node's cost), ``empty2``: two of them, PDL-chained;
- ``pattern[p=P]``: the main kernel's grid and loads (same 7-d word pattern, same split) with no decode or MMA: the
  words xor-ed into a register, P steps in flight;
- ``flat[pps=S,blk=B,p=P]``: a plain stream of the same bytes, S programs per SM, B words per step per program,
  P steps in flight (16-byte vector loads);
- ``tma[pps=S,rows=R,st=T]``: the same bytes through tensor-descriptor loads of [R, 256] words, pipelined by Triton
  over T stages;
- ``ws[st=T,pps=S,x=X]``: a Gluon kernel on the library kernel's row tiles (128 rows) and a split to S programs per SM:
  a TMA loader warp filling a T-slot ring with each step's [8 row tiles, 128 words] box (and x's [16, 128] tile where
  X), a consumer warpgroup that only waits, reads the words from shared memory and releases the slot: the floor of a
  warp-specialized M = 1 kernel;
- ``wsk[st=T,...]``: benchmarks/ternary_ws_kernel.py, that kernel with the decode and the tensor-core products in two
  consumer warpgroups (128 rows per program, a T-slot ring), one program per SM at 168 registers or two at 80 (the
  consumers raised to 104), plus the library's reduce launch; checked against the float64 product before it is
  timed.

Each time is also given as % of the copy rate on the code bytes. The floors bound what any M = 1 kernel reading
these bytes can reach: if the best stream is far above 8.3 us, 5x needs fewer bytes, not a better kernel.

    PYTHONPATH=. python benchmarks/ternary_floor_probe.py [--json PATH] [--shapes 8192x8192 28672x8192 8192x28672]
"""

import argparse
import json

import triforge  # noqa: F401,I001  (first: sets the interpreter up before triton is imported)
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from triforge import _runtime, bench, launch
from triforge.ops import ternary as T
from triforge.ops.ternary import tc
from triforge.ops.ternary.kernels import reduce_splits
from triforge.ops.ternary.reference import matmul_dense_ref
from triforge.ops.ternary.tensor import TernaryTensor
from triforge.testing import compare

import ternary_ws_kernel as wsk  # noqa: E402,I001  (benchmarks/, this script's folder, is on the path)
from decode_floor_probe import _empty_kernel  # noqa: E402,I001


@triton.jit
def _pattern_kernel(codes_ptr, out_ptr, N, KC, steps_per_split, ROW_REPS: tl.constexpr, BLOCKS_K: tl.constexpr,
                    WARPS: tl.constexpr, PREFETCH: tl.constexpr, TR: tl.constexpr):
    """ternary_tc_kernel's word loads (grid, 7-d pattern, split) with the decode and MMA replaced by an xor."""
    i_n, i_s = tl.program_id(0), tl.program_id(2)
    p_c, o_c, m_r = tc._word_pointers(codes_ptr, i_n, N, KC, WARPS, ROW_REPS, BLOCKS_K, TR)
    n_steps = tl.cdiv(KC, 8 * BLOCKS_K)
    s_start = i_s * steps_per_split
    s_end = tl.minimum(s_start + steps_per_split, n_steps)
    acc = tl.zeros([4, 8, WARPS, 2, ROW_REPS, BLOCKS_K, 2], dtype=tl.int32)
    words = tc._load_step(p_c, o_c, m_r, s_start, s_end, KC, BLOCKS_K, TR)
    if PREFETCH >= 2:
        words2 = tc._load_step(p_c, o_c, m_r, s_start + 1, s_end, KC, BLOCKS_K, TR)
    if PREFETCH >= 3:
        words3 = tc._load_step(p_c, o_c, m_r, s_start + 2, s_end, KC, BLOCKS_K, TR)
    for s in range(s_start, s_end):
        words_next = tc._load_step(p_c, o_c, m_r, s + PREFETCH, s_end, KC, BLOCKS_K, TR)
        acc ^= words
        if PREFETCH == 1:
            words = words_next
        elif PREFETCH == 2:
            words = words2
            words2 = words_next
        else:
            words = words2
            words2 = words3
            words3 = words_next
    tot = tl.reshape(acc, [4 * 8 * WARPS * 2 * ROW_REPS * BLOCKS_K * 2])
    tl.store(out_ptr + (i_s * tl.num_programs(0) + i_n), tl.reduce(tot, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _flat_kernel(src_ptr, out_ptr, n_words, per_prog, BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """A plain stream: program i xors words [i per_prog, (i + 1) per_prog), BLOCK per step, PREFETCH steps ahead."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * per_prog
    end = tl.minimum(start + per_prog, n_words)
    o = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    w = tl.load(src_ptr + start + o, mask=start + o < end, other=0)
    if PREFETCH >= 2:
        w2 = tl.load(src_ptr + start + BLOCK + o, mask=start + BLOCK + o < end, other=0)
    if PREFETCH >= 3:
        w3 = tl.load(src_ptr + start + 2 * BLOCK + o, mask=start + 2 * BLOCK + o < end, other=0)
    for off in range(start, end, BLOCK):
        nxt = off + PREFETCH * BLOCK + o
        wn = tl.load(src_ptr + nxt, mask=nxt < end, other=0)
        acc ^= w
        if PREFETCH == 1:
            w = wn
        elif PREFETCH == 2:
            w = w2
            w2 = wn
        else:
            w = w2
            w2 = w3
            w3 = wn
    tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _tma_kernel(src_ptr, out_ptr, n_rows, rows_per_prog, ROWS: tl.constexpr, STAGES: tl.constexpr):
    """The stream through tensor descriptors: [ROWS, 256]-word boxes of the codes seen as [n_rows, 256]."""
    pid = tl.program_id(0)
    desc = tl.make_tensor_descriptor(src_ptr, [n_rows, 256], [256, 1], [ROWS, 256])
    r0 = pid * rows_per_prog
    r1 = tl.minimum(r0 + rows_per_prog, n_rows)
    acc = tl.zeros([ROWS, 256], dtype=tl.int32)
    for r in tl.range(r0, r1, ROWS, num_stages=STAGES):
        acc ^= desc.load([r, 0])
    tl.store(out_ptr + pid, tl.reduce(tl.reshape(acc, [ROWS * 256]), 0, _xor))


@gluon.jit
def _gxor(a, b):
    return a ^ b


@gluon.jit
def _ws_loader(w_desc, x_desc, w_s, x_s, ready, empty, row0, s0, s1, STAGES: gl.constexpr, X: gl.constexpr):
    """One warp: each K step's [8 row tiles, 128 words] box of codes (and x's [16, 128] tile) into the ring."""
    if X:
        nbytes: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes
    else:
        nbytes: gl.constexpr = w_desc.block_type.nbytes
    for i in range(s1 - s0):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), nbytes)
        tma.async_copy_global_to_shared(w_desc, [row0, (s0 + i) * 128], ready.index(slot), w_s.index(slot))
        if X:
            tma.async_copy_global_to_shared(x_desc, [0, (s0 + i) * 128], ready.index(slot), x_s.index(slot))


@gluon.jit
def _ws_consumer(w_s, ready, empty, out_ptr, pid, s0, s1, STAGES: gl.constexpr):
    """One warpgroup: waits for each step's words, xors them into registers (LDS), releases the slot."""
    lay: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    acc = gl.zeros([8, 128], gl.int32, lay)
    for i in range(s1 - s0):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        acc ^= w_s.index(slot).load(lay)
        mbarrier.arrive(empty.index(slot), count=1)
    tot = gl.reduce(gl.reduce(acc, 1, _gxor), 0, _gxor)
    gl.store(out_ptr + pid, tot)


@gluon.jit
def _ws_floor_kernel(w_desc, x_desc, out_ptr, n_steps, per_split, STAGES: gl.constexpr, X: gl.constexpr):
    """The stream a warp-specialized M = 1 kernel would feed on: a TMA loader warp and a consumer warpgroup that only
    waits for each step's words and releases them (no decode, no MMA), on the library kernel's grid."""
    i_n = gl.program_id(0)
    i_s = gl.program_id(1)
    s0 = i_s * per_split
    s1 = gl.minimum(s0 + per_split, n_steps)
    w_s = gl.allocate_shared_memory(gl.int32, [STAGES, 8, 128], w_desc.layout)
    x_s = gl.allocate_shared_memory(x_desc.dtype, [STAGES, 16, 128], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_ws_consumer, (w_s, ready, empty, out_ptr, i_s * gl.num_programs(0) + i_n, s0, s1, STAGES)),
        (_ws_loader, (w_desc, x_desc, w_s, x_s, ready, empty, i_n * 8, s0, s1, STAGES, X)),
    ], [1], [24])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


def m1_sets(N: int, K: int, gen: torch.Generator):
    """(absmean weights [N, K] as a TernaryTensor, their code bytes, input sets): (x [1, K] bf16, a copy of the tc
    codes) per set, fresh x each, as many sets as exceed the L2 four times."""
    tt = TernaryTensor.from_float(torch.randn(N, K, generator=gen, device="cuda"), method="absmean")
    codes0 = tt.tc_codes()
    n_sets = bench.rotation_count(codes0.numel() * 4, bench.l2_bytes())
    sets = [(torch.randn(1, K, generator=gen, device="cuda").to(torch.bfloat16), codes0.clone()) for _ in range(n_sets)]
    return tt, codes0.numel() * 4, sets


def report(title: str, us_by_key: dict, nbytes: int, copy_tbps: float) -> None:
    """One shape's timed variants, fastest first, with the share of the copy rate on ``nbytes``."""
    print(title, flush=True)
    for key, us in sorted(us_by_key.items(), key=lambda kv: kv[1] or 1e9):
        if us:
            print(f"  {us:7.2f} us  {nbytes / (us * 1e-6) / (copy_tbps * 1e12):6.1%}  {key}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--shapes", nargs="*", default=["8192x8192", "28672x8192", "8192x28672"])
    ap.add_argument("--only", nargs="*", help="time only these row families (the key before its '[': e.g. ws wsk op "
                    "op_fixup reduce flat pattern tma)")
    args = ap.parse_args()
    _runtime.require_gpu("ternary_floor_probe")

    def wanted(key):
        return not args.only or key.split("[")[0] in args.only
    name = torch.cuda.get_device_name()
    copy = bench.peaks()["copy_tbps"]  # bytes read + written per second of a large copy (the bench's % of copy)
    launch.use_tensor_descriptors()
    n_sm = _runtime.num_sms()
    pdl = launch.pdl_options(True)
    dummy = torch.empty(1, device="cuda")
    empty_us = bench.graph_us_over(lambda _: _empty_kernel[(1,)](dummy, PDL=False), [None])
    empty2_us = bench.graph_us_over(lambda _: (_empty_kernel[(1,)](dummy, **pdl), _empty_kernel[(1,)](dummy, **pdl)), [None])
    print(f"{name}: empty kernel {empty_us:.2f} us, two PDL-chained {empty2_us:.2f} us per call", flush=True)
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        N, K = (int(v) for v in shape.split("x"))
        tt, nbytes, sets = m1_sets(N, K, g)
        codes0 = sets[0][1]
        n_sets = len(sets)
        cfg0 = tc.tc_config(1, N, K)
        plan = tc._tc_plan(1, N, K, codes0.shape[1], None)
        grid, per_split = plan[12], plan[13]
        reps, nbk, warps = cfg0["ROW_REPS"], cfg0["BLOCKS_K"], cfg0["num_warps"]
        row = {"N": N, "K": K, "bytes": nbytes, "sets": n_sets, "cfg": cfg0, "grid": list(grid), "us": {}}
        ref = T.matmul(sets[0][0], tt)

        def op(s, cfg=None):
            return tc.ternary_matmul_tc(s[0], tt, codes=s[1], cfg=cfg)

        timed = {"op": op, "op_fixup": lambda s: op(s, {"FIXUP": 1})}
        for p in (1, 2, 3):
            timed[f"op[p={p}]"] = (lambda s, p=p: op(s, {"PREFETCH": p}))
        for pps in (2, 8):
            timed[f"op[pps={pps}]"] = (lambda s, pps=pps: op(s, {"programs_per_sm": pps}))
        part = torch.randn(grid[2], 1, N, device="cuda")
        y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
        scales = tt.kernel_operands()[0]
        timed["reduce"] = lambda s: reduce_splits(part, scales, None, y, False, 256, True, True)
        out = torch.empty(grid[0] * grid[2] * 8, device="cuda", dtype=torch.int32)
        kc = codes0.shape[1]
        for p in (1, 2, 3):
            timed[f"pattern[p={p}]"] = (lambda s, p=p: _pattern_kernel[grid](
                s[1], out, N, kc, per_split, ROW_REPS=reps, BLOCKS_K=nbk, WARPS=warps, PREFETCH=p, TR=tc.TILE_ROWS,
                num_warps=warps, num_stages=1))
        n_words = codes0.numel()
        for pps in (1, 2, 4, 8):
            for blk in (1024, 4096):
                for p in (1, 2, 3):
                    progs = pps * n_sm
                    per = triton.cdiv(triton.cdiv(n_words, progs), blk) * blk
                    g_flat = (triton.cdiv(n_words, per),)
                    timed[f"flat[pps={pps},blk={blk},p={p}]"] = (lambda s, g_flat=g_flat, per=per, blk=blk, p=p:
                                                               _flat_kernel[g_flat](s[1], out, n_words, per, BLOCK=blk,
                                                                                    PREFETCH=p, num_warps=4))
        n_rows = n_words // 256
        for pps in (1, 2, 4):
            for rws, st in ((8, 4), (16, 4), (16, 6), (32, 3)):
                progs = pps * n_sm
                per = triton.cdiv(triton.cdiv(n_rows, progs), rws) * rws
                g_tma = (triton.cdiv(n_rows, per),)
                timed[f"tma[pps={pps},rows={rws},st={st}]"] = (lambda s, g_tma=g_tma, per=per, rws=rws, st=st:
                                                            _tma_kernel[g_tma](s[1], out, n_rows, per, ROWS=rws,
                                                                               STAGES=st, num_warps=4))
        w_lay = gl.NVMMASharedLayout.get_default_for([8, 128], gl.int32)
        x_lay = gl.NVMMASharedLayout.get_default_for([16, 128], gl.bfloat16)
        x_desc = TensorDescriptor.from_tensor(sets[0][0], [16, 128], x_lay)  # x [1, K]: rows past 1 zero-filled
        n_steps = kc // 8
        w_descs = {}
        for st in (2, 4, 6):
            for pps in (2, 4, 8):
                for xx in (False, True):
                    sp = max(1, min(n_steps, pps * n_sm // triton.cdiv(N, 128)))
                    per = triton.cdiv(n_steps, sp)
                    g_ws = (triton.cdiv(N, 128), triton.cdiv(n_steps, per))

                    def ws(s, st=st, per=per, g_ws=g_ws, xx=xx):
                        key = s[1].data_ptr()
                        if key not in w_descs:
                            w_descs[key] = TensorDescriptor.from_tensor(s[1].view(-1, kc * tc.TILE_ROWS), [8, 128],
                                                                        w_lay)
                        _ws_floor_kernel[g_ws](w_descs[key], x_desc, out, n_steps, per, STAGES=st, X=xx, num_warps=4)
                    timed[f"ws[st={st},pps={pps},x={int(xx)}]"] = ws
        ref64 = matmul_dense_ref(sets[0][0], tt)
        ws_descs = {}
        for st in (4, 8, 12) if wanted("wsk") else ():
            for two in (False, True):
                cfg_ws = dict(wsk.TWO_PER_SM, STAGES=st) if two else {"STAGES": st, "programs_per_sm": 1}
                key = f"wsk[st={st},{'2 per SM, maxnreg 80' if two else '1 per SM'}]"
                try:
                    ok = compare(key, ref64, wsk.ternary_ws_matmul(sets[0][0], tt, sets[0][1], cfg_ws, ws_descs),
                                 dtype=torch.bfloat16).ok
                    print(f"  {key}: {'matches' if ok else 'DIFFERS FROM'} the float64 product", flush=True)
                    row.setdefault("wsk_ok", {})[key] = bool(ok)
                except Exception as e:  # a compile or launch failure: reported, not timed
                    print(f"  {key}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                timed[key] = (lambda s, cfg_ws=cfg_ws: wsk.ternary_ws_matmul(s[0], tt, s[1], cfg_ws, ws_descs))
        for key, call in timed.items():
            if not wanted(key):
                continue
            try:
                if key.startswith("op"):
                    got = call(sets[0])
                    torch.cuda.synchronize()
                    if not torch.equal(got, ref):  # the configs sum the same partials in the same order
                        print(f"  {key}: output differs from ternary.matmul's", flush=True)
                row["us"][key] = bench.graph_us_over(call, sets)
            except Exception as e:  # out of resources and the like: reported
                row["us"][key] = None
                print(f"  {key}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        report(f"N={N} K={K}: {nbytes / 1e6:.1f} MB of codes, {n_sets} sets, grid {grid}, entry {cfg0}", row["us"],
               nbytes, copy)
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "copy_tbps": copy, "empty_us": empty_us, "empty2_us": empty2_us, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
