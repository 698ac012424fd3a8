"""mHC K1 backward's streaming kernel for Hopper, warp-specialized, in Gluon: a probe, not the library's kernel.

Measured slower than the Triton kernel at every configuration (benchmarks/NOTES.md, session 36):
best 84.4-84.8% / 83.9-84.1% of copy against 87.6-88.0% / 87.2-87.7% at C = 2560 / 1024 (mhc_ws_probe.py).

The same work and partition as ``backward.mhc_project_bwd_kernel`` (one wave of P programs, each a
balanced run over (column block, token tile) units in column-block-major order; per program and column
block one dW^T partial, summed in program order by ``mhc_project_bwd_reduce_kernel``), written with
explicit shared memory, mbarriers and warp specialization:

- a loader partition (one warp) keeps STAGES token tiles in flight: x [BLOCK_T, BLOCK_K] and the tile's
  per-token terms (a_hi, a_lo [BLOCK_T, R], coef [BLOCK_T]) arrive by TMA into a ring of shared-memory
  slots, each slot's arrival signalled on its ``ready`` mbarrier;
- the default partition (one warpgroup) takes each slot in turn: dx = a_hi W (wgmma from shared memory,
  W's column block stored there in x's dtype once per block) - coef x (x read from the same slot), and
  dW^T += x^T a_hi + x^T a_lo (wgmma with x's slot as the transposed A operand: x never passes through
  registers for dW), frees the slot (``empty``) and sends dx out by a TMA store from a double buffer.

Triton's own pipeliner (the Triton kernel) issues the next loads only as its loop advances, behind each
iteration's barriers; here the loads run ahead on their own warp, bounded only by the ring.

MATH = 0 is a probe: dx = x and no dW (the access pattern's own ceiling in this structure).
LOAD 1 loads by cp.async on LOADER_WARPS warps instead of TMA; STORE 1 / 2 store dx from registers (as computed /
after a layout change to 16-byte rows) instead of TMA stores. Compiled GPUs only (Gluon has no interpreter).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from triforge import launch
from triforge.ops import mhc as M


@gluon.jit
def _k1_ws_loader(x_desc, ah_desc, al_desc, c_desc, xs, ahs, als, cs, ready, empty, u_start, u_end, n_t,
                  BLOCK_T: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, TILE_BYTES: gl.constexpr):
    for u in range(u_start, u_end):
        i = (u - u_start).to(gl.int32)
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # slot s freed by the consumer (first pass: free)
        kb = (u // n_t).to(gl.int32)
        row = (u - kb * n_t).to(gl.int32) * BLOCK_T
        bar = ready.index(s)
        mbarrier.expect(bar, TILE_BYTES)
        tma.async_copy_global_to_shared(x_desc, [row, kb * BLOCK_K], bar, xs.index(s))
        tma.async_copy_global_to_shared(ah_desc, [row, 0], bar, ahs.index(s))
        tma.async_copy_global_to_shared(al_desc, [row, 0], bar, als.index(s))
        tma.async_copy_global_to_shared(c_desc, [row], bar, cs.index(s))


@gluon.jit
def _k1_ws_loader_ptr(x_ptr, ah_ptr, al_ptr, c_ptr, xs, ahs, als, cs, ready, empty, u_start, u_end, n_t, T, K,
                      R: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                      NW: gl.constexpr):
    """The loader by cp.async (per-thread 16-byte copies, no TMA): each thread arrives on the slot's ``ready``
    barrier (count 32 NW) when its own copies have landed."""
    x_l: gl.constexpr = gl.BlockedLayout([1, 8], [256 // BLOCK_K, BLOCK_K // 8], [NW, 1], [1, 0])
    a_l: gl.constexpr = gl.BlockedLayout([1, 8], [256 // R, R // 8], [NW, 1], [1, 0])
    c_l: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    o_tx = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, x_l))
    o_kx = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_l))
    o_ta = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, a_l))
    o_ra = gl.arange(0, R, layout=gl.SliceLayout(0, a_l))
    o_tc = gl.arange(0, BLOCK_T, layout=c_l)
    for u in range(u_start, u_end):
        i = (u - u_start).to(gl.int32)
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        kb = (u // n_t).to(gl.int32)
        row = (u - kb * n_t).to(gl.int32) * BLOCK_T
        t = row + o_tx
        k = kb * BLOCK_K + o_kx
        async_copy.async_copy_global_to_shared(xs.index(s), x_ptr + t.to(gl.int64)[:, None] * K + k[None, :],
                                               mask=(t < T)[:, None] & (k < K)[None, :])
        ta = row + o_ta
        o_a = ta.to(gl.int64)[:, None] * R + o_ra[None, :]
        m_a = (ta < T)[:, None]
        async_copy.async_copy_global_to_shared(ahs.index(s), ah_ptr + o_a, mask=m_a)
        async_copy.async_copy_global_to_shared(als.index(s), al_ptr + o_a, mask=m_a)
        tc = row + o_tc
        async_copy.async_copy_global_to_shared(cs.index(s), c_ptr + tc, mask=tc < T)
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)


@gluon.jit
def _k1_ws_compute(dx_desc, dx_ptr, w_ptr, dw_part_ptr, xs, ahs, als, cs, ws, dxs, ready, empty, u_start, u_end, n_t,
                   T, K, p, J, kb_first, R: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_K: gl.constexpr,
                   STAGES: gl.constexpr, MATH: gl.constexpr, STORE: gl.constexpr, DX_BUFS: gl.constexpr,
                   num_warps: gl.constexpr):
    # dx tile [BLOCK_T, BLOCK_K] and dW^T tile [BLOCK_K, R] as wgmma accumulators of one warpgroup
    dx_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, BLOCK_K, 16])
    dw_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, R, 16])
    w_l: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])
    o_r = gl.arange(0, R, layout=gl.SliceLayout(1, w_l))
    o_kw = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, w_l))
    o_kd = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, dw_l))
    o_rd = gl.arange(0, R, layout=gl.SliceLayout(0, dw_l))
    acc_dw = gl.zeros([BLOCK_K, R], gl.float32, dw_l)
    for u in range(u_start, u_end):
        i = (u - u_start).to(gl.int32)
        s = i % STAGES
        kb = (u // n_t).to(gl.int32)
        i_t = (u - kb * n_t).to(gl.int32)
        first = (u == u_start) | (i_t == 0)  # a column block starts: its W block into shared memory
        if MATH:
            if first:  # every wgmma before was waited for: ws is free
                o_k = kb * BLOCK_K + o_kw
                b_w = gl.load(w_ptr + o_r[:, None] * K + o_k[None, :], mask=(o_k < K)[None, :], other=0.0)
                ws.store(b_w.to(ws.dtype))
                fence_async_shared()
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        x_s = xs.index(s)
        if MATH:
            tok = warpgroup_mma(ahs.index(s), ws, gl.zeros([BLOCK_T, BLOCK_K], gl.float32, dx_l), use_acc=False,
                                is_async=True)
            acc_dw = warpgroup_mma(x_s.permute((1, 0)), ahs.index(s), acc_dw, use_acc=(first == 0), is_async=True)
            acc_dw = warpgroup_mma(x_s.permute((1, 0)), als.index(s), acc_dw, is_async=True)
            b_x = x_s.load(dx_l).to(gl.float32)
            b_c = cs.index(s).load(gl.SliceLayout(1, dx_l))
            b_dx, acc_dw = warpgroup_mma_wait(num_outstanding=0, deps=(tok, acc_dw))
            b_dx = b_dx - b_c[:, None] * b_x
        else:
            b_dx = x_s.load(dx_l).to(gl.float32)
        fence_async_shared()  # this slot's reads (generic and wgmma) ordered before the loader's next TMA into it
        mbarrier.arrive(empty.index(s))
        if STORE == 0:  # by TMA from a ring of DX_BUFS buffers in shared memory
            d = i % DX_BUFS
            tma.store_wait(DX_BUFS - 1)  # the store that used buffer d DX_BUFS tiles ago has read it
            dxs.index(d).store(b_dx.to(dxs.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(dx_desc, [i_t * BLOCK_T, kb * BLOCK_K], dxs.index(d))
        elif STORE == 1:  # from registers, in the accumulator's layout (4-byte pieces: uncoalesced)
            o_t = i_t * BLOCK_T + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, dx_l))
            o_k = kb * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, dx_l))
            gl.store(dx_ptr + o_t.to(gl.int64)[:, None] * K + o_k[None, :], b_dx.to(dx_ptr.dtype.element_ty),
                     mask=(o_t < T)[:, None] & (o_k < K)[None, :])
        else:  # from registers after a layout change to 16-byte rows (through shared memory)
            st_l: gl.constexpr = gl.BlockedLayout([1, 8], [256 // BLOCK_K, BLOCK_K // 8], [num_warps, 1], [1, 0])
            b_o = gl.convert_layout(b_dx.to(dx_ptr.dtype.element_ty), st_l)
            o_t = i_t * BLOCK_T + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, st_l))
            o_k = kb * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, st_l))
            gl.store(dx_ptr + o_t.to(gl.int64)[:, None] * K + o_k[None, :], b_o,
                     mask=(o_t < T)[:, None] & (o_k < K)[None, :])
        if MATH:
            if (u == u_end - 1) | (i_t == n_t - 1):  # the column block ends in this run: its dW^T partial out
                o_dw = ((p * J + (kb - kb_first)) * R + o_rd[None, :]) * BLOCK_K + o_kd[:, None]
                gl.store(dw_part_ptr + o_dw, acc_dw)
    if STORE == 0:
        tma.store_wait(0)


@gluon.jit
def mhc_project_bwd_ws_kernel(
    x_desc,  # [T, K] 16-bit, block [BLOCK_T, BLOCK_K]
    ah_desc,  # [T, R] a_hi in x's dtype, block [BLOCK_T, R]
    al_desc,  # [T, R] a_lo in x's dtype
    c_desc,  # [T] fp32 coef, block [BLOCK_T]
    dx_desc,  # [T, K] x's dtype, block [BLOCK_T, BLOCK_K]
    x_ptr,  # the same tensors as pointers (LOAD 1: cp.async; STORE 1: stores from registers)
    ah_ptr,
    al_ptr,
    c_ptr,
    dx_ptr,
    w_ptr,  # [R, K] fp32 W
    dw_part_ptr,  # [P, J, R, BLOCK_K] fp32, as the Triton kernel's
    T,
    K,
    n_t,
    U,
    P,
    J,
    R: gl.constexpr,
    BLOCK_T: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    W_LAYOUT: gl.constexpr,  # NVMMASharedLayout of W's [R, BLOCK_K] block in x's dtype
    MATH: gl.constexpr,
    LOAD: gl.constexpr,  # 0: TMA on one loader warp; 1: cp.async on LOADER_WARPS warps
    STORE: gl.constexpr,  # 0: dx by TMA store; 1: stored from registers as computed; 2: after a layout change
    DX_BUFS: gl.constexpr,  # STORE 0: dx buffers in shared memory (stores in flight)
    LOADER_WARPS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    p = gl.program_id(0).to(gl.int64)
    u_start = p * U // P
    u_end = (p + 1) * U // P
    kb_first = u_start // n_t
    xs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_T, BLOCK_K], x_desc.layout)
    ahs = gl.allocate_shared_memory(ah_desc.dtype, [STAGES, BLOCK_T, R], ah_desc.layout)
    als = gl.allocate_shared_memory(al_desc.dtype, [STAGES, BLOCK_T, R], al_desc.layout)
    cs = gl.allocate_shared_memory(c_desc.dtype, [STAGES, BLOCK_T], c_desc.layout)
    ws = gl.allocate_shared_memory(x_desc.dtype, [R, BLOCK_K], W_LAYOUT)
    dxs = gl.allocate_shared_memory(dx_desc.dtype, [DX_BUFS, BLOCK_T, BLOCK_K], dx_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1 if LOAD == 0 else 32 * LOADER_WARPS)
        mbarrier.init(empty.index(s), count=1)
    TILE_BYTES: gl.constexpr = (x_desc.block_type.nbytes + ah_desc.block_type.nbytes + al_desc.block_type.nbytes
                                + c_desc.block_type.nbytes)
    if LOAD == 0:
        gl.warp_specialize([
            (_k1_ws_compute, (dx_desc, dx_ptr, w_ptr, dw_part_ptr, xs, ahs, als, cs, ws, dxs, ready, empty, u_start, u_end,
                            n_t, T, K, p, J, kb_first, R, BLOCK_T, BLOCK_K, STAGES, MATH, STORE, DX_BUFS,
                            num_warps)),
            (_k1_ws_loader, (x_desc, ah_desc, al_desc, c_desc, xs, ahs, als, cs, ready, empty, u_start, u_end, n_t,
                             BLOCK_T, BLOCK_K, STAGES, TILE_BYTES)),
        ], [1], [LOADER_REGS])
    else:
        gl.warp_specialize([
            (_k1_ws_compute, (dx_desc, dx_ptr, w_ptr, dw_part_ptr, xs, ahs, als, cs, ws, dxs, ready, empty, u_start, u_end,
                            n_t, T, K, p, J, kb_first, R, BLOCK_T, BLOCK_K, STAGES, MATH, STORE, DX_BUFS,
                            num_warps)),
            (_k1_ws_loader_ptr, (x_ptr, ah_ptr, al_ptr, c_ptr, xs, ahs, als, cs, ready, empty, u_start, u_end, n_t, T,
                                 K, R, BLOCK_T, BLOCK_K, STAGES, LOADER_WARPS)),
        ], [LOADER_WARPS], [LOADER_REGS])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


def ws_main(x_flat, a_hi, a_lo, coef, w, cfg):
    """M.project_bwd_main's warp-specialized form (same outputs, same partition; compiled sm90, 16-bit x, K % 8 == 0)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    T, K = x_flat.shape
    R = w.shape[0]
    bt, bk = cfg["BLOCK_T"], cfg["BLOCK_K"]
    n_t, U, P, J = M.project_bwd_grid(T, K, cfg)
    dx = launch.new_output((T, K), x_flat.dtype, x_flat.device)
    dw_part = launch.new_output((P, J, R, bk), torch.float32, x_flat.device)
    g16 = gl.bfloat16 if x_flat.dtype == torch.bfloat16 else gl.float16
    x_l = gl.NVMMASharedLayout.get_default_for([bt, bk], g16)
    a_l = gl.NVMMASharedLayout.get_default_for([bt, R], g16)
    desc = TensorDescriptor.from_tensor
    launch.launch(
        "mhc_project_bwd", mhc_project_bwd_ws_kernel, (P,),
        desc(x_flat, [bt, bk], x_l), desc(a_hi, [bt, R], a_l), desc(a_lo, [bt, R], a_l),
        desc(coef, [bt], gl.NVMMASharedLayout.get_default_for([bt], gl.float32)), desc(dx, [bt, bk], x_l),
        x_flat, a_hi, a_lo, coef, dx, w, dw_part, T, K, n_t, U, P, J,
        R=R, BLOCK_T=bt, BLOCK_K=bk, STAGES=cfg.get("num_stages", 4),
        W_LAYOUT=gl.NVMMASharedLayout.get_default_for([R, bk], g16), MATH=int(cfg.get("MATH", 1)),
        LOAD=int(cfg.get("LOAD", 0)), STORE=int(cfg.get("STORE", 0)), DX_BUFS=int(cfg.get("DX_BUFS", 2)), LOADER_WARPS=int(cfg.get("LOADER_WARPS", 4)),
        LOADER_REGS=int(cfg.get("LOADER_REGS", 40 if not cfg.get("LOAD") else 96)), num_warps=cfg.get("num_warps", 4),
        **launch.maxnreg_option(cfg),
    )
    return dx, dw_part
