"""Ternary (1.58-bit) weight kernels over bit-sliced planes.

Weights: ``plus``/``minus`` int32 [N, KW] (bit b of word w is column 32w + b), per-row fp32 scales.
- ``popcount_matmul_a8``: int8 activations as 8 bit planes; exact integer result
  sum_b 2^b (popc(plus & a_b) - popc(minus & a_b)), bit 7 weighing -128 (two's complement).
- ``ternary_matmul``: fp16/bf16/fp32 activations; weight tiles are expanded to {-1, 0, +1} on chip
  and multiplied with tensor-core dots; K is split across programs while output tiles are few
  (decode), and 2048-column chunks whose weights are all zero for every row of the tile are
  skipped (plane skipping).
"""

import torch
import triton
import triton.language as tl

from triforge import _runtime, launch
from triforge.launch import new_output

CHUNK_WORDS = 64  # 2048 columns: the granularity of the sparsity metadata


@triton.jit
def _popc(v, USE_ASM: tl.constexpr):
    """Population count of int32 words (as int32)."""
    if USE_ASM:
        return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)
    u = v.to(tl.uint32, bitcast=True)
    u = u - ((u >> 1) & 0x55555555)
    u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
    u = (u + (u >> 4)) & 0x0F0F0F0F
    u = (u * 0x01010101) >> 24
    return u.to(tl.int32)


