"""Chunked Gated DeltaNet forward (chunk BT = 64, WY representation): kernels and launchers.

Three kernels, each with its own launcher, so a backward can call any of them alone:

1. ``chunk_gated_delta_rule_fwd_kernel_intra``, grid (chunks, B*HV) (ORDER 1: (chunks * HV/H, B*H)): everything
   inside one chunk.
   gamma = cumsum(g); A = strictly_lower(beta k k^T) * exp(gamma_i - gamma_j); T = (I + A)^-1 by
   forward substitution on the four 16x16 diagonal blocks, then a block merge with tensor-core
   dots; w = T diag(beta e^gamma) K, u = T diag(beta) V.
   Reads k, v, g, beta; writes gamma (fp32), w, u (input dtype); T (fp32) when asked
   (STORE_T, for a backward); decay and A (fp32) only in stages mode.
2. ``chunk_gated_delta_rule_fwd_kernel_h``, grid (V / BV, N*HV): the sequential inter-chunk
   recurrence for one (sequence, value head, V-block), the state block S [K, BV] in fp32 registers:
   v_new = u - w S; S <- e^gamma_last S + K^T diag(e^(gamma_last - gamma)) v_new. With FUSE_O it
   also writes the chunk's output (no HBM round trip of h and v_new):
   o = scale (diag(e^gamma) Q S + ((Q K^T) * decay) v_new). Reads w, u, k, gamma (+ q); writes
   the final state (fp32), o (FUSE_O), h (STORE_H: state entering each chunk, input dtype) and
   v_new (STORE_V_NEW, input dtype).
3. ``chunk_gated_delta_rule_fwd_kernel_o``, grid (V / BV, chunks, B*HV): the output from stored
   h and v_new (the unfused path; a backward recomputing o needs it).

``chunk_fwd`` runs kernel 1, then kernel 2 with the output fused when the recurrence alone fills
the GPU (``use_fused``: many sequences x heads), else kernel 2 (h, v_new) and kernel 3: with few
programs the fused kernel's longer serial chunk step costs more than the h and v_new round trips.

g and gamma are always fp32 in registers; every exp is of a masked argument <= 0 where g <= 0
(the masked-out entries get -inf before exp, never exp of a positive number). Padded rows of a
short last chunk load k = v = beta = g = 0, so they add nothing to A, w, u, v_new or the state.
With cu_seqlens (B = 1) each sequence starts its own chunks; ``chunk_indices`` maps a program to
(sequence, chunk) and ``chunk_offsets`` gives each sequence's first row in h.
"""

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triforge import _runtime, launch
from triforge.launch import new_output
from triforge.ops._tl import cast as _cast

BT = 64  # chunk length
BC = 16  # diagonal block of the triangular solve
L2NORM_EPS = tl.constexpr(1e-6)
# the log decay's floor inside the chunked kernels: e^-80 (1.8e-35, a normal fp32 number) is negligible beside O(1)
# values, so a g below it (-1e4, or -inf: a full reset) gives the fp32 result of -80, while gamma = cumsum(g) stays
# small enough that the g after it keep their bits (an unclamped -1e6 swallowed the next -0.1, and -inf gave
# exp(-inf - -inf) = NaN; the recurrent kernel reads g itself and needs no floor). NaN stays NaN. A run of r floored
# tokens in one chunk adds -80 r to gamma, as r tokens of g = -80 would: past a few dozen, the decays after it carry
# the fp32 cumsum's ~1e-4 relative error of any large |gamma| (the same at g = -30 a token, gamma ~ -1900).
G_FLOOR_VALUE = -80.0
G_FLOOR = tl.constexpr(G_FLOOR_VALUE)


# ----------------------------------------------------------------------------- shared helpers


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation. fp32 operands use PREC (tf32 or tf32x3). UPCAST: Triton
    3.6's CPU interpreter multiplies bf16 operands of tl.dot wrongly; compute in fp32 there."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision=PREC)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _inv_norm_rows(b_x):
    """[R, K] fp32 -> [R]: rsqrt(sum(x^2) + 1e-6), each row's l2norm scale."""
    return tl.rsqrt(tl.sum(b_x * b_x, axis=1) + L2NORM_EPS)


@triton.jit
def _l2norm_rows(b_x):
    """[R, K] -> fp32 rows scaled to unit length: x * rsqrt(sum(x^2) + 1e-6) (HF's / fla's l2norm)."""
    b_x = b_x.to(tl.float32)
    return b_x * _inv_norm_rows(b_x)[:, None]


@triton.jit
def _seq_span(i_n, T, cu_seqlens_ptr, IS_VARLEN: tl.constexpr):
    """(bos, seq_len) of sequence i_n: its first row (int64) and its length (packed: from cu_seqlens;
    else every sequence has T rows)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens_ptr + i_n).to(tl.int64)
        seq_len = (tl.load(cu_seqlens_ptr + i_n + 1) - bos).to(tl.int32)
    else:
        bos = i_n.to(tl.int64) * T
        seq_len = T
    return bos, seq_len


@triton.jit
def _state_program(i_nh, T, cu_seqlens_ptr, chunk_offsets_ptr, H: tl.constexpr, HV: tl.constexpr, BT: tl.constexpr,
                   IS_VARLEN: tl.constexpr):
    """(i_hv, i_h, bos, seq_len, boh, NT) of the recurrences' program i_nh = sequence x value head: the
    value head and its q/k head, the sequence's first row and length, its first chunk in the per-chunk
    state buffers (h, dh; packed: from chunk_offsets) and its number of chunks."""
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, seq_len = _seq_span(i_n, T, cu_seqlens_ptr, IS_VARLEN)
    if IS_VARLEN:
        boh = tl.load(chunk_offsets_ptr + i_n).to(tl.int64)
    else:
        boh = i_n.to(tl.int64) * tl.cdiv(T, BT)
    return i_hv, i_h, bos, seq_len, boh, tl.cdiv(seq_len, BT)


@triton.jit
def _chunk_coords(i_c, i_b, T, cu_seqlens_ptr, chunk_indices_ptr, IS_VARLEN: tl.constexpr):
    """(bos, seq_len, i_t, i_n) of program chunk i_c: sequence start row, its length, the chunk
    inside the sequence and the sequence index."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices_ptr + i_c * 2).to(tl.int64)
        i_t = tl.load(chunk_indices_ptr + i_c * 2 + 1)
    else:
        i_n = i_b.to(tl.int64)
        i_t = i_c
    bos, seq_len = _seq_span(i_n, T, cu_seqlens_ptr, IS_VARLEN)
    return bos, seq_len, i_t, i_n


@triton.jit
def _decay(b_gamma, m_t, BT: tl.constexpr):
    """[BT, BT] exp(gamma_i - gamma_j) for valid i >= j, else 0 (masked before the exp)."""
    o_i = tl.arange(0, BT)
    m_keep = (o_i[:, None] >= o_i[None, :]) & m_t[:, None] & m_t[None, :]
    return tl.exp(tl.where(m_keep, b_gamma[:, None] - b_gamma[None, :], float("-inf")))


