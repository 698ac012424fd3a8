"""GEMV for decode (1..64 rows of activations against a weight matrix), with the epilogues a decoder
layer needs fused in: bias, residual add, RMSNorm prologue, RoPE + KV-cache write, SwiGLU.

    y [M, N] = x [M, K] @ W^T,   W [N, K]

Weight layout: W stays row-major [N, K] with K contiguous (``nn.Linear.weight``'s own layout, no
repacking). A program owns BLOCK_N whole rows of W and streams them along K in [BLOCK_N, BLOCK_K]
tiles; each thread reads 16 contiguous bytes of one row (8 bf16 / 4 fp32) and a warp covers 512
contiguous bytes, so every weight byte arrives through a fully coalesced 16-byte vector load and is
read exactly once. The x chunk [M, BLOCK_K] is shared by every row of the tile (L1/L2 hits). Rows of
W that several outputs need together are concatenated along N, never interleaved:

    fused QKV     W [(Hq + 2 Hkv) * D, C]   q rows, then k rows, then v rows (head-major, D per head)
    gate/up       W [2 I, C]                gate rows 0..I-1, then up rows I..2I-1

so a fused weight is ``torch.cat`` of the Hugging Face weights and a program reads its rows of each
part with a second row offset (the q/k half-rotation pairs row d with row d + D/2 of the same head;
gate row j with up row I + j).

Decode is memory-bound: time ~ bytes of W / bandwidth. Every kernel accumulates in fp32 and rounds
where the eager Hugging Face model rounds (the projection, then the residual sum / SiLU / product),
so bf16 results track the eager model; with fp32 inputs every rounding is a no-op.

Two inner products, picked per launch:
- FMA (M <= 2): a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 accumulator of elementwise products, reduced over
  K once after the loop (no per-chunk reductions, no tensor cores for a single row).
- DOT (M > 2): tl.dot on [BLOCK_M >= 16, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles (tensor cores; rows
  past M are masked). fp32 runs the dot in IEEE fp32; in Triton 3.6's CPU interpreter a bf16 dot is
  computed in fp32 (the interpreter multiplies bf16 dot operands wrongly; bf16 products are exact in
  fp32 either way).

Kernels (grid axis 0 over row blocks of W, axis 1 over blocks of M):
- ``gemv_kernel``: y = round(round(x @ W^T + bias) + residual), optional RMSNorm prologue.
- ``gemv_qkv_rope_kernel``: RMSNorm prologue, q/k/v projection + bias (fp32, rounded once), RoPE
  (rotate_half, cos/sin rows of each row's position) on q and k in fp32; q to the output, k and v
  straight into the caches at row ``positions[m]``.
- ``gemv_gate_up_kernel``: RMSNorm prologue, y = silu(x @ Wg^T) * (x @ Wu^T).
- ``gemv_stream_kernel`` (cfg "PPS" > 0, M <= 2): either of the two above as a persistent grid of PPS
  programs per SM, each streaming a balanced range of row blocks with the next tiles prefetched.
- ``gemv_mlp_kernel`` (``gemv_mlp_launch``; used by the engine only where a "gemv_mlp" config exists):
  gate/up + SwiGLU, a grid barrier, down + residual in one persistent launch.
Both are opt-in. In the Qwen2.5-0.5B decode step on the H100 (benchmarks/decode_ab.py, session 13) they
were slower than the one-shot kernels: 1389 (stream) and 1268 (fused MLP) against 1408 generate tokens/s.

The RMSNorm prologue (Qwen2RMSNorm numerics: rstd in fp32, xn = round(w * round(x * rstd))) costs
one extra pass over x per program (M * K elements from L2, against BLOCK_N * K weight elements from
HBM) and saves a launch plus a write and read of the normalised activations.
"""

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from triforge import _runtime, launch
from triforge.launch import new_output
from triforge.ops._tl import rne_bf16 as _rne_bf16
from triforge.ops._checks import check_same_device, check_tensor
from triforge.registry import OpSpec, register
from triforge.tune import Tunable
from triforge.tune import register as register_tunable

MAX_FMA_ROWS = 2  # M above this takes the tensor-core (tl.dot) path

# ----------------------------------------------------------------------------- references


def _round(x, dtype):
    """x rounded to ``dtype`` and back: the eager model's rounding points (float64 references)."""
    return x.to(dtype).to(x.dtype) if dtype is not None else x


def rms_norm_ref(x, weight, eps, dtype=None):
    """Qwen2RMSNorm: w * round(x * rstd) (rounded again to ``dtype``)."""
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return _round(weight * _round(x * rstd, dtype), dtype)


def gemv_ref(x, weight, bias=None, residual=None, norm_weight=None, eps=1e-6, dtype=None):
    """Golden reference (call with float64 tensors; ``dtype`` places the kernel's roundings). Stages."""
    stages = OrderedDict()
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps, dtype)
        stages["xn"] = x
    y = x @ weight.T
    if bias is not None:
        y = y + bias
    y = _round(y, dtype)
    if residual is not None:
        y = _round(y + residual, dtype)
    stages["y"] = y
    return stages


