"""FlashAttention-2 backward kernels (flash-attn layout, bottom-right causal alignment).

With s = scale * q k^T, p = softmax(s) (recomputed from q, k and the forward's lse), and
delta_i = rowsum(dO * O)_i - dlse_i (dlse: the upstream gradient of the returned lse, if any; O is
the stored output plus its rounding residual, so delta does not carry O's bf16/fp16 rounding):

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   dQ = scale * dS K,   dK = scale * dS^T Q

Kernels:
- ``flash_attn_bwd_preprocess_kernel``: delta [B, H, Sq] fp32.
- ``flash_attn_bwd_dkdv_kernel``: a program per BLOCK_N keys of one (batch, kv head) and a slice of
  its group of query heads; it loops over those query heads and their query blocks, accumulating
  dK and dV in fp32 registers. Deterministic: with one slice per group it writes dK/dV directly,
  with several slices each writes its fp32 partial sum and the launcher adds them in a fixed order.
- ``flash_attn_bwd_dq_kernel``: a program per BLOCK_M queries of one (batch, query head), looping
  over key blocks as the forward does (it recomputes P and dP: 7 block matmuls per block pair in all).
- ATOMIC_DQ (FlashAttention-2's design, 5 matmuls per block pair): the dK/dV kernel also computes
  dS K for each query block and adds it to an fp32 accumulator with atomic adds (1) or TMA bulk
  reductions (2); ``flash_attn_bwd_dq_convert_kernel`` scales it into dq. The order of the fp32
  additions varies from run to run: dq is not bitwise reproducible (dk, dv still are).
Rows with lse = -inf (they saw no key) use lse = +inf here, so p = 0 and they get zero gradients.
Causal programs skip blocks entirely above the diagonal and mask only the boundary blocks.
TMA (Hopper): the streamed tiles come through tensor descriptors built on the device, one per
(batch, head) [S, D] matrix, so rows past a sequence's end read as zeros (16-byte aligned strides).

VARLEN (packed sequences, as in forward.py): the dK/dV and dQ programs read their sequence's rows
and lengths from cu_seqlens_q / cu_seqlens_k and those past its end exit; lse and delta are
[H, Tq]. The preprocess works row by row: a packed batch is a batch of one to it.
"""

import triton
import triton.language as tl

from triforge.ops.attention.forward import (
    _cast,
    _causal_key_range,
    _dot,
    _rows_desc,
    _seq_start,
    _stats_row,
    _varlen_seq,
)

LOG2E = 1.4426950408889634