@triton.jit
def _solve_unit_lower(b_A, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, DIAG_PRODUCT: tl.constexpr):
    """(I + A)^-1 for a strictly lower [BT, BT] A (fp32).

    The NB = BT / BC diagonal blocks D are inverted first: Td = (I + D)^-1. DIAG_PRODUCT 1 (BC = 16): as the
    product (I - D)(I + D^2)(I + D^4)(I + D^8) (D^16 = 0) of the block-diagonal [BT, BT] D, six tensor-core dots
    four deep (products of block-diagonal matrices stay block-diagonal, exactly; reference.solve_unit_lower_blocks
    models its tf32 operands); DIAG_PRODUCT 2: the same six products of the NB blocks as batched [NB, BC, BC]
    dots (mma.sync on sm90, no zero blocks: local sm90 build at 8 warps 135 registers, 128 under maxnreg 128 with
    no spill, against 252 for DIAG_PRODUCT 1; sm90.json's choice since session 45, at 4 warps: 12-13% faster than
    DIAG_PRODUCT 1 on the H200, 8 warps slower); 0: by forward substitution in fp32, all
    NB at once as [NB, BC, BC] tiles, row r of every block per step (BC - 1 serial steps, each two cross-thread
    sums). With E = A - D (strictly block-lower),
    I + A = (I + D)(I + N) with N = Td E, N^NB = 0, so (I + A)^-1 = sum_p (-N)^p Td: NB tensor-core dots,
    each of block-lower matrices.
    """
    NB: tl.constexpr = BT // BC
    o_i = tl.arange(0, BT)
    m_eye = o_i[:, None] == o_i[None, :]
    if DIAG_PRODUCT == 1:
        tl.static_assert(BC == 16, "the product form of the diagonal blocks is written for BC = 16")
        b_D = tl.where((o_i // BC)[:, None] == (o_i // BC)[None, :], b_A, 0.0)
        b_D2 = tl.dot(b_D, b_D, input_precision=PREC)
        b_D4 = tl.dot(b_D2, b_D2, input_precision=PREC)
        b_D3 = tl.dot(b_D, b_D2, input_precision=PREC)
        b_X = tl.where(m_eye, 1.0, 0.0) - b_D + b_D2 - b_D3  # (I - D)(I + D^2)
        b_D8 = tl.dot(b_D4, b_D4, input_precision=PREC)
        b_X = b_X + tl.dot(b_X, b_D4, input_precision=PREC)  # (I - D)(I + D^2)(I + D^4)
        b_Td = b_X + tl.dot(b_X, b_D8, input_precision=PREC)
    else:
        o_b = tl.arange(0, NB)
        m_same = o_b[:, None] == o_b[None, :]  # [NB, NB]
        b_A4 = tl.reshape(b_A, [NB, BC, NB, BC])
        b_D = tl.sum(tl.where(m_same[:, None, :, None], b_A4, 0.0), axis=2)  # [NB, BC, BC]
        o_r = tl.arange(0, BC)
        if DIAG_PRODUCT == 2:
            # the product form as batched [NB, BC, BC] dots: the same products as DIAG_PRODUCT 1 without its
            # zero blocks (1/NB of the multiply-adds, a quarter of the registers per tile)
            tl.static_assert(BC == 16, "the product form of the diagonal blocks is written for BC = 16")
            b_D2 = tl.dot(b_D, b_D, input_precision=PREC)
            b_D4 = tl.dot(b_D2, b_D2, input_precision=PREC)
            b_D3 = tl.dot(b_D, b_D2, input_precision=PREC)
            b_X = tl.where((o_r[:, None] == o_r[None, :])[None, :, :], 1.0, 0.0) - b_D + b_D2 - b_D3
            b_D8 = tl.dot(b_D4, b_D4, input_precision=PREC)
            b_X = b_X + tl.dot(b_X, b_D4, input_precision=PREC)
            b_Tb = b_X + tl.dot(b_X, b_D8, input_precision=PREC)  # (I + D)^-1 of every block
            b_Td = tl.reshape(tl.where(m_same[:, None, :, None], b_Tb[:, :, None, :], 0.0), [BT, BT])
        else:
            b_Ti = tl.zeros([NB, BC, BC], dtype=tl.float32)  # (I + D)^-1 - I, strictly lower
            for r in range(1, BC):
                m_row = (o_r == r)[None, :, None]
                b_a = -tl.sum(tl.where(m_row, b_D, 0.0), axis=1)  # [NB, BC]: -D[r, :] of every block
                b_a = b_a + tl.sum(b_a[:, :, None] * b_Ti, axis=1)
                b_Ti = tl.where(m_row, b_a[:, None, :], b_Ti)
            b_Td = tl.reshape(tl.where(m_same[:, None, :, None], b_Ti[:, :, None, :], 0.0), [BT, BT])
            b_Td = tl.where(m_eye, 1.0, b_Td)
    b_E = tl.where((o_i // BC)[:, None] > (o_i // BC)[None, :], b_A, 0.0)
    b_N = tl.dot(b_Td, b_E, input_precision=PREC)
    b_P = b_Td
    b_T = b_Td
    for _ in tl.static_range(1, NB):
        b_P = -tl.dot(b_N, b_P, input_precision=PREC)
        b_T += b_P
    return b_T


# ----------------------------------------------------------------------------- kernels


@triton.jit
def chunk_gated_delta_rule_fwd_kernel_intra(
    k_ptr,  # [B, T, H, K] input dtype
    v_ptr,  # [B, T, HV, V] input dtype
    g_ptr,  # [B, T, HV] log decay, fp32 or input dtype
    beta_ptr,  # [B, T, HV] fp32 or input dtype
    gamma_ptr,  # [B, T, HV] fp32 out: cumsum of g inside each chunk
    w_ptr,  # [B, T, HV, K] out, k's dtype: T diag(beta e^gamma) K
    u_ptr,  # [B, T, HV, V] out, v's dtype: T diag(beta) V
    t_ptr,  # [B, T, HV, BT] fp32 out (STORE_T): (I + A)^-1, row t holds its chunk's row
    decay_ptr,  # [B, T, HV, BT] fp32 out (STAGES)
    a_ptr,  # [B, T, HV, BT] fp32 out (STAGES): A before the solve
    kn_ptr,  # [B, T, H, K] out (STORE_KN), k's dtype: the l2-normalised k the later kernels read
    cu_seqlens_ptr,  # [N + 1] int32 (IS_VARLEN)
    chunk_indices_ptr,  # [chunks, 2] int32: (sequence, chunk in sequence) (IS_VARLEN)
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    L2NORM: tl.constexpr,
    STORE_T: tl.constexpr,
    STAGES: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE: tl.constexpr,
    V_LATE: tl.constexpr,
    STORE_KN: tl.constexpr = False,
    DIAG_PRODUCT: tl.constexpr = 1,
    ORDER: tl.constexpr = 0,
):
    """ORDER (config key): 0, the grid (chunk, sequence x value head); 1, (chunk x G, sequence x k head) with
    G = HV / H, so the G value heads that read one k tile run as neighbouring programs and all but the first find
    it in L2 (2, sm90.json's entry: the launcher picks by the reuse distance, ``_intra_order``).
    DIAG_PRODUCT (1, the default where the configs file has no entry; the launcher's config key: 0 for the
    substitution, 2 for the same products batched over the blocks, sm90.json's entry since session 45,
    ``_solve_unit_lower``): the solve's diagonal blocks
    inverted by tensor-core products (``_solve_unit_lower``; sm90, bf16, K = V = 128: 835.6 against 881.6 us for
    the substitution under its register cap at (1, 32768, 16, 32), 786.8 / 796.6 at (8, 4096, 16, 32), 417.2 /
    430.4 at (4, 8192, 16, 16), 219.7 / 229.5 at (1, 8192, 32, 32); benchmarks/NOTES.md, session 27).
    STORE_KN (with L2NORM): the normalised k, rounded to k's dtype as w uses it, is stored for the recurrence
    and the output kernel, which then skip their own normalisation of k (K_NORMED).
    V_LATE: v is loaded after the solve and k diag(beta e^gamma) formed before it, so neither v nor the
    fp32 k is live through the solve (sm90, bf16, K = V = 128: 176 registers at 8 warps against 246, no
    spill at 4 warps against 140 bytes); the v load's latency is no longer hidden behind the solve."""
    if ORDER == 1:
        i_c, i_bh = tl.program_id(0) // (HV // H), tl.program_id(1) * (HV // H) + tl.program_id(0) % (HV // H)
    else:
        i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos, seq_len, i_t, _ = _chunk_coords(i_c, i_b, T, cu_seqlens_ptr, chunk_indices_ptr, IS_VARLEN)

    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    m_t = o_t < seq_len
    o_row = bos + o_t.to(tl.int64)  # [BT] global token rows
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)

    b_g = tl.load(g_ptr + o_row * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_g = tl.where(b_g < G_FLOOR, G_FLOOR, b_g)  # (a NaN compares false: it stays)
    b_beta = tl.load(beta_ptr + o_row * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_gamma = tl.cumsum(b_g, axis=0)
    tl.store(gamma_ptr + o_row * HV + i_hv, b_gamma, mask=m_t)

    b_k = tl.load(k_ptr + (o_row * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    if L2NORM:
        # k k^T of the unit rows as (k k^T) * r_i r_j, r = rsqrt(|k|^2 + eps): the products of the stored 16-bit
        # values are exact in the fp32 accumulation (tf32 products of the fp32 unit rows kept 10 bits), and the
        # dot's operands are k's 16-bit tile (16 KB of shared memory each, against 32 KB for fp32 rows)
        b_kf = b_k.to(tl.float32)
        b_r = _inv_norm_rows(b_kf)
        b_kk = _dot(b_k, tl.trans(b_k), None, PREC, UPCAST)
        b_kk = b_kk * b_r[:, None] * b_r[None, :]
        b_k = _cast(b_kf * b_r[:, None], k_ptr.dtype.element_ty, RNE)  # = _l2norm_rows(k), rounded
        if STORE_KN:  # one writer per k head: the first of its value heads
            tl.store(kn_ptr + (o_row * H + i_h)[:, None] * K + o_k[None, :], b_k,
                     mask=m_t[:, None] & (i_hv % (HV // H) == 0))
    else:
        b_kk = _dot(b_k, tl.trans(b_k), None, PREC, UPCAST)
    p_v = v_ptr + (o_row * HV + i_hv)[:, None] * V + o_v[None, :]
    if V_LATE:
        b_kb = _cast(b_k.to(tl.float32) * (b_beta * tl.exp(tl.where(m_t, b_gamma, 0.0)))[:, None], b_k.dtype, RNE)
    else:
        b_v = tl.load(p_v, mask=m_t[:, None], other=0.0)

    b_decay = _decay(b_gamma, m_t, BT)
    b_A = tl.where(o_i[:, None] > o_i[None, :], b_kk * b_beta[:, None] * b_decay, 0.0)
    b_T = _solve_unit_lower(b_A, BT, BC, PREC, DIAG_PRODUCT)

    # w = T diag(beta e^gamma) K, u = T diag(beta) V; e^gamma <= 1 (masked rows: beta = 0)
    if V_LATE:
        b_v = tl.load(p_v, mask=m_t[:, None], other=0.0)
    else:
        b_kb = _cast(b_k.to(tl.float32) * (b_beta * tl.exp(tl.where(m_t, b_gamma, 0.0)))[:, None], b_k.dtype, RNE)
    b_vb = _cast(b_v.to(tl.float32) * b_beta[:, None], b_v.dtype, RNE)
    b_w = _dot(_cast(b_T, b_k.dtype, RNE), b_kb, None, PREC, UPCAST)
    b_u = _dot(_cast(b_T, b_v.dtype, RNE), b_vb, None, PREC, UPCAST)
    tl.store(w_ptr + (o_row * HV + i_hv)[:, None] * K + o_k[None, :], _cast(b_w, w_ptr.dtype.element_ty, RNE),
             mask=m_t[:, None])
    tl.store(u_ptr + (o_row * HV + i_hv)[:, None] * V + o_v[None, :], _cast(b_u, u_ptr.dtype.element_ty, RNE),
             mask=m_t[:, None])

    o_sq = (o_row * HV + i_hv)[:, None] * BT + o_i[None, :]  # [BT, BT] rows of the [.., BT] buffers
    if STORE_T:
        tl.store(t_ptr + o_sq, b_T, mask=m_t[:, None])
    if STAGES:
        tl.store(decay_ptr + o_sq, b_decay, mask=m_t[:, None])
        tl.store(a_ptr + o_sq, b_A, mask=m_t[:, None])


@triton.jit
def _chunk_p(b_q, b_k, b_gamma, m_t, BT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, RNE: tl.constexpr):
    """[BT, BT] P = (Q K^T) * decay of one chunk, rounded to q's dtype: the output kernel's, stored by the training
    forward, and the backward's dh kernel's where it is not (the same expression, so the same bits)."""
    b_qk = _dot(b_q, tl.trans(b_k), None, PREC, UPCAST)
    return _cast(b_qk * _decay(b_gamma, m_t, BT), b_q.dtype, RNE)


@triton.jit
def _chunk_output(b_q, b_k, b_S, b_vn, b_gamma, m_t, scale, BT: tl.constexpr, PREC: tl.constexpr,
                  UPCAST: tl.constexpr, RNE: tl.constexpr):
    """([BT, BV] fp32 scale (diag(e^gamma) Q S + P v_new), P) of one chunk (P: ``_chunk_p``)."""
    b_o = _dot(b_q, _cast(b_S, b_q.dtype, RNE), None, PREC, UPCAST)
    b_o = b_o * tl.exp(tl.where(m_t, b_gamma, 0.0))[:, None]
    b_p = _chunk_p(b_q, b_k, b_gamma, m_t, BT, PREC, UPCAST, RNE)
    b_o = _dot(b_p, _cast(b_vn, b_q.dtype, RNE), b_o, PREC, UPCAST)
    return b_o * scale, b_p


@triton.jit
def chunk_gated_delta_rule_fwd_kernel_h(
    q_ptr,  # [B, T, H, K] (FUSE_O)
    k_ptr,  # [B, T, H, K]
    w_ptr,  # [B, T, HV, K]
    u_ptr,  # [B, T, HV, V]
    gamma_ptr,  # [B, T, HV] fp32
    h0_ptr,  # [N, HV, K, V] fp32 initial state (USE_H0)
    ht_ptr,  # [N, HV, K, V] fp32 out: final state (STORE_FINAL)
    h_ptr,  # [B, NT, HV, K, V] out (STORE_H): state entering each chunk, input dtype
    v_new_ptr,  # [B, T, HV, V] out (STORE_V_NEW), input dtype
    o_ptr,  # [B, T, HV, V] out (FUSE_O), v's dtype
    cu_seqlens_ptr,  # [N + 1] int32 (IS_VARLEN)
    chunk_offsets_ptr,  # [N + 1] int32: first chunk of each sequence in h (IS_VARLEN)
    T,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_FINAL: tl.constexpr,
    FUSE_O: tl.constexpr,
    STORE_H: tl.constexpr,
    STORE_V_NEW: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE: tl.constexpr,
    K_NORMED: tl.constexpr = False,
):
    """K_NORMED (with L2NORM): k arrives l2-normalised (the intra kernel's STORE_KN); only q is normalised here."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_hv, i_h, bos, seq_len, boh, NT = _state_program(i_nh, T, cu_seqlens_ptr, chunk_offsets_ptr, H, HV, BT,
                                                      IS_VARLEN)

    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_kv = o_k[:, None] * V + o_v[None, :]  # [K, BV] offsets inside one state
    o_state = i_nh.to(tl.int64) * K * V

    b_S = tl.zeros([K, BV], dtype=tl.float32)
    if USE_H0:
        b_S += tl.load(h0_ptr + o_state + o_kv, mask=m_v[None, :], other=0.0)

    for i_t in range(NT):
        o_t = i_t * BT + o_i
        m_t = o_t < seq_len
        o_row = bos + o_t.to(tl.int64)
        m_tv = m_t[:, None] & m_v[None, :]
        if STORE_H:
            o_h = ((boh + i_t) * HV + i_hv) * K * V
            tl.store(h_ptr + o_h + o_kv, _cast(b_S, h_ptr.dtype.element_ty, RNE), mask=m_v[None, :])

        b_w = tl.load(w_ptr + (o_row * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        o_vrow = (o_row * HV + i_hv)[:, None] * V + o_v[None, :]
        b_u = tl.load(u_ptr + o_vrow, mask=m_tv, other=0.0).to(tl.float32)
        b_vn = b_u - _dot(b_w, _cast(b_S, b_w.dtype, RNE), None, PREC, UPCAST)  # [BT, BV] fp32
        if STORE_V_NEW:
            tl.store(v_new_ptr + o_vrow, _cast(b_vn, v_new_ptr.dtype.element_ty, RNE), mask=m_tv)

        b_gamma = tl.load(gamma_ptr + o_row * HV + i_hv, mask=m_t, other=0.0)
        last = tl.minimum(i_t * BT + BT, seq_len) - 1
        b_glast = tl.load(gamma_ptr + (bos + last) * HV + i_hv)
        b_k = tl.load(k_ptr + (o_row * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        if L2NORM and not K_NORMED:
            b_k = _cast(_l2norm_rows(b_k), k_ptr.dtype.element_ty, RNE)

        if FUSE_O:
            b_q = tl.load(q_ptr + (o_row * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
            if L2NORM:
                b_q = _cast(_l2norm_rows(b_q), q_ptr.dtype.element_ty, RNE)
            b_o, _ = _chunk_output(b_q, b_k, b_S, b_vn, b_gamma, m_t, scale, BT, PREC, UPCAST, RNE)
            tl.store(o_ptr + o_vrow, _cast(b_o, o_ptr.dtype.element_ty, RNE), mask=m_tv)

        # S <- e^gamma_last S + K^T diag(e^(gamma_last - gamma)) v_new
        b_vs = b_vn * tl.exp(tl.where(m_t, b_glast - b_gamma, float("-inf")))[:, None]
        b_S = b_S * tl.exp(b_glast)
        b_S = _dot(tl.trans(b_k), _cast(b_vs, b_k.dtype, RNE), b_S, PREC, UPCAST)

    if STORE_FINAL:
        tl.store(ht_ptr + o_state + o_kv, b_S, mask=m_v[None, :])


@triton.jit
def chunk_gated_delta_rule_fwd_kernel_o(
    q_ptr,  # [B, T, H, K]
    k_ptr,  # [B, T, H, K]
    v_new_ptr,  # [B, T, HV, V]
    h_ptr,  # [B, NT, HV, K, V] state entering each chunk
    gamma_ptr,  # [B, T, HV] fp32
    o_ptr,  # [B, T, HV, V] out, v's dtype
    qn_ptr,  # [B, T, H, K] out (STORE_QN), q's dtype: the l2-normalised q, kept for the backward
    p_ptr,  # [B, T, HV, BT] out (STORE_P), q's dtype: P = (Q K^T) * decay, row t its chunk's row
    cu_seqlens_ptr,  # [N + 1] int32 (IS_VARLEN)
    chunk_indices_ptr,  # [chunks, 2] int32 (IS_VARLEN)
    T,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE: tl.constexpr,
    K_NORMED: tl.constexpr = False,
    STORE_QN: tl.constexpr = False,
    STORE_P: tl.constexpr = False,
):
    """STORE_QN (with L2NORM; the training forward): the normalised q, rounded as the output uses it, is also
    stored, by one program per q head and chunk (the first V-block of the head's first value head), so the
    backward does not normalise q again. STORE_P (the training forward): P as the output uses it, by the first
    V-block, so the backward's dh kernel reads it instead of computing it in its serial loop."""
    i_v, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos, seq_len, i_t, _ = _chunk_coords(i_c, i_b, T, cu_seqlens_ptr, chunk_indices_ptr, IS_VARLEN)
    # h row of this chunk: chunks are numbered in order (varlen: over all sequences)
    i_hc = i_c.to(tl.int64) if IS_VARLEN else i_b.to(tl.int64) * tl.cdiv(T, BT) + i_c

    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < seq_len
    o_row = bos + o_t.to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]

    b_q = tl.load(q_ptr + (o_row * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    b_k = tl.load(k_ptr + (o_row * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    if L2NORM:
        b_q = _cast(_l2norm_rows(b_q), q_ptr.dtype.element_ty, RNE)
        if not K_NORMED:
            b_k = _cast(_l2norm_rows(b_k), k_ptr.dtype.element_ty, RNE)
        if STORE_QN:
            tl.store(qn_ptr + (o_row * H + i_h)[:, None] * K + o_k[None, :], b_q,
                     mask=m_t[:, None] & (i_v == 0) & (i_hv % (HV // H) == 0))
    b_S = tl.load(h_ptr + (i_hc * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
    o_vrow = (o_row * HV + i_hv)[:, None] * V + o_v[None, :]
    b_vn = tl.load(v_new_ptr + o_vrow, mask=m_tv, other=0.0)
    b_gamma = tl.load(gamma_ptr + o_row * HV + i_hv, mask=m_t, other=0.0)
    b_o, b_p = _chunk_output(b_q, b_k, b_S.to(tl.float32), b_vn.to(tl.float32), b_gamma, m_t, scale, BT, PREC, UPCAST,
                             RNE)
    tl.store(o_ptr + o_vrow, _cast(b_o, o_ptr.dtype.element_ty, RNE), mask=m_tv)
    if STORE_P:
        o_j = tl.arange(0, BT)
        tl.store(p_ptr + (o_row * HV + i_hv)[:, None] * BT + o_j[None, :], b_p, mask=m_t[:, None] & (i_v == 0))


# ----------------------------------------------------------------------------- launch configs

_FALLBACK = {
    "gated_delta_rule_fwd_intra": {"num_warps": 4, "num_stages": 2, "V_LATE": 1},
    "gated_delta_rule_fwd_h": {"BV": 64, "num_warps": 4, "num_stages": 2},
    "gated_delta_rule_fwd_h_o": {"BV": 64, "num_warps": 4, "num_stages": 1},
    "gated_delta_rule_fwd_o": {"BV": 64, "num_warps": 4, "num_stages": 2},
}
# Triton 3.6 on sm_90 miscompiles the fused recurrence (FUSE_O) with V-blocks of 16 or 32 (wrong
# states; an illegal address at BV = 32); BV = 64 and 128 gave the reference's values. Other
# shapes take the unfused recurrence + output kernel.
FUSED_BV = (64, 128)
_RECURRENCES = ("gated_delta_rule_fwd_h", "gated_delta_rule_fwd_h_o")


# Compiled (Triton 3.6, sm_90) the kernels go wrong at head dims of 32: an illegal address in the intra
# kernel at K = 32 (V = 128), NaN in the recurrence at V = 32 (K = 128) (benchmarks/deltanet_probe.py on
# the H100); 64, 128 and 256 give the reference's values. chunk_fwd and chunk_bwd therefore run head
# dims below 64 zero-padded to 64 there, which is exact: padded q/k coordinates add 0 to every dot
# product and to the l2norm, padded v columns stay 0 through u, v_new, the state and o, and padded
# state rows / columns of the initial state are 0. The launchers refuse smaller dims when compiled.
PAD_MIN = 64
PAD_SMALL_DIMS = not _runtime.INTERPRET  # tests switch it on in the interpreter to check the padding
_K_NAMES = frozenset({"w", "dq_hv", "dk_local", "dw", "dk_hv", "dq", "dk"})
_V_NAMES = frozenset({"u", "v_new", "o", "dv_new", "dv"})
_KV_NAMES = frozenset({"h", "final_state", "dh", "dh0"})


def padded_dims(K, V):
    """The head dims the kernels run at (K, V itself unless PAD_SMALL_DIMS and one is below PAD_MIN)."""
    if not PAD_SMALL_DIMS:
        return K, V
    return max(K, PAD_MIN), max(V, PAD_MIN)


def pad_last(x, n, dims=1):
    """x zero-padded to n along its last ``dims`` dims (None stays None)."""
    if x is None or all(d == n for d in x.shape[-dims:]):
        return x
    pads = []
    for d in reversed(x.shape[-dims:]):
        pads += [0, n - d]
    return torch.nn.functional.pad(x, pads)


def pad_state(x, K, V):
    """[..., k, v] zero-padded to [..., K, V] (None stays None)."""
    if x is None or x.shape[-2:] == (K, V):
        return x
    return torch.nn.functional.pad(x, (0, V - x.shape[-1], 0, K - x.shape[-2]))


def unpad(name, x, K, V):
    """A stage or result named ``name`` of a padded run, cut back to head dims K, V."""
    if x is None or x.numel() == 0:  # absent: None or an empty placeholder (final state not asked for)
        return x
    if name in _K_NAMES:
        return x[..., :K].contiguous()
    if name in _V_NAMES:
        return x[..., :V].contiguous()
    if name in _KV_NAMES:
        return x[..., :K, :V].contiguous()
    return x


def check_kernel_dims(K, V):
    """Compiled launches need K, V >= PAD_MIN when PAD_SMALL_DIMS (chunk_fwd / chunk_bwd pad)."""
    if PAD_SMALL_DIMS and min(K, V) < PAD_MIN:
        raise ValueError(f"compiled Gated DeltaNet kernels take head dims >= {PAD_MIN} (K={K}, V={V}): "
                         "chunk_fwd / chunk_bwd pad smaller ones")


def config_key(K, V, dtype, nh=None):
    """Config key: head dims, dtype and (for the recurrence) the bucket of sequences x heads."""
    fields = {"k": K, "v": V, "dtype": launch.dtype_tag(dtype)}
    if nh is not None:
        fields["nh"] = min(launch.next_power_of_2(nh), 4096)
    return launch.config_key(**fields)


def fwd_config(kernel, K, V, dtype, nh=None):
    """Tuned config of ``kernel`` (recurrences keyed by nh = sequences x value heads too), else the
    fallback: V-blocks of 64 (at most V), 8 warps once the state block passes 128 x 64."""
    nh = nh if kernel in _RECURRENCES else None
    return dict(_fwd_config(kernel, K, V, dtype, nh, _runtime.config_scope()))  # (a copy: callers may edit it)


@launch.config_cache
def _fwd_config(kernel, K, V, dtype, nh, scope):  # scope (arch, device tag): a key of the cache only
    fallback = dict(_FALLBACK[kernel])
    if "BV" in fallback:
        fallback["BV"] = min(fallback["BV"], V)
        if kernel in _RECURRENCES and K * fallback["BV"] > 128 * 64:
            fallback["num_warps"] = 8
        if _runtime.INTERPRET:
            fallback["BV"] = min(V, 16)  # several V-blocks even at V = 32
    return launch.config(kernel, config_key(K, V, dtype, nh), fallback)


def use_fused(K, V, nh):
    """Fuse the output into the recurrence when the recurrence alone fills the GPU (>= 2 programs
    per SM at BV = 64): it saves the h and v_new round trips; with fewer programs the fused kernel's
    longer serial chunk step costs more than the separate, fully parallel output kernel."""
    if _runtime.INTERPRET:
        return True
    return V >= min(FUSED_BV) and nh * launch.cdiv(V, 64) >= 2 * _runtime.num_sms()


GLUON_ENV = "TRIFORGE_DELTANET_GLUON"
# the training forward (residuals kept for the backward) through the Gluon kernel too (fused_ws SAVE): "1" takes it
# where the inference forward would; off by default until measured on a GPU (built in session 44 without one)
GLUON_SAVE_ENV = "TRIFORGE_DELTANET_GLUON_SAVE"


def gluon_save_on():
    """Whether a saving (training) forward may take the Gluon kernel (``TRIFORGE_DELTANET_GLUON_SAVE=1``)."""
    flag = os.environ.get(GLUON_SAVE_ENV, "0")
    if flag not in ("0", "1"):
        raise ValueError(f"{GLUON_SAVE_ENV} must be 0 or 1, got {flag!r}")
    return flag == "1"


def gluon_save_cfg(cfg):
    """``cfg`` for the kernel's SAVE variant: at BV 64 the output partitions give the state partition 8 registers per
    thread for its h and v_new stores (168: ptxas spilled 8-16 bytes; 160: none, local sm90 build, session 44)."""
    return dict(cfg, OUT_REGS=min(cfg["OUT_REGS"], 160)) if cfg["BV"] == 64 else dict(cfg)


# fused_ws.fwd_ws's two configs (gluon_config's choice; benchmarks/NOTES.md, session 40)
GLUON_CFGS = {
    "bv32": {"BV": 32, "STAGES": 3, "NB": 3, "FTZ": 1, "L2NORM": 3, "OUT_REGS": 152, "LOAD_REGS": 80},
    "bv64": {"BV": 64, "STAGES": 2, "NB": 3, "FTZ": 1, "L2NORM": 1, "OUT_REGS": 168, "LOAD_REGS": 24},
}


def gluon_on(x):
    """Whether the Gluon kernels may take a launch on ``x``'s device: compiled sm90 launches of 16-bit tensors,
    unless ``TRIFORGE_DELTANET_GLUON=0``."""
    flag = os.environ.get(GLUON_ENV, "1")
    if flag not in ("0", "1"):
        raise ValueError(f"{GLUON_ENV} must be 0 or 1, got {flag!r}")
    if flag == "0" or _runtime.INTERPRET or not x.is_cuda or _runtime.arch() != "sm90":
        return False
    return x.dtype in (torch.float16, torch.bfloat16)


def tma_ready(*tensors):
    """Contiguous and 16-byte aligned: what a TMA descriptor over the tensor needs."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


def gluon_config(q, K, V, nh, initial_state=None, l2norm=True):
    """The launch config of fused_ws.py's warp-specialized Gluon recurrence + output where it takes a forward that
    keeps nothing for a backward, else None: compiled sm90 launches of 16-bit contiguous inputs at K = 128 and V a
    multiple of 64 (``TRIFORGE_DELTANET_GLUON=0``: never). nh = sequences x value heads.
    Measured (benchmarks/NOTES.md, session 40): 32-column V-blocks with the loader warpgroup taking q's row norms
    (L2NORM 3) while those programs fit in one wave (nh V / 32 <= SMs: (1, 32768, 16, 32), (1, 8192, 32, 32)), else
    64-column V-blocks with q normalised in its ring slot ((8, 4096, 16, 32), (4, 8192, 16, 16))."""
    if not gluon_on(q) or K != 128 or V % 64 != 0:
        return None
    if not tma_ready(q):  # q is read by TMA (w, u and kn are the intra kernel's)
        return None
    if initial_state is not None and (initial_state.dtype != torch.float32 or not initial_state.is_contiguous()):
        return None
    cfg = dict(GLUON_CFGS["bv32" if nh * (V // 32) <= _runtime.num_sms() else "bv64"])
    if not l2norm:  # no q norms: the plain loader warp
        cfg.update(L2NORM=0, LOAD_REGS=24)
    return cfg


def _flags(dtype):
    """Kernel numerics flags for inputs of ``dtype``."""
    bf16_interp = _runtime.INTERPRET and dtype == torch.bfloat16
    return {"PREC": "tf32x3" if dtype == torch.float32 else "tf32", "UPCAST": bf16_interp, "RNE": bf16_interp}


# ----------------------------------------------------------------------------- varlen bookkeeping


@dataclass
class Varlen:
    """cu_seqlens (int32) and the chunk tables derived from it (built on the host once per call)."""

    cu_seqlens: torch.Tensor  # [N + 1] int32
    chunk_indices: torch.Tensor  # [NT, 2] int32: (sequence, chunk inside it)
    chunk_offsets: torch.Tensor  # [N + 1] int32: first chunk of each sequence
    n_chunks: int
    n_seqs: int


def prepare_varlen(cu_seqlens) -> Varlen | None:
    if cu_seqlens is None:
        return None
    cu = cu_seqlens.to(torch.int32)
    lens = (cu[1:] - cu[:-1]).long()
    per_seq = (lens + BT - 1) // BT
    offsets = torch.cat([per_seq.new_zeros(1), per_seq.cumsum(0)])
    n_chunks = int(offsets[-1])
    seq = torch.repeat_interleave(torch.arange(len(lens), device=cu.device), per_seq, output_size=n_chunks)
    local = torch.arange(n_chunks, device=cu.device) - offsets[seq]
    indices = torch.stack([seq, local], 1).to(torch.int32).contiguous()
    return Varlen(cu.contiguous(), indices, offsets.to(torch.int32), n_chunks, len(lens))


def _n_chunks(T, varlen, B):
    return (B, launch.cdiv(T, BT)) if varlen is None else (1, varlen.n_chunks)


def _varlen_ptrs(varlen, device):
    if varlen is None:
        dummy = torch.empty(1, dtype=torch.int32, device=device)
        return dummy, dummy, dummy
    return varlen.cu_seqlens, varlen.chunk_indices, varlen.chunk_offsets


# ----------------------------------------------------------------------------- launchers


_RESIDENT: dict = {}


def _intra_order(order, n_c, G, args, kw):
    """The intra grid's order (config key ORDER): 0 or 1 as given; 2 picks by the reuse distance of a k tile. Under
    ORDER 0 the G value heads that read one k tile are n_c programs apart (n_c: the grid's chunks, a sequence's or,
    packed, all of them), so past the programs resident at once the tile is read from HBM G times; then 1, which
    makes them neighbours (H200, session 45: -3.5% at (1, 32768, 16, 32), n_c 512 against 396 resident; +2% at
    (8, 4096, 16, 32), n_c 64, where ORDER 0 already finds the tile in L2)."""
    if order != 2:
        return order
    if G == 1 or _runtime.INTERPRET:
        return 0
    # what the compiled variant's resources depend on (its constexprs follow from these and the dtypes), and the device
    key = (args[0].device, args[0].dtype, args[1].dtype, kw["H"], kw["HV"], kw["K"], kw["V"], kw["L2NORM"],
           kw["STORE_T"], kw["STAGES"], kw["IS_VARLEN"], kw["V_LATE"], kw["STORE_KN"], kw["DIAG_PRODUCT"],
           kw["num_warps"], kw["num_stages"], kw.get("maxnreg"))
    per_sm = _RESIDENT.get(key)
    if per_sm is None:
        per_sm = _RESIDENT[key] = launch.resident_programs(chunk_gated_delta_rule_fwd_kernel_intra, args,
                                                           dict(kw, ORDER=1))
    return 1 if n_c > per_sm * _runtime.num_sms() else 0


def chunk_fwd_intra(k, v, g, beta, *, l2norm=False, varlen=None, store_t=False, stages=False, store_kn=False, cfg=None):
    """Kernel 1. k [B, T, H, K], v [B, T, HV, V], g, beta [B, T, HV] -> dict with gamma [B, T, HV] fp32,
    w [B, T, HV, K], u [B, T, HV, V] (input dtype), T (store_t or stages), decay, A (stages):
    [B, T, HV, 64] fp32, and kn [B, T, H, K] (store_kn with l2norm): k l2-normalised, in k's dtype."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    check_kernel_dims(K, V)
    cfg = cfg or fwd_config("gated_delta_rule_fwd_intra", K, V, k.dtype)
    dev = k.device
    out = {
        "gamma": new_output((B, T, HV), torch.float32, dev),
        "w": new_output((B, T, HV, K), k.dtype, dev),
        "u": new_output((B, T, HV, V), v.dtype, dev),
    }
    sq = (B, T, HV, BT)
    t_buf = new_output(sq, torch.float32, dev) if (store_t or stages) else out["gamma"]
    decay = new_output(sq, torch.float32, dev) if stages else out["gamma"]
    a_buf = new_output(sq, torch.float32, dev) if stages else out["gamma"]
    store_kn = store_kn and l2norm
    kn = new_output(k.shape, k.dtype, dev) if store_kn else out["w"]
    cu, indices, _ = _varlen_ptrs(varlen, dev)
    n_b, n_c = _n_chunks(T, varlen, B)
    e = k.element_size()
    nbytes = (B * T * (H * K * e * (1 + int(store_kn)) + HV * V * e + 2 * HV * 4) + B * T * HV * (K + V) * e
              + B * T * HV * 4)
    args = (k, v, g, beta, out["gamma"], out["w"], out["u"], t_buf, decay, a_buf, kn, cu, indices, T)
    kw = dict(
        H=H, HV=HV, K=K, V=V, BT=BT, BC=BC, L2NORM=l2norm, STORE_T=store_t or stages, STAGES=stages,
        IS_VARLEN=varlen is not None, **_flags(k.dtype), V_LATE=bool(cfg.get("V_LATE", 0)), STORE_KN=store_kn,
        DIAG_PRODUCT=int(cfg.get("DIAG_PRODUCT", 1)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        # a register cap (config key maxnreg; sm90's entry had 168 until session 27, when the product-form solve
        # without a cap measured faster) only for the launch that stores neither T nor the stages: with T stored
        # the spills cost more than the occupancy buys
        **(launch.maxnreg_option(cfg) if not (store_t or stages) else {}),
    )
    kw["ORDER"] = order = _intra_order(int(cfg.get("ORDER", 0)), n_c, HV // H, args, kw)
    grid = (n_c * (HV // H), n_b * H) if order == 1 else (n_c, n_b * HV)
    launch.launch("gated_delta_rule_fwd_intra", chunk_gated_delta_rule_fwd_kernel_intra, grid, *args, nbytes=nbytes,
                  **kw)
    if store_kn:
        out["kn"] = kn
    if store_t or stages:
        out["T"] = t_buf
    if stages:
        out["decay"], out["A"] = decay, a_buf
    return out


def _fwd_h_launch(q, k, w, u, gamma, initial_state, scale, *, l2norm, varlen, fuse_o, store_h, store_v_new,
                  output_final_state, cfg, k_normed=False):
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    check_kernel_dims(K, V)
    N = B if varlen is None else varlen.n_seqs
    kernel = "gated_delta_rule_fwd_h_o" if fuse_o else "gated_delta_rule_fwd_h"
    cfg = cfg or fwd_config(kernel, K, V, k.dtype, N * HV)
    if fuse_o and cfg["BV"] not in FUSED_BV and not _runtime.INTERPRET:
        raise ValueError(f"the fused recurrence needs BV in {FUSED_BV}, got {cfg['BV']}")
    dev = k.device
    n_b, n_c = _n_chunks(T, varlen, B)
    final = new_output((N, HV, K, V) if output_final_state else (0,), torch.float32, dev)
    h = new_output((n_b, n_c, HV, K, V), k.dtype, dev) if store_h else final
    v_new = new_output((B, T, HV, V), u.dtype, dev) if store_v_new else final
    o = new_output((B, T, HV, V), u.dtype, dev) if fuse_o else final
    cu, _, offsets = _varlen_ptrs(varlen, dev)
    e = k.element_size()
    n_v = launch.cdiv(V, cfg["BV"])
    nbytes = (B * T * (HV * K * e * n_v + HV * V * e + H * K * e * n_v * (2 if fuse_o else 1) + HV * 4)
              + N * HV * K * V * 4 * (int(initial_state is not None) + int(output_final_state))
              + (n_b * n_c * HV * K * V * e if store_h else 0) + B * T * HV * V * e * (int(store_v_new) + int(fuse_o)))
    launch.launch(
        kernel, chunk_gated_delta_rule_fwd_kernel_h, (n_v, N * HV),
        q if q is not None else k, k, w, u, gamma, initial_state if initial_state is not None else final,
        final, h, v_new, o, cu, offsets, T, scale,
        nbytes=nbytes, H=H, HV=HV, K=K, V=V, BT=BT, BV=cfg["BV"], L2NORM=l2norm, USE_H0=initial_state is not None,
        STORE_FINAL=output_final_state, FUSE_O=fuse_o, STORE_H=store_h, STORE_V_NEW=store_v_new, IS_VARLEN=varlen is not None, **_flags(k.dtype),
        K_NORMED=bool(k_normed and l2norm), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return {"final_state": final, "h": h if store_h else None, "v_new": v_new if store_v_new else None,
            "o": o if fuse_o else None}


def chunk_fwd_h(k, w, u, gamma, initial_state=None, *, l2norm=False, varlen=None, output_final_state=True, cfg=None,
                k_normed=False):
    """Kernel 2 alone: (h [B, NT, HV, K, V], v_new [B, T, HV, V], final_state [N, HV, K, V] fp32 or an
    empty tensor). With varlen, B = 1 and NT counts the chunks of every sequence. k_normed: k is already
    l2-normalised (the intra kernel's kn)."""
    r = _fwd_h_launch(None, k, w, u, gamma, initial_state, 1.0, l2norm=l2norm, varlen=varlen, fuse_o=False,
                      store_h=True, store_v_new=True, output_final_state=output_final_state, cfg=cfg,
                      k_normed=k_normed)
    return r["h"], r["v_new"], r["final_state"]


def chunk_fwd_h_o(q, k, w, u, gamma, initial_state, scale, *, l2norm=False, varlen=None, stages=False,
                  output_final_state=True, cfg=None, k_normed=False):
    """Kernel 2 with the output fused: dict o [B, T, HV, V], final_state (fp32, or an empty tensor
    when not asked); h and v_new in stages mode."""
    return _fwd_h_launch(q, k, w, u, gamma, initial_state, scale, l2norm=l2norm, varlen=varlen, fuse_o=True,
                         store_h=stages, store_v_new=stages, output_final_state=output_final_state, cfg=cfg,
                         k_normed=k_normed)


def chunk_fwd_o(q, k, v_new, h, gamma, scale, *, l2norm=False, varlen=None, cfg=None, k_normed=False, qn=None,
                p=None):
    """Kernel 3: o [B, T, HV, V] from the stored states h and v_new (k_normed: k already l2-normalised).
    qn (with l2norm): a [B, T, H, K] buffer in q's dtype that receives the normalised q (the training forward).
    p: a [B, T, HV, BT] buffer in q's dtype that receives P = (Q K^T) * decay per chunk (the training forward)."""
    B, T, H, K = q.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    check_kernel_dims(K, V)
    cfg = cfg or fwd_config("gated_delta_rule_fwd_o", K, V, q.dtype)
    n_b, n_c = _n_chunks(T, varlen, B)
    o = new_output((B, T, HV, V), v_new.dtype, q.device)
    cu, indices, _ = _varlen_ptrs(varlen, q.device)
    e = q.element_size()
    n_v = launch.cdiv(V, cfg["BV"])
    store_qn = qn is not None and l2norm
    if store_qn and (qn.shape != q.shape or qn.dtype != q.dtype or not qn.is_contiguous()):
        raise ValueError(f"qn must be a contiguous {tuple(q.shape)} {q.dtype} buffer, got {tuple(qn.shape)} {qn.dtype}")
    if p is not None and (tuple(p.shape) != (B, T, HV, BT) or p.dtype != q.dtype or not p.is_contiguous()):
        raise ValueError(f"p must be a contiguous {(B, T, HV, BT)} {q.dtype} buffer, got {tuple(p.shape)} {p.dtype}")
    nbytes = (B * T * (2 * H * K * e * n_v + 2 * HV * V * e + HV * 4 + H * K * e * int(store_qn)
                       + HV * BT * e * int(p is not None)) + h.numel() * e)
    launch.launch(
        "gated_delta_rule_fwd_o", chunk_gated_delta_rule_fwd_kernel_o, (n_v, n_c, n_b * HV),
        q, k, v_new, h, gamma, o, qn if store_qn else o, p if p is not None else o, cu, indices, T, scale,
        nbytes=nbytes, H=H, HV=HV, K=K, V=V, BT=BT, BV=cfg["BV"], L2NORM=l2norm, IS_VARLEN=varlen is not None,
        K_NORMED=bool(k_normed and l2norm), STORE_QN=store_qn, STORE_P=p is not None, **_flags(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o


# chunk_fwd(save=True)'s residuals, in this order; qn and kn (the normalised q and k) are empty without l2norm, and P
# (the output kernel's (Q K^T) * decay, [B, T, HV, BT]) is empty after a fused recurrence
SAVED_NAMES = ("gamma", "w", "T", "h", "v_new", "qn", "kn", "P")


def _saved(q, k, gamma, w, t, h, v_new, qn, kn, p):
    """The saving forward's residuals by ``SAVED_NAMES``; qn, kn, P absent (None) as distinct empty tensors (a custom
    op's outputs may not alias each other)."""
    return {"gamma": gamma, "w": w, "T": t, "h": h, "v_new": v_new,
            "qn": qn if qn is not None else q.new_empty((0,)), "kn": kn if kn is not None else k.new_empty((0,)),
            "P": p if p is not None else q.new_empty((0,))}


def chunk_fwd(q, k, v, g, beta, scale, initial_state=None, *, output_final_state=True, l2norm=False, cu_seqlens=None,
              stages=False, fuse_o=None, save=False):
    """The chunked forward: the intra kernel, then the recurrence with the output fused, or the
    recurrence and the output kernel (``fuse_o``; None: ``use_fused``'s choice).

    Returns (o, final_state); with ``stages`` a dict of every stage instead (gamma, decay, A, T, w,
    u, h, v_new, o, final_state), all from the kernels' own buffers. With ``save``: (o, final_state,
    saved), saved = {gamma, w, T, h, v_new, qn, kn} (``SAVED_NAMES``), what the backward would otherwise
    recompute with the intra and state kernels and its l2norm kernel (T stored by the intra kernel; with
    l2norm kn by the intra kernel and qn by the output kernel, empty tensors without; the recurrence runs
    unfused unless ``fuse_o`` is True, and the fused one then stores h and v_new too, and q is normalised by
    the backward's kernel 0; with ``TRIFORGE_DELTANET_GLUON_SAVE=1``, where the Gluon kernel would take the
    inference forward, its SAVE variant stores h, v_new and P, and kernel 0 forms qn); at padded head dims
    (``padded_dims``) in the padded dims.
    """
    K, V = q.shape[3], v.shape[3]
    Kp, Vp = padded_dims(K, V)
    if (Kp, Vp) != (K, V):
        res = chunk_fwd(pad_last(q, Kp), pad_last(k, Kp), pad_last(v, Vp), g, beta, scale,
                        pad_state(initial_state, Kp, Vp), output_final_state=output_final_state, l2norm=l2norm,
                        cu_seqlens=cu_seqlens, stages=stages, fuse_o=fuse_o, save=save)
        if stages:
            return {n: unpad(n, t, K, V) for n, t in res.items()}
        return (unpad("o", res[0], K, V), unpad("final_state", res[1], K, V)) + tuple(res[2:])
    varlen = prepare_varlen(cu_seqlens)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if varlen is None else varlen.n_seqs
    use_ws = not (stages or fuse_o is False) and (not save or gluon_save_on())
    ws = gluon_config(q, K, V, N * HV, initial_state, l2norm) if use_ws else None
    if ws is not None and save:
        ws = gluon_save_cfg(ws)
    if fuse_o is None:
        # saving: the unfused pair (the fused recurrence storing h and v_new took 1.48 ms at (8, 4096, 16, 32)
        # against 0.97 without the stores; the unfused state kernel, which stores them anyway, 0.55)
        fuse_o = use_fused(K, V, N * HV) and not save
    want_final = output_final_state or stages
    # with l2norm the intra kernel also stores the normalised k: the later kernels read it instead of
    # normalising k again (the recurrence did so in every V-block program at every chunk step)
    intra = chunk_fwd_intra(k, v, g, beta, l2norm=l2norm, varlen=varlen, stages=stages, store_t=save,
                            store_kn=l2norm)
    w, u, gamma = intra["w"], intra["u"], intra["gamma"]
    if ws is not None:  # Hopper: the warp-specialized Gluon recurrence + output (imported only here: no interpreter)
        from triforge.ops.deltanet.fused_ws import fwd_ws

        res = fwd_ws(q, intra.get("kn", k), w, u, gamma, initial_state, scale, l2norm=l2norm,
                     cu_seqlens=None if varlen is None else varlen.cu_seqlens, output_final_state=output_final_state,
                     cfg=ws, save=save, chunk_offsets=None if varlen is None else varlen.chunk_offsets,
                     n_chunks=None if varlen is None else varlen.n_chunks)
        if not save:
            return res
        o, final, kept = res
        qn = None
        if l2norm:  # qn as the Triton saving forward keeps it (kernel 0's bits; the op's fake has its shape)
            from triforge.ops.deltanet.chunk_bwd import chunk_bwd_l2norm

            qn = chunk_bwd_l2norm(q)[0]
        return o, final, _saved(q, k, gamma, w, intra["T"], kept["h"], kept["v_new"], qn, intra.get("kn"), kept["P"])
    kk = intra.get("kn", k)
    # the training forward keeps the normalised q (stored by the output kernel) for the backward
    # (the fused kernel does not store it: after a fused saving forward the backward's kernel 0 normalises q)
    qn = new_output(q.shape, q.dtype, q.device) if save and l2norm and not stages and not fuse_o else None
    # and P, which the backward's dh kernel would otherwise recompute in its serial chunk loop
    p = new_output((B, T, HV, BT), q.dtype, q.device) if save and not stages and not fuse_o else None
    if fuse_o:
        rec = chunk_fwd_h_o(q, kk, w, u, gamma, initial_state, scale, l2norm=l2norm, varlen=varlen,
                            stages=stages or save, output_final_state=want_final, k_normed=l2norm)
        o, final, h, v_new = rec["o"], rec["final_state"], rec["h"], rec["v_new"]  # (stages: h and v_new stored)
    else:
        h, v_new, final = chunk_fwd_h(kk, w, u, gamma, initial_state, l2norm=l2norm, varlen=varlen,
                                      output_final_state=want_final, k_normed=l2norm)
        o = chunk_fwd_o(q, kk, v_new, h, gamma, scale, l2norm=l2norm, varlen=varlen, k_normed=l2norm, qn=qn, p=p)
    if save and not stages:
        return o, final, _saved(q, k, gamma, w, intra["T"], h, v_new, qn, intra.get("kn"), p)
    if not stages:
        return o, final
    out = {n: intra[n] for n in ("gamma", "decay", "A", "T", "w", "u")}
    out.update(h=h, v_new=v_new, o=o, final_state=final)
    return out