def rope_rows_ref(x, cos, sin):
    """x [M, H, D] rotated with per-row cos/sin [M, D] (rotate_half)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def gemv_qkv_rope_ref(x, weight, bias, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads,
                      norm_weight=None, eps=1e-6, dtype=None):
    """Stages (xn), qkv (projection + bias, rounded), q (rotated), k_cache, v_cache (clones, appended)."""
    stages = OrderedDict()
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps, dtype)
        stages["xn"] = x
    M = x.shape[0]
    D = k_cache.shape[-1]
    qkv = _round(x @ weight.T + bias, dtype)
    stages["qkv"] = qkv
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    pos = positions.long()
    c, s = cos[pos].to(x.dtype), sin[pos].to(x.dtype)
    stages["q"] = _round(rope_rows_ref(q.reshape(M, num_heads, D), c, s), dtype)
    k_rot = _round(rope_rows_ref(k.reshape(M, num_kv_heads, D), c, s), dtype)
    kc, vc = k_cache.clone(), v_cache.clone()
    rows = torch.arange(M, device=x.device)
    kc[rows, pos] = k_rot.to(kc.dtype)
    vc[rows, pos] = v.reshape(M, num_kv_heads, D).to(vc.dtype)
    stages["k_cache"] = kc
    stages["v_cache"] = vc
    return stages


def gemv_gate_up_ref(x, weight, norm_weight=None, eps=1e-6, dtype=None):
    """Stages (xn), y = round(round(silu(round(gate))) * round(up))."""
    stages = OrderedDict()
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps, dtype)
        stages["xn"] = x
    inter = weight.shape[0] // 2
    gate = _round(x @ weight[:inter].T, dtype)
    up = _round(x @ weight[inter:].T, dtype)
    act = _round(gate * torch.sigmoid(gate), dtype)
    stages["y"] = _round(act * up, dtype)
    return stages


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _norm_chunk(b_x, b_rstd, nw_ptr, o_k, m_k, DT: tl.constexpr, RNE: tl.constexpr):
    """Qwen2RMSNorm of an fp32 x chunk: round(w * round(x * rstd)) in the weight dtype, kept in fp32."""
    b_nw = tl.load(nw_ptr + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_x = b_x * b_rstd[:, None]
    b_x = _rne_bf16(b_x) if RNE else b_x.to(DT).to(tl.float32)
    b_x = b_x * b_nw[None, :]
    return _rne_bf16(b_x) if RNE else b_x.to(DT).to(tl.float32)


@triton.jit
def _x_rstd(x_ptr, o_xm, o_k0, m_m, K, eps, BLOCK_K: tl.constexpr, CG: tl.constexpr):
    """RMSNorm's fp32 1 / rms of each row of x [BLOCK_M, K], in one pass over K in BLOCK_K-wide chunks."""
    b_ss = tl.zeros([o_xm.shape[0]], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + o_k0
        m_x = m_m[:, None] & (o_k < K)[None, :]
        if CG:
            b_x = tl.load(x_ptr + o_xm + o_k[None, :], mask=m_x, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            b_x = tl.load(x_ptr + o_xm + o_k[None, :], mask=m_x, other=0.0).to(tl.float32)
        b_ss += tl.sum(b_x * b_x, axis=1)
    return tl.rsqrt(b_ss / K + eps)


@triton.jit
def _x_chunk(x_ptr, xn_ptr, nw_ptr, write_xn, o_xm, o_k, m_m, K, b_rstd, DT: tl.constexpr, NORM: tl.constexpr,
             STORE_XN: tl.constexpr, RNE: tl.constexpr, CG: tl.constexpr = False):
    """The fp32 x chunk [BLOCK_M, BLOCK_K] at columns o_k, RMSNorm-ed (and stored to xn) when NORM.
    CG: read past L1 (x was written by other programs of the same launch)."""
    m_k = o_k < K
    m_x = m_m[:, None] & m_k[None, :]
    if CG:
        b_x = tl.load(x_ptr + o_xm + o_k[None, :], mask=m_x, other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        b_x = tl.load(x_ptr + o_xm + o_k[None, :], mask=m_x, other=0.0).to(tl.float32)
    if NORM:
        b_x = _norm_chunk(b_x, b_rstd, nw_ptr, o_k, m_k, DT, RNE)
        if STORE_XN:
            tl.store(xn_ptr + o_xm + o_k[None, :], b_x.to(xn_ptr.dtype.element_ty), mask=m_x & write_xn)
    return b_x


@triton.jit
def _product(b_x, b_w, acc, DT: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr):
    """acc + the products of an fp32 x chunk [BLOCK_M, BLOCK_K] and a weight tile [BLOCK_N, BLOCK_K]:
    a tensor-core dot into [BLOCK_M, BLOCK_N], or FMA into [BLOCK_M, BLOCK_N, BLOCK_K] (reduced later)."""
    if USE_DOT:  # (one return at the end: the compiler keeps generating code after a return in a branch)
        if IEEE:
            out = tl.dot(b_x, tl.trans(b_w.to(tl.float32)), acc, input_precision="ieee")
        else:
            out = tl.dot(b_x.to(DT), tl.trans(b_w), acc)
    else:
        out = acc + b_x[:, None, :] * b_w.to(tl.float32)[None, :, :]
    return out


@triton.jit
def _gemv_tiles(
    x_ptr,  # [M, K] activations
    w_ptr,  # [N_total, K] weight, row-major (K contiguous)
    nw_ptr,  # [K] RMSNorm weight (read when NORM)
    xn_ptr,  # [M, K] normalised activations (written by the first row block when STORE_XN)
    write_xn,  # this program writes xn
    M,
    K,
    eps,
    o_m,  # [BLOCK_M] activation rows
    o_na,  # [BLOCK_N] weight rows of the first tile
    o_nb,  # [BLOCK_N] weight rows of the second tile (TWO)
    m_n,  # [BLOCK_N] which rows exist
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    TWO: tl.constexpr,
    STORE_XN: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    RNE: tl.constexpr,
    ONE: tl.constexpr,  # K <= BLOCK_K: one K step
    PDL: tl.constexpr,  # launched as a programmatic dependent: wait for the previous kernel before reading x
    PRE: tl.constexpr,  # PDL, several K steps: the first step's weight tiles are loaded before the wait
    r_ptr=None,  # [M, N] residual (read when HAS_RESIDUAL)
    N=0,
    HAS_RESIDUAL: tl.constexpr = False,
):
    """(acc_a, acc_b, b_r) [BLOCK_M, BLOCK_N] fp32: x (RMSNorm-ed when NORM) times rows o_na (and o_nb) of W,
    and the residual's tile at rows o_na (HAS_RESIDUAL; else zeros). The residual is loaded right after the
    wait (it is the previous kernel's output), before the products: its L2 round trip overlaps them instead
    of following them in the epilogue.
    ONE: the weight tiles are loaded first, then x once (its sum of squares, norm and product from the
    same registers), so the weights' DRAM latency overlaps the norm's L2 round trip and reduction
    instead of following them (a decode GEMV's program is one or two such latencies long).
    PDL: nothing but weights is read (and nothing written) before griddepcontrol.wait, so under
    programmatic dependent launch the kernel starts, and fetches its weights, while its predecessor
    drains."""
    DT = w_ptr.dtype.element_ty
    m_m = o_m < M
    o_k0 = tl.arange(0, BLOCK_K)
    o_xm = o_m.to(tl.int64)[:, None] * K
    o_wa = o_na.to(tl.int64)[:, None] * K
    o_wb = o_nb.to(tl.int64)[:, None] * K
    if USE_DOT:
        acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc_a = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    if ONE:
        m_k = o_k0 < K
        m_w = m_n[:, None] & m_k[None, :]
        m_x = m_m[:, None] & m_k[None, :]
        b_wa = tl.load(w_ptr + o_wa + o_k0[None, :], mask=m_w, other=0.0)
        b_wb = b_wa
        if TWO:
            b_wb = tl.load(w_ptr + o_wb + o_k0[None, :], mask=m_w, other=0.0)
        if PDL:  # weights are constants: their loads are in flight while the previous kernel finishes
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start: it waits the same way
        b_r = _load_residual(r_ptr, o_m, m_m, o_na, N, HAS_RESIDUAL)
        b_x = tl.load(x_ptr + o_xm + o_k0[None, :], mask=m_x, other=0.0).to(tl.float32)
        if NORM:
            b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / K + eps)
            b_x = _norm_chunk(b_x, b_rstd, nw_ptr, o_k0, m_k, DT, RNE)
            if STORE_XN:
                tl.store(xn_ptr + o_xm + o_k0[None, :], b_x.to(xn_ptr.dtype.element_ty), mask=m_x & write_xn)
        acc_a = _product(b_x, b_wa, acc_a, DT, USE_DOT, IEEE)
        if TWO:
            acc_b = _product(b_x, b_wb, acc_b, DT, USE_DOT, IEEE)
    else:
        k_first = 0
        if PDL:
            if PRE:  # the first K step's weight tiles are in flight while the previous kernel drains
                m_w0 = m_n[:, None] & (o_k0 < K)[None, :]
                f_wa = tl.load(w_ptr + o_wa + o_k0[None, :], mask=m_w0, other=0.0)
                f_wb = f_wa
                if TWO:
                    f_wb = tl.load(w_ptr + o_wb + o_k0[None, :], mask=m_w0, other=0.0)
                k_first = BLOCK_K
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start: it waits the same way
        b_r = _load_residual(r_ptr, o_m, m_m, o_na, N, HAS_RESIDUAL)
        b_rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if NORM:
            b_rstd = _x_rstd(x_ptr, o_xm, o_k0, m_m, K, eps, BLOCK_K, False)
        if PDL:
            if PRE:  # the peeled first K step, on the prefetched tiles
                b_x = _x_chunk(x_ptr, xn_ptr, nw_ptr, write_xn, o_xm, o_k0, m_m, K, b_rstd, DT, NORM, STORE_XN, RNE)
                acc_a = _product(b_x, f_wa, acc_a, DT, USE_DOT, IEEE)
                if TWO:
                    acc_b = _product(b_x, f_wb, acc_b, DT, USE_DOT, IEEE)
        for k0 in range(k_first, K, BLOCK_K):
            o_k = k0 + o_k0
            m_k = o_k < K
            b_x = _x_chunk(x_ptr, xn_ptr, nw_ptr, write_xn, o_xm, o_k, m_m, K, b_rstd, DT, NORM, STORE_XN, RNE)
            m_w = m_n[:, None] & m_k[None, :]
            acc_a = _product(b_x, tl.load(w_ptr + o_wa + o_k[None, :], mask=m_w, other=0.0), acc_a, DT, USE_DOT, IEEE)
            if TWO:
                acc_b = _product(b_x, tl.load(w_ptr + o_wb + o_k[None, :], mask=m_w, other=0.0), acc_b, DT, USE_DOT,
                                 IEEE)
    if USE_DOT:
        return acc_a, acc_b, b_r
    else:
        return tl.sum(acc_a, axis=2), tl.sum(acc_b, axis=2), b_r


@triton.jit
def _load_residual(r_ptr, o_m, m_m, o_n, N, HAS_RESIDUAL: tl.constexpr):
    """The residual tile [BLOCK_M, BLOCK_N] in fp32 at rows o_m, columns o_n (zeros without a residual)."""
    if HAS_RESIDUAL:
        o_mn = o_m.to(tl.int64)[:, None] * N + o_n[None, :]
        b_r = tl.load(r_ptr + o_mn, mask=m_m[:, None] & (o_n < N)[None, :], other=0.0).to(tl.float32)
    else:
        b_r = tl.zeros([o_m.shape[0], o_n.shape[0]], dtype=tl.float32)
    return b_r


@triton.jit
def gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] row-major
    b_ptr,  # [N] bias (read when HAS_BIAS)
    r_ptr,  # [M, N] residual (read when HAS_RESIDUAL)
    nw_ptr,  # [K] RMSNorm weight (read when NORM)
    y_ptr,  # [M, N] output, x's dtype
    xn_ptr,  # [M, K] normalised x (written when STORE_XN)
    M,
    N,
    K,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    NORM: tl.constexpr,
    STORE_XN: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    RNE: tl.constexpr,
    ONE: tl.constexpr,
    PDL: tl.constexpr,
    PRE: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    DT = w_ptr.dtype.element_ty
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_n = o_n < N
    acc, _, b_r = _gemv_tiles(
        x_ptr, w_ptr, nw_ptr, xn_ptr, i_n == 0, M, K, eps, o_m, o_n, o_n, m_n,
        BLOCK_M, BLOCK_N, BLOCK_K, NORM, False, STORE_XN, USE_DOT, IEEE, RNE, ONE, PDL, PRE, r_ptr, N, HAS_RESIDUAL,
    )
    _epilogue(acc, acc, b_r, o_n, o_m, m_m, y_ptr, b_ptr, N, DT, False, HAS_BIAS, HAS_RESIDUAL, RNE)


@triton.jit
def gemv_qkv_rope_kernel(
    x_ptr,  # [M, C] residual stream (RMSNorm-ed when NORM)
    w_ptr,  # [(HQ + 2 HKV) * D, C] q, k, v rows
    b_ptr,  # [(HQ + 2 HKV) * D] bias
    nw_ptr,  # [C] RMSNorm weight (read when NORM)
    cos_ptr,  # [P >= S_max, D] fp32 cos table, row = position
    sin_ptr,  # [P >= S_max, D] fp32 sin table
    pos_ptr,  # [M] int32 position of each row (= its cache row)
    q_ptr,  # [M, HQ, D] rotated queries, x's dtype
    kc_ptr,  # [B >= M, S_max, HKV, D] key cache (row positions[m] of batch row m written)
    vc_ptr,  # [B >= M, S_max, HKV, D] value cache
    qkv_ptr,  # [M, (HQ + 2 HKV) * D] projections before RoPE (written when STORE_PRE)
    xn_ptr,  # [M, C] normalised x (written when STORE_XN)
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    M,
    C,
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # half-rows per program (a half-row pairs dim d with d + D/2 of one head)
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    STORE_PRE: tl.constexpr,
    STORE_XN: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    RNE: tl.constexpr,
    ONE: tl.constexpr,
    PDL: tl.constexpr,
    PRE: tl.constexpr,
):
    HALF: tl.constexpr = D // 2
    NH: tl.constexpr = HQ + 2 * HKV
    DT = w_ptr.dtype.element_ty
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    # half-row r: head r // HALF (q heads, then k heads, then v heads), dims d and d + HALF, d = r % HALF
    o_r = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_r = o_r < NH * HALF
    o_h = o_r // HALF
    o_d = o_r % HALF
    o_na = o_h * D + o_d
    o_nb = o_na + HALF
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    acc_a, acc_b, _ = _gemv_tiles(
        x_ptr, w_ptr, nw_ptr, xn_ptr, i_n == 0, M, C, eps, o_m, o_na, o_nb, m_r,
        BLOCK_M, BLOCK_N, BLOCK_K, NORM, True, STORE_XN, USE_DOT, IEEE, RNE, ONE, PDL, PRE,
    )
    # bias in fp32, one rounding: the projection as the eager model stores it
    b_xa = acc_a + tl.load(b_ptr + o_na, mask=m_r, other=0.0).to(tl.float32)[None, :]
    b_xb = acc_b + tl.load(b_ptr + o_nb, mask=m_r, other=0.0).to(tl.float32)[None, :]
    b_xa = _rne_bf16(b_xa) if RNE else b_xa.to(DT).to(tl.float32)
    b_xb = _rne_bf16(b_xb) if RNE else b_xb.to(DT).to(tl.float32)
    m_mr = m_m[:, None] & m_r[None, :]
    if STORE_PRE:
        o_pre = o_m.to(tl.int64)[:, None] * (NH * D) + o_na[None, :]
        tl.store(qkv_ptr + o_pre, b_xa.to(qkv_ptr.dtype.element_ty), mask=m_mr)
        tl.store(qkv_ptr + o_pre + HALF, b_xb.to(qkv_ptr.dtype.element_ty), mask=m_mr)
    # rotate_half on q and k heads: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2 (fp32); v heads pass through
    b_pos = tl.load(pos_ptr + o_m, mask=m_m, other=0).to(tl.int64)
    o_cs = b_pos[:, None] * D + o_d[None, :]
    b_c1 = tl.load(cos_ptr + o_cs, mask=m_mr, other=1.0)
    b_c2 = tl.load(cos_ptr + o_cs + HALF, mask=m_mr, other=1.0)
    b_s1 = tl.load(sin_ptr + o_cs, mask=m_mr, other=0.0)
    b_s2 = tl.load(sin_ptr + o_cs + HALF, mask=m_mr, other=0.0)
    b_ya = b_xa * b_c1 - b_xb * b_s1
    b_yb = b_xb * b_c2 + b_xa * b_s2
    b_ya = _rne_bf16(b_ya) if RNE else b_ya.to(DT).to(tl.float32)
    b_yb = _rne_bf16(b_yb) if RNE else b_yb.to(DT).to(tl.float32)
    is_v = (o_h >= HQ + HKV)[None, :]
    b_ya = tl.where(is_v, b_xa, b_ya)
    b_yb = tl.where(is_v, b_xb, b_yb)
    # q -> q_ptr; k, v -> their cache at row (m, positions[m])
    o_q = o_m.to(tl.int64)[:, None] * (HQ * D) + o_na[None, :]
    m_q = m_mr & (o_h < HQ)[None, :]
    tl.store(q_ptr + o_q, b_ya.to(q_ptr.dtype.element_ty), mask=m_q)
    tl.store(q_ptr + o_q + HALF, b_yb.to(q_ptr.dtype.element_ty), mask=m_q)
    o_row = o_m.to(tl.int64)[:, None]
    o_kc = o_row * stride_kb + b_pos[:, None] * stride_ks + ((o_h - HQ) * stride_kh + o_d)[None, :]
    m_k = m_mr & ((o_h >= HQ) & (o_h < HQ + HKV))[None, :]
    tl.store(kc_ptr + o_kc, b_ya.to(kc_ptr.dtype.element_ty), mask=m_k)
    tl.store(kc_ptr + o_kc + HALF, b_yb.to(kc_ptr.dtype.element_ty), mask=m_k)
    o_vc = o_row * stride_vb + b_pos[:, None] * stride_vs + ((o_h - HQ - HKV) * stride_vh + o_d)[None, :]
    m_v = m_mr & is_v
    tl.store(vc_ptr + o_vc, b_ya.to(vc_ptr.dtype.element_ty), mask=m_v)
    tl.store(vc_ptr + o_vc + HALF, b_yb.to(vc_ptr.dtype.element_ty), mask=m_v)


@triton.jit
def gemv_gate_up_kernel(
    x_ptr,  # [M, C] (RMSNorm-ed when NORM)
    w_ptr,  # [2 I, C]: gate rows, then up rows
    nw_ptr,  # [C] RMSNorm weight (read when NORM)
    y_ptr,  # [M, I] silu(gate) * up, x's dtype
    xn_ptr,  # [M, C] normalised x (written when STORE_XN)
    M,
    I,
    C,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    STORE_XN: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    RNE: tl.constexpr,
    ONE: tl.constexpr,
    PDL: tl.constexpr,
    PRE: tl.constexpr,
):
    DT = w_ptr.dtype.element_ty
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    acc_g, acc_u, _ = _gemv_tiles(
        x_ptr, w_ptr, nw_ptr, xn_ptr, i_n == 0, M, C, eps, o_m, o_n, o_n + I, m_n,
        BLOCK_M, BLOCK_N, BLOCK_K, NORM, True, STORE_XN, USE_DOT, IEEE, RNE, ONE, PDL, PRE,
    )
    _epilogue(acc_g, acc_u, acc_g, o_n, o_m, m_m, y_ptr, y_ptr, I, DT, True, False, False, RNE)


@triton.jit
def _stream_range(pid, n_prog, N, n_steps, BLOCK_N: tl.constexpr):
    """Program pid's flat steps [j0, j1) (j = unit * n_steps + K step): a contiguous, balanced range of whole
    units (row blocks of BLOCK_N rows); empty when the grid has more programs than units."""
    units = tl.cdiv(N, BLOCK_N)
    u0 = (pid * units) // n_prog
    u1 = ((pid + 1) * units) // n_prog
    return u0 * n_steps, u1 * n_steps


@triton.jit
def _stream_tile(w_ptr, j, j1, n_steps, N, K, o_b, o_k0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 TWO: tl.constexpr):
    """Weight tile(s) of flat step j = unit * n_steps + step: rows unit * BLOCK_N + [0, BLOCK_N), columns
    step * BLOCK_K + [0, BLOCK_K); nothing is read for j >= j1 (past the program's range). TWO: the rows N
    further down too (gate/up: the up row of each gate row)."""
    u = j // n_steps
    o_n = u * BLOCK_N + o_b
    o_k = (j - u * n_steps) * BLOCK_K + o_k0
    m = ((o_n < N) & (j < j1))[:, None] & (o_k < K)[None, :]
    off = o_n.to(tl.int64)[:, None] * K + o_k[None, :]
    b_wa = tl.load(w_ptr + off, mask=m, other=0.0)
    b_wb = b_wa
    if TWO:
        b_wb = tl.load(w_ptr + off + N.to(tl.int64) * K, mask=m, other=0.0)
    return b_wa, b_wb


@triton.jit
def _epilogue(b_a, b_b, b_r, o_n, o_m, m_m, y_ptr, b_ptr, N, DT: tl.constexpr, GATE_UP: tl.constexpr,
              HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RNE: tl.constexpr):
    """Outputs [BLOCK_M, BLOCK_N] at columns o_n from the fp32 projections, rounded where the eager model
    rounds: plain, round(round(b_a + bias) + residual) (b_r: the residual tile, fp32, loaded by the caller);
    GATE_UP (b_b: up), round(round(silu(round(b_a))) * round(b_b))."""
    m_n = o_n < N
    o_mn = o_m.to(tl.int64)[:, None] * N + o_n[None, :]
    m_mn = m_m[:, None] & m_n[None, :]
    if HAS_BIAS:
        b_a += tl.load(b_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    b_a = _rne_bf16(b_a) if RNE else b_a.to(DT).to(tl.float32)
    if GATE_UP:
        b_u = _rne_bf16(b_b) if RNE else b_b.to(DT).to(tl.float32)
        b_act = b_a * tl.sigmoid(b_a)
        b_act = _rne_bf16(b_act) if RNE else b_act.to(DT).to(tl.float32)
        b_y = b_act * b_u
        b_y = _rne_bf16(b_y) if RNE else b_y.to(DT).to(tl.float32)
    else:
        b_y = b_a
        if HAS_RESIDUAL:
            b_y += b_r
            b_y = _rne_bf16(b_y) if RNE else b_y.to(DT).to(tl.float32)
    tl.store(y_ptr + o_mn, b_y.to(y_ptr.dtype.element_ty), mask=m_mn)


@triton.jit
def _stream_store(acc_a, acc_b, u, o_b, o_m, m_m, y_ptr, b_ptr, r_ptr, N, BLOCK_N: tl.constexpr, DT: tl.constexpr,
                  GATE_UP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RNE: tl.constexpr):
    """Unit u's outputs from its [BLOCK_M, BLOCK_N, BLOCK_K] product sums (_epilogue's roundings)."""
    b_a = tl.sum(acc_a, axis=2)
    b_b = b_a
    if GATE_UP:
        b_b = tl.sum(acc_b, axis=2)
    o_n = u * BLOCK_N + o_b
    b_r = _load_residual(r_ptr, o_m, m_m, o_n, N, HAS_RESIDUAL)
    _epilogue(b_a, b_b, b_r, o_n, o_m, m_m, y_ptr, b_ptr, N, DT, GATE_UP, HAS_BIAS, HAS_RESIDUAL, RNE)


@triton.jit
def _stream_rows(x_ptr, w_ptr, b_ptr, r_ptr, nw_ptr, y_ptr, xn_ptr, M, N, K, n_steps, eps, j0, j1, b_wa, b_wb,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATE_UP: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, STORE_XN: tl.constexpr,
                 RNE: tl.constexpr, ONE: tl.constexpr, CG: tl.constexpr):
    """Flat steps [j0, j1) of a streaming GEMV, given the first step's weight tiles (b_wa, b_wb: the caller
    loads them, before its wait). Each step loads the next step's tiles before its own products, so two
    steps of weights are in flight from start to end. The per-unit sums over K run in gemv_kernel's order."""
    DT = w_ptr.dtype.element_ty
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_b = tl.arange(0, BLOCK_N)
    o_k0 = tl.arange(0, BLOCK_K)
    o_xm = o_m.to(tl.int64)[:, None] * K
    write_xn = (j0 == 0) & (j1 > 0)  # the owner of unit 0 writes xn (from its steps of that unit)
    b_rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ONE:  # x (normalised) once per program
        b_x1 = _x_chunk(x_ptr, xn_ptr, nw_ptr, False, o_xm, o_k0, m_m, K, b_rstd, DT, False, False, RNE, CG)
        if NORM:
            b_rstd = tl.rsqrt(tl.sum(b_x1 * b_x1, axis=1) / K + eps)
            b_x1 = _norm_chunk(b_x1, b_rstd, nw_ptr, o_k0, o_k0 < K, DT, RNE)
            if STORE_XN:
                tl.store(xn_ptr + o_xm + o_k0[None, :], b_x1.to(xn_ptr.dtype.element_ty),
                         mask=m_m[:, None] & (o_k0 < K)[None, :] & write_xn)
    else:
        b_x1 = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        if NORM:
            b_rstd = _x_rstd(x_ptr, o_xm, o_k0, m_m, K, eps, BLOCK_K, CG)
    acc_a = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for j in range(j0, j1):
        f_wa, f_wb = _stream_tile(w_ptr, j + 1, j1, n_steps, N, K, o_b, o_k0, BLOCK_N, BLOCK_K, GATE_UP)
        if ONE:
            p_a = b_x1[:, None, :] * b_wa.to(tl.float32)[None, :, :]
            p_b = p_a
            if GATE_UP:
                p_b = b_x1[:, None, :] * b_wb.to(tl.float32)[None, :, :]
            _stream_store(p_a, p_b, j, o_b, o_m, m_m, y_ptr, b_ptr, r_ptr, N, BLOCK_N, DT, GATE_UP, HAS_BIAS,
                          HAS_RESIDUAL, RNE)
        else:
            u = j // n_steps
            s = j - u * n_steps
            b_x = _x_chunk(x_ptr, xn_ptr, nw_ptr, write_xn & (u == 0), o_xm, s * BLOCK_K + o_k0, m_m, K, b_rstd, DT,
                           NORM, STORE_XN, RNE, CG)
            acc_a += b_x[:, None, :] * b_wa.to(tl.float32)[None, :, :]
            if GATE_UP:
                acc_b += b_x[:, None, :] * b_wb.to(tl.float32)[None, :, :]
            if s == n_steps - 1:
                _stream_store(acc_a, acc_b, u, o_b, o_m, m_m, y_ptr, b_ptr, r_ptr, N, BLOCK_N, DT, GATE_UP, HAS_BIAS,
                              HAS_RESIDUAL, RNE)
                acc_a = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
                acc_b = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        b_wa = f_wa
        b_wb = f_wb


@triton.jit
def gemv_stream_kernel(
    x_ptr,  # [M, K] activations (RMSNorm-ed when NORM)
    w_ptr,  # [N, K] row-major; GATE_UP: [2N, K], gate rows then up rows
    b_ptr,  # [N] bias (read when HAS_BIAS)
    r_ptr,  # [M, N] residual (read when HAS_RESIDUAL)
    nw_ptr,  # [K] RMSNorm weight (read when NORM)
    y_ptr,  # [M, N] output, x's dtype
    xn_ptr,  # [M, K] normalised x (written when STORE_XN)
    M,
    N,  # output columns (GATE_UP: the intermediate size I)
    K,
    n_steps,  # cdiv(K, BLOCK_K)
    eps,
    BLOCK_M: tl.constexpr,  # >= M: one program covers every row of x
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATE_UP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    NORM: tl.constexpr,
    STORE_XN: tl.constexpr,
    RNE: tl.constexpr,
    ONE: tl.constexpr,  # n_steps == 1: x is loaded (and normalised) once per program
    PDL: tl.constexpr,
):
    """Persistent streaming GEMV (FMA path, M <= BLOCK_M <= 2): a grid of a few programs per SM, each
    walking a contiguous, balanced range of row blocks ("units": BLOCK_N rows of W, or BLOCK_N gate/up
    row pairs) K step by K step with the next step's tiles in flight (_stream_rows), instead of one-shot
    programs that each pay a launch, a DRAM round trip and a tail. Same products, sums and roundings as
    gemv_kernel / gemv_gate_up_kernel."""
    j0, j1 = _stream_range(tl.program_id(0), tl.num_programs(0), N, n_steps, BLOCK_N)
    b_wa, b_wb = _stream_tile(w_ptr, j0, j1, n_steps, N, K, tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K), BLOCK_N,
                              BLOCK_K, GATE_UP)
    if PDL:  # the first tiles (weights: constants) are in flight while the previous kernel drains
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _stream_rows(x_ptr, w_ptr, b_ptr, r_ptr, nw_ptr, y_ptr, xn_ptr, M, N, K, n_steps, eps, j0, j1, b_wa, b_wb,
                 BLOCK_M, BLOCK_N, BLOCK_K, GATE_UP, HAS_BIAS, HAS_RESIDUAL, NORM, STORE_XN, RNE, ONE, False)


@triton.jit
def _grid_barrier(sync_ptr, n_prog, max_spin):
    """Every program of the grid arrives before any leaves (the launcher keeps the grid within what the
    SMs hold at once, so all programs are resident). sync_ptr: int32 [arrivals, departures, timeouts], zero
    between launches: the last program to leave re-arms it. A program that spins max_spin times without
    seeing every arrival counts a timeout (the host raises on it) and leaves: never a hang."""
    tl.debug_barrier()  # this program's stores (every thread's) precede its arrival
    n = tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu") + 1
    spins = 0
    # poll with plain (volatile) loads: polling atomics would queue behind the arrivals on the same address
    while (n < n_prog) & (spins < max_spin):
        n = tl.load(sync_ptr, volatile=True)
        spins += 1
    n = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")  # one acquire: synchronises with every arrival
    if n < n_prog:
        tl.atomic_add(sync_ptr + 2, 1, sem="relaxed", scope="gpu")
    left = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == n_prog - 1:  # everyone has passed the spin: re-arm for the next launch
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
    tl.debug_barrier()  # the other threads' reads follow the acquire


@triton.jit
def gemv_mlp_kernel(
    x_ptr,  # [M, C] residual stream after attention: RMSNorm-ed for gate/up, the residual of down
    wgu_ptr,  # [2I, C] gate rows, then up rows
    nw_ptr,  # [C] post-attention RMSNorm weight
    wd_ptr,  # [C, I] down_proj weight
    act_ptr,  # [M, I] silu(gate) * up: written by phase 1, read by phase 2
    y_ptr,  # [M, C] x + act @ Wd^T
    xn_ptr,  # [M, C] normalised x (written when STORE_XN)
    sync_ptr,  # int32 [3] grid-barrier counters (PHASE 0)
    M,
    C,
    I,
    n_steps_d,  # cdiv(I, BK_D)
    eps,
    max_spin,
    BLOCK_M: tl.constexpr,
    BN_GU: tl.constexpr,  # gate/up row pairs per unit
    BK_GU: tl.constexpr,  # >= C: gate/up in one K step
    BN_D: tl.constexpr,  # down rows per unit
    BK_D: tl.constexpr,
    STORE_XN: tl.constexpr,
    RNE: tl.constexpr,
    PHASE: tl.constexpr,  # 0: both phases with a grid barrier between; 1 / 2: that phase alone (a launch each)
    PDL: tl.constexpr,
):
    """The decoder MLP in one persistent launch: phase 1 is gemv_gate_up (norm prologue, SwiGLU) over
    balanced ranges of gate/up row pairs into act; a grid barrier; phase 2 is down_proj + residual over
    balanced ranges of down rows, reading act past L1. Gate/up's first tiles are loaded before
    griddepcontrol.wait, down's first tiles right after phase 1, so they are in flight through gate/up's
    tail and the barrier instead of after a kernel boundary (a second launch's ramp). Dependents are
    released after the barrier (every program of this grid is resident by then). Same roundings as the
    two kernels it replaces."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    g0, g1 = _stream_range(pid, n_prog, I, 1, BN_GU)
    d0, d1 = _stream_range(pid, n_prog, C, n_steps_d, BN_D)
    if PHASE != 2:
        g_wa, g_wb = _stream_tile(wgu_ptr, g0, g1, 1, I, C, tl.arange(0, BN_GU), tl.arange(0, BK_GU), BN_GU, BK_GU,
                                  True)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PHASE != 2:
        _stream_rows(x_ptr, wgu_ptr, wgu_ptr, wgu_ptr, nw_ptr, act_ptr, xn_ptr, M, I, C, 1, eps, g0, g1, g_wa, g_wb,
                     BLOCK_M, BN_GU, BK_GU, True, False, False, True, STORE_XN, RNE, True, False)
    if PHASE != 1:  # (after phase 1: not held in registers through it)
        d_wa, d_wb = _stream_tile(wd_ptr, d0, d1, n_steps_d, C, I, tl.arange(0, BN_D), tl.arange(0, BK_D), BN_D, BK_D,
                                  False)
    if PHASE == 0:
        _grid_barrier(sync_ptr, n_prog, max_spin)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if PHASE != 1:
        _stream_rows(act_ptr, wd_ptr, wd_ptr, x_ptr, wd_ptr, y_ptr, xn_ptr, M, C, I, n_steps_d, eps, d0, d1, d_wa, d_wb,
                     BLOCK_M, BN_D, BK_D, False, False, True, False, False, RNE, BK_D >= I, PHASE == 0)


# ----------------------------------------------------------------------------- launch configs


def _block_m(M: int) -> int:
    if M <= MAX_FMA_ROWS:
        return launch.next_power_of_2(M)
    return max(16, min(64, launch.next_power_of_2(M)))


def _fallback(kind, M, N, K, dtype):
    """Heuristic launch config: (BLOCK_N, BLOCK_K, num_warps, num_stages).

    GPU, FMA path: a [BLOCK_N, BLOCK_K] weight tile of up to 16 KB per K step (up to 128 bytes per
    thread in flight; the loop is not software-pipelined, so each step's loads must cover the DRAM
    latency), BLOCK_N shrunk until there are >= 2 programs per SM (down_proj has only C = 896 rows).
    DOT path: 16..64-row tiles, 128-wide K steps, 3 pipeline stages. Two-tile kernels (qkv, gate/up)
    read two row sets per step, so their tiles are half as tall. The interpreter pays per program
    and per K step, so there tiles are as large as the shapes allow.
    """
    bm = _block_m(M)
    use_dot = bm > MAX_FMA_ROWS
    two = kind in ("qkv", "gate_up")
    rows = N // 2 if two else N  # output rows (row pairs) the grid walks
    if _runtime.INTERPRET:  # ~256K-element product tiles: few programs, few K steps
        bk = max(16, min(256, launch.next_power_of_2(K)))
        bn = max(16 if use_dot else 1, min(launch.next_power_of_2(rows), 262144 // (bm * bk)))
        return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 4, "num_stages": 1}
    e = torch.finfo(dtype).bits // 8
    sms = _runtime.num_sms()
    if use_dot:
        bn = 32 if two else 64
        while bn > 16 and launch.cdiv(rows, bn) < 2 * sms:
            bn //= 2
        bk = 128 if e == 2 else 64
        cfg = {"BLOCK_N": bn, "BLOCK_K": min(bk, max(16, launch.next_power_of_2(K))), "num_warps": 4, "num_stages": 3}
    else:
        tile = (8192 if two else 16384) // e // bm  # elements of one row-block tile per K step
        bk = min(launch.next_power_of_2(K), 2048 if e == 2 else 1024)
        bn = max(1, tile // bk)
        while bn > 1 and launch.cdiv(rows, bn) < 2 * sms:
            bn //= 2
        cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 4, "num_stages": 2}
    return cfg


_KERNELS = {"plain": "gemv", "qkv": "gemv_qkv_rope", "gate_up": "gemv_gate_up"}


def _config_key(M, N, K, dtype):
    return launch.config_key(m=_block_m(M), n=N, k=K, dtype=launch.dtype_tag(dtype))


def _config(kind, M, N, K, dtype):
    return launch.config(_KERNELS[kind], _config_key(M, N, K, dtype), _fallback(kind, M, N, K, dtype))


def _flags(dtype, M):
    bm = _block_m(M)
    return {
        "BLOCK_M": bm,
        "USE_DOT": bm > MAX_FMA_ROWS,
        "IEEE": dtype == torch.float32 or _runtime.INTERPRET,
        "RNE": _runtime.INTERPRET and dtype == torch.bfloat16,
    }


# ----------------------------------------------------------------------------- launchers


def _one(cfg, K):
    """One K step (K <= BLOCK_K): the weights-first single-step path (cfg "ONE": 0 turns it off)."""
    return bool(cfg.get("ONE", 1)) and K <= cfg["BLOCK_K"]


def _pre(cfg):
    """Under PDL, several K steps: the first step's weight tiles loaded before the wait (cfg "PRE": 0 turns it off)."""
    return bool(cfg.get("PRE", 1))


def _stream(cfg, flags):
    """The persistent streaming kernel (cfg "PPS": programs per SM, > 0) for the FMA path (M <= 2)."""
    return int(cfg.get("PPS", 0)) > 0 and not flags["USE_DOT"]


def _stream_launch(name, x, weight, y, xn, bias, residual, norm_weight, N, eps, nbytes, cfg, flags, gate_up, pdl):
    M, K = x.shape
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    n_steps = launch.cdiv(K, bk)
    grid = (min(launch.cdiv(N, bn), int(cfg["PPS"]) * _runtime.num_sms()),)
    launch.launch(
        name, gemv_stream_kernel, grid,
        x, weight, bias if bias is not None else weight, residual if residual is not None else x,
        norm_weight if norm_weight is not None else weight, y, xn if xn is not None else x,
        M, N, K, n_steps, float(eps),
        nbytes=nbytes,
        BLOCK_M=flags["BLOCK_M"], BLOCK_N=bn, BLOCK_K=bk, GATE_UP=gate_up, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, NORM=norm_weight is not None, STORE_XN=xn is not None, RNE=flags["RNE"],
        ONE=n_steps == 1, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch.pdl_options(pdl),
    )


def gemv_launch(x, weight, bias=None, residual=None, norm_weight=None, eps=1e-6, store_xn=False, cfg=None,
                pdl=False):
    """x [M, K], weight [N, K], all contiguous. Returns (y [M, N], xn [M, K] or None). pdl: launch as a
    programmatic dependent of the previous kernel in the stream (sm90+; ignored where unsupported)."""
    M, K = x.shape
    N = weight.shape[0]
    cfg = cfg or _config("plain", M, N, K, x.dtype)
    flags = _flags(x.dtype, M)
    y = new_output((M, N), x.dtype, x.device)
    xn = new_output((M, K), x.dtype, x.device) if store_xn else None
    e = x.element_size()
    nbytes = e * (N * K + M * K + M * N + (N if bias is not None else 0) + (M * N if residual is not None else 0)
                  + (K if norm_weight is not None else 0))
    if _stream(cfg, flags):
        _stream_launch("gemv_stream", x, weight, y, xn, bias, residual, norm_weight, N, eps, nbytes, cfg, flags,
                       False, pdl)
        return y, xn
    grid = (launch.cdiv(N, cfg["BLOCK_N"]), launch.cdiv(M, flags["BLOCK_M"]))
    launch.launch(
        "gemv", gemv_kernel, grid,
        x, weight, bias if bias is not None else weight, residual if residual is not None else x,
        norm_weight if norm_weight is not None else weight, y, xn if xn is not None else x,
        M, N, K, float(eps),
        nbytes=nbytes,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, NORM=norm_weight is not None, STORE_XN=store_xn, ONE=_one(cfg, K),
        PRE=_pre(cfg),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **flags, **launch.pdl_options(pdl),
    )
    return y, xn


def gemv_qkv_rope_launch(x, weight, bias, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads,
                         norm_weight=None, eps=1e-6, store_pre=False, store_xn=False, cfg=None, pdl=False):
    """Returns (q [M, Hq, D], qkv [M, NQKV] or None, xn [M, C] or None); k/v land in the caches."""
    M, C = x.shape
    D = k_cache.shape[-1]
    NQKV = weight.shape[0]
    cfg = cfg or _config("qkv", M, NQKV, C, x.dtype)
    flags = _flags(x.dtype, M)
    bn = cfg["BLOCK_N"]
    q = new_output((M, num_heads, D), x.dtype, x.device)
    qkv = new_output((M, NQKV), x.dtype, x.device) if store_pre else None
    xn = new_output((M, C), x.dtype, x.device) if store_xn else None
    e = x.element_size()
    nbytes = e * (NQKV * C + NQKV + M * C + M * NQKV) + 4 * M * (1 + 2 * D) + (e * C if norm_weight is not None else 0)
    grid = (launch.cdiv((num_heads + 2 * num_kv_heads) * (D // 2), bn), launch.cdiv(M, flags["BLOCK_M"]))
    launch.launch(
        "gemv_qkv_rope", gemv_qkv_rope_kernel, grid,
        x, weight, bias, norm_weight if norm_weight is not None else bias, cos, sin, positions, q,
        k_cache, v_cache, qkv if qkv is not None else q, xn if xn is not None else x,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        M, C, float(eps),
        nbytes=nbytes,
        HQ=num_heads, HKV=num_kv_heads, D=D, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], NORM=norm_weight is not None,
        STORE_PRE=store_pre, STORE_XN=store_xn, ONE=_one(cfg, C), PRE=_pre(cfg), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **flags, **launch.pdl_options(pdl),
    )
    return q, qkv, xn


def gemv_gate_up_launch(x, weight, norm_weight=None, eps=1e-6, store_xn=False, cfg=None, pdl=False):
    """x [M, C], weight [2I, C]. Returns (y [M, I], xn [M, C] or None)."""
    M, C = x.shape
    inter = weight.shape[0] // 2
    cfg = cfg or _config("gate_up", M, 2 * inter, C, x.dtype)
    flags = _flags(x.dtype, M)
    y = new_output((M, inter), x.dtype, x.device)
    xn = new_output((M, C), x.dtype, x.device) if store_xn else None
    e = x.element_size()
    nbytes = e * (2 * inter * C + M * C + M * inter + (C if norm_weight is not None else 0))
    if _stream(cfg, flags):
        _stream_launch("gemv_gate_up_stream", x, weight, y, xn, None, None, norm_weight, inter, eps, nbytes, cfg,
                       flags, True, pdl)
        return y, xn
    grid = (launch.cdiv(inter, cfg["BLOCK_N"]), launch.cdiv(M, flags["BLOCK_M"]))
    launch.launch(
        "gemv_gate_up", gemv_gate_up_kernel, grid,
        x, weight, norm_weight if norm_weight is not None else weight, y, xn if xn is not None else x,
        M, inter, C, float(eps),
        nbytes=nbytes,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], NORM=norm_weight is not None, STORE_XN=store_xn,
        ONE=_one(cfg, C), PRE=_pre(cfg), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **flags,
        **launch.pdl_options(pdl),
    )
    return y, xn


MLP_MAX_SPIN = 1 << 16  # grid-barrier polls (~1 us each: ~65 ms) before a program gives up and counts a timeout


def mlp_config(M, C, I, dtype):
    """The fused MLP's tuned config (keys BN_GU, BK_GU, BN_D, BK_D, PPS, num_warps) for this shape, or
    None: the fused kernel has no heuristic default; untuned shapes keep the two kernels."""
    if M > MAX_FMA_ROWS:
        return None
    found = launch.config("gemv_mlp", launch.config_key(m=_block_m(M), c=C, i=I, dtype=launch.dtype_tag(dtype)), {})
    return found or None


def gemv_mlp_launch(x, w_gate_up, norm_weight, w_down, sync, eps=1e-6, store_xn=False, cfg=None, pdl=False):
    """The decoder MLP, x + down(silu(gate(rms_norm(x))) * up(rms_norm(x))), in one persistent launch
    (gemv_mlp_kernel). x [M <= 2, C]; w_gate_up [2I, C]; norm_weight [C]; w_down [C, I]; sync int32 [3],
    zeros (the grid barrier's counters, re-armed by each launch; sync[2] counts barrier timeouts, which
    check_mlp_sync turns into an error). All contiguous. Returns (y [M, C], act [M, I], xn [M, C] or None).
    Under the interpreter (programs run one after another: no barrier can hold) or with cfg "SPLIT" the
    two phases are two launches of the same kernel."""
    M, C = x.shape
    inter = w_down.shape[1]
    flags = _flags(x.dtype, M)
    if flags["USE_DOT"]:
        raise ValueError(f"the fused MLP kernel takes at most {MAX_FMA_ROWS} rows of x, got {M}")
    cfg = cfg or mlp_config(M, C, inter, x.dtype)
    if cfg is None:
        raise ValueError(f"no fused-MLP config for M={M} C={C} I={inter} {x.dtype} on {_runtime.arch()}")
    if cfg["BK_GU"] < C:
        raise ValueError(f"BK_GU ({cfg['BK_GU']}) must cover C = {C} (gate/up run in one K step)")
    act = new_output((M, inter), x.dtype, x.device)
    y = new_output((M, C), x.dtype, x.device)
    xn = new_output((M, C), x.dtype, x.device) if store_xn else None
    e = x.element_size()
    nbytes = e * (3 * inter * C + 3 * M * C + 2 * M * inter + C + (M * C if store_xn else 0))
    args = (x, w_gate_up, norm_weight, w_down, act, y, xn if xn is not None else x, sync, M, C, inter,
            launch.cdiv(inter, cfg["BK_D"]), float(eps), MLP_MAX_SPIN)
    kw = dict(BLOCK_M=flags["BLOCK_M"], BN_GU=cfg["BN_GU"], BK_GU=cfg["BK_GU"], BN_D=cfg["BN_D"], BK_D=cfg["BK_D"],
              STORE_XN=store_xn, RNE=flags["RNE"], num_warps=cfg["num_warps"], num_stages=1, **launch.pdl_options(pdl))
    units = max(launch.cdiv(inter, cfg["BN_GU"]), launch.cdiv(C, cfg["BN_D"]))
    if _runtime.INTERPRET or cfg.get("SPLIT"):
        grid = (min(units, int(cfg["PPS"]) * _runtime.num_sms()),)
        launch.launch("gemv_mlp", gemv_mlp_kernel, grid, *args, nbytes=nbytes, PHASE=1, **kw)
        launch.launch("gemv_mlp", gemv_mlp_kernel, grid, *args, nbytes=nbytes, PHASE=2, **kw)
    else:
        kw["PHASE"] = 0
        per_sm = launch.resident_programs(gemv_mlp_kernel, args, kw)
        if per_sm < 1:
            raise RuntimeError(f"the fused MLP kernel does not fit on an SM at {cfg}")
        grid = (min(units, min(int(cfg["PPS"]), per_sm) * _runtime.num_sms()),)
        launch.launch("gemv_mlp", gemv_mlp_kernel, grid, *args, nbytes=nbytes, **kw)
    return y, act, xn


def check_mlp_sync(sync):
    """Raise if a fused-MLP launch's grid barrier timed out (its outputs are then wrong). Synchronises."""
    timeouts = int(sync[2].item())
    if timeouts:
        raise RuntimeError(f"the fused MLP kernel's grid barrier timed out in {timeouts} program(s): its grid was "
                           "not resident at once (another kernel holding the SMs?); its outputs are invalid")


# ----------------------------------------------------------------------------- validation


def _check_matrix(name, t, rows=None, cols=None):
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows, got shape {tuple(t.shape)}")
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{name} must have {cols} columns, got shape {tuple(t.shape)}")


def _check_vector(name, t, n, dtype):
    check_tensor(name, t, ndim=1)
    if t.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},), got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have the weight's dtype {dtype}, got {t.dtype}")


