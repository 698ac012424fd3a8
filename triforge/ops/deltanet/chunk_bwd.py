"""Chunked Gated DeltaNet backward (chunk BT = 64): kernels and launchers.

The math, stage by stage, is in ``reference.py``'s docstring and ``reference.chunk_bwd_ref_stages``;
the buffers below carry the same names. ``chunk_bwd`` runs:

- Unless the training forward kept them (``saved``: ``chunk.chunk_fwd(save=True)``), the forward's
  launchers again: ``chunk.chunk_fwd_intra`` (gamma, w, u, T = (I + A)^-1 and, with l2norm, the
  normalised k) and ``chunk.chunk_fwd_h`` (h, the state entering each chunk, and v_new).
0. ``chunk_gated_delta_rule_bwd_kernel_l2norm``, grid (B*T*H / BR): with the in-kernel l2norm and no
   saved qn, q normalised once (k comes normalised from an intra kernel), rounded to the input dtype
   as the forward kernels round them, so the kernels below read unit rows in K-blocks. The training
   forward keeps both (its output kernel stores qn, its intra kernel kn), so this kernel does not run.
1. ``chunk_gated_delta_rule_bwd_kernel_dh``, grid (V / BV, N*HV): the reverse recurrence over the
   chunks of one (sequence, value head, V-block), the state gradient dS [K, BV] in fp32 registers:
   dv_new = P^T dO + diag(l) K dS; dS <- e^gamma_last dS + Q^T diag(scale e) dO - w^T dv_new.
   P = (Q K^T) * decay comes from the training forward (saved, its output kernel's) or is computed here.
   Reads q, k, w, gamma, dO (+ dht, P); writes dh (the gradient of the state leaving each chunk,
   input dtype), dv_new (= du, input dtype) and dh0 (fp32).
2. ``chunk_gated_delta_rule_bwd_kernel_dqkw``, grid (K / BK, chunks, B*HV): one chunk of one value
   head and one K-block, looping over V-blocks for dO S^T, v_new dS'^T, dv_new S^T and dO v_new^T
   (the last recomputed by every K-block). Reads q, k, gamma, v_new, h, dh, dO, dv_new; writes
   dq_hv and dw [B, T, HV, K] (input dtype), dk_local (fp32) and dgamma_local as one partial sum per
   K-block [K / BK, B, T, HV] (every dgamma term is a sum over K, so the split is exact).
3. ``chunk_gated_delta_rule_bwd_kernel_wy``, grid (chunks, B*HV): back through the WY
   representation. V-blocks: dT = du (diag(beta) V)^T, dv = diag(beta) T^T du; K-blocks: dT +=
   dw (diag(beta e) K)^T, the beta/gamma terms of T^T dw, K K^T; then dA = -T^T dT T^T and A's
   terms; dg = the reverse cumsum of dgamma inside the chunk; a second K-block pass writes dk_hv =
   dk_local + diag(beta e) T^T dw + (dKK + dKK^T) K. Reads k, v, beta, gamma, T, dw, dv_new,
   dk_local, dgamma_local; writes dk_hv (fp32, over dk_local unless stages are asked), dv, dbeta,
   dg (their inputs' dtypes), and dT, dA, dgamma in stages mode. (dq_hv is stored in the input dtype,
   as fla stores its per-value-head dq: in fp32 it was 0.54 GB of the backward's traffic at (8, 4096,
   16, 32). dk_hv stays fp32: the l2norm's backward cancels its last rows' terms by ~2000x where a
   final-state gradient enters, below a 16-bit rounding of them; reference.py.)
4. ``chunk_gated_delta_rule_bwd_kernel_qk``, grid (B*T / BR, H): dq = l2norm_bwd(scale * sum of
   the group's dq_hv), dk likewise: the sum over the HV / H value heads reading a query/key head,
   then the l2norm's backward r (dy - y (y . dy)) on the raw q and k. Writes dq, dk (q's dtype).

Every exponent is of a masked argument <= 0, as in the forward: e = e^gamma, l = e^(gamma_last -
gamma) and the decay mask; padded rows of a short last chunk load zeros and get e = l = 0. Matrix
products are tensor-core ``tl.dot``s with fp32 accumulation (fp32 inputs: tf32x3); row scalings
are applied to the [BT, BV] side or after the product, so no fp32 [BT, K] temporaries stay live.
Register budget (sm90, bf16, K = V = 128, the fallback configs; ``test_deltanet_bwd`` compiles them):
no spills. fp32 inputs at K = 128 spill (tf32x3 splits every operand), as the forward's do.

The default backward (``TRIFORGE_DELTANET_BWD=torch`` selects a PyTorch recompute; see ``__init__``).
Triton 3.6 miscompiles the WY kernel on sm90 when it is pipelined at 4 or 8 warps (dbeta/dgamma
rel. error 4-6e-3 against float64 on its own inputs, 1e-4 unpipelined: benchmarks/NOTES.md), so its
configs have 1 stage; the tuner refuses configs whose outputs disagree with the fallback's.
"""

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from triforge import _runtime, launch
from triforge.launch import new_output
from triforge.ops._tl import cast as _cast
from triforge.ops.deltanet.chunk import (
    BT,
    L2NORM_EPS,
    _chunk_coords,
    _chunk_p,
    _decay,
    _dot,
    _flags,
    _l2norm_rows,
    _n_chunks,
    _state_program,
    _varlen_ptrs,
    check_kernel_dims,
    chunk_fwd_h,
    chunk_fwd_intra,
    gluon_on,
    pad_last,
    pad_state,
    padded_dims,
    prepare_varlen,
    tma_ready,
    unpad,
)

# ----------------------------------------------------------------------------- kernels


