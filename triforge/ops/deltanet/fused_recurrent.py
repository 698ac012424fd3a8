"""Token-by-token Gated DeltaNet forward for decode (T = 1 with a state) and short sequences.

``fused_recurrent_gated_delta_rule_fwd_kernel``, grid (V / BV, N*HV): one program per
(sequence, value head, V-block) holds its state block S [K, BV] in fp32 registers (K whole) and
walks the tokens: S <- e^g S; u = beta (v - S^T k); S <- S + k u^T; o = S^T (scale q). All
arithmetic is fp32 (q and k are normalised in fp32 when asked, never rounded). At T = 1 the
kernel is a state read + write: memory-bound, so V is split across programs until the grid
covers every SM (BV from the tuned config, else a heuristic).
"""

import torch
import triton
import triton.language as tl

from triforge import _runtime, launch
from triforge.launch import new_output
from triforge.ops.deltanet.chunk import L2NORM_EPS, _cast, _seq_span

@triton.jit(do_not_specialize=["T"])
def fused_recurrent_gated_delta_rule_fwd_kernel(
    q_ptr,  # [B, T, H, K]
    k_ptr,  # [B, T, H, K]
    v_ptr,  # [B, T, HV, V]
    g_ptr,  # [B, T, HV] log decay, fp32 or input dtype
    beta_ptr,  # [B, T, HV]
    h0_ptr,  # [N, HV, K, V] fp32 initial state (USE_H0)
    ht_ptr,  # [N, HV, K, V] fp32 out: final state (STORE_FINAL)
    o_ptr,  # [B, T, HV, V] out, v's dtype
    cu_seqlens_ptr,  # [N + 1] int32 (IS_VARLEN)
    T,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_FINAL: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    RNE: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, seq_len = _seq_span(i_n, T, cu_seqlens_ptr, IS_VARLEN)

    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_kv = o_k[:, None] * V + o_v[None, :]
    o_state = i_nh.to(tl.int64) * K * V

    b_S = tl.zeros([K, BV], dtype=tl.float32)
    if USE_H0:
        b_S += tl.load(h0_ptr + o_state + o_kv, mask=m_v[None, :], other=0.0)

    p_q = q_ptr + (bos * H + i_h) * K + o_k
    p_k = k_ptr + (bos * H + i_h) * K + o_k
    p_v = v_ptr + (bos * HV + i_hv) * V + o_v
    p_o = o_ptr + (bos * HV + i_hv) * V + o_v
    p_g = g_ptr + bos * HV + i_hv
    p_beta = beta_ptr + bos * HV + i_hv
    for _ in range(seq_len):
        b_q = tl.load(p_q).to(tl.float32)
        b_k = tl.load(p_k).to(tl.float32)
        if L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + L2NORM_EPS)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + L2NORM_EPS)
        b_v = tl.load(p_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(p_g).to(tl.float32)
        b_beta = tl.load(p_beta).to(tl.float32)

        b_S = b_S * tl.exp(b_g)
        b_u = b_beta * (b_v - tl.sum(b_S * b_k[:, None], axis=0))  # [BV]
        b_S += b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_S * b_q[:, None], axis=0) * scale
        tl.store(p_o, _cast(b_o, o_ptr.dtype.element_ty, RNE), mask=m_v)

        p_q += H * K
        p_k += H * K
        p_v += HV * V
        p_o += HV * V
        p_g += HV
        p_beta += HV

    if STORE_FINAL:
        tl.store(ht_ptr + o_state + o_kv, b_S, mask=m_v[None, :])


def config_key(K, V, dtype, nh):
    return launch.config_key(k=K, v=V, dtype=launch.dtype_tag(dtype), nh=min(launch.next_power_of_2(nh), 4096))


def recurrent_config(K, V, dtype, nh):
    """Tuned config, else one warp per program and BV = 32, or 16 when that leaves fewer than two
    programs per SM (H100 at K = V = 128: 96% of copy bandwidth at B = 256, 89% at B = 64)."""
    bv = 32 if nh * launch.cdiv(V, 32) >= 2 * _runtime.num_sms() else 16
    fallback = {"BV": min(bv, V), "num_warps": 1}
    return launch.config("gated_delta_rule_fwd_recurrent", config_key(K, V, dtype, nh), fallback)


def fused_recurrent_fwd(q, k, v, g, beta, scale, initial_state=None, *, output_final_state=True, l2norm=False,
                        cu_seqlens=None, cfg=None):
    """q, k [B, T, H, K], v [B, T, HV, V], g, beta [B, T, HV], initial_state [N, HV, K, V] fp32 ->
    (o [B, T, HV, V] in v's dtype, final state [N, HV, K, V] fp32, or an empty tensor when not asked)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    cfg = cfg or recurrent_config(K, V, q.dtype, N * HV)
    dev = q.device
    o = new_output((B, T, HV, V), v.dtype, dev)
    final = new_output((N, HV, K, V) if output_final_state else (0,), torch.float32, dev)
    cu = cu_seqlens.to(torch.int32) if cu_seqlens is not None else final
    n_v = launch.cdiv(V, cfg["BV"])
    e = q.element_size()
    state = N * HV * K * V * 4
    nbytes = B * T * (2 * H * K * e * n_v + 2 * HV * V * e + 2 * HV * 4) + state * (int(initial_state is not None)
                                                                                    + int(output_final_state))
    launch.launch(
        "gated_delta_rule_fwd_recurrent", fused_recurrent_gated_delta_rule_fwd_kernel, (n_v, N * HV),
        q, k, v, g, beta, initial_state if initial_state is not None else final, final, o, cu, T, scale,
        nbytes=nbytes, H=H, HV=HV, K=K, V=V, BV=cfg["BV"], L2NORM=l2norm, USE_H0=initial_state is not None,
        STORE_FINAL=output_final_state, IS_VARLEN=cu_seqlens is not None,
        RNE=_runtime.INTERPRET and v.dtype == torch.bfloat16, num_warps=cfg["num_warps"],
    )
    return o, final
