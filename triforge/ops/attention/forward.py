"""FlashAttention-2 forward kernel (flash-attn layout: q [B, Sq, H, D], k/v [B, Sk, Hkv, D]).

One program per (BLOCK_M query rows, batch * query head). K/V tiles stream through an online
softmax in base 2 with fp32 statistics and accumulator:

    s   = (q @ k^T) * scale * log2(e)          (the scale multiplies the fp32 scores, so q is not
                                                 rounded again: |QK^T| ~ 1e4 stays exact enough)
    m'  = max(m, rowmax(s));  p = exp2(s - m');  l' = l * exp2(m - m') + rowsum(p)
    acc = acc * exp2(m - m') + p @ v
    o   = acc / l,   lse = (m + log2(l)) * ln(2)

Causal masking is bottom-right aligned (query i sees keys j <= i + Sk - Sq). The key loop runs in
two phases: blocks every row of the program sees completely (no mask at all), then the boundary
blocks (the diagonal and the partial last block) with masks; blocks past the diagonal are never
visited. For training, the kernel also writes o's rounding residual (o in fp32 minus o rounded)
so that the backward's delta = rowsum(dO * O) uses O to twice its dtype's mantissa bits.
A row that sees no key keeps m = -inf and l = 0: a safe max (0) stands in for m in the
exponentials and the row stores o = 0, lse = -inf.

TMA (Hopper): Q, K and V tiles come through tensor descriptors built on the device, one per
(batch, head) [S, D] matrix (16-byte aligned strides): bulk tensor copies, rows past the sequence's
end read as zeros. WARP_SPEC (with TMA, not VARLEN): Triton's Hopper warp specialization splits the
program into a producer warpgroup issuing those copies and two consumer warpgroups of BLOCK_M / 2
rows, whose softmax and matmuls drift apart and overlap. The pass takes a single key loop, so that
loop masks every tile when any tile needs it (causal, or Sk % BLOCK_N != 0: not EVEN_N).

VARLEN (flash-attn's varlen layout): q [Tq, H, D] and k/v [Tk, Hkv, D] pack B sequences, sequence b
in rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q (likewise cu_seqlens_k for k/v). The batch
index is the sequence: the grid spans the longest sequence and the programs past their own
sequence's end exit at once; each sequence is attended with its own lengths Sq, Sk (so causal
alignment is per sequence). lse is [H, Tq].
"""

import triton
import triton.language as tl

from triforge.ops._tl import cast as _cast
from triforge.ops._tl import exp2_emu

LOG2E = 1.4426950408889634  # host side: the launchers pass softmax_scale * LOG2E
LN2 = tl.constexpr(0.6931471805599453)  # a constexpr global, readable inside @triton.jit functions


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b. IEEE: fp32 operands, full fp32 products (no tf32). UPCAST: compute a bf16 dot in
    fp32 (Triton 3.6's CPU interpreter multiplies bf16 operands of tl.dot wrongly; the products of
    bf16 values are exact in fp32 either way)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _fwd_loop(
    acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, offs_m, offs_d, lo, hi, Sk, shift, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, WARP_SPEC: tl.constexpr, EMU: tl.constexpr,
):
    """The key loop of ``_fwd_inner`` over tiles [lo, hi)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    tile = offs_n0[:, None] * stride_ks + offs_d[None, :]
    tile_v = offs_n0[:, None] * stride_vs + offs_d[None, :]
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        offs_n = start_n + offs_n0
        if MASKED:
            m_n = offs_n < Sk
        if TMA:
            k = k_src.load([start_n, 0])
        elif MASKED:
            k = tl.load(k_src + tl.cast(start_n, tl.int64) * stride_ks + tile, mask=m_n[:, None], other=0.0)
        else:
            k = tl.load(k_src + tl.cast(start_n, tl.int64) * stride_ks + tile)
        qk = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST, IEEE)
        if MASKED:
            valid = m_n[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None] + shift)
            s = tl.where(valid, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no key yet: m_new = -inf; exp2 must never see (-inf) - (-inf)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
        else:
            # every key of the block is visible to every row: the row max is finite; the scale and
            # the max subtraction are one FMA per score
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_use = m_new
            # (EMU of every 8 exponentials on the FMA pipes: _tl.exp2_emu; its arguments are finite here)
            p = exp2_emu(qk * qk_scale - m_use[:, None], EMU)
        if TMA:
            v = v_src.load([start_n, 0])
        elif MASKED:
            v = tl.load(v_src + tl.cast(start_n, tl.int64) * stride_vs + tile_v, mask=m_n[:, None], other=0.0)
        else:
            v = tl.load(v_src + tl.cast(start_n, tl.int64) * stride_vs + tile_v)
        alpha = tl.exp2(m_i - m_use)
        acc = acc * alpha[:, None]
        acc = _dot(_cast(p, v.dtype, UPCAST), v, acc, UPCAST, IEEE)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q,
    k_src, v_src,  # TMA: descriptors of this (batch, kv head)'s K / V [Sk, D]; else pointers to its row 0
    stride_ks, stride_vs,
    offs_m,  # [BLOCK_M] query rows of the program
    offs_d,  # [HEAD_DIM]
    lo, hi,  # key range [lo, hi), lo a multiple of BLOCK_N
    Sk, shift,  # shift = Sk - Sq (bottom-right causal alignment)
    qk_scale,  # softmax scale * log2(e)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # boundary blocks: key bounds (and the causal mask when CAUSAL)
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    TMA: tl.constexpr,  # K/V tiles by tensor descriptor (TMA on Hopper; rows past Sk read as 0)
    WARP_SPEC: tl.constexpr,  # Hopper: a producer warpgroup issues the TMA loads, two consumers compute
    GUARD: tl.constexpr,  # the loop inside ``if lo < hi`` (not with WARP_SPEC, whose pass takes a bare loop)
    EMU: tl.constexpr,  # unmasked tiles: EMU of every 8 exponentials emulated on the FMA pipes (_tl.exp2_emu)
):
    if GUARD and not WARP_SPEC:
        # the loop inside ``if lo < hi``: a loop that may run no trip leaves, on that path, its initial acc
        # (register moves) flowing into the wgmma wait after the loop, and ptxas then serializes every wgmma
        # of the kernel (C7515; found in the non-causal D = 64 kernel, whose key loop is empty when Sk is a
        # multiple of BLOCK_N). Inside the guard the loop always runs and the initial values merge past the wait.
        if lo < hi:
            acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, offs_m, offs_d, lo, hi, Sk,
                                      shift, qk_scale, BLOCK_M, BLOCK_N, MASKED, CAUSAL, UPCAST, IEEE, TMA, WARP_SPEC,
                                      EMU)
    else:
        acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, offs_m, offs_d, lo, hi, Sk,
                                  shift, qk_scale, BLOCK_M, BLOCK_N, MASKED, CAUSAL, UPCAST, IEEE, TMA, WARP_SPEC, EMU)
    return acc, l_i, m_i


@triton.jit
def _rows_desc(base, S, stride_s, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A tensor descriptor of the [S, HEAD_DIM] rows of one (batch or sequence, head) from ``base``,
    loading [BLOCK, HEAD_DIM] tiles (an empty sequence's is encoded with S = 1 and never read)."""
    return tl.make_tensor_descriptor(base, [tl.maximum(S, 1), HEAD_DIM], [stride_s, 1], [BLOCK, HEAD_DIM])


