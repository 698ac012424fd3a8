"""mHC-lite forward kernels: K1 fused RMSNorm + projection, K3 pre-map, K4 post-res (n = 4 streams)."""

import triton
import triton.language as tl

from triforge.ops._tl import cast as _cast


@triton.jit
def dot16(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b for 16-bit a, b. UPCAST computes it in fp32: Triton 3.6's CPU interpreter
    multiplies bf16 operands of tl.dot wrongly (the products are exact in fp32 either way)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def mhc_project_fwd_kernel(
    x_ptr,  # [T, K] streams flattened (K = n*C), bf16/fp16/fp32
    w_ptr,  # [R, K] fp32 W
    proj_ptr,  # [T, R] fp32
    inv_rms_ptr,  # [T] fp32
    T,
    K,
    eps,
    R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_W: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE: tl.constexpr,
    TMA: tl.constexpr,
    STACK: tl.constexpr = 0,
):
    """proj = (x W^T) * inv_rms, inv_rms = rsqrt(mean(x^2) + eps). 16-bit x: each W^T tile is split here
    into two parts in x's dtype (hi = W rounded, lo = W - hi: ~16 mantissa bits of W kept) and takes
    two tensor-core dots; the split of a [BLOCK_K, R] tile is a few ALU operations per element, cheaper
    than the four PyTorch launches that split W once per call (~10 us: 5% of the kernel at C = 1024).
    TMA: x and W tiles arrive through tensor descriptors (no per-element addresses; rows past T and
    columns past K are zero-filled).
    STACK (16-bit x): one dot per tile instead of two: x times [hi | lo] (W^T's two parts as 2R = 64 interleaved
    columns: hi of row r in column 2r, lo in 2r + 1), so the tensor cores read the x tile once instead of twice (wgmma
    N = 64 instead of two of N = 32); each row's hi and lo products are summed after the loop. (x^T as the B operand
    of one dot of [hi; lo] instead: ptxas serialized every wgmma, its A operand in registers; session 48's local
    sm90 compile.)"""
    i_t = tl.program_id(0)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < T
    o_r = tl.arange(0, R)
    p_x = x_ptr + o_t.to(tl.int64)[:, None] * K
    b_acc = tl.zeros([BLOCK_T, R], dtype=tl.float32)
    b_acc2 = tl.zeros([BLOCK_T, 2 * R], dtype=tl.float32)  # (STACK: column 2r the hi products of row r, 2r + 1 lo)
    b_ss = tl.zeros([BLOCK_T], dtype=tl.float32)
    if TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, [T, K], [K, 1], [BLOCK_T, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, [R, K], [K, 1], [R, BLOCK_K])
    for k0 in range(0, K, BLOCK_K):
        if TMA:
            b_x = x_desc.load([i_t * BLOCK_T, k0])
            b_w = tl.trans(w_desc.load([0, k0]))  # [BLOCK_K, R]: W^T
        else:
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < K
            b_x = tl.load(p_x + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
            b_w = tl.load(w_ptr + o_r[None, :] * K + o_k[:, None], mask=m_k[:, None], other=0.0)  # [BLOCK_K, R]: W^T
        b_xf = b_x.to(tl.float32)
        b_ss += tl.sum(b_xf * b_xf, axis=1)
        if SPLIT_W:
            b_hi = _cast(b_w, x_ptr.dtype.element_ty, RNE)
            b_lo = _cast(b_w - b_hi.to(tl.float32), x_ptr.dtype.element_ty, RNE)
            if STACK:
                b_ws = tl.reshape(tl.join(b_hi, b_lo), (BLOCK_K, 2 * R))  # [BLOCK_K, R, 2] -> columns (r, hi / lo)
                b_acc2 = dot16(b_x, b_ws, b_acc2, UPCAST)
            else:
                b_acc = dot16(b_x, b_hi, b_acc, UPCAST)
                b_acc = dot16(b_x, b_lo, b_acc, UPCAST)
        else:
            b_acc = tl.dot(b_xf, b_w, b_acc, input_precision="tf32x3")
    if STACK and SPLIT_W:  # [BLOCK_T, 2R] -> [BLOCK_T, R, 2] -> hi + lo
        b_hi_p, b_lo_p = tl.split(tl.reshape(b_acc2, (BLOCK_T, R, 2)))
        b_acc = b_hi_p + b_lo_p
    b_inv = tl.rsqrt(b_ss / K + eps)
    tl.store(inv_rms_ptr + o_t, b_inv, mask=m_t)
    o_p = o_t.to(tl.int64)[:, None] * R + o_r[None, :]
    tl.store(proj_ptr + o_p, b_acc * b_inv[:, None], mask=m_t[:, None])


@triton.jit
def mhc_pre_map_fwd_kernel(
    x_ptr,  # [T, 4, C] streams
    h_ptr,  # [T, 4] fp32 h_pre
    y_ptr,  # [T, C] layer input, x's dtype
    n,  # T * C
    C: tl.constexpr,
    BLOCK: tl.constexpr,
    EVEN: tl.constexpr,  # n % BLOCK == 0: no masks
    I64: tl.constexpr,  # offsets past int32 (x has >= 2^31 elements)
):
    """One contiguous BLOCK of the flattened [T * C] output per program (the shape of the elementwise
    kernel torch.compile generates, which a [BLOCK_T, BLOCK_C] tile grid trailed by 2%): element
    (t, c) reads h[t, j] (L1 hits) and x[t, j, c] for the four streams j."""
    i = tl.program_id(0)
    if I64:
        i = i.to(tl.int64)
    o = i * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    t = o // C
    p_x = x_ptr + t * (4 * C) + o % C
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(4):
        if EVEN:
            b_h = tl.load(h_ptr + t * 4 + j, eviction_policy="evict_last")
            b_x = tl.load(p_x + j * C)
        else:
            b_h = tl.load(h_ptr + t * 4 + j, mask=m, other=0.0, eviction_policy="evict_last")
            b_x = tl.load(p_x + j * C, mask=m, other=0.0)
        acc += b_h * b_x.to(tl.float32)
    if EVEN:
        tl.store(y_ptr + o, acc.to(y_ptr.dtype.element_ty))
    else:
        tl.store(y_ptr + o, acc.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _column(H_ptr, o_t64, m_t, j: tl.constexpr):
    """H[t, :, j] as a [BLOCK_T, 4] tile."""
    o_i = tl.arange(0, 4)
    return tl.load(H_ptr + o_t64[:, None] * 16 + o_i[None, :] * 4 + j, mask=m_t[:, None], other=0.0)


@triton.jit
def mhc_post_res_fwd_kernel(
    x_ptr,  # [T, 4, C] streams
    f_ptr,  # [T, C] layer output, x's dtype
    H_ptr,  # [T, 4, 4] fp32 H_merged
    hp_ptr,  # [T, 4] fp32 h_post
    y_ptr,  # [T, 4, C] new streams, x's dtype
    T,
    C,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_i = tl.arange(0, 4)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_t, m_c = o_t < T, o_c < C
    o_t64 = o_t.to(tl.int64)
    m_tc = m_t[:, None] & m_c[None, :]
    p_x = x_ptr + o_t64[:, None] * 4 * C + o_c[None, :]
    b_f = tl.load(f_ptr + o_t64[:, None] * C + o_c[None, :], mask=m_tc, other=0.0).to(tl.float32)
    b_hp = tl.load(hp_ptr + o_t64[:, None] * 4 + o_i[None, :], mask=m_t[:, None], other=0.0)
    b_y = b_hp[:, :, None] * b_f[:, None, :]
    b_y += _column(H_ptr, o_t64, m_t, 0)[:, :, None] * tl.load(p_x, mask=m_tc, other=0.0).to(tl.float32)[:, None, :]
    b_y += _column(H_ptr, o_t64, m_t, 1)[:, :, None] * tl.load(p_x + C, mask=m_tc, other=0.0).to(tl.float32)[:, None, :]
    b_y += _column(H_ptr, o_t64, m_t, 2)[:, :, None] * tl.load(p_x + 2 * C, mask=m_tc, other=0.0).to(tl.float32)[:, None, :]
    b_y += _column(H_ptr, o_t64, m_t, 3)[:, :, None] * tl.load(p_x + 3 * C, mask=m_tc, other=0.0).to(tl.float32)[:, None, :]
    o_y = o_t64[:, None, None] * 4 * C + o_i[None, :, None] * C + o_c[None, None, :]
    tl.store(y_ptr + o_y, b_y.to(y_ptr.dtype.element_ty), mask=m_t[:, None, None] & m_c[None, None, :])
