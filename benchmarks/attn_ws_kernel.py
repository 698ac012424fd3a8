"""Attention forward for Hopper, warp-specialized, in Gluon (FlashAttention-3's structure): a probe.

One program = one (batch, head, 128-query tile); three partitions:
- a loader warp: Q once, then K and V tiles of BN keys by TMA into a ring of STAGES slots (``k_ready`` / ``v_ready``
  mbarriers; a slot is refilled after both consumers have released it on ``kv_empty``);
- two consumer warpgroups, 64 query rows each: S = Q K^T by wgmma from shared memory, the online softmax in registers
  (log2 domain), P converted in registers to the next wgmma's A operand, O += P V with V from shared memory.
  PIPE 1 (FA3's intra-warpgroup overlap): S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued together, and the
  softmax of S_j runs while the PV product is on the tensor cores.

Non-causal; S_q, S_k multiples of BM / BN (the probe's shapes); q, k, v [B, S, H, D] contiguous, H_kv = H / GROUP.
Writes o [B, S_q, H, D] in q's dtype and lse [B, H, S_q] (natural log). Compiled GPUs only (Gluon has no interpreter).
"""

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, k_ready, v_ready, kv_empty, q_row, kv_row, q_col, kv_col,
            n_kv, BMW: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_s.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + BMW, q_col], q_bar, q_s.index(1))
    for j in range(n_kv):
        s = j % STAGES
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)  # both consumers freed slot s (first pass: free)
        row = kv_row + j * BN
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(s), k_s.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_ready.index(s), v_s.index(s))