@triton.jit
def flash_attn_bwd_preprocess_kernel(
    o_ptr, do_ptr,  # [B, Sq, H, D]; last dim contiguous
    ores_ptr,  # [B, Sq, H, D] o's rounding residual (read when HAS_RES), o's strides
    dlse_ptr,  # [B, H, Sq] fp32 (read when HAS_DLSE)
    delta_ptr,  # [B, H, Sq] fp32
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    H, Sq,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = (i_bh // H).to(tl.int64)
    i_h = (i_bh % H).to(tl.int64)
    m0 = i_m.to(tl.int64) * BLOCK_M
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_m = i_m * BLOCK_M + offs_m0
    offs_d = tl.arange(0, HEAD_DIM)
    m_m = offs_m < Sq
    p_o = i_b * stride_ob + i_h * stride_oh + m0 * stride_os + offs_m0[:, None] * stride_os + offs_d[None, :]
    o = tl.load(o_ptr + p_o, mask=m_m[:, None], other=0.0).to(tl.float32)
    if HAS_RES:
        o += tl.load(ores_ptr + p_o, mask=m_m[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + i_b * stride_dob + i_h * stride_doh + m0 * stride_dos
                 + offs_m0[:, None] * stride_dos + offs_d[None, :], mask=m_m[:, None], other=0.0)
    delta = tl.sum(o * do.to(tl.float32), axis=1)
    row = i_bh.to(tl.int64) * Sq + offs_m
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + row, mask=m_m, other=0.0)
    tl.store(delta_ptr + row, delta, mask=m_m)


@triton.jit
def _load_lse2(lse_ptr, offs, mask):
    """lse in base 2 (lse * log2 e); rows that saw no key (-inf) and padding rows give +inf: p = 0."""
    lse = tl.load(lse_ptr + offs, mask=mask, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v,
    q_src, do_src,  # TMA: descriptors of this (batch, query head)'s Q / dO [Sq, D]; else pointers to its row 0
    lse_base, delta_base,  # this (batch, query head)'s [Sq] rows
    dq_dst,  # ATOMIC_DQ: its fp32 dQ accumulator [Sq, D] (2: a descriptor; 1: a pointer to row 0)
    stride_qs, stride_dos, stride_dqs,
    offs_n,  # [BLOCK_N] key positions of the program
    offs_d,
    lo, hi,  # query range [lo, hi), lo a multiple of BLOCK_M
    Sq, Sk, shift, qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # mask padded keys and, when CAUSAL, keys past the diagonal
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    TMA: tl.constexpr,  # Q/dO tiles through tensor descriptors; rows past Sq read as 0
    ATOMIC_DQ: tl.constexpr,  # 0; else also dQ += dS K into the fp32 accumulator: 1 atomic adds, 2 TMA reduce
):
    offs_m0 = tl.arange(0, BLOCK_M)
    tile_q = offs_m0[:, None] * stride_qs + offs_d[None, :]
    tile_do = offs_m0[:, None] * stride_dos + offs_d[None, :]
    tile_dq = offs_m0[:, None] * stride_dqs + offs_d[None, :]
    for start_m in range(lo, hi, BLOCK_M):
        m64 = tl.cast(start_m, tl.int64)
        offs_m = start_m + offs_m0
        m_m = offs_m < Sq
        if TMA:
            q = q_src.load([start_m, 0])
        else:
            q = tl.load(q_src + m64 * stride_qs + tile_q, mask=m_m[:, None], other=0.0)
        lse2 = _load_lse2(lse_base, offs_m, m_m)
        qkT = _dot(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), UPCAST, IEEE)
        if MASKED:  # masked in the exponent: exp2 never overflows on a hidden key
            valid = (offs_n < Sk)[:, None]
            if CAUSAL:
                valid = valid & (offs_n[:, None] <= offs_m[None, :] + shift)
            pT = tl.exp2(tl.where(valid, qkT * qk_scale - lse2[None, :], float("-inf")))
        else:
            pT = tl.exp2(qkT * qk_scale - lse2[None, :])
        if TMA:
            do = do_src.load([start_m, 0])
        else:
            do = tl.load(do_src + m64 * stride_dos + tile_do, mask=m_m[:, None], other=0.0)
        delta = tl.load(delta_base + offs_m, mask=m_m, other=0.0)
        dv = _dot(_cast(pT, do.dtype, UPCAST), do, dv, UPCAST, IEEE)
        dpT = _dot(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), UPCAST, IEEE)
        dsT = _cast(pT * (dpT - delta[None, :]), q.dtype, UPCAST)
        dk = _dot(dsT, q, dk, UPCAST, IEEE)
        if ATOMIC_DQ:  # dQ (unscaled) of these queries from this key block; the launcher scales the sum
            dq = _dot(tl.trans(dsT), k, tl.zeros(q.shape, dtype=tl.float32), UPCAST, IEEE)
            if ATOMIC_DQ == 2:  # a bulk reduction from shared memory, rows past Sq dropped
                dq_dst.atomic_add([start_m, 0], dq)
            else:
                tl.atomic_add(dq_dst + m64 * stride_dqs + tile_dq, dq, mask=m_m[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def flash_attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # [B, Sq, H, D], [B, Sk, Hkv, D] x2, [B, Sq, H, D]
    lse_ptr, delta_ptr,  # [B, H, Sq] fp32; VARLEN: [H, Tq]
    dk_ptr, dv_ptr,  # [B, Sk, Hkv * KV_SPLIT, D]: k's dtype (KV_SPLIT = 1) or fp32 partial sums
    cu_seqlens_q_ptr, cu_seqlens_k_ptr,  # VARLEN: int32 [B + 1] row offsets of q/do and of k/v/dk/dv; else None
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,  # dk and dv share one layout
    H, Hkv, GROUP,  # GROUP = H // Hkv
    HEADS_PER_SPLIT,  # GROUP // KV_SPLIT query heads per program
    KV_SPLIT,
    Sq, Sk,  # VARLEN: the packed totals Tq, Tk (each program reads its sequence's lengths)
    qk_scale,  # scale * log2(e)
    sm_scale,
    dq_ptr,  # ATOMIC_DQ: fp32 [B, Sq, H, D] dQ accumulator (zeroed; unscaled sums); else None
    stride_dqb, stride_dqs, stride_dqh,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    VARLEN: tl.constexpr,
    TMA: tl.constexpr = False,  # Q/dO tiles through device-built tensor descriptors (16-byte aligned)
    ATOMIC_DQ: tl.constexpr = 0,  # FlashAttention-2's dQ here too (no dQ kernel): 1 atomic adds, 2 TMA reduce
):
    i_n = tl.program_id(0)
    i_bs = tl.program_id(1)  # (batch, kv head, split)
    i_split = i_bs % KV_SPLIT
    i_bhk = i_bs // KV_SPLIT
    i_b = (i_bhk // Hkv).to(tl.int64)
    i_hk = i_bhk % Hkv
    n0 = i_n * BLOCK_N
    n64 = n0.to(tl.int64)
    Tq = Sq  # lse / delta rows per head
    bos_q, bos_k = 0, 0
    if VARLEN:  # sequence i_b: q/do rows [bos_q, bos_q + Sq), k/v/dk/dv rows [bos_k, bos_k + Sk)
        bos_q, Sq = _varlen_seq(cu_seqlens_q_ptr, i_b)
        bos_k, Sk = _varlen_seq(cu_seqlens_k_ptr, i_b)
        if n0 >= Sk:  # past this sequence's keys (those of a sequence with no query store dk = dv = 0)
            return
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_n = n0 + offs_n0
    offs_d = tl.arange(0, HEAD_DIM)
    m_n = offs_n < Sk
    k = tl.load(k_ptr + _seq_start(i_b, bos_k, stride_kb, stride_ks, VARLEN) + i_hk.to(tl.int64) * stride_kh
                + n64 * stride_ks + offs_n0[:, None] * stride_ks + offs_d[None, :], mask=m_n[:, None], other=0.0)
    v = tl.load(v_ptr + _seq_start(i_b, bos_k, stride_vb, stride_vs, VARLEN) + i_hk.to(tl.int64) * stride_vh
                + n64 * stride_vs + offs_n0[:, None] * stride_vs + offs_d[None, :], mask=m_n[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    shift = Sk - Sq
    if CAUSAL:
        # query i sees key j iff i >= j - shift: rows before lo see none of the block's keys,
        # rows from full on see all of them; [lo, full) are the diagonal blocks
        lo = (tl.maximum(n0 - shift, 0) // BLOCK_M) * BLOCK_M
        full = tl.maximum(n0 + BLOCK_N - 1 - shift, 0)
        full = tl.minimum(((full + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, Sq)
        full = tl.maximum(full, lo)
    else:
        lo = 0
        full = 0
    if n0 + BLOCK_N > Sk:  # the partial last key block: every query block masks its padded keys
        full = Sq

    h_first = i_hk * GROUP + i_split * HEADS_PER_SPLIT
    for g in range(HEADS_PER_SPLIT):
        i_h = (h_first + g).to(tl.int64)
        q_src = q_ptr + _seq_start(i_b, bos_q, stride_qb, stride_qs, VARLEN) + i_h * stride_qh
        do_src = do_ptr + _seq_start(i_b, bos_q, stride_dob, stride_dos, VARLEN) + i_h * stride_doh
        dq_dst = dq_ptr  # None unless ATOMIC_DQ
        if ATOMIC_DQ:
            dq_dst = dq_ptr + _seq_start(i_b, bos_q, stride_dqb, stride_dqs, VARLEN) + i_h * stride_dqh
        if TMA:  # one (batch, head)'s [Sq, D] per descriptor
            q_src = _rows_desc(q_src, Sq, stride_qs, BLOCK_M, HEAD_DIM)
            do_src = _rows_desc(do_src, Sq, stride_dos, BLOCK_M, HEAD_DIM)
        if ATOMIC_DQ == 2:
            dq_dst = _rows_desc(dq_dst, Sq, stride_dqs, BLOCK_M, HEAD_DIM)
        row = _stats_row(i_b * H + i_h, i_h, bos_q, Tq, VARLEN)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_ptr + row, delta_ptr + row, dq_dst,
                                 stride_qs, stride_dos, stride_dqs, offs_n, offs_d, lo, full, Sq, Sk, shift,
                                 qk_scale, BLOCK_M, BLOCK_N, True, CAUSAL, UPCAST, IEEE, TMA, ATOMIC_DQ)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_ptr + row, delta_ptr + row, dq_dst,
                                 stride_qs, stride_dos, stride_dqs, offs_n, offs_d, full, Sq, Sq, Sk, shift,
                                 qk_scale, BLOCK_M, BLOCK_N, False, CAUSAL, UPCAST, IEEE, TMA, ATOMIC_DQ)
    dk = dk * sm_scale
    out = (_seq_start(i_b, bos_k, stride_dkb, stride_dks, VARLEN) + (i_hk * KV_SPLIT + i_split).to(tl.int64) * stride_dkh
           + n64 * stride_dks + offs_n0[:, None] * stride_dks + offs_d[None, :])
    tl.store(dk_ptr + out, _cast(dk, dk_ptr.dtype.element_ty, UPCAST), mask=m_n[:, None])
    tl.store(dv_ptr + out, _cast(dv, dv_ptr.dtype.element_ty, UPCAST), mask=m_n[:, None])


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse2, delta,
    k_src, v_src,  # TMA: descriptors of this (batch, kv head)'s K / V [Sk, D]; else pointers to its row 0
    stride_ks, stride_vs,
    offs_m, offs_d,
    lo, hi,
    Sk, shift, qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    TMA: tl.constexpr,  # rows past Sk read as 0
):
    offs_n0 = tl.arange(0, BLOCK_N)
    tile_k = offs_n0[:, None] * stride_ks + offs_d[None, :]
    tile_v = offs_n0[:, None] * stride_vs + offs_d[None, :]
    for start_n in range(lo, hi, BLOCK_N):
        n64 = tl.cast(start_n, tl.int64)
        offs_n = start_n + offs_n0
        if MASKED:
            m_n = offs_n < Sk
        if TMA:
            k = k_src.load([start_n, 0])
            v = v_src.load([start_n, 0])
        elif MASKED:
            k = tl.load(k_src + n64 * stride_ks + tile_k, mask=m_n[:, None], other=0.0)
            v = tl.load(v_src + n64 * stride_vs + tile_v, mask=m_n[:, None], other=0.0)
        else:
            k = tl.load(k_src + n64 * stride_ks + tile_k)
            v = tl.load(v_src + n64 * stride_vs + tile_v)
        qk = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST, IEEE)
        if MASKED:  # masked in the exponent: exp2 never overflows on a hidden key
            valid = m_n[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None] + shift)
            p = tl.exp2(tl.where(valid, qk * qk_scale - lse2[:, None], float("-inf")))
        else:
            p = tl.exp2(qk * qk_scale - lse2[:, None])
        dp = _dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST, IEEE)
        ds = p * (dp - delta[:, None])
        dq = _dot(_cast(ds, k.dtype, UPCAST), k, dq, UPCAST, IEEE)
    return dq


@triton.jit
def flash_attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,
    lse_ptr, delta_ptr,  # [B, H, Sq] fp32; VARLEN: [H, Tq]
    dq_ptr,  # [B, Sq, H, D] contiguous, q's dtype
    cu_seqlens_q_ptr, cu_seqlens_k_ptr,  # VARLEN: int32 [B + 1] row offsets of q/do/dq and of k/v; else None
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    H, GROUP,
    Sq, Sk,  # VARLEN: the packed totals Tq, Tk (each program reads its sequence's lengths)
    qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    VARLEN: tl.constexpr,
    TMA: tl.constexpr = False,  # Q/dO/K/V tiles through device-built tensor descriptors (16-byte aligned)
    GUARD: tl.constexpr = True,  # each key loop inside ``if lo < hi`` (keeps ptxas from serializing wgmma)
):
    i_m = tl.program_id(0)
    if CAUSAL:
        i_m = tl.num_programs(0) - 1 - i_m
    i_bh = tl.program_id(1)
    i_b = (i_bh // H).to(tl.int64)
    i_h = i_bh % H
    i_hk = (i_h // GROUP).to(tl.int64)
    i_h = i_h.to(tl.int64)
    m0 = i_m.to(tl.int64) * BLOCK_M
    Tq = Sq  # lse / delta rows per head
    bos_q, bos_k = 0, 0
    if VARLEN:  # sequence i_b: q/do/dq rows [bos_q, bos_q + Sq), k/v rows [bos_k, bos_k + Sk)
        bos_q, Sq = _varlen_seq(cu_seqlens_q_ptr, i_b)
        bos_k, Sk = _varlen_seq(cu_seqlens_k_ptr, i_b)
        if m0 >= Sq:  # past this sequence's end
            return
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_m = i_m * BLOCK_M + offs_m0
    offs_d = tl.arange(0, HEAD_DIM)
    m_m = offs_m < Sq
    q_base = q_ptr + _seq_start(i_b, bos_q, stride_qb, stride_qs, VARLEN) + i_h * stride_qh
    do_base = do_ptr + _seq_start(i_b, bos_q, stride_dob, stride_dos, VARLEN) + i_h * stride_doh
    k_src = k_ptr + _seq_start(i_b, bos_k, stride_kb, stride_ks, VARLEN) + i_hk * stride_kh
    v_src = v_ptr + _seq_start(i_b, bos_k, stride_vb, stride_vs, VARLEN) + i_hk * stride_vh
    if TMA:  # one (batch, head)'s [S, D] per descriptor; rows past its end read as 0
        q = _rows_desc(q_base, Sq, stride_qs, BLOCK_M, HEAD_DIM).load([i_m * BLOCK_M, 0])
        do = _rows_desc(do_base, Sq, stride_dos, BLOCK_M, HEAD_DIM).load([i_m * BLOCK_M, 0])
        k_src = _rows_desc(k_src, Sk, stride_ks, BLOCK_N, HEAD_DIM)
        v_src = _rows_desc(v_src, Sk, stride_vs, BLOCK_N, HEAD_DIM)
    else:
        q = tl.load(q_base + m0 * stride_qs + offs_m0[:, None] * stride_qs + offs_d[None, :], mask=m_m[:, None],
                    other=0.0)
        do = tl.load(do_base + m0 * stride_dos + offs_m0[:, None] * stride_dos + offs_d[None, :], mask=m_m[:, None],
                     other=0.0)
    row = _stats_row(i_bh, i_h, bos_q, Tq, VARLEN)
    lse2 = _load_lse2(lse_ptr + row, offs_m, m_m)
    delta = tl.load(delta_ptr + row + offs_m, mask=m_m, other=0.0)

    shift = Sk - Sq
    full_end, hi = _causal_key_range(i_m, Sk, shift, BLOCK_M, BLOCK_N, CAUSAL)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if GUARD:  # each key loop inside ``if lo < hi``: see forward._fwd_inner (ptxas's wgmma serialization)
        if full_end > 0:
            dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, offs_m, offs_d,
                               0, full_end, Sk, shift, qk_scale, BLOCK_M, BLOCK_N, False, CAUSAL, UPCAST, IEEE, TMA)
        if full_end < hi:
            dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, offs_m, offs_d,
                               full_end, hi, Sk, shift, qk_scale, BLOCK_M, BLOCK_N, True, CAUSAL, UPCAST, IEEE, TMA)
    else:
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, offs_m, offs_d,
                           0, full_end, Sk, shift, qk_scale, BLOCK_M, BLOCK_N, False, CAUSAL, UPCAST, IEEE, TMA)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, offs_m, offs_d,
                           full_end, hi, Sk, shift, qk_scale, BLOCK_M, BLOCK_N, True, CAUSAL, UPCAST, IEEE, TMA)
    dq = dq * sm_scale
    tl.store(dq_ptr + _seq_start(i_b, bos_q, stride_dqb, stride_dqs, VARLEN) + i_h * stride_dqh + m0 * stride_dqs
             + offs_m0[:, None] * stride_dqs + offs_d[None, :], _cast(dq, dq_ptr.dtype.element_ty, UPCAST), mask=m_m[:, None])


@triton.jit
def flash_attn_bwd_dq_convert_kernel(
    acc_ptr,  # [N] fp32: the ATOMIC_DQ accumulator (unscaled), contiguous
    dq_ptr,  # [N] q's dtype, contiguous
    N, sm_scale,
    BLOCK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    dq = tl.load(acc_ptr + offs, mask=m, other=0.0) * sm_scale
    tl.store(dq_ptr + offs, _cast(dq, dq_ptr.dtype.element_ty, UPCAST), mask=m)
