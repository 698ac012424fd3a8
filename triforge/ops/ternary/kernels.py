"""Ternary (1.58-bit) weight kernels over bit-sliced planes.

Weights: ``plus``/``minus`` int32 [N, KW] (bit b of word w is column 32w + b), per-row fp32 scales.
- ``popcount_matmul_a8``: int8 activations as 8 bit planes; exact integer result
  sum_b 2^b (popc(plus & a_b) - popc(minus & a_b)), bit 7 weighing -128 (two's complement).
- ``ternary_gemv``: the decode path (M <= 16 rows of fp16/bf16/fp32 activations): bits feed fp32
  FMAs straight from the words in registers, no tile is expanded or converted (design and cost
  model in ``ternary_gemv_kernel``'s docstring).
- ``ternary_matmul``: the GEMM path for larger M; weight tiles are expanded to {-1, 0, +1} on chip
  and multiplied with tensor-core dots; K is split across programs while output tiles are few.
Both skip 2048-column chunks whose weights are all zero for every row of a program's block (plane
skipping).
"""

import torch
import triton
import triton.language as tl

from triforge import _runtime, launch
from triforge.launch import new_output
from triforge.ops._tl import cast as _cast

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
        p_a = a_ptr + o_mw
        for b in tl.static_range(8):
            b_a = tl.load(p_a, mask=m_mw, other=0)[:, None, :]
            # (the next plane by a pointer step: in int64, as 8 planes of M x KW words pass 2^31 elements first)
            p_a += tl.cast(M, tl.int64) * KW
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
def _dot_w(b_x, b_t, b_acc, DOT_F32: tl.constexpr):
    """b_acc + b_x @ b_t^T, b_t the expanded {-1, 0, 1} weights: in b_x's dtype on the tensor cores, or (DOT_F32: the
    interpreter, whose bf16 dot is wrong, and fp32 x) both in fp32 with an IEEE dot (exact parts stay exact)."""
    if DOT_F32:
        return tl.dot(b_x.to(tl.float32), tl.trans(b_t), b_acc, input_precision="ieee")
    return tl.dot(b_x, tl.trans(b_t.to(b_x.dtype)), b_acc)


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
    SPLIT3: tl.constexpr = False,
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
            # the chunk's words that exist (K's last chunk is short: at K = 896, 28 of 64 words; the masked rest
            # would still be expanded and multiplied)
            for j in range(0, tl.minimum(KW - c * 64, 64), BLOCK_W):
                w0 = c * 64 + j
                b_t = _expand(plus_ptr, minus_ptr, o_n, m_n, w0, KW, BLOCK_W, BLOCK_N)  # [BN, BW*32]
                o_k = w0 * 32 + tl.arange(0, BLOCK_W * 32)
                b_x = tl.load(x_ptr + o_m.to(tl.int64)[:, None] * K + o_k[None, :],
                              mask=m_m[:, None] & (o_k < K)[None, :], other=0.0)
                if SPLIT3:
                    # fp32 x as the sum of three bf16 parts (hi = x rounded, mid and lo the rounded remainders: 24
                    # bits of x's 24), each times the exact {-1, 0, 1} weights on the tensor cores with fp32
                    # accumulation; the fp32 FMA dot (DOT_F32) spills at every tile (sm90 build: 0.4-8.6 KB)
                    x_hi = b_x.to(tl.bfloat16)
                    r = b_x - x_hi.to(tl.float32)
                    x_mid = r.to(tl.bfloat16)
                    x_lo = (r - x_mid.to(tl.float32)).to(tl.bfloat16)
                    b_acc = _dot_w(x_lo, b_t, b_acc, DOT_F32)
                    b_acc = _dot_w(x_mid, b_t, b_acc, DOT_F32)
                    b_acc = _dot_w(x_hi, b_t, b_acc, DOT_F32)
                else:
                    b_acc = _dot_w(b_x, b_t, b_acc, DOT_F32)
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
    kw = launch.cdiv(K, 32)
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
        "ternary_popcount_a8", ternary_popcount_a8_kernel, (launch.cdiv(M, bm), launch.cdiv(N, bn)),
        planes, plus, minus, out, M, N, KW,
        nbytes=planes.numel() * 4 + 2 * plus.numel() * 4 + out.numel() * 4,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_W=bw, USE_ASM=not _runtime.INTERPRET, num_warps=4,
    )
    return out