@triton.jit
def ternary_popcount_a8_kernel(
    a_ptr,  # [8, M, KW] int32 activation bit planes
    plus_ptr,  # [N, KW] int32
    minus_ptr,  # [N, KW] int32
    out_ptr,  # [M, N] int32 exact integer product
    M,
    N,
    KW,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m, m_n = o_m < M, o_n < N
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for w0 in range(0, KW, BLOCK_W):
        o_w = w0 + tl.arange(0, BLOCK_W)
        m_w = o_w < KW
        o_nw = o_n.to(tl.int64)[:, None] * KW + o_w[None, :]
        m_nw = m_n[:, None] & m_w[None, :]
        b_p = tl.load(plus_ptr + o_nw, mask=m_nw, other=0)[None, :, :]
        b_q = tl.load(minus_ptr + o_nw, mask=m_nw, other=0)[None, :, :]
        o_mw = o_m.to(tl.int64)[:, None] * KW + o_w[None, :]
        m_mw = m_m[:, None] & m_w[None, :]
        for b in tl.static_range(8):
            b_a = tl.load(a_ptr + b * M * KW + o_mw, mask=m_mw, other=0)[:, None, :]
            b_d = tl.sum(_popc(b_p & b_a, USE_ASM) - _popc(b_q & b_a, USE_ASM), axis=2)
            if b == 7:
                b_acc -= b_d * 128
            else:
                b_acc += b_d * (1 << b)
    o_out = o_m.to(tl.int64)[:, None] * N + o_n[None, :]
    tl.store(out_ptr + o_out, b_acc, mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _expand(plus_ptr, minus_ptr, o_n, m_n, w0, KW, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr):
    """Weights of BLOCK_N rows x (BLOCK_W * 32) columns starting at word w0, as fp32 {-1, 0, 1}."""
    o_w = w0 + tl.arange(0, BLOCK_W)
    m = m_n[:, None] & (o_w < KW)[None, :]
    o_nw = o_n.to(tl.int64)[:, None] * KW + o_w[None, :]
    b_p = tl.load(plus_ptr + o_nw, mask=m, other=0).to(tl.uint32, bitcast=True)
    b_q = tl.load(minus_ptr + o_nw, mask=m, other=0).to(tl.uint32, bitcast=True)
    sh = tl.arange(0, 32).to(tl.uint32)
    t = ((b_p[:, :, None] >> sh[None, None, :]) & 1).to(tl.float32) - ((b_q[:, :, None] >> sh[None, None, :]) & 1).to(tl.float32)
    return tl.reshape(t, [BLOCK_N, BLOCK_W * 32])


@triton.jit
def ternary_matmul_kernel(
    x_ptr,  # [M, K] activations, fp16/bf16/fp32
    plus_ptr,  # [N, KW] int32
    minus_ptr,  # [N, KW] int32
    active_ptr,  # [N, n_chunks] int32: 1 where the row has a non-zero weight in the chunk (read when SKIP)
    part_ptr,  # [S, M, N] fp32: the product over this program's run of chunks
    M,
    N,
    K,
    KW,
    n_chunks,
    chunks_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SKIP: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """A program per (BLOCK_M rows of x, BLOCK_N weight rows, run of 2048-column chunks): split-K
    keeps decode (M = 1) busy; weight tiles are expanded to {-1, 0, 1} in x's dtype for tl.dot."""
    i_m, i_n, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m, m_n = o_m < M, o_n < N
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    c_start = i_s * chunks_per_split
    c_end = tl.minimum(c_start + chunks_per_split, n_chunks)
    for c in range(c_start, c_end):
        run = True
        if SKIP:
            b_act = tl.load(active_ptr + o_n.to(tl.int64) * n_chunks + c, mask=m_n, other=0)
            run = tl.max(b_act, axis=0) > 0
        if run:
            for j in range(0, 64, BLOCK_W):
                w0 = c * 64 + j
                b_t = _expand(plus_ptr, minus_ptr, o_n, m_n, w0, KW, BLOCK_W, BLOCK_N)  # [BN, BW*32]
                o_k = w0 * 32 + tl.arange(0, BLOCK_W * 32)
                b_x = tl.load(x_ptr + o_m.to(tl.int64)[:, None] * K + o_k[None, :],
                              mask=m_m[:, None] & (o_k < K)[None, :], other=0.0)
                if DOT_F32:
                    b_acc = tl.dot(b_x.to(tl.float32), tl.trans(b_t), b_acc, input_precision="ieee")
                else:
                    b_acc = tl.dot(b_x, tl.trans(b_t.to(x_ptr.dtype.element_ty)), b_acc)
    o_out = (i_s.to(tl.int64) * M + o_m[:, None]) * N + o_n[None, :]
    tl.store(part_ptr + o_out, b_acc, mask=m_m[:, None] & m_n[None, :])


# ----------------------------------------------------------------------------- launchers


def _to_int32_words(bits: torch.Tensor) -> torch.Tensor:
    """bits [..., KW, 32] (0/1) -> int32 words [..., KW] (bit b of a word is element b)."""
    words = (bits.to(torch.int64) << torch.arange(32, device=bits.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def activation_bit_planes(x_int8: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] -> int32 [8, M, KW]: plane b holds bit b of each byte (two's complement)."""
    M, K = x_int8.shape
    kw = triton.cdiv(K, 32)
    u = x_int8.to(torch.int16) & 0xFF
    bits = torch.stack([(u >> b) & 1 for b in range(8)])  # [8, M, K]
    bits = torch.nn.functional.pad(bits, (0, kw * 32 - K))
    return _to_int32_words(bits.view(8, M, kw, 32)).contiguous()


def popcount_matmul_a8(x_int8: torch.Tensor, plus: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
    """Exact int32 [M, N] = x_int8 [M, K] @ trits^T through bit-plane popcounts."""
    M = x_int8.shape[0]
    N, KW = plus.shape
    planes = activation_bit_planes(x_int8)
    out = new_output((M, N), torch.int32, x_int8.device)
    bm, bn, bw = (16, 32, 8) if not _runtime.INTERPRET else (16, 16, 4)
    launch.launch(
        "ternary_popcount_a8", ternary_popcount_a8_kernel, (triton.cdiv(M, bm), triton.cdiv(N, bn)),
        planes, plus, minus, out, M, N, KW,
        nbytes=planes.numel() * 4 + 2 * plus.numel() * 4 + out.numel() * 4,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_W=bw, USE_ASM=not _runtime.INTERPRET, num_warps=4,
    )
    return out


def chunk_activity(plus: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
    """int32 [N, n_chunks]: 1 where the row has any non-zero weight in the 2048-column chunk."""
    N, KW = plus.shape
    n_chunks = triton.cdiv(KW, CHUNK_WORDS)
    nz = torch.nn.functional.pad((plus | minus) != 0, (0, n_chunks * CHUNK_WORDS - KW))
    return nz.view(N, n_chunks, CHUNK_WORDS).any(-1).to(torch.int32).contiguous()


def ternary_matmul(x2d, plus, minus, scales, bias=None, active=None):
    """x2d [M, K] (fp16/bf16/fp32) @ (scales * trits)^T (+ bias) -> [M, N] in x's dtype.

    ``active`` (from ``chunk_activity``) enables skipping all-zero 2048-column chunks.
    """
    M, K = x2d.shape
    N, KW = plus.shape
    n_chunks = triton.cdiv(KW, CHUNK_WORDS)
    skip = active is not None
    bm = 16 if M <= 16 or _runtime.INTERPRET else 64
    bn = 16 if _runtime.INTERPRET else 64
    bw = 2 if _runtime.INTERPRET else 8
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    splits = max(1, min(n_chunks, triton.cdiv(_runtime.num_sms() * 4, tiles)))  # split K while tiles are few
    per_split = triton.cdiv(n_chunks, splits)
    splits = triton.cdiv(n_chunks, per_split)
    part = new_output((splits, M, N), torch.float32, x2d.device)
    launch.launch(
        "ternary_matmul", ternary_matmul_kernel, (triton.cdiv(M, bm), triton.cdiv(N, bn), splits),
        x2d, plus, minus, active if skip else plus, part, M, N, K, KW, n_chunks, per_split,
        nbytes=x2d.numel() * x2d.element_size() + 2 * plus.numel() * 4 + M * N * x2d.element_size(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_W=bw, SKIP=skip,
        DOT_F32=x2d.dtype == torch.float32 or (_runtime.INTERPRET and x2d.dtype == torch.bfloat16), num_warps=4,
    )
    y = (part[0] if splits == 1 else part.sum(0)) * scales.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x2d.dtype)