def _validate_common(x, weight, norm_weight, eps):
    check_tensor("x", x, ndim=2)
    check_tensor("weight", weight, ndim=2)
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype ({x.dtype}), got {weight.dtype}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [N, K] with K = {x.shape[1]} (x's last dimension), got {tuple(weight.shape)}")
    if norm_weight is not None:
        _check_vector("norm_weight", norm_weight, x.shape[1], x.dtype)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


def _contig(t):
    return t if t is None or t.is_contiguous() else t.contiguous()


# ----------------------------------------------------------------------------- public API


def gemv(x, weight, bias=None, residual=None, norm_weight=None, eps: float = 1e-6):
    """``round(round(rms_norm(x) @ weight.T + bias) + residual)`` for a few rows of x.

    x [M, K] (M small: decode rows), weight [N, K] row-major (``nn.Linear.weight``); bias [N],
    residual [M, N] and the RMSNorm prologue (norm_weight [K], eps) are optional. Same dtype
    throughout (fp32, fp16, bf16); fp32 accumulation. Returns y [M, N] in x's dtype.
    """
    _validate_common(x, weight, norm_weight, eps)
    N = weight.shape[0]
    if bias is not None:
        _check_vector("bias", bias, N, x.dtype)
    if residual is not None:
        check_tensor("residual", residual, ndim=2)
        if tuple(residual.shape) != (x.shape[0], N):
            raise ValueError(f"residual must have shape ({x.shape[0]}, {N}), got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"residual must have x's dtype ({x.dtype}), got {residual.dtype}")
    check_same_device(x=x, weight=weight, bias=bias, residual=residual, norm_weight=norm_weight)
    y, _ = gemv_launch(_contig(x), _contig(weight), _contig(bias), _contig(residual), _contig(norm_weight), eps)
    return y


def gemv_qkv_rope(x, weight, bias, cos, sin, positions, k_cache, v_cache, num_heads: int, num_kv_heads: int,
                  norm_weight=None, eps: float = 1e-6):
    """Fused (RMSNorm +) QKV projection + bias + RoPE + KV-cache append for one token per row.

    x [M, C]; weight [(Hq + 2 Hkv) * D, C] (q, k, v rows concatenated) and bias [(Hq + 2 Hkv) * D];
    cos, sin [P >= S_max, D] float32 tables (row p: position p, rotate_half convention); positions int32
    [M]: the position of each row's token, also its cache row; k_cache, v_cache [B >= M, S_max, Hkv, D]
    (x's dtype, unit last stride): row m's rotated k and its v are written IN PLACE at
    [m, positions[m]]. Returns the rotated queries q [M, Hq, D].
    """
    _validate_qkv(x, weight, bias, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads, norm_weight, eps)
    q, _, _ = gemv_qkv_rope_launch(_contig(x), _contig(weight), _contig(bias), _contig(cos), _contig(sin),
                                   _contig(positions), k_cache, v_cache, num_heads, num_kv_heads,
                                   _contig(norm_weight), eps)
    return q


def gemv_gate_up_swiglu(x, weight, norm_weight=None, eps: float = 1e-6):
    """``silu(xn @ Wg.T) * (xn @ Wu.T)`` with weight [2I, C] = cat(Wg, Wu) and xn = rms_norm(x) when
    norm_weight is given (else x). Returns [M, I] in x's dtype."""
    _validate_common(x, weight, norm_weight, eps)
    if weight.shape[0] % 2:
        raise ValueError(f"weight must stack gate and up rows ([2I, C]), got an odd row count {weight.shape[0]}")
    check_same_device(x=x, weight=weight, norm_weight=norm_weight)
    y, _ = gemv_gate_up_launch(_contig(x), _contig(weight), _contig(norm_weight), eps)
    return y


def lm_head_argmax(x, weight, norm_weight=None, eps: float = 1e-6):
    """Greedy head: logits = rms_norm(x) @ weight.T (x's dtype, as the eager model), then the argmax of
    each row (first index on ties). Returns (logits [M, V], token ids int64 [M])."""
    logits = gemv(x, weight, norm_weight=norm_weight, eps=eps)
    return logits, torch.argmax(logits, dim=-1)


def _validate_qkv(x, weight, bias, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads, norm_weight, eps):
    _validate_common(x, weight, norm_weight, eps)
    for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    check_tensor("k_cache", k_cache, ndim=4)
    check_tensor("v_cache", v_cache, ndim=4)
    B, S_max, Hkv, D = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if Hkv != num_kv_heads:
        raise ValueError(f"k_cache has {Hkv} kv heads, num_kv_heads is {num_kv_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
    if D % 2 or D > 256 or D & (D - 1):
        raise ValueError(f"head_dim (k_cache's last dimension) must be a power of two <= 256, got {D}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype ({x.dtype}), got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    M = x.shape[0]
    if B < M:
        raise ValueError(f"the caches hold {B} batch rows, fewer than x's {M} rows")
    nqkv = (num_heads + 2 * num_kv_heads) * D
    _check_matrix("weight", weight, rows=nqkv)
    _check_vector("bias", bias, nqkv, x.dtype)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, dtypes=(torch.float32,), ndim=2)
        if t.shape[1] != D or t.shape[0] < S_max:
            raise ValueError(
                f"{name} must be a float32 table [P, D] with D = {D} and a row for every cache row "
                f"(P >= S_max = {S_max}), got {tuple(t.shape)}"
            )
    check_tensor("positions", positions, dtypes=(torch.int32,), ndim=1)
    if positions.shape[0] != M:
        raise ValueError(f"positions must have shape ({M},) (one per row of x), got {tuple(positions.shape)}")
    check_same_device(x=x, weight=weight, bias=bias, cos=cos, sin=sin, positions=positions, k_cache=k_cache,
                      v_cache=v_cache, norm_weight=norm_weight)


def gemv_stages(x, weight, bias=None, residual=None, norm_weight=None, eps=1e-6):
    """The kernel's own buffers, named as gemv_ref's stages: (xn), y."""
    _validate_common(x, weight, norm_weight, eps)
    y, xn = gemv_launch(_contig(x), _contig(weight), _contig(bias), _contig(residual), _contig(norm_weight), eps,
                        store_xn=norm_weight is not None)
    stages = OrderedDict()
    if xn is not None:
        stages["xn"] = xn
    stages["y"] = y
    return stages


def gemv_qkv_rope_stages(x, weight, bias, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads,
                         norm_weight=None, eps=1e-6):
    """The kernel's own buffers, named as gemv_qkv_rope_ref's stages (the caches are appended in place)."""
    _validate_qkv(x, weight, bias, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads, norm_weight, eps)
    q, qkv, xn = gemv_qkv_rope_launch(_contig(x), _contig(weight), _contig(bias), _contig(cos), _contig(sin),
                                      _contig(positions), k_cache, v_cache, num_heads, num_kv_heads,
                                      _contig(norm_weight), eps, store_pre=True, store_xn=norm_weight is not None)
    stages = OrderedDict()
    if xn is not None:
        stages["xn"] = xn
    stages["qkv"] = qkv
    stages["q"] = q
    stages["k_cache"] = k_cache
    stages["v_cache"] = v_cache
    return stages


def gemv_gate_up_stages(x, weight, norm_weight=None, eps=1e-6):
    """The kernel's own buffers, named as gemv_gate_up_ref's stages: (xn), y."""
    _validate_common(x, weight, norm_weight, eps)
    y, xn = gemv_gate_up_launch(_contig(x), _contig(weight), _contig(norm_weight), eps, store_xn=norm_weight is not None)
    stages = OrderedDict()
    if xn is not None:
        stages["xn"] = xn
    stages["y"] = y
    return stages


def rope_tables(head_dim: int, max_positions: int, theta: float, device=None):
    """cos, sin [max_positions, head_dim] float32, computed as Hugging Face's default rotary embedding:
    inv_freq = 1 / theta ** (arange(0, D, 2) / D); freqs = pos * inv_freq; emb = cat(freqs, freqs)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    pos = torch.arange(max_positions, dtype=torch.float)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


# ----------------------------------------------------------------------------- registry

# Qwen2.5-0.5B decode shapes: C = 896, I = 4864, Hq = 14, Hkv = 2, D = 64
_REAL = {"M": 1, "C": 896, "I": 4864, "Hq": 14, "Hkv": 2, "D": 64, "S": 4096}
_TINY = {"M": 3, "C": 200, "I": 300, "Hq": 4, "Hkv": 2, "D": 64, "S": 40}


def _dims(tier):
    if isinstance(tier, dict):
        return {**_REAL, **tier}
    return {"tiny": _TINY, "real": _REAL}[tier]


def _rand(shape, dtype, device, gen, scale=1.0):
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float32)).to(device=device, dtype=dtype)


def _make_residual_inputs(tier, dtype, device, gen):
    d = _dims(tier)
    M, N, K = d["M"], d["C"], d["I"]  # down_proj + residual
    return {"x": _rand((M, K), dtype, device, gen), "weight": _rand((N, K), dtype, device, gen, K ** -0.5),
            "residual": _rand((M, N), dtype, device, gen)}


def _make_qkv_inputs(tier, dtype, device, gen):
    d = _dims(tier)
    M, C, Hq, Hkv, D, S = d["M"], d["C"], d["Hq"], d["Hkv"], d["D"], d["S"]
    nqkv = (Hq + 2 * Hkv) * D
    cos, sin = rope_tables(D, S, 1e6, device)
    return {
        "x": _rand((M, C), dtype, device, gen), "weight": _rand((nqkv, C), dtype, device, gen, C ** -0.5),
        "bias": _rand((nqkv,), dtype, device, gen, 0.5), "cos": cos, "sin": sin,
        "positions": torch.randint(0, S, (M,), generator=gen, dtype=torch.int32).to(device),
        "k_cache": _rand((M, S, Hkv, D), dtype, device, gen), "v_cache": _rand((M, S, Hkv, D), dtype, device, gen),
        "num_heads": Hq, "num_kv_heads": Hkv, "norm_weight": _rand((C,), dtype, device, gen, 0.1) + 1, "eps": 1e-6,
    }


def _make_gate_up_inputs(tier, dtype, device, gen):
    d = _dims(tier)
    M, C, inter = d["M"], d["C"], d["I"]
    return {"x": _rand((M, C), dtype, device, gen), "weight": _rand((2 * inter, C), dtype, device, gen, C ** -0.5),
            "norm_weight": _rand((C,), dtype, device, gen, 0.1) + 1, "eps": 1e-6}


def _dt(inputs):
    return inputs["x"].dtype


def _gemv_bytes(inputs, mode):
    x, w = inputs["x"], inputs["weight"]
    e = x.element_size()
    return e * (w.numel() + x.numel() + 2 * inputs["residual"].numel())


def _qkv_bytes(inputs, mode):
    x, w = inputs["x"], inputs["weight"]
    e, M = x.element_size(), x.shape[0]
    D = inputs["k_cache"].shape[-1]
    return e * (w.numel() + w.shape[0] + x.numel() + M * w.shape[0] + x.shape[1]) + 4 * M * (1 + 2 * D)


def _gate_up_bytes(inputs, mode):
    x, w = inputs["x"], inputs["weight"]
    e = x.element_size()
    return e * (w.numel() + x.numel() + x.shape[0] * w.shape[0] // 2 + x.shape[1])


def _matmul_flops(inputs, mode):
    return 2 * inputs["x"].shape[0] * inputs["weight"].numel()


def _torch_residual_peer(inputs):
    return lambda x, weight, residual: (torch.nn.functional.linear(x, weight) + residual,)


def _torch_gate_up_peer(inputs):
    def run(x, weight, norm_weight, eps):
        xf = x.float()
        xn = norm_weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
        gate, up = torch.nn.functional.linear(xn, weight).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up,)

    return run


def _describe(inputs):
    return "M={} N={} K={}".format(inputs["x"].shape[0], inputs["weight"].shape[0], inputs["weight"].shape[1])


register(OpSpec(
    name="gemv_residual",
    family="gemv",
    make_inputs=_make_residual_inputs,
    reference=lambda x, weight, residual: gemv_ref(x, weight, residual=residual, dtype=None),
    stages=lambda x, weight, residual: gemv_stages(x, weight, residual=residual),
    call=lambda x, weight, residual: (gemv(x, weight, residual=residual),),
    outputs=("y",),
    flops=_matmul_flops,
    bytes=_gemv_bytes,
    peers={"torch": _torch_residual_peer},
    describe=_describe,
))
register(OpSpec(
    name="gemv_qkv_rope",
    family="gemv",
    make_inputs=_make_qkv_inputs,
    reference=lambda **kw: gemv_qkv_rope_ref(**kw),
    stages=lambda **kw: gemv_qkv_rope_stages(**kw),
    call=lambda **kw: (gemv_qkv_rope(**kw),),
    outputs=("q",),
    flops=_matmul_flops,
    bytes=_qkv_bytes,
    describe=_describe,
))
register(OpSpec(
    name="gemv_gate_up_swiglu",
    family="gemv",
    make_inputs=_make_gate_up_inputs,
    reference=lambda **kw: gemv_gate_up_ref(**kw),
    stages=lambda **kw: gemv_gate_up_stages(**kw),
    call=lambda **kw: (gemv_gate_up_swiglu(**kw),),
    outputs=("y",),
    flops=_matmul_flops,
    bytes=_gate_up_bytes,
    peers={"torch": _torch_gate_up_peer},
    describe=_describe,
))


def _tune_setup(kind):
    def setup(shape, dtype, device):
        M, N, K = shape["M"], shape["N"], shape["K"]
        x = torch.randn(M, K, device=device, dtype=dtype)
        w = torch.randn(N, K, device=device, dtype=dtype) * K ** -0.5
        nw = torch.ones(K, device=device, dtype=dtype)
        key = _config_key(M, N, K, dtype)
        if kind == "plain":
            r = torch.randn(M, N, device=device, dtype=dtype)
            return (lambda cfg: gemv_launch(x, w, residual=r, cfg=cfg)), key
        if kind == "gate_up":
            return (lambda cfg: gemv_gate_up_launch(x, w, nw, cfg=cfg)), key
        D = shape.get("D", 64)
        hkv = shape.get("Hkv", 2)
        hq = N // D - 2 * hkv
        S = 64
        cos, sin = rope_tables(D, S, 1e6, device)
        pos = torch.zeros(M, dtype=torch.int32, device=device)
        kc = torch.zeros(M, S, hkv, D, device=device, dtype=dtype)
        vc = torch.zeros_like(kc)
        b = torch.zeros(N, device=device, dtype=dtype)
        return (lambda cfg: gemv_qkv_rope_launch(x, w, b, cos, sin, pos, kc, vc, hq, hkv, nw, cfg=cfg)), key

    return setup


_FMA_SPACE = {"BLOCK_N": [1, 2, 4, 8], "BLOCK_K": [512, 1024, 2048, 4096, 8192], "num_warps": [4, 8],
              "num_stages": [1, 2]}
register_tunable(Tunable(
    kernel="gemv", space=_FMA_SPACE, setup=_tune_setup("plain"),
    shape_names=("M", "N", "K"), default_shape={"M": 1, "N": 896, "K": 4864},
))
register_tunable(Tunable(
    kernel="gemv_gate_up", space=_FMA_SPACE, setup=_tune_setup("gate_up"),
    shape_names=("M", "N", "K"), default_shape={"M": 1, "N": 9728, "K": 896},
))
register_tunable(Tunable(
    kernel="gemv_qkv_rope", space=_FMA_SPACE, setup=_tune_setup("qkv"),
    shape_names=("M", "N", "K"), default_shape={"M": 1, "N": 1152, "K": 896, "D": 64, "Hkv": 2},
))