def chunk_activity(plus: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
    """int32 [N, n_chunks]: 1 where the row has any non-zero weight in the 2048-column chunk."""
    N, KW = plus.shape
    n_chunks = launch.cdiv(KW, CHUNK_WORDS)
    nz = torch.nn.functional.pad((plus | minus) != 0, (0, n_chunks * CHUNK_WORDS - KW))
    return nz.view(N, n_chunks, CHUNK_WORDS).any(-1).to(torch.int32).contiguous()


def ternary_matmul(x2d, plus, minus, scales, bias=None, active=None):
    """x2d [M, K] (fp16/bf16/fp32) @ (scales * trits)^T (+ bias) -> [M, N] in x's dtype.

    ``active`` (from ``chunk_activity``) enables skipping all-zero 2048-column chunks.
    """
    M, K = x2d.shape
    N, KW = plus.shape
    n_chunks = launch.cdiv(KW, CHUNK_WORDS)
    skip = active is not None
    bm = 16 if M <= 16 or _runtime.INTERPRET else 64
    bn = 16 if _runtime.INTERPRET else 64
    split3 = x2d.dtype == torch.float32  # fp32 x as three bf16 parts on the tensor cores (the kernel's SPLIT3)
    bw = 2 if _runtime.INTERPRET or split3 else 8  # (SPLIT3 at BLOCK_W 4: 12 B of spills in the sm90 build; 2: none)
    tiles = launch.cdiv(M, bm) * launch.cdiv(N, bn)
    splits = max(1, min(n_chunks, launch.cdiv(_runtime.num_sms() * 4, tiles)))  # split K while tiles are few
    per_split = launch.cdiv(n_chunks, splits)
    splits = launch.cdiv(n_chunks, per_split)
    part = new_output((splits, M, N), torch.float32, x2d.device)
    launch.launch(
        "ternary_matmul", ternary_matmul_kernel, (launch.cdiv(M, bm), launch.cdiv(N, bn), splits),
        x2d, plus, minus, active if skip else plus, part, M, N, K, KW, n_chunks, per_split,
        nbytes=x2d.numel() * x2d.element_size() + 2 * plus.numel() * 4 + M * N * x2d.element_size(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_W=bw, SKIP=skip,
        # DOT_F32: the interpreter's dot in fp32 (its bf16 dot is wrong); bf16 x there, and SPLIT3's parts
        SPLIT3=split3, DOT_F32=_runtime.INTERPRET and x2d.dtype in (torch.bfloat16, torch.float32), num_warps=4,
    )
    y = (part[0] if splits == 1 else part.sum(0)) * scales.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x2d.dtype)


# ----------------------------------------------------------------------------- decode GEMV (M <= 16)

DECODE_MAX_M = 16  # the GEMV's design limit (its fp32 FMAs grow with M)
# matmul() sends M <= GEMV_DISPATCH_M rows to the GEMV, more to ternary_matmul (tensor cores). Measured on
# the H100 (results/h100-2026-11-22-3c95182-ternary.json against -00c5aa1-ternary-attention-causal.json):
# at M = 4 the GEMV is 1.7-1.9x faster than the tile kernel (8192^2: 0.136 vs 0.262 ms; 28672x8192: 0.167
# vs 0.285), at M = 16 it is 1.3-2.2x slower (0.247 vs 0.186; 0.609 vs 0.282). M = 5..15 is unmeasured.
GEMV_DISPATCH_M = 4
WORD_BITS = 32
# kernel-side constants (jit functions read globals only as constexpr)
BITS = tl.constexpr(WORD_BITS)
HALF_BITS = tl.constexpr(16)  # a word is read as two halves of 16 bits
HALF_SHIFT = tl.constexpr(9)  # the upper half is read from the word shifted right by 9: bits 16..31 -> 7..22
CHUNK = tl.constexpr(CHUNK_WORDS)
MAGIC_2_23 = tl.constexpr(0x4B000000)  # float32 bits of 2^23; MAGIC_2_23 - (j << 23) is 2^(23 - j)


@triton.jit
def ternary_gemv_bitmajor_kernel(
    x_ptr,  # [M, K] activations, fp16/bf16/fp32
    xt_ptr,  # [n_steps, 32, BLOCK_M, BLOCK_W] fp32: xt[s, b, m, j] = x[m, 32 (s BLOCK_W + j) + b], else 0
    M,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Bit-major activations, one K step of one row per program: for each bit b, the BLOCK_W x values
    that bit b of the step's words multiplies, contiguous (0 past K and for rows m >= M)."""
    i_s, i_m = tl.program_id(0), tl.program_id(1)
    o_j = tl.arange(0, BLOCK_W)
    o_b = tl.arange(0, BITS)
    o_k = (i_s * BLOCK_W + o_j)[:, None] * BITS + o_b[None, :]  # [BLOCK_W, 32]
    b_x = tl.load(x_ptr + i_m.to(tl.int64) * K + o_k, mask=(o_k < K) & (i_m < M), other=0.0)
    o_t = o_b[None, :] * (BLOCK_M * BLOCK_W) + i_m * BLOCK_W + o_j[:, None]
    tl.store(xt_ptr + i_s.to(tl.int64) * (BITS * BLOCK_M * BLOCK_W) + o_t, b_x.to(tl.float32))


@triton.jit
def ternary_gemv_kernel(
    xt_ptr,  # [n_steps, 32, BLOCK_M, BLOCK_W] fp32 bit-major activations (ternary_gemv_bitmajor_kernel)
    plus_ptr,  # [N, KW] int32
    minus_ptr,  # [N, KW] int32
    active_ptr,  # [N, n_chunks] int32: 1 where the row has a non-zero weight in the chunk (read when SKIP)
    scale_ptr,  # [N] fp32 row scales, element n at n * stride_scale (0: one scale per tensor); read when FINAL
    bias_ptr,  # [N] bias, any float dtype (read when FINAL and HAS_BIAS)
    out_ptr,  # FINAL: y [M, N] in x's dtype; else part [S, M, N] fp32, this split's share of the sum over K
    stride_scale,
    magic,  # MAGIC_2_23 as a run-time value: the per-bit constants then live in registers (see below)
    M,
    N,
    KW,
    n_chunks,
    steps_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BIT_UNROLL: tl.constexpr,
    SKIP: tl.constexpr,
    FINAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RNE: tl.constexpr,
):
    """y [M, N] = x [M, K] @ (scales * trits)^T (+ bias) for M <= 16, the trits read as bits into FMAs.

    Work split: program (i_n, i_s) owns BLOCK_N rows and a run of ``steps_per_split`` K steps of
    BLOCK_W words. The launcher splits K only until N / BLOCK_N x splits reaches programs_per_sm
    programs per SM; with one split the program writes y itself (scales, bias, cast) and no second
    launch runs, else it writes fp32 partials that ternary_gemv_reduce_kernel sums in a fixed order.
    A K step loads the plus/minus words of its rows as one flat [1, BLOCK_N * BLOCK_W] tile (index
    t = row * BLOCK_W + word): each thread reads 4 consecutive words of one row, a 16-byte load, and
    32-word steps make every row segment one whole 128-byte line. Every plane byte is read once.

    Inner product, per word and bit (no [BLOCK_N, BLOCK_W * 32] tile is built and nothing is converted
    through shared memory): with c_j the float32 2^(23 - j), whose mantissa bit j weighs exactly 1,
        P = bits_as_f32((p & (1 << j)) | c_j) in {2^(23-j), 2^(23-j) + 1},  Q likewise from q,
        d = P - Q in {-1, 0, 1} exactly,   acc[m, t] = fma(d, x[m, 32 w + bit], acc[m, t]).
    j must stay <= 22 (the mantissa): bits 0..15 are read in place (j = bit), bits 16..31 from the
    word shifted right by 9 once per step (j = bit - 9). Per weight that is 2 LOP3 (the and-or is one
    instruction when one of its two constants sits in a register: ``magic`` arrives at run time for
    that; with both as immediates ptxas emits AND then OR, 4 per weight) and 1 FADD, shared by the M
    rows, then M FFMAs; no int-to-float conversion (quarter rate). The x values a bit multiplies come
    from ``xt``, x rearranged bit-major per step by ternary_gemv_bitmajor_kernel: for each bit one
    contiguous [BLOCK_M, BLOCK_W] fp32 block, read as 16-byte loads at compile-time offsets from one
    pointer per step (L1/L2 hits: xt is M * K * 4 bytes and all programs of a split read the same
    step). acc [BLOCK_M, BLOCK_N * BLOCK_W] fp32 keeps M in-thread (d computed once for all rows) and
    is reduced over the words once at the end. fp32 accumulation; the products are exact.

    Cost model (H100 SXM: 132 SMs x 4 schedulers x 32 lanes issue 16896 thread-instructions per
    clock; LOP3 runs on the 64 integer lanes per SM). SASS of the K loop with the fallback configs
    (tests/ops/test_ternary_kernels.py compiles it for sm90a): 1100 instructions per thread per step of
    256 weights at M = 1 (512 LOP3, 256 FADD, 256 FFMA, 36 LDG.128, 16 SHF, ...): 4.30 per weight;
    M = 2: 5.8, 4: 9.2, 8: 14.2, 16: 24.3. At N = K = 8192 (67.1 M weights) M = 1 is 0.29 G
    thread-instructions, 17.1 k clocks = 8.6-9.7 us at 1.98-1.755 GHz, against 5.6 us for the 16.8 MB of
    planes at 3.0 TB/s: issue-bound (the integer lanes nearly so), ~1.6x the byte floor. Each further
    row of x adds an FFMA and a quarter of an x load per weight (M = 16: ~50 us, where tensor cores are
    the right tool).

    Plane skipping (SKIP): a K step is skipped when no row of the block has a non-zero weight in the
    step's 2048-column chunk (BLOCK_W divides 64, so a step never straddles two chunks); the decision
    is a block-wide max over the rows' flags, a few shared-memory operations and barriers per step.
    """
    T: tl.constexpr = BLOCK_N * BLOCK_W
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_t = tl.arange(0, T)[None, :]  # [1, T]
    o_n = i_n * BLOCK_N + o_t // BLOCK_W
    o_wt = o_t % BLOCK_W
    m_n = o_n < N
    o_m = tl.arange(0, BLOCK_M)[:, None]  # [BM, 1]
    p_p = plus_ptr + o_n.to(tl.int64) * KW + o_wt
    p_q = minus_ptr + o_n.to(tl.int64) * KW + o_wt
    p_x = xt_ptr + o_m * BLOCK_W + o_wt  # [BM, T]; bit b of step s at + (s * 32 + b) * BLOCK_M * BLOCK_W
    if SKIP:
        p_act = active_ptr + o_n.to(tl.int64) * n_chunks
    b_acc = tl.zeros([BLOCK_M, T], dtype=tl.float32)
    s_start = i_s * steps_per_split
    s_end = tl.minimum(s_start + steps_per_split, tl.cdiv(KW, BLOCK_W))
    for s in range(s_start, s_end):
        w0 = s * BLOCK_W
        run = True
        if SKIP:
            b_act = tl.load(p_act + w0 // CHUNK, mask=m_n, other=0)
            run = tl.max(b_act) > 0
        if run:
            m_w = m_n & (w0 + o_wt < KW)
            b_p = tl.load(p_p + w0, mask=m_w, other=0)
            b_q = tl.load(p_q + w0, mask=m_w, other=0)
            p_xs = p_x + s * (BITS * BLOCK_M * BLOCK_W)
            for h in tl.static_range(2):
                # bits 16h .. 16h + 15 sit at mantissa positions 7h .. 7h + 15 (<= 22) after the shift;
                # the arithmetic shift's sign copies land above position 22, which no mask reads
                b_ph = b_p >> (HALF_SHIFT * h)
                b_qh = b_q >> (HALF_SHIFT * h)
                for g in range(0, HALF_BITS, BIT_UNROLL):
                    for u in tl.static_range(BIT_UNROLL):
                        pos = (HALF_BITS - HALF_SHIFT) * h + g + u
                        c = magic - (pos << 23)
                        b_d = ((b_ph & (1 << pos)) | c).to(tl.float32, bitcast=True) - \
                            ((b_qh & (1 << pos)) | c).to(tl.float32, bitcast=True)
                        b_x = tl.load(p_xs + (HALF_BITS * h + g + u) * (BLOCK_M * BLOCK_W))
                        b_acc = tl.fma(b_d, b_x, b_acc)
    b_y = tl.sum(tl.reshape(b_acc, [BLOCK_M, BLOCK_N, BLOCK_W]), axis=2)  # [BM, BN]
    o_ny = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ny = o_ny < N
    o_my = tl.arange(0, BLOCK_M)
    m_y = (o_my < M)[:, None] & m_ny[None, :]
    if FINAL:
        b_y = b_y * tl.load(scale_ptr + o_ny * stride_scale, mask=m_ny, other=0.0)[None, :]
        if HAS_BIAS:
            b_y += tl.load(bias_ptr + o_ny, mask=m_ny, other=0.0).to(tl.float32)[None, :]
        o_y = o_my.to(tl.int64)[:, None] * N + o_ny[None, :]
        tl.store(out_ptr + o_y, _cast(b_y, out_ptr.dtype.element_ty, RNE), mask=m_y)
    else:
        o_y = (i_s.to(tl.int64) * M + o_my[:, None]) * N + o_ny[None, :]
        tl.store(out_ptr + o_y, b_y, mask=m_y)


@triton.jit
def ternary_gemv_reduce_kernel(
    part_ptr,  # [S, M, N] fp32 split-K partial sums
    scale_ptr,  # [N] fp32, element n at n * stride_scale
    bias_ptr,  # [N] (read when HAS_BIAS)
    y_ptr,  # [M, N] in x's dtype
    stride_scale,
    M,
    N,
    S,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RNE: tl.constexpr,
    S_UNROLL: tl.constexpr = 0,  # S as a constant (> 0): every partial's load issued before the sums
    PDL: tl.constexpr = False,  # a programmatic dependent launch: everything is read after griddepcontrol.wait
):
    """y = (sum over s in order 0..S-1 of part[s]) * scales (+ bias): fixed order, so deterministic."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    n_mn = tl.cast(M, tl.int64) * N  # a partial's elements (int64: S of them are strided by it)
    m_o = o < n_mn
    o_n = o % N
    b_y = tl.zeros([BLOCK], dtype=tl.float32)
    if S_UNROLL > 0:
        for s in tl.static_range(S_UNROLL):
            b_y += tl.load(part_ptr + s * n_mn + o, mask=m_o, other=0.0)
    else:
        for s in range(0, S):
            b_y += tl.load(part_ptr + s * n_mn + o, mask=m_o, other=0.0)
    b_y = b_y * tl.load(scale_ptr + o_n * stride_scale, mask=m_o, other=0.0)
    if HAS_BIAS:
        b_y += tl.load(bias_ptr + o_n, mask=m_o, other=0.0).to(tl.float32)
    tl.store(y_ptr + o, _cast(b_y, y_ptr.dtype.element_ty, RNE), mask=m_o)


def reduce_splits(part: torch.Tensor, scales: torch.Tensor, bias, y: torch.Tensor, rne: bool, block: int = 1024,
                  unroll: bool = False, pdl: bool = False) -> None:
    """y [M, N] = (part [S, M, N] fp32 summed over S in order) * scales (+ bias), cast to y's dtype: the
    second launch of a split-K product (``ternary_gemv_reduce_kernel``). ``unroll``: S compiled in, all loads
    issued at once; ``pdl``: launched as a programmatic dependent of the kernel that wrote ``part``."""
    S, M, N = part.shape
    launch.launch(
        "ternary_gemv_reduce", ternary_gemv_reduce_kernel, (launch.cdiv(M * N, block),),
        part, scales, bias if bias is not None else scales, y, scales.stride(0), M, N, S,
        nbytes=4 * S * M * N + N * 4 + M * N * y.element_size(),
        BLOCK=block, HAS_BIAS=bias is not None, RNE=rne, S_UNROLL=S if unroll else 0, num_warps=4,
        **launch.pdl_options(pdl),
    )


def _gemv_block_m(M: int) -> int:
    return launch.next_power_of_2(M)


def gemv_fallback_config(M: int, N: int, K: int, interpreter: bool | None = None) -> dict:
    """Heuristic launch config of ``ternary_gemv_kernel``: BLOCK_N, BLOCK_W, BIT_UNROLL, num_warps,
    programs_per_sm.

    GPU (sm90), 16 rows per program, 4 warps (the flat tile must cover 4 words x 32 lanes x num_warps,
    or M stops being in-thread), no split at N = 8192 (512 programs, no reduction launch):
    - M = 1: 64-word steps (a whole chunk; each thread holds two rows' 16-byte vectors of the same
      words, so their x loads are shared), all 16 bits of a half unrolled (each bit's constants
      hoisted): 4.30 instructions per weight, 96 registers (5 programs/SM);
    - M = 2: 32-word steps, one vector per thread (the 64-word step spills at M = 2), bits unrolled:
      5.8 instructions per weight, 72 registers;
    - M = 3, 4: 64-word steps, all 16 bits unrolled, as at M = 1: the tune at M = 4, 8192^2 (commit 46ae583)
      ranked it first of 48 configs (35.4 us by do_bench); the earlier fallback (32-word steps, bits unrolled
      by 4, chosen for registers) took 65 us (CUDA-graph replay, benchmarks/ternary_host_probe.py);
    - M > 4 (not dispatched here by ``matmul``): 32-word steps, bits unrolled by 4 in a loop: unrolling all 16
      hoists every bit's x loads (16 M vectors of 4 floats) and runs out of registers.
    Interpreter: a program costs per
    numpy op, so tiles as large as the shapes allow (64-word steps, up to 64 rows; it reports 4 SMs,
    so small grids still split K). ``interpreter`` (default: this process's mode) picks the branch.
    """
    kw = launch.cdiv(K, WORD_BITS)
    if _runtime.INTERPRET if interpreter is None else interpreter:
        bw = max(16, min(64, launch.next_power_of_2(kw)))
        return {"BLOCK_N": max(8, min(64, launch.next_power_of_2(N))), "BLOCK_W": bw, "BIT_UNROLL": 16,
                "num_warps": 4, "programs_per_sm": 1}
    wide = M == 1 or 2 < M <= 4
    return {"BLOCK_N": 16, "BLOCK_W": 64 if wide else 32, "BIT_UNROLL": 16 if M <= 4 else 4, "num_warps": 4,
            "programs_per_sm": 4}


def _gemv_config_key(M: int, N: int, K: int) -> str:
    # the kernel reads fp32 bit-major activations whatever x's dtype: no dtype in the key
    return launch.config_key(m=_gemv_block_m(M), n=N, k=K)


def _gemv_config(M: int, N: int, K: int) -> dict:
    return launch.config("ternary_gemv", _gemv_config_key(M, N, K), gemv_fallback_config(M, N, K))


def gemv_splits(n_blocks: int, n_steps: int, programs_per_sm: int) -> int:
    """K splits so that n_blocks x splits reaches programs_per_sm programs per SM (at most one step each)."""
    return max(1, min(n_steps, (programs_per_sm * _runtime.num_sms()) // n_blocks))


@launch.config_cache
def _gemv_plan(M: int, N: int, K: int, KW: int, cfg_items=None):
    """(BLOCK_M, BLOCK_N, BLOCK_W, BIT_UNROLL, num_warps, n_steps, n_blocks, splits, steps per split) of a
    GEMV launch: the tuned (or given) config and the split-K arithmetic, worked out once per shape."""
    cfg = dict(cfg_items) if cfg_items is not None else _gemv_config(M, N, K)
    bm, bn, bw = _gemv_block_m(M), cfg["BLOCK_N"], cfg["BLOCK_W"]
    if CHUNK_WORDS % bw:
        raise ValueError(f"BLOCK_W must divide {CHUNK_WORDS} (a K step stays inside one chunk), got {bw}")
    if HALF_BITS.value % cfg["BIT_UNROLL"]:
        raise ValueError(f"BIT_UNROLL must divide {HALF_BITS.value}, got {cfg['BIT_UNROLL']}")
    n_steps = launch.cdiv(KW, bw)
    n_blocks = launch.cdiv(N, bn)
    splits = gemv_splits(n_blocks, n_steps, cfg["programs_per_sm"])
    per_split = launch.cdiv(n_steps, splits)
    splits = launch.cdiv(n_steps, per_split)
    return bm, bn, bw, cfg["BIT_UNROLL"], cfg["num_warps"], n_steps, n_blocks, splits, per_split


def ternary_gemv(x2d, plus, minus, scales, bias=None, active=None, cfg=None):
    """Decode path: x2d [M <= 16, K] (fp16/bf16/fp32) @ (scales * trits)^T (+ bias) -> [M, N] in x's dtype.

    ``scales``: fp32 [N] (a stride-0 expansion of a per-tensor scale is read as such, not copied).
    ``active`` (from ``chunk_activity`` or ``SparsityMetadata.active``) enables plane skipping.
    Launches: the bit-major copy of x, the GEMV, and (only when K is split) the fixed-order reduction.
    """
    M, K = x2d.shape
    N, KW = plus.shape
    bias = None if bias is None else bias.contiguous()
    if not 1 <= M <= DECODE_MAX_M:
        raise ValueError(f"x2d must have 1..{DECODE_MAX_M} rows for the decode kernel, got {M}")
    plan = _gemv_plan(M, N, K, KW, None if cfg is None else tuple(sorted(cfg.items())))
    bm, bn, bw, unroll, warps, n_steps, n_blocks, splits, per_split = plan
    device = x2d.device
    # whole steps and BLOCK_M rows, zero-filled: the GEMV's x loads need no mask
    xt = new_output((n_steps, WORD_BITS, bm, bw), torch.float32, device)
    xsize = x2d.element_size()
    xt_bytes = n_steps * WORD_BITS * bm * bw * 4
    launch.launch(
        "ternary_gemv_bitmajor", ternary_gemv_bitmajor_kernel, (n_steps, bm),
        x2d, xt, M, K, nbytes=M * K * xsize + xt_bytes, BLOCK_M=bm, BLOCK_W=bw,
        num_warps=4,
    )
    skip = active is not None
    final = splits == 1
    rne = _runtime.INTERPRET and x2d.dtype == torch.bfloat16  # the interpreter truncates fp32 -> bf16 casts
    y = new_output((M, N), x2d.dtype, device)
    out = y if final else new_output((splits, M, N), torch.float32, device)
    launch.launch(
        "ternary_gemv", ternary_gemv_kernel, (n_blocks, splits),
        xt, plus, minus, active if skip else plus, scales, bias if bias is not None else scales, out,
        scales.stride(0), MAGIC_2_23.value, M, N, KW, launch.cdiv(KW, CHUNK_WORDS), per_split,
        nbytes=8 * N * KW + xt_bytes + M * N * (xsize if final else 4 * splits),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_W=bw, BIT_UNROLL=unroll, SKIP=skip, FINAL=final,
        HAS_BIAS=bias is not None, RNE=rne, num_warps=warps,
    )
    if not final:
        reduce_splits(out, scales, bias, y, rne)
    return y
