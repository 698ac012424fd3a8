"""mHC-lite backward kernels (n = 4 streams).

K1: with a = inv_rms * dproj and coef = (inv_rms^2 sum_r dproj*proj + inv_rms^3 d_inv_rms) / K,
    dx = a W - coef * x  and  dW = a^T x; one pass over x gives both (dW as per-run partials, summed per
    column block by a reduce kernel).
    16-bit x: dx takes one tensor-core dot of a and W rounded to x's dtype (dx is stored in that
    dtype: rel error ~2.9e-3 against ~1.7e-3 for rounding the exact dx); dW^T = x^T a takes a split
    into two 16-bit parts (a_hi + a_lo, ~16 mantissa bits: dW to ~2e-6). Three dots per tile: with
    five (a and W both split) the kernel was bound by its small dots, not by memory.
K3: dx[t, j, c] = h_pre[t, j] dy[t, c];  dh_pre[t, j] = sum_c dy[t, c] x[t, j, c].
K4: dx[t, j, c] = sum_i H[t, i, j] g[t, i, c];  dF[t, c] = sum_i h_post[t, i] g[t, i, c];
    dH[t, i, j] = sum_c g[t, i, c] x[t, j, c];  dh_post[t, i] = sum_c g[t, i, c] F[t, c].
"""

import triton
import triton.language as tl

from triforge.ops._tl import cast as _cast
from triforge.ops.mhc.forward import dot16


@triton.jit
def mhc_project_bwd_prologue_kernel(
    dproj_ptr,  # [T, R] grad of proj (any float dtype)
    proj_ptr,  # [T, R] fp32
    inv_ptr,  # [T] fp32 inv_rms
    dinv_ptr,  # [T] grad of inv_rms (read when HAS_DINV)
    a_hi_ptr,  # [T, R] a = inv_rms * dproj: in x's dtype when SPLIT, else fp32
    a_lo_ptr,  # [T, R] a - a_hi in x's dtype (written when SPLIT)
    coef_ptr,  # [T] fp32
    T,
    K,
    R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_DINV: tl.constexpr,
    SPLIT: tl.constexpr,
    RNE: tl.constexpr,
):
    """K1 backward's per-token terms in one pass (they were eight PyTorch ops, 0.15 ms at T = 65536):
    a = inv_rms dproj (split hi + lo for 16-bit x) and coef = (inv_rms^2 sum_r dproj proj
    + inv_rms^3 d_inv_rms) / K."""
    i_t = tl.program_id(0)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < T
    o_t64 = o_t.to(tl.int64)
    o = o_t64[:, None] * R + tl.arange(0, R)[None, :]
    b_dp = tl.load(dproj_ptr + o, mask=m_t[:, None], other=0.0).to(tl.float32)
    b_p = tl.load(proj_ptr + o, mask=m_t[:, None], other=0.0)
    b_inv = tl.load(inv_ptr + o_t, mask=m_t, other=0.0)
    b_a = b_dp * b_inv[:, None]
    b_coef = b_inv * b_inv * tl.sum(b_dp * b_p, axis=1)
    if HAS_DINV:
        b_coef += b_inv * b_inv * b_inv * tl.load(dinv_ptr + o_t, mask=m_t, other=0.0).to(tl.float32)
    tl.store(coef_ptr + o_t, b_coef / K, mask=m_t)
    if SPLIT:
        b_hi = _cast(b_a, a_hi_ptr.dtype.element_ty, RNE)
        tl.store(a_hi_ptr + o, b_hi, mask=m_t[:, None])
        tl.store(a_lo_ptr + o, _cast(b_a - b_hi.to(tl.float32), a_lo_ptr.dtype.element_ty, RNE), mask=m_t[:, None])
    else:
        tl.store(a_hi_ptr + o, b_a, mask=m_t[:, None])