@triton.jit
def chunk_gated_delta_rule_bwd_kernel_l2norm(
    q_ptr,  # [R, K] (R = B*T*H rows)
    k_ptr,  # [R, K]
    qn_ptr,  # [R, K] out, q's dtype: q * rsqrt(|q|^2 + 1e-6), rounded as the forward rounds it
    kn_ptr,  # [R, K] out, k's dtype (HAS_K)
    R,
    K: tl.constexpr,
    BR: tl.constexpr,
    RNE: tl.constexpr,
    HAS_K: tl.constexpr = True,  # False: q alone (k arrives normalised from the forward's intra kernel)
):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = o_r < R
    o_x = o_r[:, None] * K + tl.arange(0, K)[None, :]
    b_q = tl.load(q_ptr + o_x, mask=m_r[:, None], other=0.0)
    tl.store(qn_ptr + o_x, _cast(_l2norm_rows(b_q), qn_ptr.dtype.element_ty, RNE), mask=m_r[:, None])
    if HAS_K:
        b_k = tl.load(k_ptr + o_x, mask=m_r[:, None], other=0.0)
        tl.store(kn_ptr + o_x, _cast(_l2norm_rows(b_k), kn_ptr.dtype.element_ty, RNE), mask=m_r[:, None])


# T unspecialised here alone: the other chunked kernels specialise it (1-10% faster on the H100, session 32:
# benchmarks/results/logs-2026-11-24-session32/call1), this one measured 5% slower with it at (1, 32768, 16, 32)
@triton.jit(do_not_specialize=["T"])
def chunk_gated_delta_rule_bwd_kernel_dh(
    q_ptr,  # [B, T, H, K] (normalised when the forward normalises)
    k_ptr,  # [B, T, H, K] (normalised likewise)
    w_ptr,  # [B, T, HV, K]
    gamma_ptr,  # [B, T, HV] fp32
    do_ptr,  # [B, T, HV, V]
    dht_ptr,  # [N, HV, K, V] fp32: the final state's gradient (USE_DHT)
    dh_ptr,  # [B, NT, HV, K, V] out: gradient of the state leaving each chunk, input dtype
    dv_new_ptr,  # [B, T, HV, V] out, input dtype
    dh0_ptr,  # [N, HV, K, V] fp32 out: the initial state's gradient (STORE_DH0)
    p_ptr,  # [B, T, HV, BT] q's dtype: the forward's P = (Q K^T) * decay (LOAD_P)
    cu_seqlens_ptr,  # [N + 1] int32 (IS_VARLEN)
    chunk_offsets_ptr,  # [N + 1] int32: first chunk of each sequence in dh (IS_VARLEN)
    T,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    USE_DHT: tl.constexpr,
    STORE_DH0: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE: tl.constexpr,
    LOAD_P: tl.constexpr = False,
):
    """LOAD_P: P comes from the training forward (its output kernel's, the same bits as ``_chunk_p`` here), so the
    serial chunk loop runs four tensor-core products instead of five (H100, benchmarks/deltanet_dh_ablation.py at
    166c1a9: 933 -> 639 us at (8, 4096, 16, 32), 1565 -> 893 at (1, 32768, 16, 32))."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_hv, i_h, bos, seq_len, boh, NT = _state_program(i_nh, T, cu_seqlens_ptr, chunk_offsets_ptr, H, HV, BT,
                                                      IS_VARLEN)

    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_kv = o_k[:, None] * V + o_v[None, :]  # [K, BV] offsets inside one state
    o_state = i_nh.to(tl.int64) * K * V

    b_dS = tl.zeros([K, BV], dtype=tl.float32)
    if USE_DHT:
        b_dS += tl.load(dht_ptr + o_state + o_kv, mask=m_v[None, :], other=0.0)

    for i_s in range(NT):
        i_t = NT - 1 - i_s
        o_t = i_t * BT + o_i
        m_t = o_t < seq_len
        o_row = bos + o_t.to(tl.int64)
        m_tv = m_t[:, None] & m_v[None, :]
        o_h = ((boh + i_t) * HV + i_hv) * K * V
        tl.store(dh_ptr + o_h + o_kv, _cast(b_dS, dh_ptr.dtype.element_ty, RNE), mask=m_v[None, :])

        o_qk = (o_row * H + i_h)[:, None] * K + o_k[None, :]
        b_q = tl.load(q_ptr + o_qk, mask=m_t[:, None], other=0.0)
        b_k = tl.load(k_ptr + o_qk, mask=m_t[:, None], other=0.0)
        b_w = tl.load(w_ptr + (o_row * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_gamma = tl.load(gamma_ptr + o_row * HV + i_hv, mask=m_t, other=0.0)
        last = tl.minimum(i_t * BT + BT, seq_len) - 1
        b_glast = tl.load(gamma_ptr + (bos + last) * HV + i_hv)
        o_vrow = (o_row * HV + i_hv)[:, None] * V + o_v[None, :]
        b_do = tl.load(do_ptr + o_vrow, mask=m_tv, other=0.0)

        # dv_new = P^T dO + diag(l) K dS   (P = (Q K^T) * decay, in q's dtype as the forward's output uses it; scale
        # applied after)
        if LOAD_P:
            b_p = tl.load(p_ptr + (o_row * HV + i_hv)[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
        else:
            b_p = _chunk_p(b_q, b_k, b_gamma, m_t, BT, PREC, UPCAST, RNE)
        b_dvn = _dot(tl.trans(b_p), b_do, None, PREC, UPCAST) * scale
        b_l = tl.exp(tl.where(m_t, b_glast - b_gamma, float("-inf")))
        b_dvn += _dot(b_k, _cast(b_dS, b_k.dtype, RNE), None, PREC, UPCAST) * b_l[:, None]
        tl.store(dv_new_ptr + o_vrow, _cast(b_dvn, dv_new_ptr.dtype.element_ty, RNE), mask=m_tv)

        # dS <- e^gamma_last dS + Q^T diag(scale e) dO - w^T dv_new
        b_e = tl.exp(tl.where(m_t, b_gamma, float("-inf")))
        b_doe = _cast(b_do.to(tl.float32) * (b_e * scale)[:, None], b_q.dtype, RNE)
        b_dS = b_dS * tl.exp(b_glast)
        b_dS = _dot(tl.trans(b_q), b_doe, b_dS, PREC, UPCAST)
        b_dS = _dot(tl.trans(b_w), _cast(-b_dvn, b_w.dtype, RNE), b_dS, PREC, UPCAST)

    if STORE_DH0:
        tl.store(dh0_ptr + o_state + o_kv, b_dS, mask=m_v[None, :])


@triton.jit
def chunk_gated_delta_rule_bwd_kernel_dqkw(
    q_ptr,  # [B, T, H, K] (normalised when the forward normalises)
    k_ptr,  # [B, T, H, K] (normalised likewise)
    v_new_ptr,  # [B, T, HV, V]
    h_ptr,  # [B, NT, HV, K, V] state entering each chunk
    dh_ptr,  # [B, NT, HV, K, V] gradient of the state leaving each chunk
    do_ptr,  # [B, T, HV, V]
    dv_new_ptr,  # [B, T, HV, V]
    gamma_ptr,  # [B, T, HV] fp32
    dq_ptr,  # [B, T, HV, K] out, input dtype: dq_hv (gradient of the scaled, normalised q of each value head)
    dk_ptr,  # [B, T, HV, K] fp32 out: dk_local (through o and the state, not w or A)
    dw_ptr,  # [B, T, HV, K] out, input dtype
    dgamma_ptr,  # [K / BK, B, T, HV] fp32 out: dgamma_local, one partial sum per K-block
    cu_seqlens_ptr,  # [N + 1] int32 (IS_VARLEN)
    chunk_indices_ptr,  # [chunks, 2] int32 (IS_VARLEN)
    T,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE: tl.constexpr,
):
    i_k, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos, seq_len, i_t, _ = _chunk_coords(i_c, i_b, T, cu_seqlens_ptr, chunk_indices_ptr, IS_VARLEN)
    i_hc = i_c.to(tl.int64) if IS_VARLEN else i_b.to(tl.int64) * tl.cdiv(T, BT) + i_c
    o_h = (i_hc * HV + i_hv) * K * V

    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    m_t = o_t < seq_len
    o_row = bos + o_t.to(tl.int64)
    o_k = i_k * BK + tl.arange(0, BK)

    b_dos = tl.zeros([BT, BK], dtype=tl.float32)  # dO S^T
    b_vds = tl.zeros([BT, BK], dtype=tl.float32)  # v_new dS'^T
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)  # dv_new S^T
    b_dp = tl.zeros([BT, BT], dtype=tl.float32)  # dO v_new^T
    b_sds = tl.zeros([BK], dtype=tl.float32)  # sum(S * dS') by row
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        o_vrow = (o_row * HV + i_hv)[:, None] * V + o_v[None, :]
        b_vn = tl.load(v_new_ptr + o_vrow, mask=m_tv, other=0.0)
        b_do = tl.load(do_ptr + o_vrow, mask=m_tv, other=0.0)
        b_dvn = tl.load(dv_new_ptr + o_vrow, mask=m_tv, other=0.0)
        o_kv = o_k[:, None] * V + o_v[None, :]
        b_S = tl.load(h_ptr + o_h + o_kv, mask=m_v[None, :], other=0.0)
        b_dS = tl.load(dh_ptr + o_h + o_kv, mask=m_v[None, :], other=0.0)
        b_dos = _dot(b_do, tl.trans(b_S), b_dos, PREC, UPCAST)
        b_vds = _dot(b_vn, tl.trans(b_dS), b_vds, PREC, UPCAST)
        b_dw = _dot(b_dvn, tl.trans(b_S), b_dw, PREC, UPCAST)
        b_dp = _dot(b_do, tl.trans(b_vn), b_dp, PREC, UPCAST)
        b_sds += tl.sum(b_S.to(tl.float32) * b_dS.to(tl.float32), axis=1)

    o_qk = (o_row * H + i_h)[:, None] * K + o_k[None, :]
    b_q = tl.load(q_ptr + o_qk, mask=m_t[:, None], other=0.0)
    b_k = tl.load(k_ptr + o_qk, mask=m_t[:, None], other=0.0)
    b_gamma = tl.load(gamma_ptr + o_row * HV + i_hv, mask=m_t, other=0.0)
    n_valid = tl.minimum(seq_len - i_t * BT, BT)
    b_glast = tl.load(gamma_ptr + (bos + i_t * BT + n_valid - 1) * HV + i_hv)
    b_e = tl.exp(tl.where(m_t, b_gamma, float("-inf")))
    b_l = tl.exp(tl.where(m_t, b_glast - b_gamma, float("-inf")))

    b_dp = b_dp * _decay(b_gamma, m_t, BT)  # dP: the gradient of Q K^T (q scaled)
    b_dpc = _cast(b_dp, b_k.dtype, RNE)
    # dq_hv = diag(e) dO S^T + dP K;  dk_local = dP^T Q + diag(l) v_new dS'^T
    b_dq = _dot(b_dpc, b_k, b_dos * b_e[:, None], PREC, UPCAST)
    b_dk = _dot(tl.trans(b_dpc), b_q, None, PREC, UPCAST) * scale + b_vds * b_l[:, None]
    # dgamma_local (this K-block's share) = e rowsum(Q * dO S^T) + rowsum(M) - colsum(M) - a, M = dP * Q K^T,
    # a = l rowsum(K * v_new dS'^T); the last row adds sum(a) + e^gamma_last sum(S * dS')
    b_m = b_dp * _dot(b_q, tl.trans(b_k), None, PREC, UPCAST) * scale
    b_a = b_l * tl.sum(b_k.to(tl.float32) * b_vds, axis=1)
    b_dg = b_e * tl.sum(b_q.to(tl.float32) * b_dos, axis=1) * scale + tl.sum(b_m, axis=1) - tl.sum(b_m, axis=0) - b_a
    b_dg += tl.where(o_i == n_valid - 1, tl.sum(b_a, axis=0) + tl.exp(b_glast) * tl.sum(b_sds, axis=0), 0.0)

    o_krow = (o_row * HV + i_hv)[:, None] * K + o_k[None, :]
    tl.store(dq_ptr + o_krow, _cast(b_dq, dq_ptr.dtype.element_ty, RNE), mask=m_t[:, None])
    tl.store(dk_ptr + o_krow, b_dk, mask=m_t[:, None])
    tl.store(dw_ptr + o_krow, _cast(-b_dw, dw_ptr.dtype.element_ty, RNE), mask=m_t[:, None])
    n_all = (tl.num_programs(2) // HV).to(tl.int64) * T  # B*T rows (varlen: B = 1)
    tl.store(dgamma_ptr + i_k * n_all * HV + o_row * HV + i_hv, b_dg, mask=m_t)


@triton.jit
def chunk_gated_delta_rule_bwd_kernel_wy(
    k_ptr,  # [B, T, H, K] (normalised when the forward normalises)
    v_ptr,  # [B, T, HV, V]
    beta_ptr,  # [B, T, HV]
    gamma_ptr,  # [B, T, HV] fp32
    t_ptr,  # [B, T, HV, BT] fp32: (I + A)^-1, row t holds its chunk's row
    dw_ptr,  # [B, T, HV, K] input dtype
    dv_new_ptr,  # [B, T, HV, V]: du
    dk_local_ptr,  # [B, T, HV, K] fp32
    dgamma_local_ptr,  # [NP, B, T, HV] fp32: kernel 2's partial sums
    dk_ptr,  # [B, T, HV, K] fp32 out: dk_hv (may alias dk_local: each program reads its rows first)
    dv_ptr,  # [B, T, HV, V] out, v's dtype
    dbeta_ptr,  # [B, T, HV] out, beta's dtype
    dg_ptr,  # [B, T, HV] out, g's dtype
    dgamma_ptr,  # [B, T, HV] fp32 out (STAGES)
    dt_ptr,  # [B, T, HV, BT] fp32 out (STAGES): dT, strictly lower
    da_ptr,  # [B, T, HV, BT] fp32 out (STAGES): dA, strictly lower
    cu_seqlens_ptr,  # [N + 1] int32 (IS_VARLEN)
    chunk_indices_ptr,  # [chunks, 2] int32 (IS_VARLEN)
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NP: tl.constexpr,
    STAGES: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE: tl.constexpr,
):
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos, seq_len, i_t, _ = _chunk_coords(i_c, i_b, T, cu_seqlens_ptr, chunk_indices_ptr, IS_VARLEN)

    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    m_t = o_t < seq_len
    o_row = bos + o_t.to(tl.int64)
    o_hrow = o_row * HV + i_hv  # [BT] rows of the [B, T, HV] buffers
    o_sq = o_hrow[:, None] * BT + o_i[None, :]
    m_lower = (o_i[:, None] > o_i[None, :]) & m_t[:, None] & m_t[None, :]

    b_beta = tl.load(beta_ptr + o_hrow, mask=m_t, other=0.0).to(tl.float32)
    b_gamma = tl.load(gamma_ptr + o_hrow, mask=m_t, other=0.0)
    b_e = tl.exp(tl.where(m_t, b_gamma, float("-inf")))
    b_T = tl.load(t_ptr + o_sq, mask=m_lower, other=0.0) + tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    b_Tc = _cast(b_T, v_ptr.dtype.element_ty, RNE)
    b_dgamma = tl.zeros([BT], dtype=tl.float32)
    n_all = (tl.num_programs(1) // HV).to(tl.int64) * T  # B*T rows (varlen: B = 1)
    for i_p in tl.static_range(NP):
        b_dgamma += tl.load(dgamma_local_ptr + i_p * n_all * HV + o_hrow, mask=m_t, other=0.0)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)

    # u = T diag(beta) V: dT = du (diag(beta) V)^T, dv = diag(beta) T^T du
    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        o_vrow = o_hrow[:, None] * V + o_v[None, :]
        b_v = tl.load(v_ptr + o_vrow, mask=m_tv, other=0.0)
        b_du = tl.load(dv_new_ptr + o_vrow, mask=m_tv, other=0.0)
        b_vb = _cast(b_v.to(tl.float32) * b_beta[:, None], b_v.dtype, RNE)
        b_dT = _dot(b_du, tl.trans(b_vb), b_dT, PREC, UPCAST)
        b_dvb = _dot(tl.trans(b_Tc), b_du, None, PREC, UPCAST)
        tl.store(dv_ptr + o_vrow, _cast(b_dvb * b_beta[:, None], dv_ptr.dtype.element_ty, RNE), mask=m_tv)
        b_dbeta += tl.sum(b_dvb * b_v.to(tl.float32), axis=1)

    # w = T diag(beta e) K: dT += dw (diag(beta e) K)^T; d(diag(beta e) K) = T^T dw; K K^T for A's terms
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = tl.load(k_ptr + (o_row * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_dw = tl.load(dw_ptr + o_hrow[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_kbg = _cast(b_k.to(tl.float32) * (b_beta * b_e)[:, None], b_k.dtype, RNE)
        b_dT = _dot(b_dw, tl.trans(b_kbg), b_dT, PREC, UPCAST)
        b_dkbg_k = tl.sum(_dot(tl.trans(b_Tc), b_dw, None, PREC, UPCAST) * b_k.to(tl.float32), axis=1)
        b_dbeta += b_e * b_dkbg_k
        b_dgamma += b_beta * b_e * b_dkbg_k
        b_kk = _dot(b_k, tl.trans(b_k), b_kk, PREC, UPCAST)

    # dA = -strictly_lower(T^T dT T^T); only T's strictly lower part depends on A
    b_dT = tl.where(m_lower, b_dT, 0.0)
    b_dA = _dot(_dot(tl.trans(b_T), b_dT, None, PREC, UPCAST), tl.trans(b_T), None, PREC, UPCAST)
    b_dA = tl.where(m_lower, -b_dA, 0.0)

    # A = beta_i (k_i . k_j) decay_ij: G = dA * K K^T * decay, dKK = diag(beta) dA * decay, M2 = dA * A
    b_dAd = b_dA * _decay(b_gamma, m_t, BT)
    b_G = b_dAd * b_kk
    b_dbeta += tl.sum(b_G, axis=1)
    b_m2 = b_G * b_beta[:, None]
    b_dgamma += tl.sum(b_m2, axis=1) - tl.sum(b_m2, axis=0)
    b_dg = tl.cumsum(b_dgamma, axis=0, reverse=True)  # padded rows hold 0
    tl.store(dbeta_ptr + o_hrow, _cast(b_dbeta, dbeta_ptr.dtype.element_ty, RNE), mask=m_t)
    tl.store(dg_ptr + o_hrow, _cast(b_dg, dg_ptr.dtype.element_ty, RNE), mask=m_t)
    if STAGES:
        tl.store(dgamma_ptr + o_hrow, b_dgamma, mask=m_t)
        tl.store(dt_ptr + o_sq, b_dT, mask=m_t[:, None])
        tl.store(da_ptr + o_sq, b_dA, mask=m_t[:, None])

    # dk_hv = dk_local + diag(beta e) T^T dw + (dKK + dKK^T) K, one K-block at a time
    b_dkk = _cast(b_dAd * b_beta[:, None], k_ptr.dtype.element_ty, RNE)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        o_krow = o_hrow[:, None] * K + o_k[None, :]
        b_k = tl.load(k_ptr + (o_row * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_dw = tl.load(dw_ptr + o_krow, mask=m_t[:, None], other=0.0)
        b_dk = tl.load(dk_local_ptr + o_krow, mask=m_t[:, None], other=0.0)
        b_dk += _dot(tl.trans(b_Tc), b_dw, None, PREC, UPCAST) * (b_beta * b_e)[:, None]
        b_dk = _dot(b_dkk, b_k, b_dk, PREC, UPCAST)
        b_dk = _dot(tl.trans(b_dkk), b_k, b_dk, PREC, UPCAST)
        tl.store(dk_ptr + o_krow, b_dk, mask=m_t[:, None])


@triton.jit
def chunk_gated_delta_rule_bwd_kernel_qk(
    q_ptr,  # [R, H, K] raw q (R = B*T rows)
    k_ptr,  # [R, H, K] raw k
    dq_hv_ptr,  # [R, HV, K] (input dtype; fp32 works too)
    dk_hv_ptr,  # [R, HV, K] fp32
    dq_ptr,  # [R, H, K] out, q's dtype
    dk_ptr,  # [R, H, K] out, k's dtype
    R,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BR: tl.constexpr,
    L2NORM: tl.constexpr,
):
    i_r, i_h = tl.program_id(0), tl.program_id(1)
    G: tl.constexpr = HV // H
    o_r = i_r.to(tl.int64) * BR + tl.arange(0, BR)
    m_r = o_r < R
    o_k = tl.arange(0, K)
    b_dq = tl.zeros([BR, K], dtype=tl.float32)
    b_dk = tl.zeros([BR, K], dtype=tl.float32)
    for j in tl.static_range(G):  # the value heads reading this query/key head
        o_hv = (o_r * HV + i_h * G + j)[:, None] * K + o_k[None, :]
        b_dq += tl.load(dq_hv_ptr + o_hv, mask=m_r[:, None], other=0.0).to(tl.float32)
        b_dk += tl.load(dk_hv_ptr + o_hv, mask=m_r[:, None], other=0.0).to(tl.float32)
    b_dq = b_dq * scale
    o_x = (o_r * H + i_h)[:, None] * K + o_k[None, :]
    if L2NORM:
        # y = x r, r = rsqrt(|x|^2 + eps): dx = r (dy - y (y . dy))
        b_q = tl.load(q_ptr + o_x, mask=m_r[:, None], other=0.0).to(tl.float32)
        b_k = tl.load(k_ptr + o_x, mask=m_r[:, None], other=0.0).to(tl.float32)
        b_rq = tl.rsqrt(tl.sum(b_q * b_q, axis=1) + L2NORM_EPS)
        b_rk = tl.rsqrt(tl.sum(b_k * b_k, axis=1) + L2NORM_EPS)
        b_yq, b_yk = b_q * b_rq[:, None], b_k * b_rk[:, None]
        b_dq = b_rq[:, None] * (b_dq - b_yq * tl.sum(b_yq * b_dq, axis=1)[:, None])
        b_dk = b_rk[:, None] * (b_dk - b_yk * tl.sum(b_yk * b_dk, axis=1)[:, None])
    tl.store(dq_ptr + o_x, b_dq.to(dq_ptr.dtype.element_ty), mask=m_r[:, None])
    tl.store(dk_ptr + o_x, b_dk.to(dk_ptr.dtype.element_ty), mask=m_r[:, None])


# ----------------------------------------------------------------------------- launch configs

_FALLBACK = {
    "gated_delta_rule_bwd_l2norm": {"BR": 64, "num_warps": 4, "num_stages": 1},
    "gated_delta_rule_bwd_dh": {"BV": 64, "num_warps": 4, "num_stages": 2},
    "gated_delta_rule_bwd_dqkw": {"BK": 64, "BV": 64, "num_warps": 8, "num_stages": 2},
    # num_stages 1: Triton 3.6 miscompiles this kernel on sm90 when it pipelines its loops (num_stages 2)
    # at 4 and 8 warps. Measured on the H100 at (1, 8192, 32, 32) against float64 on the kernel's own
    # inputs (benchmarks/deltanet_probe.py --kernels): dgamma rel. error 6e-3 (4 warps) and 5.6e-3 (8)
    # with 2 stages, 8.7e-5 with 1 stage at 2, 4 and 8 warps alike (what is left: dA's tf32 products).
    # 4 warps, 1 stage is also the fastest: 0.326 ms against 0.587 (8 warps, 2 stages) and 0.58 (2 warps).
    # (fla pins its WY backward to 2 warps on Hopper for a miscompile of the same family, fla #988.)
    # At 4 warps, 1 stage it is also wrong where its K loop has one block and its V loop two (K = 32 or
    # 64 with V = 128: dT rel. error 1.0 against float64, every seed; 2 and 8 warps correct on the same
    # inputs; K = 128 with V = 32..256 correct: benchmarks/deltanet_wy_check.py on the H100), so bwd_config
    # keeps 4 warps for K >= 128 only and takes 8 below.
    "gated_delta_rule_bwd_wy": {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 1},
    "gated_delta_rule_bwd_qk": {"BR": 32, "num_warps": 4, "num_stages": 1},
}


def config_key(K, V, dtype, nh=None):
    """Config key: head dims, dtype and (for the recurrence) the bucket of sequences x heads."""
    fields = {"k": K, "v": V, "dtype": launch.dtype_tag(dtype)}
    if nh is not None:
        fields["nh"] = min(launch.next_power_of_2(nh), 4096)
    return launch.config_key(**fields)


def bwd_config(kernel, K, V, dtype, nh=None):
    """Tuned config of ``kernel`` (the recurrence keyed by nh = sequences x heads too), else the
    fallback: K- and V-blocks of 64 (at most K and V; 16 in the interpreter, so K = V = 32 take two
    blocks each). The recurrence takes V-blocks of 32 at K = 32 and 8 warps once its state block
    reaches 128 x 64: the other choices spill registers on sm90 (24 and 44 bytes)."""
    nh = nh if kernel == "gated_delta_rule_bwd_dh" else None
    return dict(_bwd_config(kernel, K, V, dtype, nh, _runtime.config_scope()))  # (a copy: callers may edit it)


@launch.config_cache
def _bwd_config(kernel, K, V, dtype, nh, scope):  # scope (arch, device tag): a key of the cache only
    fallback = dict(_FALLBACK[kernel])
    for name, dim in (("BK", K), ("BV", V)):
        if name in fallback:
            fallback[name] = min(dim, 16) if _runtime.INTERPRET else min(fallback[name], dim)
    if kernel == "gated_delta_rule_bwd_dh" and not _runtime.INTERPRET:
        if K < 64:
            fallback["BV"] = min(fallback["BV"], 32)
        if K * fallback["BV"] >= 128 * 64:
            fallback["num_warps"] = 8
    if kernel == "gated_delta_rule_bwd_wy" and not _runtime.INTERPRET and K < 128:
        fallback["num_warps"] = 8  # 4 warps miscompile with one K-block and two V-blocks (_FALLBACK)
    return launch.config(kernel, config_key(K, V, dtype, nh), fallback)


# ----------------------------------------------------------------------------- launchers


def chunk_bwd_l2norm(q, k=None, *, cfg=None):
    """Kernel 0: (qn, kn) [B, T, H, K] in q's dtype, each row x * rsqrt(|x|^2 + 1e-6) as the forward
    kernels compute and round it; with k None, q alone (kn None)."""
    B, T, H, K = q.shape
    cfg = cfg or bwd_config("gated_delta_rule_bwd_l2norm", K, K, q.dtype)
    qn = new_output(q.shape, q.dtype, q.device)
    kn = new_output(k.shape, k.dtype, k.device) if k is not None else None
    R = B * T * H
    launch.launch(
        "gated_delta_rule_bwd_l2norm", chunk_gated_delta_rule_bwd_kernel_l2norm, (launch.cdiv(R, cfg["BR"]),),
        q, k if k is not None else q, qn, kn if k is not None else qn, R,
        nbytes=(2 if k is None else 4) * q.numel() * q.element_size(), K=K, BR=cfg["BR"],
        RNE=_flags(q.dtype)["RNE"], HAS_K=k is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return qn, kn


def chunk_bwd_dh(qn, kn, w, gamma, do, dht, scale, *, varlen=None, store_dh0=True, cfg=None, p=None):
    """Kernel 1: (dh [B, NT, HV, K, V] input dtype, dv_new [B, T, HV, V] input dtype, dh0 [N, HV, K, V]
    fp32 or an empty tensor when not ``store_dh0``). qn, kn: q and k as the forward uses them
    (normalised when it normalises); dht [N, HV, K, V] fp32 or None; p: the training forward's P
    [B, T, HV, BT] in q's dtype, or None (computed in the kernel)."""
    B, T, H, K = qn.shape
    HV, V = do.shape[2], do.shape[3]
    check_kernel_dims(K, V)
    N = B if varlen is None else varlen.n_seqs
    cfg = cfg or bwd_config("gated_delta_rule_bwd_dh", K, V, qn.dtype, N * HV)
    dev = qn.device
    n_b, n_c = _n_chunks(T, varlen, B)
    dh = new_output((n_b, n_c, HV, K, V), qn.dtype, dev)
    dv_new = new_output((B, T, HV, V), qn.dtype, dev)
    dh0 = new_output((N, HV, K, V) if store_dh0 else (0,), torch.float32, dev)
    cu, _, offsets = _varlen_ptrs(varlen, dev)
    e = qn.element_size()
    n_v = launch.cdiv(V, cfg["BV"])
    if p is not None and (tuple(p.shape) != (B, T, HV, BT) or p.dtype != qn.dtype):
        raise ValueError(f"saved P must be {(B, T, HV, BT)} {qn.dtype}, got {tuple(p.shape)} {p.dtype}")
    nbytes = (B * T * n_v * (2 * H * K * e + HV * K * e + HV * 4 + HV * BT * e * int(p is not None))
              + 2 * B * T * HV * V * e + dh.numel() * e + N * HV * K * V * 4 * (int(dht is not None) + int(store_dh0)))
    launch.launch(
        "gated_delta_rule_bwd_dh", chunk_gated_delta_rule_bwd_kernel_dh, (n_v, N * HV),
        qn, kn, w, gamma, do, dht if dht is not None else dh0, dh, dv_new, dh0, p if p is not None else dh0, cu,
        offsets, T, scale,
        nbytes=nbytes, H=H, HV=HV, K=K, V=V, BT=BT, BV=cfg["BV"], USE_DHT=dht is not None, STORE_DH0=store_dh0,
        IS_VARLEN=varlen is not None, **_flags(qn.dtype), LOAD_P=p is not None, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return dh, dv_new, dh0


def dqkw_ws_ok(qn, kn, v_new, h, dh, do, dv_new, varlen=None):
    """Whether kernel 2 runs as bwd_ws.py's persistent warp-specialized Gluon kernel: compiled sm90 launches of
    16-bit tensors (``chunk.gluon_on``), dense sequences, K = V = 128, every tile it reads by TMA contiguous and
    16-byte aligned. Measured on an H200 (benchmarks/NOTES.md, session 42): 1.24-1.64x the Triton kernel at the bench
    shapes."""
    B, T, _, K = qn.shape
    V = do.shape[3]
    return (varlen is None and B * T > 0 and K == 128 and V == 128 and gluon_on(qn)
            and all(t.dtype == qn.dtype for t in (kn, v_new, h, dh, do, dv_new))
            and tma_ready(qn, kn, v_new, h, dh, do, dv_new))


def chunk_bwd_dqkw(qn, kn, v_new, h, dh, do, dv_new, gamma, scale, *, varlen=None, cfg=None):
    """Kernel 2: dict dq_hv, dw [B, T, HV, K] (input dtype), dk_local [B, T, HV, K] fp32 and
    dgamma_local [K / BK, B, T, HV] fp32 (one partial sum per K-block); bwd_ws.dqkw_ws where ``dqkw_ws_ok``
    (unless a ``cfg`` is given: the tuner's), with two partial sums (one per consumer warpgroup)."""
    B, T, H, K = qn.shape
    HV, V = do.shape[2], do.shape[3]
    check_kernel_dims(K, V)
    if cfg is None and gamma.is_contiguous() and dqkw_ws_ok(qn, kn, v_new, h, dh, do, dv_new, varlen):
        from triforge.ops.deltanet import bwd_ws  # (Gluon: imported only where it runs)

        return bwd_ws.dqkw_ws(qn, kn, v_new, h, dh, do, dv_new, gamma, scale)
    cfg = cfg or bwd_config("gated_delta_rule_bwd_dqkw", K, V, qn.dtype)
    dev = qn.device
    n_b, n_c = _n_chunks(T, varlen, B)
    bk = min(cfg["BK"], K)
    n_k = K // bk
    out = {"dq_hv": new_output((B, T, HV, K), qn.dtype, dev), "dk_local": new_output((B, T, HV, K), torch.float32, dev),
           "dw": new_output((B, T, HV, K), qn.dtype, dev)}
    out["dgamma_local"] = new_output((n_k, B, T, HV), torch.float32, dev)
    cu, indices, _ = _varlen_ptrs(varlen, dev)
    e = qn.element_size()
    nbytes = (B * T * (2 * H * K * e + n_k * 3 * HV * V * e + HV * 4) + n_k * 2 * h.numel() * e
              + B * T * HV * (K * (4 + 2 * e) + n_k * 4))
    launch.launch(
        "gated_delta_rule_bwd_dqkw", chunk_gated_delta_rule_bwd_kernel_dqkw, (n_k, n_c, n_b * HV),
        qn, kn, v_new, h, dh, do, dv_new, gamma, out["dq_hv"], out["dk_local"], out["dw"], out["dgamma_local"],
        cu, indices, T, scale,
        nbytes=nbytes, H=H, HV=HV, K=K, V=V, BT=BT, BK=bk, BV=cfg["BV"], IS_VARLEN=varlen is not None,
        **_flags(qn.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch.maxnreg_option(cfg),
    )
    return out


def chunk_bwd_wy(kn, v, beta, g_dtype, gamma, t, dw, dv_new, dk_local, dgamma_local, *, varlen=None, stages=False,
                 cfg=None):
    """Kernel 3: dict dk_hv [B, T, HV, K] fp32 (written over dk_local unless ``stages``), dv [B, T, HV, V]
    (v's dtype), dbeta (beta's dtype), dg [B, T, HV] (``g_dtype``); with ``stages`` also dgamma
    [B, T, HV] fp32 and dT, dA [B, T, HV, 64] fp32. dgamma_local [NP, B, T, HV]: kernel 2's partials."""
    B, T, H, K = kn.shape
    HV, V = v.shape[2], v.shape[3]
    cfg = cfg or bwd_config("gated_delta_rule_bwd_wy", K, V, kn.dtype)
    dev = kn.device
    n_b, n_c = _n_chunks(T, varlen, B)
    out = {
        "dk_hv": new_output((B, T, HV, K), torch.float32, dev) if stages else dk_local,
        "dv": new_output((B, T, HV, V), v.dtype, dev),
        "dbeta": new_output((B, T, HV), beta.dtype, dev),
        "dg": new_output((B, T, HV), g_dtype, dev),
    }
    if stages:
        out["dgamma"] = new_output((B, T, HV), torch.float32, dev)
        out["dT"] = new_output((B, T, HV, BT), torch.float32, dev)
        out["dA"] = new_output((B, T, HV, BT), torch.float32, dev)
    cu, indices, _ = _varlen_ptrs(varlen, dev)
    e = kn.element_size()
    n_p = dgamma_local.shape[0]
    nbytes = (B * T * HV * (2 * H // HV * K * e + 2 * V * e + BT * 4 + 4 + n_p * 4 + beta.element_size())
              + B * T * HV * (2 * K * e + 2 * K * 4) + B * T * HV * (V * e + beta.element_size() + 4))
    launch.launch(
        "gated_delta_rule_bwd_wy", chunk_gated_delta_rule_bwd_kernel_wy, (n_c, n_b * HV),
        kn, v, beta, gamma, t, dw, dv_new, dk_local, dgamma_local, out["dk_hv"], out["dv"], out["dbeta"], out["dg"],
        out.get("dgamma", gamma), out.get("dT", t), out.get("dA", t), cu, indices, T,
        nbytes=nbytes, H=H, HV=HV, K=K, V=V, BT=BT, BK=min(cfg["BK"], K), BV=cfg["BV"], NP=n_p, STAGES=stages,
        IS_VARLEN=varlen is not None, **_flags(kn.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def chunk_bwd_qk(q, k, dq_hv, dk_hv, scale, *, l2norm=False, cfg=None):
    """Kernel 4: (dq, dk) [B, T, H, K] in q's dtype: the group sums of dq_hv (times scale) and dk_hv,
    through the l2norm's backward (on the raw q, k) when ``l2norm``."""
    B, T, H, K = q.shape
    HV = dq_hv.shape[2]
    cfg = cfg or bwd_config("gated_delta_rule_bwd_qk", K, K, q.dtype)
    R = B * T
    dq = new_output(q.shape, q.dtype, q.device)
    dk = new_output(k.shape, k.dtype, k.device)
    e = q.element_size()
    nbytes = R * (HV * K * (dq_hv.element_size() + dk_hv.element_size()) + 2 * H * K * e * (1 + int(l2norm)))
    launch.launch(
        "gated_delta_rule_bwd_qk", chunk_gated_delta_rule_bwd_kernel_qk, (launch.cdiv(R, cfg["BR"]), H),
        q, k, dq_hv, dk_hv, dq, dk, R, scale,
        nbytes=nbytes, H=H, HV=HV, K=K, BR=cfg["BR"], L2NORM=l2norm,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return dq, dk


BWD_STAGE_NAMES = ("dh", "dv_new", "dq_hv", "dk_local", "dw", "dgamma_local", "dT", "dA", "dv", "dbeta", "dk_hv",
                   "dgamma", "dg", "dq", "dk", "dh0")


def chunk_bwd(do, dht, q, k, v, g, beta, scale, initial_state=None, *, l2norm=False, cu_seqlens=None, stages=False,
              saved=None):
    """The chunked backward: the forward's intra and state kernels again (unless ``saved``: the forward's
    gamma, w, T, h, v_new, P and, with l2norm, qn and kn, ``chunk.chunk_fwd(save=True)``'s residuals, at the
    padded head dims; an empty P is computed by the dh kernel), then kernels 0-4 (kernel 0 only where
    the normalised q and k were not kept; the recompute's intra kernel stores kn, so there it normalises q alone).

    do [B, T, HV, V] in v's dtype; dht [N, HV, K, V] fp32 or None. Returns (dq, dk, dv, dg, dbeta,
    dh0) in their inputs' dtypes (dh0 fp32; None without an initial state); with ``stages`` an
    OrderedDict of the reference's backward stages (``BWD_STAGE_NAMES``; dh0 only with an initial
    state) from the kernels' own buffers (dgamma_local: the sum of kernel 2's K-block partials).
    """
    K, V = q.shape[3], v.shape[3]
    Kp, Vp = padded_dims(K, V)
    if (Kp, Vp) != (K, V):  # see chunk.PAD_MIN: exact, the padded coordinates get zero gradients
        res = chunk_bwd(pad_last(do, Vp), pad_state(dht, Kp, Vp), pad_last(q, Kp), pad_last(k, Kp), pad_last(v, Vp),
                        g, beta, scale, pad_state(initial_state, Kp, Vp), l2norm=l2norm, cu_seqlens=cu_seqlens,
                        stages=stages, saved=saved)
        if stages:
            return OrderedDict((n, unpad(n, t, K, V)) for n, t in res.items())
        return tuple(unpad(n, t, K, V) for n, t in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), res))
    varlen = prepare_varlen(cu_seqlens)
    qn, kn, p = q, k, None
    if saved is not None:
        gamma, w, t, h, v_new = (saved[n] for n in ("gamma", "w", "T", "h", "v_new"))
        p = saved["P"] if saved["P"].numel() else None
        if l2norm:  # the forward's normalised q and k (output and intra kernels)
            qn, kn = saved["qn"], saved["kn"]
            if qn.numel() == 0:  # a fused saving forward keeps no qn: kernel 0 on q alone
                qn = chunk_bwd_l2norm(q)[0]
            if qn.shape != q.shape or kn.shape != k.shape or qn.dtype != q.dtype or kn.dtype != k.dtype:
                raise ValueError(f"saved qn / kn must match q / k ({tuple(q.shape)} {q.dtype}), got "
                                 f"{tuple(qn.shape)} {qn.dtype} / {tuple(kn.shape)} {kn.dtype}")
    else:
        # as chunk_fwd runs them: the recurrence reads the intra kernel's normalised k
        intra = chunk_fwd_intra(k, v, g, beta, l2norm=l2norm, varlen=varlen, store_t=True, store_kn=l2norm)
        gamma, w, t = intra["gamma"], intra["w"], intra["T"]
        h, v_new, _ = chunk_fwd_h(intra.get("kn", k), w, intra["u"], gamma, initial_state, l2norm=l2norm,
                                  varlen=varlen, output_final_state=False, k_normed=l2norm)
        if l2norm:
            qn, kn = chunk_bwd_l2norm(q)[0], intra["kn"]
    dh, dv_new, dh0 = chunk_bwd_dh(qn, kn, w, gamma, do, dht, scale, varlen=varlen,
                                   store_dh0=initial_state is not None, p=p)
    local = chunk_bwd_dqkw(qn, kn, v_new, h, dh, do, dv_new, gamma, scale, varlen=varlen)
    wy = chunk_bwd_wy(kn, v, beta, g.dtype, gamma, t, local["dw"], dv_new, local["dk_local"], local["dgamma_local"],
                      varlen=varlen, stages=stages)
    dq, dk = chunk_bwd_qk(q, k, local["dq_hv"], wy["dk_hv"], scale, l2norm=l2norm)
    dh0 = dh0 if initial_state is not None else None
    if not stages:
        return dq, dk, wy["dv"], wy["dg"], wy["dbeta"], dh0
    local["dgamma_local"] = local["dgamma_local"].sum(0)
    found = dict(dh=dh, dv_new=dv_new, dq=dq, dk=dk, dh0=dh0, **local, **wy)
    return OrderedDict((n, found[n]) for n in BWD_STAGE_NAMES if found[n] is not None)