@gluon.jit
def _consumer(q_s, k_s, v_s, q_bar, k_ready, v_ready, kv_empty, o_ptr, lse_ptr, WG: gl.constexpr, q_row0, o_col,
              lse_base, n_kv, qk_scale, stride_os, BMW: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
              STAGES: gl.constexpr, PIPE: gl.constexpr):
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    dtype: gl.constexpr = q_s.dtype
    q = q_s.index(WG)
    acc = gl.zeros([BMW, D], gl.float32, o_l)
    mbarrier.wait(q_bar, 0)
    if PIPE:
        # FA3's order: S_j = Q K_j^T and O += P_{j-1} V_{j-1} issued together; the softmax of S_j runs while the PV
        # product is on the tensor cores
        mbarrier.wait(k_ready.index(0), 0)
        s0 = warpgroup_mma(q, k_s.index(0).permute((1, 0)), gl.zeros([BMW, BN], gl.float32, s_l), use_acc=False,
                           is_async=True)
        s0 = warpgroup_mma_wait(0, deps=[s0])
        m_i = gl.max(s0, 1) * qk_scale
        p = gl.exp2(s0 * qk_scale - m_i[:, None])
        l_i = gl.sum(p, 1)
        pa = gl.convert_layout(p.to(dtype), p_l)
        for j in range(1, n_kv):
            st = j % STAGES
            sp = (j - 1) % STAGES
            mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
            s_j = warpgroup_mma(q, k_s.index(st).permute((1, 0)), gl.zeros([BMW, BN], gl.float32, s_l),
                                use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(sp), ((j - 1) // STAGES) & 1)
            acc = warpgroup_mma(pa, v_s.index(sp), acc, is_async=True)
            s_j = warpgroup_mma_wait(1, deps=[s_j])  # S_j done; the PV product may still run
            m_new = gl.maximum(m_i, gl.max(s_j, 1) * qk_scale)
            p = gl.exp2(s_j * qk_scale - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc, pa = warpgroup_mma_wait(0, deps=[acc, pa])
            mbarrier.arrive(kv_empty.index(sp))
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            pa = gl.convert_layout(p.to(dtype), p_l)
        sl = (n_kv - 1) % STAGES
        mbarrier.wait(v_ready.index(sl), ((n_kv - 1) // STAGES) & 1)
        acc = warpgroup_mma(pa, v_s.index(sl), acc, is_async=True)
        acc, pa = warpgroup_mma_wait(0, deps=[acc, pa])
        mbarrier.arrive(kv_empty.index(sl))
    else:
        m_i = gl.full([BMW], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
        l_i = gl.zeros([BMW], gl.float32, gl.SliceLayout(1, s_l))
        for j in range(n_kv):
            st = j % STAGES
            ph = (j // STAGES) & 1
            mbarrier.wait(k_ready.index(st), ph)
            s_cur = warpgroup_mma(q, k_s.index(st).permute((1, 0)), gl.zeros([BMW, BN], gl.float32, s_l),
                                  use_acc=False, is_async=True)
            s_cur = warpgroup_mma_wait(0, deps=[s_cur])
            m_new = gl.maximum(m_i, gl.max(s_cur, 1) * qk_scale)
            p = gl.exp2(s_cur * qk_scale - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            pa = gl.convert_layout(p.to(dtype), p_l)
            mbarrier.wait(v_ready.index(st), ph)
            acc = warpgroup_mma(pa, v_s.index(st), acc, is_async=True)
            acc, pa = warpgroup_mma_wait(0, deps=[acc, pa])
            mbarrier.arrive(kv_empty.index(st))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_l))
    o = acc / l_o[:, None]
    rows = q_row0 + WG * BMW + gl.arange(0, BMW, layout=gl.SliceLayout(1, o_l))
    cols = o_col + gl.arange(0, D, layout=gl.SliceLayout(0, o_l))
    gl.store(o_ptr + rows.to(gl.int64)[:, None] * stride_os + cols[None, :], o.to(o_ptr.dtype.element_ty))
    r_l = WG * BMW + gl.arange(0, BMW, layout=gl.SliceLayout(1, s_l))
    gl.store(lse_ptr + lse_base + r_l, (m_i + gl.log2(l_i)) * 0.6931471805599453)


@gluon.jit
def attn_fwd_ws_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, S_q, S_k, H, GROUP, qk_scale,
                       BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, PIPE: gl.constexpr,
                       CONS_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    BMW: gl.constexpr = BM // 2
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    q_row = b * S_q + pid_m * BM  # rows of the [B S, H D] views
    kv_row = b * S_k
    q_col = h * D
    kv_col = (h // GROUP) * D
    n_kv = S_k // BN
    q_s = gl.allocate_shared_memory(q_desc.dtype, [2, BMW, D], q_desc.layout)
    k_s = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
    v_s = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=2)
    lse_base = (bh.to(gl.int64) * S_q + pid_m * BM)
    stride_os = H * D
    gl.warp_specialize([
        (_consumer, (q_s, k_s, v_s, q_bar, k_ready, v_ready, kv_empty, o_ptr, lse_ptr, 0, q_row, q_col, lse_base,
                     n_kv, qk_scale, stride_os, BMW, BN, D, STAGES, PIPE)),
        (_consumer, (q_s, k_s, v_s, q_bar, k_ready, v_ready, kv_empty, o_ptr, lse_ptr, 1, q_row, q_col, lse_base,
                     n_kv, qk_scale, stride_os, BMW, BN, D, STAGES, PIPE)),
        (_loader, (q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, k_ready, v_ready, kv_empty, q_row, kv_row, q_col,
                   kv_col, n_kv, BMW, BN, STAGES)),
    ], [4, 1], [CONS_REGS, LOADER_REGS])
    mbarrier.invalidate(q_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(s))
        mbarrier.invalidate(v_ready.index(s))
        mbarrier.invalidate(kv_empty.index(s))


def attn_fwd_ws(q, k, v, softmax_scale=None, cfg=None):
    """o, lse = softmax(q k^T * scale) v (non-causal) by ``attn_fwd_ws_kernel``; q [B, S_q, H, D], k/v [B, S_k, H_kv, D]
    contiguous 16-bit, S_q % BM == 0, S_k % BN == 0."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    cfg = dict({"BM": 128, "BN": 128, "STAGES": 2, "PIPE": 0, "CONS_REGS": 240, "LOADER_REGS": 24}, **(cfg or {}))
    B, S_q, H, D = q.shape
    S_k, H_kv = k.shape[1], k.shape[2]
    bm, bn = cfg["BM"], cfg["BN"]
    assert S_q % bm == 0 and S_k % bn == 0 and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    o = torch.empty_like(q)
    lse = torch.empty((B, H, S_q), dtype=torch.float32, device=q.device)
    g16 = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    ql = gl.NVMMASharedLayout.get_default_for([bm // 2, D], g16)
    kl = gl.NVMMASharedLayout.get_default_for([bn, D], g16)
    q_desc = TensorDescriptor.from_tensor(q.view(B * S_q, H * D), [bm // 2, D], ql)
    k_desc = TensorDescriptor.from_tensor(k.view(B * S_k, H_kv * D), [bn, D], kl)
    v_desc = TensorDescriptor.from_tensor(v.view(B * S_k, H_kv * D), [bn, D], kl)
    attn_fwd_ws_kernel[(S_q // bm, B * H)](
        q_desc, k_desc, v_desc, o, lse, S_q, S_k, H, H // H_kv, scale * math.log2(math.e),
        BM=bm, BN=bn, D=D, STAGES=cfg["STAGES"], PIPE=cfg["PIPE"], CONS_REGS=cfg["CONS_REGS"],
        LOADER_REGS=cfg["LOADER_REGS"], num_warps=4,
    )
    return o, lse