@triton.jit
def _token_terms(a_hi_ptr, a_lo_ptr, coef_ptr, i_t, T, R: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT: tl.constexpr):
    """Token tile i_t's a_hi, a_lo ([BLOCK_T, R]; a_lo is a_hi again unless SPLIT) and coef ([BLOCK_T])."""
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < T
    o_a = o_t[:, None] * R + tl.arange(0, R)[None, :]
    b_a_hi = tl.load(a_hi_ptr + o_a, mask=m_t[:, None], other=0.0)
    b_a_lo = b_a_hi
    if SPLIT:
        b_a_lo = tl.load(a_lo_ptr + o_a, mask=m_t[:, None], other=0.0)
    return b_a_hi, b_a_lo, tl.load(coef_ptr + o_t, mask=m_t, other=0.0)


@triton.jit
def mhc_project_bwd_kernel(
    x_ptr,  # [T, K] streams flattened
    a_hi_ptr,  # [T, R] inv_rms * dproj, in x's dtype (fp32 when x is fp32)
    a_lo_ptr,  # [T, R] remainder a - a_hi (read when SPLIT)
    coef_ptr,  # [T] fp32
    w_ptr,  # [R, K] fp32 W (rounded to x's dtype here for the dx dot when SPLIT)
    dx_ptr,  # [T, K] x's dtype
    dw_part_ptr,  # [P, J, R, BLOCK_K] fp32: slot j of program p = dW^T over its tiles of its j-th column block
    T,
    K,
    n_t,  # token tiles: cdiv(T, BLOCK_T)
    U,  # work units: column blocks x token tiles
    P,  # programs (the grid)
    J,  # slots per program in dw_part
    R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE: tl.constexpr,
    TMA: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Persistent and balanced: the U = n_k x n_t units (column block, token tile), ordered column-block
    major, are cut into P equal runs, one per program (P = SMs x programs_per_sm, one wave). A run
    spans one or a few column blocks; for each it loads W's [R, BLOCK_K] block once, walks its token
    tiles (the pipelined inner loop) and stores its dW^T partial in its next slot; project_bwd_reduce
    sums the partials of each column block in program order (deterministic). With a 2-D grid
    (column blocks x token splits) 80 column blocks never spread evenly over 132 SMs: a third of the
    SMs ran 3 programs and the rest 2, and the kernel took the 3-program time (81% of copy).
    TMA: 1: x tiles arrive and dx tiles leave through tensor descriptors (the copy engine moves them;
    out-of-range rows and columns are zero-filled on load and dropped on store); 2: x through a descriptor,
    dx stored from registers (no shared-memory staging of dx, no wait on the previous tile's store); 3: as 1,
    and a_hi, a_lo and coef through descriptors as well (no per-element addresses: 140 registers against 162
    at BLOCK_T 32, 4 warps).
    PREFETCH (TMA 0-2): each tile's per-token terms (a_hi, a_lo, coef) are loaded one tile ahead."""
    # int64: kb and i_t derive from p, so the token offsets below (o_t * K, o_t * R) are int64 too (at T = 1M,
    # C = 4096 they pass 2^31 elements); keep this cast
    p = tl.program_id(0).to(tl.int64)
    u_start = p * U // P
    u_end = (p + 1) * U // P
    kb_first = u_start // n_t
    kb_last = (u_end - 1) // n_t
    o_r = tl.arange(0, R)
    o_kk = tl.arange(0, BLOCK_K)
    if TMA > 0:
        x_desc = tl.make_tensor_descriptor(x_ptr, [T, K], [K, 1], [BLOCK_T, BLOCK_K])
        dx_desc = tl.make_tensor_descriptor(dx_ptr, [T, K], [K, 1], [BLOCK_T, BLOCK_K])
    if TMA == 3:
        ah_desc = tl.make_tensor_descriptor(a_hi_ptr, [T, R], [R, 1], [BLOCK_T, R])
        al_desc = tl.make_tensor_descriptor(a_lo_ptr, [T, R], [R, 1], [BLOCK_T, R])
        c_desc = tl.make_tensor_descriptor(coef_ptr, [T], [1], [BLOCK_T])
    for kb in range(kb_first, kb_last + 1):
        o_k = kb * BLOCK_K + o_kk
        m_k = o_k < K
        b_w = tl.load(w_ptr + o_r[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        if SPLIT:
            b_w = _cast(b_w, x_ptr.dtype.element_ty, RNE)
        b_dwT = tl.zeros([BLOCK_K, R], dtype=tl.float32)  # dW^T: the dot's M is BLOCK_K, not R
        t_lo = tl.maximum(u_start - kb * n_t, 0)
        t_hi = tl.minimum(u_end - kb * n_t, n_t)
        n_a_hi, n_a_lo, n_coef = _token_terms(a_hi_ptr, a_lo_ptr, coef_ptr, t_lo, T, R, BLOCK_T, SPLIT)
        for i_t in range(t_lo, t_hi):
            o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
            m_t = o_t < T
            m_tk = m_t[:, None] & m_k[None, :]
            o_x = o_t[:, None] * K + o_k[None, :]
            if TMA > 0:
                b_x = x_desc.load([(i_t * BLOCK_T).to(tl.int32), (kb * BLOCK_K).to(tl.int32)])
            else:
                b_x = tl.load(x_ptr + o_x, mask=m_tk, other=0.0)
            if PREFETCH and TMA != 3:  # this tile's per-token terms were loaded one tile ahead (an L2 round trip hidden)
                b_a_hi, b_a_lo, b_coef = n_a_hi, n_a_lo, n_coef
                n_a_hi, n_a_lo, n_coef = _token_terms(a_hi_ptr, a_lo_ptr, coef_ptr, i_t + 1, T, R, BLOCK_T, SPLIT)
            elif TMA == 3:  # the per-token terms through descriptors too (no per-element addresses)
                b_a_hi = ah_desc.load([(i_t * BLOCK_T).to(tl.int32), 0])
                b_a_lo = b_a_hi
                if SPLIT:
                    b_a_lo = al_desc.load([(i_t * BLOCK_T).to(tl.int32), 0])
                b_coef = c_desc.load([(i_t * BLOCK_T).to(tl.int32)])
            else:
                b_a_hi, b_a_lo, b_coef = _token_terms(a_hi_ptr, a_lo_ptr, coef_ptr, i_t, T, R, BLOCK_T, SPLIT)
            b_xT = tl.trans(b_x)
            if SPLIT:
                b_dx = dot16(b_a_hi, b_w, tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32), UPCAST)
                b_dwT = dot16(b_xT, b_a_hi, b_dwT, UPCAST)
                b_dwT = dot16(b_xT, b_a_lo, b_dwT, UPCAST)
            else:
                b_dx = tl.dot(b_a_hi, b_w, input_precision="tf32x3")
                b_dwT = tl.dot(b_xT, b_a_hi, b_dwT, input_precision="tf32x3")
            b_dx -= b_coef[:, None] * b_x.to(tl.float32)
            if TMA == 1 or TMA == 3:
                dx_desc.store([(i_t * BLOCK_T).to(tl.int32), (kb * BLOCK_K).to(tl.int32)], b_dx.to(dx_ptr.dtype.element_ty))
            else:
                tl.store(dx_ptr + o_x, b_dx.to(dx_ptr.dtype.element_ty), mask=m_tk)
        o_dw = ((p * J + (kb - kb_first)) * R + o_r[None, :]) * BLOCK_K + o_kk[:, None]
        tl.store(dw_part_ptr + o_dw, b_dwT)


@triton.jit
def mhc_project_bwd_reduce_kernel(
    dw_part_ptr,  # [P, J, R, BLOCK_K] fp32 (mhc_project_bwd_kernel)
    dw_ptr,  # [R, K] W's dtype
    K,
    n_t,
    U,
    P,
    J,
    R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """dW[:, column block kb] = the sum, in program order, of the partials of the programs whose runs
    touch kb: programs p_of(kb n_t) .. p_of((kb + 1) n_t - 1), with p_of(u) = ((u + 1) P - 1) // U
    the program whose run [p U // P, (p + 1) U // P) holds unit u."""
    kb = tl.program_id(0).to(tl.int64)
    p_lo = ((kb * n_t + 1) * P - 1) // U
    p_hi = (((kb + 1) * n_t) * P - 1) // U
    o_r = tl.arange(0, R)
    o_kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([R, BLOCK_K], dtype=tl.float32)
    for p in range(p_lo, p_hi + 1):
        j = kb - (p * U // P) // n_t
        acc += tl.load(dw_part_ptr + ((p * J + j) * R + o_r[:, None]) * BLOCK_K + o_kk[None, :])
    o_k = kb * BLOCK_K + o_kk
    tl.store(dw_ptr + o_r[:, None] * K + o_k[None, :], acc.to(dw_ptr.dtype.element_ty), mask=(o_k < K)[None, :])


@triton.jit
def mhc_pre_map_bwd_kernel(
    dy_ptr,  # [T, C] grad of the layer input
    x_ptr,  # [T, 4, C]
    h_ptr,  # [T, 4] fp32 h_pre
    dx_ptr,  # [T, 4, C] x's dtype
    dh_ptr,  # [T, 4] fp32
    T,
    C,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    i_t = tl.program_id(0)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_j = tl.arange(0, 4)
    m_t = o_t < T
    o_t64 = o_t.to(tl.int64)
    b_h = tl.load(h_ptr + o_t64[:, None] * 4 + o_j[None, :], mask=m_t[:, None], other=0.0)
    b_dh = tl.zeros([BLOCK_T, 4], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        o_c = c0 + tl.arange(0, BLOCK_C)
        m_c = o_c < C
        b_dy = tl.load(dy_ptr + o_t64[:, None] * C + o_c[None, :], mask=m_t[:, None] & m_c[None, :], other=0.0)
        b_dy = b_dy.to(tl.float32)
        o_x = o_t64[:, None, None] * 4 * C + o_j[None, :, None] * C + o_c[None, None, :]
        m_x = m_t[:, None, None] & m_c[None, None, :]
        b_x = tl.load(x_ptr + o_x, mask=m_x, other=0.0).to(tl.float32)
        b_dh += tl.sum(b_x * b_dy[:, None, :], axis=2)
        tl.store(dx_ptr + o_x, (b_h[:, :, None] * b_dy[:, None, :]).to(dx_ptr.dtype.element_ty), mask=m_x)
    tl.store(dh_ptr + o_t64[:, None] * 4 + o_j[None, :], b_dh, mask=m_t[:, None])


@triton.jit
def _post_res_bwd_loads(g_ptr, x_ptr, f_ptr, o_t64, m_t, c0, C, BLOCK_C: tl.constexpr):
    """One C-block of g [BLOCK_T, 4, BLOCK_C], f and the four x streams [BLOCK_T, BLOCK_C] in their
    stored dtypes (a block past C is fully masked: no memory traffic)."""
    o_i = tl.arange(0, 4)
    o_c = c0 + tl.arange(0, BLOCK_C)
    m_c = o_c < C
    m_tc = m_t[:, None] & m_c[None, :]
    o_g = o_t64[:, None, None] * 4 * C + o_i[None, :, None] * C + o_c[None, None, :]
    b_g = tl.load(g_ptr + o_g, mask=m_t[:, None, None] & m_c[None, None, :], other=0.0)
    b_f = tl.load(f_ptr + o_t64[:, None] * C + o_c[None, :], mask=m_tc, other=0.0)
    o_x = o_t64[:, None] * 4 * C + o_c[None, :]
    b_x0 = tl.load(x_ptr + o_x, mask=m_tc, other=0.0)
    b_x1 = tl.load(x_ptr + o_x + C, mask=m_tc, other=0.0)
    b_x2 = tl.load(x_ptr + o_x + 2 * C, mask=m_tc, other=0.0)
    b_x3 = tl.load(x_ptr + o_x + 3 * C, mask=m_tc, other=0.0)
    return b_g, b_f, b_x0, b_x1, b_x2, b_x3


@triton.jit
def _post_res_bwd_column(g, b_Hj, b_xj, dx_ptr, o_x, m_tc):
    """For stream j: store dx[:, j] = sum_i H[:, i, j] g[:, i]; return sum_c g[:, i] x[:, j] ([BLOCK_T, 4])."""
    tl.store(dx_ptr + o_x, tl.sum(b_Hj[:, :, None] * g, axis=1).to(dx_ptr.dtype.element_ty), mask=m_tc)
    return tl.sum(g * b_xj.to(tl.float32)[:, None, :], axis=2)


@triton.jit
def mhc_post_res_bwd_kernel(
    g_ptr,  # [T, 4, C] grad of the new streams
    x_ptr,  # [T, 4, C]
    f_ptr,  # [T, C] layer output
    H_ptr,  # [T, 4, 4] fp32
    hp_ptr,  # [T, 4] fp32
    dx_ptr,  # [T, 4, C] x's dtype
    df_ptr,  # [T, C] layer output's dtype
    dH_ptr,  # [T, 4, 4] fp32
    dhp_ptr,  # [T, 4] fp32
    T,
    C,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Walks C in BLOCK_C blocks; the next block's g, f and x are loaded before this block's math
    and stores (two blocks in flight per program, as in the RMSNorm backward)."""
    i_t = tl.program_id(0)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_i = tl.arange(0, 4)
    m_t = o_t < T
    o_t64 = o_t.to(tl.int64)
    b_hp = tl.load(hp_ptr + o_t64[:, None] * 4 + o_i[None, :], mask=m_t[:, None], other=0.0)
    o_H = o_t64[:, None] * 16 + o_i[None, :] * 4  # H[:, i, j] at o_H + j
    b_H0 = tl.load(H_ptr + o_H + 0, mask=m_t[:, None], other=0.0)
    b_H1 = tl.load(H_ptr + o_H + 1, mask=m_t[:, None], other=0.0)
    b_H2 = tl.load(H_ptr + o_H + 2, mask=m_t[:, None], other=0.0)
    b_H3 = tl.load(H_ptr + o_H + 3, mask=m_t[:, None], other=0.0)
    # dH[:, :, j] accumulated as four [BLOCK_T, 4] columns
    b_dH0 = tl.zeros([BLOCK_T, 4], dtype=tl.float32)
    b_dH1 = tl.zeros([BLOCK_T, 4], dtype=tl.float32)
    b_dH2 = tl.zeros([BLOCK_T, 4], dtype=tl.float32)
    b_dH3 = tl.zeros([BLOCK_T, 4], dtype=tl.float32)
    b_dhp = tl.zeros([BLOCK_T, 4], dtype=tl.float32)
    b_g, b_f, b_x0, b_x1, b_x2, b_x3 = _post_res_bwd_loads(g_ptr, x_ptr, f_ptr, o_t64, m_t, 0, C, BLOCK_C)
    for c0 in range(0, C, BLOCK_C):
        n_g, n_f, n_x0, n_x1, n_x2, n_x3 = _post_res_bwd_loads(g_ptr, x_ptr, f_ptr, o_t64, m_t, c0 + BLOCK_C, C, BLOCK_C)
        o_c = c0 + tl.arange(0, BLOCK_C)
        m_tc = m_t[:, None] & (o_c < C)[None, :]
        b_gf = b_g.to(tl.float32)
        o_f = o_t64[:, None] * C + o_c[None, :]
        tl.store(df_ptr + o_f, tl.sum(b_hp[:, :, None] * b_gf, axis=1).to(df_ptr.dtype.element_ty), mask=m_tc)
        b_dhp += tl.sum(b_gf * b_f.to(tl.float32)[:, None, :], axis=2)
        o_x = o_t64[:, None] * 4 * C + o_c[None, :]
        b_dH0 += _post_res_bwd_column(b_gf, b_H0, b_x0, dx_ptr, o_x, m_tc)
        b_dH1 += _post_res_bwd_column(b_gf, b_H1, b_x1, dx_ptr, o_x + C, m_tc)
        b_dH2 += _post_res_bwd_column(b_gf, b_H2, b_x2, dx_ptr, o_x + 2 * C, m_tc)
        b_dH3 += _post_res_bwd_column(b_gf, b_H3, b_x3, dx_ptr, o_x + 3 * C, m_tc)
        b_g, b_f, b_x0, b_x1, b_x2, b_x3 = n_g, n_f, n_x0, n_x1, n_x2, n_x3
    tl.store(dhp_ptr + o_t64[:, None] * 4 + o_i[None, :], b_dhp, mask=m_t[:, None])
    o_dH = o_t64[:, None] * 16 + o_i[None, :] * 4
    tl.store(dH_ptr + o_dH + 0, b_dH0, mask=m_t[:, None])
    tl.store(dH_ptr + o_dH + 1, b_dH1, mask=m_t[:, None])
    tl.store(dH_ptr + o_dH + 2, b_dH2, mask=m_t[:, None])
    tl.store(dH_ptr + o_dH + 3, b_dH3, mask=m_t[:, None])


@triton.jit
def _streams(d0, d1, d2, d3, t0, c0):
    """Four [BLOCK_T, BLOCK_C] boxes (streams 0-3) joined as [BLOCK_T, BLOCK_C, 4]: the stream index is the last,
    in-thread dimension (join(join(s0, s2), join(s1, s3)) flattens to s0, s1, s2, s3)."""
    a = tl.join(d0.load([t0, c0]), d2.load([t0, c0]))
    b = tl.join(d1.load([t0, c0]), d3.load([t0, c0]))
    return tl.reshape(tl.join(a, b), (a.shape[0], a.shape[1], 4))


@triton.jit
def mhc_post_res_bwd_tma_kernel(g_ptr, x_ptr, f_ptr, H_ptr, hp_ptr, dx_ptr, df_ptr, dH_ptr, dhp_ptr, T, C,
                                BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                                STAGES: tl.constexpr):  # (arguments: mhc_post_res_bwd_kernel's; STAGES: C loop depth)
    """mhc_post_res_bwd_kernel's math with g, x and f read through tensor descriptors: each stream of g and x is a
    [T, C] matrix of row stride 4C (one descriptor per stream, boxes [BLOCK_T, BLOCK_C] zero-filled past T and C),
    so the blocks in flight sit in the shared-memory stages of the C loop's pipeline (tl.range's num_stages: Triton
    pipelines loads that feed no dot only where the loop asks) instead of registers. The four streams are joined
    into a [BLOCK_T, BLOCK_C, 4] tile whose stream index is in-thread: the sums over i (dx, df) need no shuffles.
    Persistent (grid <= SMs x programs per SM, token tiles strided over programs): the nine descriptors are built
    once per program. (A first form, one [BLOCK_T, 4, BLOCK_C] box of g and reshaped [BLOCK_T, 1, BLOCK_C] boxes of
    x in the register kernel, converted layouts through shared memory every block: 45 barriers per block, 7x
    slower on the H200.)"""
    g0 = tl.make_tensor_descriptor(g_ptr, [T, C], [4 * C, 1], [BLOCK_T, BLOCK_C])
    g1 = tl.make_tensor_descriptor(g_ptr + C, [T, C], [4 * C, 1], [BLOCK_T, BLOCK_C])
    g2 = tl.make_tensor_descriptor(g_ptr + 2 * C, [T, C], [4 * C, 1], [BLOCK_T, BLOCK_C])
    g3 = tl.make_tensor_descriptor(g_ptr + 3 * C, [T, C], [4 * C, 1], [BLOCK_T, BLOCK_C])
    x0 = tl.make_tensor_descriptor(x_ptr, [T, C], [4 * C, 1], [BLOCK_T, BLOCK_C])
    x1 = tl.make_tensor_descriptor(x_ptr + C, [T, C], [4 * C, 1], [BLOCK_T, BLOCK_C])
    x2 = tl.make_tensor_descriptor(x_ptr + 2 * C, [T, C], [4 * C, 1], [BLOCK_T, BLOCK_C])
    x3 = tl.make_tensor_descriptor(x_ptr + 3 * C, [T, C], [4 * C, 1], [BLOCK_T, BLOCK_C])
    f_d = tl.make_tensor_descriptor(f_ptr, [T, C], [C, 1], [BLOCK_T, BLOCK_C])
    o_i = tl.arange(0, 4)
    n_t = tl.cdiv(T, BLOCK_T)
    for i_t in range(tl.program_id(0), n_t, tl.num_programs(0)):
        t0 = i_t * BLOCK_T
        o_t = t0 + tl.arange(0, BLOCK_T)
        m_t = o_t < T
        o_t64 = o_t.to(tl.int64)
        m_ti = m_t[:, None]
        b_hp = tl.load(hp_ptr + o_t64[:, None] * 4 + o_i[None, :], mask=m_ti, other=0.0)  # [BLOCK_T, 4]
        o_H = o_t64[:, None] * 16 + o_i[None, :] * 4  # H[:, i, j] at o_H + j
        b_H0 = tl.load(H_ptr + o_H + 0, mask=m_ti, other=0.0)
        b_H1 = tl.load(H_ptr + o_H + 1, mask=m_ti, other=0.0)
        b_H2 = tl.load(H_ptr + o_H + 2, mask=m_ti, other=0.0)
        b_H3 = tl.load(H_ptr + o_H + 3, mask=m_ti, other=0.0)
        b_dH0 = tl.zeros([BLOCK_T, 4], dtype=tl.float32)  # dH[:, :, j]
        b_dH1 = tl.zeros([BLOCK_T, 4], dtype=tl.float32)
        b_dH2 = tl.zeros([BLOCK_T, 4], dtype=tl.float32)
        b_dH3 = tl.zeros([BLOCK_T, 4], dtype=tl.float32)
        b_dhp = tl.zeros([BLOCK_T, 4], dtype=tl.float32)
        for c0 in tl.range(0, C, BLOCK_C, num_stages=STAGES):
            b_g = _streams(g0, g1, g2, g3, t0, c0).to(tl.float32)  # [BLOCK_T, BLOCK_C, 4]
            b_f = f_d.load([t0, c0]).to(tl.float32)
            o_c = c0 + tl.arange(0, BLOCK_C)
            m_tc = m_ti & (o_c < C)[None, :]
            o_f = o_t64[:, None] * C + o_c[None, :]
            tl.store(df_ptr + o_f, tl.sum(b_g * b_hp[:, None, :], axis=2).to(df_ptr.dtype.element_ty), mask=m_tc)
            b_dhp += tl.sum(b_g * b_f[:, :, None], axis=1)
            o_x = o_t64[:, None] * 4 * C + o_c[None, :]
            b_dH0 += _post_res_bwd_stream(b_g, b_H0, x0, t0, c0, dx_ptr, o_x, m_tc)
            b_dH1 += _post_res_bwd_stream(b_g, b_H1, x1, t0, c0, dx_ptr, o_x + C, m_tc)
            b_dH2 += _post_res_bwd_stream(b_g, b_H2, x2, t0, c0, dx_ptr, o_x + 2 * C, m_tc)
            b_dH3 += _post_res_bwd_stream(b_g, b_H3, x3, t0, c0, dx_ptr, o_x + 3 * C, m_tc)
        tl.store(dhp_ptr + o_t64[:, None] * 4 + o_i[None, :], b_dhp, mask=m_ti)
        tl.store(dH_ptr + o_H + 0, b_dH0, mask=m_ti)
        tl.store(dH_ptr + o_H + 1, b_dH1, mask=m_ti)
        tl.store(dH_ptr + o_H + 2, b_dH2, mask=m_ti)
        tl.store(dH_ptr + o_H + 3, b_dH3, mask=m_ti)


@triton.jit
def _post_res_bwd_stream(g, b_Hj, xj_desc, t0, c0, dx_ptr, o_x, m_tc):
    """For stream j (g [BLOCK_T, BLOCK_C, 4], streams last): store dx[:, j] = sum_i H[:, i, j] g[:, :, i]; return
    sum_c g[:, c, i] x[:, j, c] ([BLOCK_T, 4] over i)."""
    tl.store(dx_ptr + o_x, tl.sum(g * b_Hj[:, None, :], axis=2).to(dx_ptr.dtype.element_ty), mask=m_tc)
    b_xj = xj_desc.load([t0, c0]).to(tl.float32)
    return tl.sum(g * b_xj[:, :, None], axis=1)
