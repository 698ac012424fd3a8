"""A probe (session 52): triforge/ops/attention/forward_ws.py restructured so that every partition walks work items
(query tiles x batch-heads), one per program or, with PERSIST, a grid of one program per SM taking items in turn with
two Q buffers (the loader fetches the next item's Q and K/V while the consumers finish the current one).
benchmarks/attn_ws_probe.py times it beside the library kernel in one process (``walk ... pe0 / pe1`` rows).

Measured on the H200 (session 52, calls 6-9; logs in benchmarks/results/logs-2026-11-29-session52/):
- D = 64, three warpgroups + SCHED, non-causal: persistent 0.634 ms at (16, 16, 2048) = 1.003x cuDNN against the
  library's 0.660 (0.963x); at (8, 16, 4096) 1.186 against 1.182 (equal). Causal: still under the Triton kernel
  (two warpgroups persistent 0.936-0.988x of it).
- The one-item path (pe0) is slower than the library kernel: 1.3% at D = 64 (after unsigned ring counters and RECOMP
  took the hot loop back to the library's 450 instructions), 5.5% / 2.3% at D = 128 non-causal / causal with the
  same hot loop (457 instructions) as the library: the difference is outside the key loop and not found.
- D = 128 persistent (2 stages to fit two Q buffers): 0.67-0.70x cuDNN.
Not in the library: at D = 128 it would cost the margin the entry has over cuDNN; a D = 64 non-causal entry would
need this form beside the library's (a second kernel) and its GPU tests. The key loop (_pipeline) and the tile
bounds are the library's.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from triforge import _runtime, launch
from triforge.ops.attention.forward import LN2, LOG2E
from triforge.ops.attention.forward_ws import _pipeline, _tile_bounds  # the library's


@gluon.jit
def _tile(t, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr,
          VARLEN: gl.constexpr, PERSIST: gl.constexpr):
    """Work item t of the n_m x n_bh query tiles: (m0, h, q_tok0, k_tok0, len_q, len_k, lse_base, n_kv, n_full).
    t = pid_m + n_m bh (the grid's own order; causal: each head's longest rows first); persistent and causal, every
    head's longest rows before any shorter ones (t = bh + n_bh (n_m - 1 - pid_m))."""
    if PERSIST and CAUSAL:
        pid_m = n_m - 1 - t // n_bh
        bh = t % n_bh
    else:
        pid_m = t % n_m
        bh = t // n_m
        if CAUSAL:
            pid_m = n_m - 1 - pid_m
    return _tile_bounds(pid_m, bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, BM, BN, CAUSAL, VARLEN)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, t0, t_step, n_m, n_bh,
            H, GROUP, S_q, S_k, cu_q_ptr, cu_k_ptr, D: gl.constexpr, BM: gl.constexpr, BMW: gl.constexpr,
            BN: gl.constexpr, STAGES: gl.constexpr, NUM_WG: gl.constexpr, QBUF: gl.constexpr, CAUSAL: gl.constexpr,
            VARLEN: gl.constexpr, PERSIST: gl.constexpr):
    it = 0  # K/V tiles loaded so far (the ring's position)
    i = 0  # work items so far (Q's buffer and phase)
    for t in range(t0, n_m * n_bh, t_step):
        m0, h, q_tok0, k_tok0, len_q, len_k, lse_base, n_kv, n_full = _tile(t, n_m, n_bh, H, S_q, S_k, cu_q_ptr,
                                                                            cu_k_ptr, BM, BN, CAUSAL, VARLEN, PERSIST)
        qb = i % QBUF
        mbarrier.wait(q_empty.index(qb), ((i // QBUF) & 1) ^ 1)  # every consumer done with this buffer's last Q
        mbarrier.expect(q_bar.index(qb), NUM_WG * q_desc.block_type.nbytes)
        for w in gl.static_range(NUM_WG):
            tma.async_copy_global_to_shared(q_desc, [q_tok0 + m0 + w * BMW, h * D], q_bar.index(qb),
                                            q_s.index(qb * NUM_WG + w))
        kv_col = (h // GROUP) * D
        for j in range(n_kv):
            s = it % STAGES
            mbarrier.wait(kv_empty.index(s), ((it // STAGES) & 1) ^ 1)  # every consumer freed slot s (first pass: free)
            row = k_tok0 + j * BN
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(s), k_s.index(s))
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_ready.index(s), v_s.index(s))
            it += 1
        i += 1


@gluon.jit
def _consumer(q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr,
              WG: gl.constexpr, t0, t_step, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, qk_scale, BM: gl.constexpr,
              BMW: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, QBUF: gl.constexpr,
              GUARD: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr, PERSIST: gl.constexpr,
              STORE_RES: gl.constexpr, EMU: gl.constexpr, P16: gl.constexpr, NUM_WG: gl.constexpr,
              SCHED: gl.constexpr, RECOMP: gl.constexpr):
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    stride_o = H * D
    # the ring position of this work item's first key tile, and the scheduler turns taken (SCHED): unsigned, so that
    # the ring's slot and phase are a mask and a shift (int32: signed-division fix-ups in the key loop)
    it0 = gl.to_tensor(0).to(gl.uint32)
    sc0 = gl.to_tensor(0).to(gl.uint32)
    i = 0
    for t in range(t0, n_m * n_bh, t_step):
        m0, h, q_tok0, k_tok0, len_q, len_k, lse_base, n_kv, n_full = _tile(t, n_m, n_bh, H, S_q, S_k, cu_q_ptr,
                                                                            cu_k_ptr, BM, BN, CAUSAL, VARLEN, PERSIST)
        qb = i % QBUF
        q = q_s.index(qb * NUM_WG + WG)
        rows = m0 + WG * BMW + gl.arange(0, BMW, layout=gl.SliceLayout(1, s_l))  # query positions in the sequence
        diag = len_k - len_q
        m_i = gl.full([BMW], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
        l_i = gl.zeros([BMW], gl.float32, gl.SliceLayout(1, s_l))
        acc = gl.zeros([BMW, D], gl.float32, o_l)
        mbarrier.wait(q_bar.index(qb), (i // QBUF) & 1)
        if GUARD:  # causal or packed: a tile may see no key at all
            if n_kv > 0:
                acc, m_i, l_i = _pipeline(q, k_s, v_s, k_ready, v_ready, kv_empty, sched, acc, m_i, l_i, n_kv, n_full,
                                          it0, sc0, rows, len_k, diag, qk_scale, BMW, BN, STAGES, CAUSAL, s_l, o_l,
                                          p_l, EMU, P16, WG, NUM_WG, SCHED)
        else:  # dense, S_k >= 1: every tile has keys
            acc, m_i, l_i = _pipeline(q, k_s, v_s, k_ready, v_ready, kv_empty, sched, acc, m_i, l_i, n_kv, n_full,
                                      it0, sc0, rows, len_k, diag, qk_scale, BMW, BN, STAGES, CAUSAL, s_l, o_l, p_l,
                                      EMU, P16, WG, NUM_WG, SCHED)
        mbarrier.arrive(q_empty.index(qb))  # this Q read: the loader may refill its buffer
        if RECOMP:  # the epilogue's values recomputed, not held in registers across the key loop
            m0, h, q_tok0, k_tok0, len_q, len_k, lse_base, n_kv, n_full = _tile(
                t, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, BM, BN, CAUSAL, VARLEN, PERSIST)
            rows = m0 + WG * BMW + gl.arange(0, BMW, layout=gl.SliceLayout(1, s_l))
        seen = l_i > 0.0
        l_safe = gl.where(seen, l_i, 1.0)
        l_o = gl.convert_layout(l_safe, gl.SliceLayout(1, o_l))
        o = acc / l_o[:, None]  # rows with no key: acc = 0
        r_o = m0 + WG * BMW + gl.arange(0, BMW, layout=gl.SliceLayout(1, o_l))
        c_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_l))
        off = (q_tok0 + r_o).to(gl.int64)[:, None] * stride_o + h * D + c_o[None, :]
        m_o = (r_o < len_q)[:, None]
        o16 = o.to(o_ptr.dtype.element_ty)
        gl.store(o_ptr + off, o16, mask=m_o)
        if STORE_RES:  # o's rounding error, for the backward's delta
            gl.store(res_ptr + off, (o - o16.to(gl.float32)).to(o_ptr.dtype.element_ty), mask=m_o)
        lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
        gl.store(lse_ptr + lse_base + rows, lse, mask=rows < len_q)
        it0 += n_kv.to(gl.uint32)
        sc0 += gl.maximum(n_kv - 1, 0).to(gl.uint32)
        i += 1


@gluon.jit
def flash_attn_fwd_ws_kernel(q_desc, k_desc, v_desc, o_ptr, res_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, S_q, S_k, H, GROUP,
                             n_m, n_bh, qk_scale, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                             STAGES: gl.constexpr, CAUSAL: gl.constexpr, STORE_RES: gl.constexpr, VARLEN: gl.constexpr,
                             CONS_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, EMU: gl.constexpr = 0,
                             NUM_WG: gl.constexpr = 2, P16: gl.constexpr = False, SCHED: gl.constexpr = False,
                             PERSIST: gl.constexpr = False, QBUF: gl.constexpr = 1, RECOMP: gl.constexpr = False):
    """n_m x n_bh work items (query tiles x batch-heads). The grid (n_m, n_bh) runs one each; PERSIST: a grid of
    resident programs takes items t = pid, pid + programs, ... with QBUF (2) Q buffers, so the loader fetches the next
    item's Q and first K/V tiles while the consumers finish the current one."""
    gl.static_assert(NUM_WG == 2 or NUM_WG == 3, "two or three consumer warpgroups")
    gl.static_assert(QBUF == 1 or PERSIST, "a second Q buffer serves persistent programs only")
    BMW: gl.constexpr = BM // NUM_WG
    if PERSIST:
        t0 = gl.program_id(0)
        t_step = gl.num_programs(0)
    else:
        t0 = gl.program_id(0) + gl.program_id(1) * n_m
        t_step = n_m * n_bh  # one work item
    q_s = gl.allocate_shared_memory(q_desc.dtype, [QBUF * NUM_WG, BMW, D], q_desc.layout)
    k_s = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
    v_s = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sched = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(QBUF):
        mbarrier.init(q_bar.index(b), count=1)
        mbarrier.init(q_empty.index(b), count=NUM_WG)
    for w in gl.static_range(NUM_WG):
        mbarrier.init(sched.index(w), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=NUM_WG)
    GUARD: gl.constexpr = CAUSAL or VARLEN
    if NUM_WG == 2:
        gl.warp_specialize([
            (_consumer, (q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr, 0,
                         t0, t_step, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, qk_scale, BM, BMW, BN, D, STAGES,
                         QBUF, GUARD, CAUSAL, VARLEN, PERSIST, STORE_RES, EMU, P16, NUM_WG, SCHED, RECOMP)),
            (_consumer, (q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr, 1,
                         t0, t_step, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, qk_scale, BM, BMW, BN, D, STAGES,
                         QBUF, GUARD, CAUSAL, VARLEN, PERSIST, STORE_RES, EMU, P16, NUM_WG, SCHED, RECOMP)),
            (_loader, (q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, t0, t_step,
                       n_m, n_bh, H, GROUP, S_q, S_k, cu_q_ptr, cu_k_ptr, D, BM, BMW, BN, STAGES, NUM_WG, QBUF, CAUSAL,
                       VARLEN, PERSIST)),
        ], [4, 1], [CONS_REGS, LOADER_REGS])
    else:  # three consumer warpgroups (FlashAttention-3's 192-row tiles at head_dim 64)
        gl.warp_specialize([
            (_consumer, (q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr, 0,
                         t0, t_step, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, qk_scale, BM, BMW, BN, D, STAGES,
                         QBUF, GUARD, CAUSAL, VARLEN, PERSIST, STORE_RES, EMU, P16, NUM_WG, SCHED, RECOMP)),
            (_consumer, (q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr, 1,
                         t0, t_step, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, qk_scale, BM, BMW, BN, D, STAGES,
                         QBUF, GUARD, CAUSAL, VARLEN, PERSIST, STORE_RES, EMU, P16, NUM_WG, SCHED, RECOMP)),
            (_consumer, (q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr, 2,
                         t0, t_step, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, qk_scale, BM, BMW, BN, D, STAGES,
                         QBUF, GUARD, CAUSAL, VARLEN, PERSIST, STORE_RES, EMU, P16, NUM_WG, SCHED, RECOMP)),
            (_loader, (q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, t0, t_step,
                       n_m, n_bh, H, GROUP, S_q, S_k, cu_q_ptr, cu_k_ptr, D, BM, BMW, BN, STAGES, NUM_WG, QBUF, CAUSAL,
                       VARLEN, PERSIST)),
        ], [4, 4, 1], [CONS_REGS, CONS_REGS, LOADER_REGS])
    for b in gl.static_range(QBUF):
        mbarrier.invalidate(q_bar.index(b))
        mbarrier.invalidate(q_empty.index(b))
    for w in gl.static_range(NUM_WG):
        mbarrier.invalidate(sched.index(w))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(s))
        mbarrier.invalidate(v_ready.index(s))
        mbarrier.invalidate(kv_empty.index(s))


def attn_fwd_ws(q, k, v, causal, softmax_scale, cfg, residual=False, varlen=None):
    """(o, lse, o_res) as ``attn_fwd`` returns them, by ``flash_attn_fwd_ws_kernel`` (the inputs ``attention._gluon_cfg``
    admits: contiguous 16-bit [B, S, H, D], head_dim 64 or 128, sm90); with
    ``varlen`` (attention.Varlen) the packed sequences as a batch of one.
    cfg: BLOCK_N (keys per tile), num_stages (ring slots), CONS_REGS / LOADER_REGS (registers per thread of the
    consumer / loader partitions), EMU (of every 8 exponentials of unmasked tiles, how many the FMA pipes compute:
    _tl.exp2_emu); the query tile is 128 rows (two warpgroups of 64). Three consumer warpgroups
    (192-row tiles) measured no faster at D = 64 (benchmarks/NOTES.md, session 37; code at 6d0f533)."""
    B, S_q, H, D = q.shape
    S_k, H_kv = k.shape[1], k.shape[2]
    n_wg = cfg.get("NUM_WG", 2)
    bm, bn, stages = 64 * n_wg, cfg["BLOCK_N"], cfg["num_stages"]
    q_l = launch.nvmma_layout([64, D], q.dtype)
    k_l = launch.nvmma_layout([bn, D], q.dtype)
    q_desc = TensorDescriptor.from_tensor(q.view(B * S_q, H * D), [64, D], q_l)
    k_desc = TensorDescriptor.from_tensor(k.view(B * S_k, H_kv * D), [bn, D], k_l)
    v_desc = TensorDescriptor.from_tensor(v.view(B * S_k, H_kv * D), [bn, D], k_l)
    o = launch.new_output((B, S_q, H, D), q.dtype, q.device)
    o_res = launch.new_output((B, S_q, H, D), q.dtype, q.device) if residual else q.new_empty(0)
    lse = launch.new_output((B, H, S_q), torch.float32, q.device)
    e = q.element_size()
    if varlen is None:
        n_m, n_bh, cu = launch.cdiv(S_q, bm), B * H, (lse, lse)
    else:
        n_m, n_bh = launch.cdiv(varlen.max_seqlen_q, bm), (varlen.cu_seqlens_q.numel() - 1) * H
        cu = (varlen.cu_seqlens_q, varlen.cu_seqlens_k)
    persist = bool(cfg.get("PERSIST", 0))
    # persistent: one program per SM (each holds an SM's registers and most of its shared memory)
    grid = (min(n_m * n_bh, _runtime.num_sms()),) if persist else (n_m, n_bh)
    launch.launch(
        "flash_attn_fwd", flash_attn_fwd_ws_kernel, grid,
        q_desc, k_desc, v_desc, o, o_res if residual else o, lse, *cu, S_q, S_k, H, H // H_kv, n_m, n_bh,
        softmax_scale * LOG2E,
        nbytes=e * ((3 if residual else 2) * q.numel() + k.numel() + v.numel()) + 4 * lse.numel(),
        BM=bm, BN=bn, D=D, STAGES=stages, CAUSAL=bool(causal), STORE_RES=bool(residual), VARLEN=varlen is not None,
        CONS_REGS=cfg.get("CONS_REGS", 240 if n_wg == 2 else 160), LOADER_REGS=cfg.get("LOADER_REGS", 24),
        EMU=cfg.get("EMU", 0), NUM_WG=n_wg, P16=bool(cfg.get("P16", n_wg == 3)),
        SCHED=bool(cfg.get("SCHED", 0)), PERSIST=persist, QBUF=2 if persist else 1,
        RECOMP=bool(cfg.get("RECOMP", 0)), num_warps=4,
    )
    return o, lse, o_res