@triton.jit
def _varlen_seq(cu_seqlens_ptr, i_b):
    """Sequence i_b of a packed batch: its first row bos (int64) and its length, from the prefix sums."""
    bos = tl.load(cu_seqlens_ptr + i_b)
    eos = tl.load(cu_seqlens_ptr + i_b + 1)
    return bos.to(tl.int64), eos - bos


@triton.jit
def _seq_start(i_b, bos, stride_b, stride_s, VARLEN: tl.constexpr):
    """Offset of a sequence's first row: batch row i_b of [B, S, ...], or with VARLEN row bos of the
    packed [T, ...]."""
    if VARLEN:
        return bos * stride_s
    else:
        return i_b * stride_b


@triton.jit
def _stats_row(i_bh, i_h, bos, T, VARLEN: tl.constexpr):
    """Offset of (batch, head) i_bh's first row in lse / delta: [B, H, T], or with VARLEN [H, T]
    (T the packed total) from row bos."""
    if VARLEN:
        return i_h * T + bos
    else:
        return i_bh.to(tl.int64) * T


@triton.jit
def _causal_key_range(i_m, Sk, shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys [0, full_end) are visible to every row of query block i_m (whole BLOCK_N tiles, no
    mask needed); [full_end, hi) are the boundary tiles. Nothing at or past hi is visible."""
    if CAUSAL:
        hi = tl.minimum(Sk, (i_m + 1) * BLOCK_M + shift)
        full = tl.maximum(tl.minimum(Sk, i_m * BLOCK_M + 1 + shift), 0)
        hi = tl.maximum(hi, 0)
    else:
        hi = Sk
        full = Sk
    full_end = (full // BLOCK_N) * BLOCK_N
    return full_end, hi


@triton.jit
def flash_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr,  # [B, Sq, H, D], [B, Sk, Hkv, D] x2; last dim contiguous
    o_ptr,  # [B, Sq, H, D] q's dtype
    ores_ptr,  # [B, Sq, H, D] q's dtype, o - o rounded (written when STORE_RES), o's strides
    lse_ptr,  # [B, H, Sq] fp32, natural log; VARLEN: [H, Tq]
    cu_seqlens_q_ptr, cu_seqlens_k_ptr,  # VARLEN: int32 [B + 1] row offsets of q/o and of k/v; else None
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    H, GROUP,  # query heads; query heads per kv head
    Sq, Sk,  # VARLEN: the packed totals Tq, Tk (each program reads its sequence's lengths)
    qk_scale,  # softmax scale * log2(e)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    STORE_RES: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    VARLEN: tl.constexpr,
    TMA: tl.constexpr = False,  # Q/K/V tiles through device-built tensor descriptors (16-byte aligned)
    WARP_SPEC: tl.constexpr = False,  # with TMA, not VARLEN: Hopper producer/consumer warpgroups
    EVEN_N: tl.constexpr = False,  # Sk % BLOCK_N == 0 (not VARLEN): WARP_SPEC needs no key-bound mask
    GUARD: tl.constexpr = True,  # each key loop inside ``if lo < hi`` (_fwd_inner: keeps ptxas from serializing wgmma)
    EMU: tl.constexpr = 0,  # compiled only: EMU of every 8 exponentials of unmasked tiles on the FMA pipes
):
    i_m = tl.program_id(0)
    if CAUSAL:  # the longest rows (most key blocks) start first
        i_m = tl.num_programs(0) - 1 - i_m
    i_bh = tl.program_id(1)
    i_b = (i_bh // H).to(tl.int64)
    i_h = i_bh % H
    i_hk = (i_h // GROUP).to(tl.int64)
    i_h = i_h.to(tl.int64)
    m0 = i_m.to(tl.int64) * BLOCK_M
    Tq = Sq  # lse rows per head
    bos_q, bos_k = 0, 0
    if VARLEN:  # sequence i_b: q/o rows [bos_q, bos_q + Sq), k/v rows [bos_k, bos_k + Sk)
        bos_q, Sq = _varlen_seq(cu_seqlens_q_ptr, i_b)
        bos_k, Sk = _varlen_seq(cu_seqlens_k_ptr, i_b)
        if m0 >= Sq:  # past this sequence's end
            return
    q_base = q_ptr + _seq_start(i_b, bos_q, stride_qb, stride_qs, VARLEN) + i_h * stride_qh
    k_base = k_ptr + _seq_start(i_b, bos_k, stride_kb, stride_ks, VARLEN) + i_hk * stride_kh
    v_base = v_ptr + _seq_start(i_b, bos_k, stride_vb, stride_vs, VARLEN) + i_hk * stride_vh
    o_off = _seq_start(i_b, bos_q, stride_ob, stride_os, VARLEN) + i_h * stride_oh + m0 * stride_os

    offs_m0 = tl.arange(0, BLOCK_M)
    offs_m = i_m * BLOCK_M + offs_m0
    offs_d = tl.arange(0, HEAD_DIM)
    m_m = offs_m < Sq
    if TMA:  # one (batch, head)'s [S, D] matrix per descriptor: rows past its end read as 0
        q = _rows_desc(q_base, Sq, stride_qs, BLOCK_M, HEAD_DIM).load([i_m * BLOCK_M, 0])
        k_src = _rows_desc(k_base, Sk, stride_ks, BLOCK_N, HEAD_DIM)
        v_src = _rows_desc(v_base, Sk, stride_vs, BLOCK_N, HEAD_DIM)
    else:
        q = tl.load(q_base + m0 * stride_qs + offs_m0[:, None] * stride_qs + offs_d[None, :], mask=m_m[:, None],
                    other=0.0)
        k_src, v_src = k_base, v_base

    shift = Sk - Sq
    full_end, hi = _causal_key_range(i_m, Sk, shift, BLOCK_M, BLOCK_N, CAUSAL)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if WARP_SPEC:  # the warp-specialising pass takes one loop: every tile masked if any tile needs it
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, offs_m, offs_d,
                                   0, hi, Sk, shift, qk_scale,
                                   BLOCK_M, BLOCK_N, CAUSAL or not EVEN_N, CAUSAL, UPCAST, IEEE, TMA, True, GUARD, EMU)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, offs_m, offs_d,
                                   0, full_end, Sk, shift, qk_scale,
                                   BLOCK_M, BLOCK_N, False, CAUSAL, UPCAST, IEEE, TMA, False, GUARD, EMU)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, offs_m, offs_d,
                                   full_end, hi, Sk, shift, qk_scale,
                                   BLOCK_M, BLOCK_N, True, CAUSAL, UPCAST, IEEE, TMA, False, GUARD, EMU)

    empty = l_i == 0.0  # the row saw no key
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    o_out = _cast(o, o_ptr.dtype.element_ty, UPCAST)
    p_o = offs_m0[:, None] * stride_os + offs_d[None, :]
    tl.store(o_ptr + o_off + p_o, o_out, mask=m_m[:, None])
    if STORE_RES:
        # the rounding error of o, for the backward's delta = rowsum(dO * o): with o alone it
        # carries o's rounding error, which dominates dq/dk when the softmax is peaked
        o_res = _cast(o - o_out.to(tl.float32), ores_ptr.dtype.element_ty, UPCAST)
        tl.store(ores_ptr + o_off + p_o, o_res, mask=m_m[:, None])
    tl.store(lse_ptr + _stats_row(i_bh, i_h, bos_q, Tq, VARLEN) + offs_m, lse, mask=m_m)
