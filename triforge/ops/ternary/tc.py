"""Ternary x fp16/bf16 matmul on tensor cores with a decode of ~1 instruction per weight.

``triforge.ternary.matmul`` sends fp16/bf16 activations to it unless ``TRIFORGE_TERNARY_TC=0`` (``ternary._use_tc``); see
``ternary_matmul_tc``.

Weight format ("tc codes", made from a ``TernaryTensor``'s planes by ``pack_tc``; 2 bits per weight like
the planes): int32 [N padded to a multiple of 16, KC], KC = 8 * ceil(K / 128), stored in tiles of 16 rows x
8 words (512 bytes: one 128-column block of 16 rows, row by row), tile rows outer, column blocks inner, so that
a program's K step reads whole 512-byte blocks (row-major storage read 32-64 bytes of each of 64-256 rows per
step: 5-22% slower at the large shapes; 128-row tiles of 4 KB were no faster than 16-row ones;
benchmarks/NOTES.md, nineteenth session). Each weight is a 2-bit code, trit + 1 in {0, 1, 2} (padding columns
and rows: 1). Word 8 b + 2 t + u of a row (t = 0..3, u = 0, 1) holds 16 weights of the row's 128-column
block b; its field at bits 16 e + 2 i (i = 0..7, e = 0, 1) is the weight at column

    k = 128 b + 64 u + 16 (i // 2) + 8 (i % 2) + 2 t + e

The order is the tensor-core fragment's (wgmma / mma.m16n8k16 register operand A, 16-bit, kWidth 2):
for one row, lane t (mod 4) of a quad holds columns 2 t + {0, 1} + 8 h + 16 kb, 32 per 128 columns,
which are exactly the 32 codes of words 8 b + 2 t and 8 b + 2 t + 1 (one 8-byte load); the register
pair (k, k + 1) of the fragment is field i of the two halves of one word (e = 0 low, e = 1 high), at
the same bit offset in both. The kernel never names a layout: it loads the words as a 7-d tensor whose
dims stand in the order that makes Triton's coalesced load layout, carried through the decode's
broadcast, join, permute and reshape, *be* the dot-operand layout (the reshape's result type is
``#ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>`` in the TTGIR: no conversion, no shared memory).

Decode of one register pair (two weights), the GEMV's float32 mantissa trick moved to 16 bits and
2-bit codes: with c the fp16 value 2^(10 - j) (bf16: 2^(7 - j)), whose mantissa bit j weighs exactly 1,

    P = bits_as_f16x2((w & (0x00030003 << j)) | (c | c << 16))   in {c, c + 1, c + 2} per half
    trit pair = P - (c + 1)   (exact: Sterbenz)

one LOP3 (c arrives at run time, so it sits in a register and the and-or is one instruction) and one
HADD2 (HADD2.BF16_V2) per two weights; fields above the mantissa (fp16: i >= 5, bf16: i >= 3) are read
from the word shifted right by 6 (bf16: also by 12): one SHF per word and shift, shared by its pairs.
No integer-to-float conversion. The weights are the MMA's A operand (y^T = W x^T): x's rows are the
MMA's N dimension (16..256), so small M is not padded to 64 rows; x tiles reach the B operand in shared
memory by TMA.
"""

import os

import torch
import triton
import triton.language as tl

from triforge import _runtime, launch
from triforge.launch import new_output
from triforge.ops._tl import cast as _cast
from triforge.ops.ternary.kernels import gemv_splits, reduce_splits

BLOCK_COLS = 128  # columns per group of 8 code words
WORDS_PER_BLOCK = 8
TILE_ROWS = 16  # rows per storage tile (a tile: 16 rows x 8 words = 512 bytes, one 128-column block of 16 rows)
MAGIC_F16 = 0x64006400  # fp16x2 bits of (2^10, 2^10)
MAGIC_BF16 = 0x43004300  # bf16x2 bits of (2^7, 2^7)

# ----------------------------------------------------------------------------- packing (host, torch)


def code_rows(out_features: int, tile_rows: int = TILE_ROWS) -> int:
    """Rows of the codes tensor: out_features padded to a multiple of TILE_ROWS (padding rows hold trit 0)."""
    return launch.cdiv(out_features, tile_rows) * tile_rows


def code_words(in_features: int) -> int:
    """int32 code words per row: 8 per 128-column block (16 two-bit fields each)."""
    return launch.cdiv(in_features, BLOCK_COLS) * WORDS_PER_BLOCK


def _pack_rows(plus: torch.Tensor, minus: torch.Tensor, in_features: int, nb: int) -> torch.Tensor:
    """Planes of some rows -> their code words in row order, int32 [rows, 8 nb] (the order within a row)."""
    n, kw = plus.shape
    sh = torch.arange(32, dtype=torch.int32, device=plus.device)
    i = torch.arange(8, device=plus.device)
    e = torch.arange(2, device=plus.device)
    shift = (16 * e[:, None] + 2 * i[None, :]).to(torch.int64)  # field shifts [e, i]: field i of half e at 16 e + 2 i
    bits_p = ((plus[:, :, None] >> sh) & 1).reshape(n, kw * 32)
    bits_q = ((minus[:, :, None] >> sh) & 1).reshape(n, kw * 32)
    code = (bits_p - bits_q + 1).to(torch.int64)  # trit + 1; padding columns (0 in both) give 1
    code = torch.nn.functional.pad(code, (0, nb * BLOCK_COLS - kw * 32), value=1)
    # column k = 128 b + 64 u + 16 kb2 + 8 h + 2 t + e, field i = 2 kb2 + h
    c = code.view(n, nb, 2, 4, 2, 4, 2)  # [r, b, u, kb2, h, t, e]
    c = c.permute(0, 1, 5, 2, 6, 3, 4).reshape(n, nb, 4, 2, 2, 8)  # [r, b, t, u, e, i]
    words = (c << shift).sum((-1, -2))  # [r, b, t, u] < 2^32
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.reshape(n, nb * WORDS_PER_BLOCK).to(torch.int32)


def pack_tc(plus: torch.Tensor, minus: torch.Tensor, in_features: int, tile_rows: int = TILE_ROWS) -> torch.Tensor:
    """Bit planes (int32 [N, KW], bit b of word w is column 32 w + b) -> tc codes int32 [code_rows(N), KC],
    KC = code_words(K), in tiles of TR = tile_rows rows: the words of rows TR t..TR t + TR - 1 and 128-column
    block b are the 8 TR consecutive words at (t KC / 8 + b) 8 TR, row by row (8 words each). The 2-D shape is
    storage only: row r of the tensor is not weight row r (``code_index`` maps); rows TR t.. of it hold exactly
    the tile row t."""
    n, kw = plus.shape
    nb = launch.cdiv(in_features, BLOCK_COLS)
    kc = nb * WORDS_PER_BLOCK
    tr = tile_rows
    n_pad = code_rows(n, tr)
    out = torch.empty((n_pad, kc), dtype=torch.int32, device=plus.device)
    tiles = out.view(n_pad // tr, nb, tr, WORDS_PER_BLOCK)  # [tile row, word block, row, word]
    step = tr * max(1, (1 << 22) // max(1, nb * BLOCK_COLS * tr))  # rows per pass, whole tiles
    for r0 in range(0, n_pad, step):
        r1 = min(n_pad, r0 + step)
        words = torch.full((r1 - r0, kc), 0x55555555, dtype=torch.int32, device=plus.device)  # padding rows: trit 0
        if r0 < n:
            words[: min(n, r1) - r0] = _pack_rows(plus[r0:r1], minus[r0:r1], in_features, nb)
        tiles[r0 // tr: r1 // tr] = words.view(-1, tr, nb, WORDS_PER_BLOCK).permute(0, 2, 1, 3)
    return out


def untile(codes: torch.Tensor, tile_rows: int = TILE_ROWS) -> torch.Tensor:
    """Tiled codes (whole tile rows: [TR t, KC]) -> the same words row by row ([rows, KC], row r = weight row)."""
    r, kc = codes.shape
    return codes.view(r // tile_rows, kc // WORDS_PER_BLOCK, tile_rows, WORDS_PER_BLOCK).permute(0, 2, 1, 3).reshape(r, kc)


def code_index(row: int, col: int, kc: int) -> tuple[int, int]:
    """(flat word index in the codes, bit shift) of weight (row, col)'s 2-bit field: within a row, column
    k = 128 b + 64 u + 16 kb2 + 8 h + 2 t + e sits in word 8 b + 2 t + u at bit 16 e + 2 (2 kb2 + h); the word
    of (row, 8 b + w) is at ((row // TR) KC / 8 + b) 8 TR + 8 (row % TR) + w, TR = TILE_ROWS."""
    b, r = divmod(col, BLOCK_COLS)
    u, r = divmod(r, 64)
    kb2, r = divmod(r, 16)
    h, r = divmod(r, 8)
    t, e = divmod(r, 2)
    tr, rr = divmod(row, TILE_ROWS)
    word = ((tr * (kc // WORDS_PER_BLOCK) + b) * TILE_ROWS + rr) * WORDS_PER_BLOCK + 2 * t + u
    return word, 16 * e + 2 * (2 * kb2 + h)


def unpack_words(words: torch.Tensor, in_features: int) -> torch.Tensor:
    """Code words in row order (``untile``'s output, or any of its column blocks) -> int8 trits [rows, in_features]."""
    n, kc = words.shape
    nb = kc // WORDS_PER_BLOCK
    w = words.to(torch.int64).view(n, nb, 4, 2, 1, 1) & 0xFFFFFFFF  # [r, b, t, u, e, i]
    e = torch.arange(2, device=words.device).view(1, 1, 1, 1, 2, 1)
    i = torch.arange(8, device=words.device).view(1, 1, 1, 1, 1, 8)
    c = (w >> (16 * e + 2 * i)) & 3  # [r, b, t, u, e, i]
    c = c.view(n, nb, 4, 2, 2, 4, 2).permute(0, 1, 3, 5, 6, 2, 4)  # [r, b, u, kb2, h, t, e]
    return (c.reshape(n, nb * BLOCK_COLS)[:, :in_features] - 1).to(torch.int8)


def unpack_tc(codes: torch.Tensor, in_features: int, tile_rows: int = TILE_ROWS) -> torch.Tensor:
    """Tiled codes (whole tile rows, e.g. ``codes[16 a:16 b]``) -> int8 trits [rows, in_features], padding rows
    included (the inverse of ``pack_tc``)."""
    return unpack_words(untile(codes, tile_rows), in_features)


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _decode_asm(src, mask, c, d, IS_BF16: tl.constexpr):
    """(lo, hi) 16-bit trits of the field pair selected by ``mask`` in ``src``: (src & mask) | c, less d
    (one lop3 and one sub.f16x2 / sub.rn.bf16x2; ``mov.b32 {lo, hi}`` only names the halves)."""
    if IS_BF16:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 t, $2, $3, $4, 0xEA; sub.rn.bf16x2 t, t, $5; mov.b32 {$0, $1}, t; }",
            "=h,=h,r,r,r,r", [src, mask, c, d], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    else:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 t, $2, $3, $4, 0xEA; sub.f16x2 t, t, $5; mov.b32 {$0, $1}, t; }",
            "=h,=h,r,r,r,r", [src, mask, c, d], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    return lo, hi


@triton.jit
def _decode_constants(magic, IS_BF16: tl.constexpr):
    """Per field i = 2 kb2 + h ([4, 2]): the word shift, the field's bit offset j after it, the mask of
    the field in both halves, c = 2^(10 - j) (bf16 2^(7 - j)) in both halves (from the run-time
    ``magic``, so the value sits in a register), and d = c + 1 (the trit offset), as int32."""
    return _field_constants(4 * tl.arange(0, 4)[:, None] + 2 * tl.arange(0, 2)[None, :], magic, IS_BF16)


@triton.jit
def _field_constants(f, magic, IS_BF16: tl.constexpr):
    """``_decode_constants`` of fields at bit offsets ``f`` (any shape: a Gluon caller gives them its layout)."""
    if IS_BF16:
        sh = tl.where(f >= 12, 12, tl.where(f >= 6, 6, 0))
        one_shift: tl.constexpr = 7
    else:
        sh = tl.where(f >= 10, 6, 0)
        one_shift: tl.constexpr = 10
    j = f - sh
    mask = 0x00030003 << j
    c = magic - (j << one_shift) * 0x00010001
    d = ((magic & 0xFFFF) - (j << one_shift) + (1 << j)) * 0x00010001
    return sh, j, mask, c, d


@triton.jit
def _word_pointers(codes_ptr, i_n, N, KC, WARPS: tl.constexpr, ROW_REPS: tl.constexpr, BLOCKS_K: tl.constexpr,
                   TR: tl.constexpr):
    """(pointers at step 0, word offsets in the row, rows' mask) of weight tile i_n's code words, as [t 4, rlo 8,
    w WARPS, b3 2, r ROW_REPS, blk BLOCKS_K, u 2]: block row 16 WARPS r + 16 w + 8 b3 + rlo, word 8 blk + 2 t + u. The
    dims stand in this order so that the load's coalesced layout (u in-thread, then t and rlo across lanes, w across
    warps, the rest in registers) is, after the decode's broadcast and join, the MMA operand's fragment: no data
    moves."""
    a_t = tl.arange(0, 4)[:, None, None, None, None, None, None]
    a_rlo = tl.arange(0, 8)[None, :, None, None, None, None, None]
    a_w = tl.arange(0, WARPS)[None, None, :, None, None, None, None]
    a_b3 = tl.arange(0, 2)[None, None, None, :, None, None, None]
    a_r = tl.arange(0, ROW_REPS)[None, None, None, None, :, None, None]
    a_blk = tl.arange(0, BLOCKS_K)[None, None, None, None, None, :, None]
    a_u = tl.arange(0, 2)[None, None, None, None, None, None, :]
    r_n = i_n * (16 * WARPS * ROW_REPS) + 16 * WARPS * a_r + 16 * a_w + 8 * a_b3 + a_rlo
    o_c = 8 * a_blk + 2 * a_t + a_u
    # tiled storage (pack_tc): tile (row block r_n // TR, word block b) of TR rows x 8 words at
    # ((r_n // TR) KC / 8 + b) 8 TR words; row r_n % TR at 8 words each: a K step's words are contiguous
    p_c = codes_ptr + (r_n // TR).to(tl.int64) * KC * TR + (r_n % TR) * 8 + (8 * TR) * a_blk + 2 * a_t + a_u
    return p_c, o_c, r_n < N


@triton.jit
def ternary_tc_kernel(
    x_ptr,  # [M, K] fp16/bf16
    codes_ptr,  # [code_rows(N), KC] int32 tc codes in tiles of TR rows x 8 words (pack_tc)
    scale_ptr,  # [N] fp32 row scales at n * stride_scale (read when FINAL)
    bias_ptr,  # [N] any float dtype (read when FINAL or FIXUP, and HAS_BIAS)
    y_ptr,  # [M, N] in x's dtype (written when FINAL, or by a tile's last split when FIXUP)
    part_ptr,  # [S, M, N] fp32 split-K partial sums (not FINAL)
    cnt_ptr,  # int32 [tiles] arrival counters of the splits, zero between launches (FIXUP)
    stride_scale,
    magic,  # MAGIC_F16 / MAGIC_BF16 at run time: the decode's OR constants then sit in registers
    M,
    N,
    K,
    KC,
    steps_per_split,
    n_splits,
    BLOCK_M: tl.constexpr,
    ROW_REPS: tl.constexpr,  # BLOCK_N = 16 * WARPS * ROW_REPS
    BLOCKS_K: tl.constexpr,  # 128-column blocks per K step
    WARPS: tl.constexpr,  # = num_warps
    IS_BF16: tl.constexpr,
    USE_ASM: tl.constexpr,
    TMA: tl.constexpr,  # x tiles through a tensor descriptor (K % 8 == 0; zero-filled past M and K)
    FINAL: tl.constexpr,  # one split: this program writes y
    PREFETCH: tl.constexpr,  # steps of words loaded ahead of the decode: 1..3
    XPRE: tl.constexpr,  # x by pointer loads, PREFETCH steps ahead too (not TMA)
    FIXUP: tl.constexpr,  # several splits: the last of a tile's splits to finish sums them (else a reduce launch)
    FIX4: tl.constexpr,  # FIXUP: the partials read four at a time (else one per loop trip). Four fp32 tiles of
    #                      ROW_REPS BLOCK_M / 2 registers each: the default only up to 16 each (ROW_REPS BLOCK_M <= 32);
    #                      larger, it measured slower (896x4864 M=256: 17.7 -> 19.9 us; 8192^2 M=64, 8 warps: 124 ->
    #                      165 registers, one program per SM instead of two, 25.0 -> 38.6 us)
    HAS_BIAS: tl.constexpr,
    RNE: tl.constexpr,
    TR: tl.constexpr,  # rows per storage tile of the codes (pack_tc's tile_rows)
    PDL: tl.constexpr,  # programmatic dependent launch: the first words in flight before griddepcontrol.wait
    WTMA: tl.constexpr = False,  # code words by TMA into shared memory, pipelined over num_stages steps (TR = 16,
    #                              PREFETCH 1: no registers held per word in flight)
):
    BLOCK_N: tl.constexpr = 16 * WARPS * ROW_REPS
    BK: tl.constexpr = 128 * BLOCKS_K
    tl.static_assert(not WTMA or (TR == 16 and PREFETCH == 1 and BLOCKS_K <= 2), "WTMA: 16-row tiles, PREFETCH 1, "
                     "boxes of at most 256 words")
    i_n, i_m, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p_c, o_c, m_r = _word_pointers(codes_ptr, i_n, N, KC, WARPS, ROW_REPS, BLOCKS_K, TR)
    sh, j, mask, c, d = _decode_constants(magic, IS_BF16)  # [4, 2] each, over (kb2, h)
    sh = sh[None, None, None, None, None, None, None, :, :]
    j = j[None, None, None, None, None, None, None, :, :]
    mask = mask[None, None, None, None, None, None, None, :, :]
    c = c[None, None, None, None, None, None, None, :, :]
    d = d[None, None, None, None, None, None, None, :, :]
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_k = tl.arange(0, BK)
    p_x = x_ptr + o_m.to(tl.int64)[:, None] * K + o_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    n_steps = tl.cdiv(KC, 8 * BLOCKS_K)
    s_start = i_s * steps_per_split
    s_end = tl.minimum(s_start + steps_per_split, n_steps)
    # PREFETCH steps of words in flight ahead of the decode (one load issued per step, 8 BLOCKS_K words
    # per row): the loop is latency-bound at small M, where each program decodes little per step
    # XPRE (pointer loads of x, not TMA): x tiles travel with the words, PREFETCH steps ahead in registers
    # (a TMA load per step is issued and waited on in the same step: its latency is exposed)
    if not WTMA:
        words = _load_step(p_c, o_c, m_r, s_start, s_end, KC, BLOCKS_K, TR)
    if PREFETCH >= 2:
        words2 = _load_step(p_c, o_c, m_r, s_start + 1, s_end, KC, BLOCKS_K, TR)
    if PREFETCH >= 3:
        words3 = _load_step(p_c, o_c, m_r, s_start + 2, s_end, KC, BLOCKS_K, TR)
    if PDL:
        # only the codes (constant since an earlier launch read them: the launcher's rule) are read above; x,
        # the descriptor's scratch, the partials, the counters and y are touched after the previous kernel
        # in the stream has finished and its writes are visible
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start: it waits the same way
    if TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BLOCK_M, BK])
    if WTMA:
        # the codes as [row tiles, KC TR words] (pack_tc's storage): a step's box is the program's BLOCK_N / 16 row
        # tiles x BLOCKS_K blocks of 128 words (16 rows x 8 words); rows and blocks past the tensor read as zeros
        # (trit -1 there: rows past N are not stored, and x is zero past K). Built after griddepcontrol.wait, as
        # x's: the descriptor lives in the launch's scratch memory
        w_desc = tl.make_tensor_descriptor(codes_ptr, [tl.cdiv(N, TR), KC * TR], [KC * TR, 1],
                                           [BLOCK_N // TR, 8 * TR * BLOCKS_K])
    if XPRE:
        xw = _load_x(p_x, m_m, o_k, s_start * BK, K)
        if PREFETCH >= 2:
            xw2 = _load_x(p_x, m_m, o_k, (s_start + 1) * BK, K)
        if PREFETCH >= 3:
            xw3 = _load_x(p_x, m_m, o_k, (s_start + 2) * BK, K)
    for s in range(s_start, s_end):
        if WTMA:
            # [r, w, blk, b3, rlo, t, u] (row tile 16 WARPS r + 16 w, word 8 TR blk + 8 (8 b3 + rlo) + 2 t + u) to
            # the register loads' [t, rlo, w, b3, r, blk, u]
            wt = w_desc.load([i_n * (BLOCK_N // TR), s * (8 * TR * BLOCKS_K)])
            words = tl.permute(tl.reshape(wt, [ROW_REPS, WARPS, BLOCKS_K, 2, 8, 4, 2]), (5, 4, 1, 3, 0, 2, 6))
        else:
            # the step PREFETCH ahead is requested before this step's decode
            words_next = _load_step(p_c, o_c, m_r, s + PREFETCH, s_end, KC, BLOCKS_K, TR)
        if XPRE:
            x_next = _load_x(p_x, m_m, o_k, (s + PREFETCH) * BK, K)
        w9 = words[:, :, :, :, :, :, :, None, None]
        src = tl.where(sh == 12, w9 >> 12, tl.where(sh == 6, w9 >> 6, w9))  # [.., kb2 4, h 2]
        if USE_ASM:
            lo, hi = _decode_asm(src, mask, c, d, IS_BF16)
        else:
            # plain decode for the interpreter (no inline asm there), exact: trits in fp32 for its fp32 dot
            lo = (((src >> j) & 3) - 1).to(tl.float32)
            hi = (((src >> (j + 16)) & 3) - 1).to(tl.float32)
        w10 = tl.join(lo, hi)  # [t, rlo, w, b3, r, blk, u, kb2, h, e]
        w10 = tl.permute(w10, (4, 2, 3, 1, 5, 6, 7, 8, 0, 9))  # [r, w, b3, rlo, blk, u, kb2, h, t, e]
        w_t = tl.reshape(w10, [BLOCK_N, BK])
        k0 = s * BK
        if XPRE:
            b_x = xw
        elif TMA:
            b_x = x_desc.load([i_m * BLOCK_M, k0])
        else:
            b_x = _load_x(p_x, m_m, o_k, k0, K)
        if USE_ASM:
            acc = tl.dot(w_t, tl.trans(b_x), acc)
        else:  # the interpreter: exact in fp32 (its bf16 dots are not supported)
            acc = tl.dot(w_t, tl.trans(b_x.to(tl.float32)), acc, input_precision="ieee")
        if PREFETCH == 1:
            if not WTMA:
                words = words_next
            if XPRE:
                xw = x_next
        elif PREFETCH == 2:
            words = words2
            words2 = words_next
            if XPRE:
                xw = xw2
                xw2 = x_next
        else:
            words = words2
            words2 = words3
            words3 = words_next
            if XPRE:
                xw = xw2
                xw2 = xw3
                xw3 = x_next
    # acc [BN, BM] is y^T
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    m_y = m_n[:, None] & m_m[None, :]
    if FINAL:
        _store_y(acc, scale_ptr, stride_scale, bias_ptr, y_ptr, o_m, o_n, m_y, N, HAS_BIAS, RNE)
    else:
        o_p = (i_s.to(tl.int64) * M + o_m[None, :]) * N + o_n[:, None]
        tl.store(part_ptr + o_p, acc, mask=m_y)
        if FIXUP:
            # serial split-K: every thread's partial precedes the arrival (barrier, then one release by the
            # arriving thread); the last arrival acquires, sums the S partials in order 0..S-1 (the reduce
            # kernel's order: same bits) and re-arms the counter for the next launch
            tl.debug_barrier()
            tile = i_m * tl.num_programs(0) + i_n
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == n_splits - 1:
                tl.debug_barrier()  # the other threads' reads follow the acquire
                y = _sum_parts(part_ptr, o_m, o_n, m_y, M, N, n_splits, FIX4)
                _store_y(y, scale_ptr, stride_scale, bias_ptr, y_ptr, o_m, o_n, m_y, N, HAS_BIAS, RNE)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _sum_parts(part_ptr, o_m, o_n, m_y, M, N, n_parts, FIX4: tl.constexpr):
    """The sum of the fp32 partials 0..n_parts-1 in that order (from 0.0: the reduce kernel's bits)."""
    y = tl.zeros([o_n.shape[0], o_m.shape[0]], dtype=tl.float32)
    if FIX4:  # four partials' loads issued before their sums (one L2 round trip per four splits)
        for s2 in range(0, n_parts, 4):
            q0 = _load_part(part_ptr, o_m, o_n, m_y, M, N, s2, n_parts)
            q1 = _load_part(part_ptr, o_m, o_n, m_y, M, N, s2 + 1, n_parts)
            q2 = _load_part(part_ptr, o_m, o_n, m_y, M, N, s2 + 2, n_parts)
            q3 = _load_part(part_ptr, o_m, o_n, m_y, M, N, s2 + 3, n_parts)
            y += q0  # past the last partial nothing is added (same bits)
            y = tl.where(s2 + 1 < n_parts, y + q1, y)
            y = tl.where(s2 + 2 < n_parts, y + q2, y)
            y = tl.where(s2 + 3 < n_parts, y + q3, y)
    else:
        for s2 in range(0, n_parts):
            y += _load_part(part_ptr, o_m, o_n, m_y, M, N, s2, n_parts)
    return y


@triton.jit
def _load_step(p_c, o_c, m_r, s, s_end, KC, BLOCKS_K: tl.constexpr, TR: tl.constexpr):
    """The code words of K step s (zeros past the split's last step and past the row's end): BLOCKS_K tiles of
    8 TR words (tiled storage: word block b of a row block at 8 TR b)."""
    w0 = s * (8 * BLOCKS_K)
    return tl.load(p_c + w0 * TR, mask=m_r & (s < s_end) & (w0 + o_c < KC), other=0)


@triton.jit
def _load_part(part_ptr, o_m, o_n, m_y, M, N, s, n_splits):
    """Split s's fp32 partial tile (zeros past the last split), read from L2 (.cg): other SMs wrote it."""
    o_s = (s * M + o_m[None, :]).to(tl.int64) * N + o_n[:, None]
    return tl.load(part_ptr + o_s, mask=m_y & (s < n_splits), other=0.0, cache_modifier=".cg")


@triton.jit
def _load_x(p_x, m_m, o_k, k0, K):
    """x's tile of the K step at column k0 (zeros past M and K)."""
    return tl.load(p_x + k0, mask=m_m[:, None] & (k0 + o_k < K)[None, :], other=0.0)


@triton.jit
def _store_y(acc, scale_ptr, stride_scale, bias_ptr, y_ptr, o_m, o_n, m_y, N, HAS_BIAS: tl.constexpr,
             RNE: tl.constexpr):
    """y^T tile acc [BLOCK_N, BLOCK_M] (fp32 trit sums) * row scales (+ bias), cast, stored into y [M, N]."""
    m_n = o_n < N
    y = acc * tl.load(scale_ptr + o_n * stride_scale, mask=m_n, other=0.0)[:, None]
    if HAS_BIAS:
        y += tl.load(bias_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)[:, None]
    o_y = o_m.to(tl.int64)[None, :] * N + o_n[:, None]
    tl.store(y_ptr + o_y, _cast(y, y_ptr.dtype.element_ty, RNE), mask=m_y)


# ----------------------------------------------------------------------------- launcher


def tc_fallback_config(M: int, N: int, K: int, interpreter: bool | None = None) -> dict:
    """Launch config of ``ternary_tc_kernel``: BLOCK_M (x rows per program, the MMA's N: 16..256),
    ROW_REPS and num_warps (BLOCK_N = 16 num_warps ROW_REPS weight rows), BLOCKS_K (128-column blocks
    per K step), num_stages, programs_per_sm (split-K target).

    GPU (sm90; untimed, chosen from the SASS of tests/ops/ternary/test_tc.py): x through TMA.
    M <= 64: one M tile (every weight decoded once per call), 64 weight rows, 4 warps, 256-column steps,
    unpipelined (120-153 registers, 3-4 programs per SM: their loads overlap, and each requests the
    next step's words, 4 KB, before decoding the current one: ~16 KB of plane reads in flight per SM);
    K split to ~4 programs per SM at M <= 16, ~2 at M <= 64 (the fp32 partials cost 8 M N bytes per
    split). M > 64: 128 x rows and 128 weight rows per program, 8 warps, software-pipelined (2 stages,
    ~140 registers: one program per SM), no split where the tiles fill the SMs (M = 256, N = 8192: 128
    programs; the weights are decoded twice, cheaper than 2 splits' 8 M N bytes of partials).
    Interpreter: BLOCK_N 64, pointer loads."""
    bm = max(16, launch.next_power_of_2(min(M, 256)))
    if _runtime.INTERPRET if interpreter is None else interpreter:
        return {"BLOCK_M": bm, "ROW_REPS": 1, "BLOCKS_K": 1, "num_warps": 4, "num_stages": 1, "programs_per_sm": 1}
    if bm <= 64:
        return {"BLOCK_M": bm, "ROW_REPS": 1, "BLOCKS_K": 2, "num_warps": 4, "num_stages": 1,
                "programs_per_sm": 4 if bm <= 16 else 2}
    return {"BLOCK_M": min(bm, 128), "ROW_REPS": 1, "BLOCKS_K": 1, "num_warps": 8, "num_stages": 2,
            "programs_per_sm": 1}


_COUNTERS: dict = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """int32 [>= n] zeros: the split-K arrival counters of ``ternary_tc_kernel``'s FIXUP, one set per device
    and stream (launches on one stream run in order; each launch leaves them zero again). Grown, never
    shrunk; under CUDA-graph capture the capture stream gets its own set."""
    if device.type == "cuda" and device.index is None:  # torch.device("cuda"): the current device (its tensors' index)
        device = torch.device("cuda", torch.cuda.current_device())
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    cnt = _COUNTERS.get(key)
    if cnt is None or cnt.numel() < n:
        cnt = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = cnt
    return cnt


def tc_m_bucket(M: int) -> int:
    """M's bucket in the config keys: 1, 4 (2..4), 16 (5..16), then powers of two up to 256. M <= 16 share one x
    tile of 16 rows, but not their best config: at M = 1 x by pointer loads beside the words pays, at M = 16 it
    does not (8192^2: 19.9 us with the M = 1 config against 15.6 with the untuned fallback, session 17)."""
    if M <= 1:
        return 1
    if M <= 4:
        return 4
    return max(16, launch.next_power_of_2(min(M, 256)))


def tc_config_key(M: int, N: int, K: int) -> str:
    # M's bucket with the weight shape; fp16 and bf16 share configs (same decode count)
    return launch.config_key(m=tc_m_bucket(M), n=N, k=K)


def tc_config(M: int, N: int, K: int) -> dict:
    """The tuned config at (M's bucket, N, K) on this arch (``triforge tune ternary_tc``), else the fallback."""
    return launch.config("ternary_tc", tc_config_key(M, N, K), tc_fallback_config(M, N, K))


# the tuning grid (BLOCK_M comes from M: one x tile up to 128 rows); 72 points, 24 compiles per M bucket
TC_TUNE_SPACE = {"ROW_REPS": [1, 2], "BLOCKS_K": [1, 2, 4], "num_warps": [4, 8], "num_stages": [1, 2],
                 "programs_per_sm": [2, 4, 8]}


@launch.config_cache
def _tc_plan(M: int, N: int, K: int, kc: int, cfg_items=None):
    """(BLOCK_M, BLOCKS_K, ROW_REPS, warps, stages, PREFETCH, XPRE, FIXUP, FIX4, PDL (allowed; the launcher also asks
    ``_settled``), TMA, WTMA, grid (weight tiles, x tiles, splits), steps per split, compile options (maxnreg)) of a
    launch: the tuned (or given) config and the split-K arithmetic, worked out once per shape (host time: the decode
    path is a few microseconds of GPU time per call)."""
    cfg = dict(tc_config(M, N, K), **dict(cfg_items or ()))
    bm, reps, nbk, warps = cfg["BLOCK_M"], cfg["ROW_REPS"], cfg["BLOCKS_K"], cfg["num_warps"]
    bn = 16 * warps * reps
    n_steps = launch.cdiv(kc, 8 * nbk)
    tiles = launch.cdiv(N, bn) * launch.cdiv(M, bm)
    per_split = launch.cdiv(n_steps, gemv_splits(tiles, n_steps, cfg["programs_per_sm"]))
    splits = launch.cdiv(n_steps, per_split)
    xpre = bool(cfg.get("XPRE", 0))
    # cfg["TMA"] forces it either way (the interpreter runs the descriptor path too, for the tests)
    use_tma = not xpre and bool(cfg.get("TMA", not _runtime.INTERPRET)) and K % 8 == 0
    grid = (launch.cdiv(N, bn), launch.cdiv(M, bm), splits)
    opts = launch.maxnreg_option(cfg)  # more programs per SM, hence more code words in flight
    fixup = cfg.get("FIXUP")  # None: by context (``_fixup_in_kernel``)
    # WTMA: the code words through a tensor descriptor, pipelined over num_stages (their x prefetch one step ahead);
    # opt-in: on the H200 it measured slower than the register loads at every M = 1 shape (benchmarks/NOTES.md,
    # session 51), so no entry and no tune grid holds it. A box row holds at most 256 words (BLOCKS_K <= 2); the
    # launcher also asks for 16-row tiles and 16-byte aligned codes, and then loads x one step ahead (PREFETCH 1)
    wtma = bool(cfg.get("WTMA", 0)) and nbk <= 2 and cfg.get("TR", TILE_ROWS) == TILE_ROWS
    return (bm, nbk, reps, warps, cfg["num_stages"], cfg.get("PREFETCH", 1), xpre,
            None if fixup is None else bool(fixup), bool(cfg.get("FIX4", reps * bm <= 32)), bool(cfg.get("PDL", bm <= 64)),
            use_tma, wtma, grid, per_split, opts)


PDL_ENV = "TRIFORGE_TERNARY_PDL"


def _fixup_in_kernel(x2d: torch.Tensor) -> bool:
    """Where K is split and the config does not say (``FIXUP``): the tile's last-arriving program sums the partials
    (one launch), except under CUDA-graph capture, where a second launch does it (``reduce_splits``, launched as a
    programmatic dependent, every partial loaded at once). Replayed, the two launches measured faster or equal at 18
    of the 20 (shape, M <= 64) points of the issue's grid (16-27% at the 0.5B shapes, 2-9% at 8192^2 M = 4-64; 1.8-2.5%
    slower at 8192 x 28672, M = 1 and 16: benchmarks/NOTES.md, thirty-fifth session); called eagerly, a second launch
    costs more host time (~10 us) than it saves on the GPU. Same bits either way (partials summed in split order)."""
    return not (x2d.is_cuda and torch.cuda.is_current_stream_capturing())


def _settled(codes: torch.Tensor) -> bool:
    """Whether this launch may be a programmatic dependent one (``TRIFORGE_TERNARY_PDL``, default 1; 0 never).

    Under PDL the kernel reads its first code words before griddepcontrol.wait, i.e. while the previous kernel in
    the stream may still run, so the codes must not be that kernel's output. The rule: the codes tensor was
    already read by an earlier launch and has not been written in place since (its version counter, which
    ``modify_dim``, ``copy_`` and every in-place op bump, is the one recorded then). A fresh or just-edited
    codes tensor launches without PDL once."""
    if not launch.pdl_supported() or os.environ.get(PDL_ENV, "1") == "0":
        return False
    seen = getattr(codes, "_triforge_read_version", None)
    if seen == codes._version:
        return True
    codes._triforge_read_version = codes._version
    return False


def ternary_matmul_tc(x2d: torch.Tensor, tt, bias: torch.Tensor | None = None, codes: torch.Tensor | None = None,
                      cfg: dict | None = None) -> torch.Tensor:
    """x2d [M, K] (fp16/bf16) @ (scales * trits)^T (+ bias) -> [M, N] in x's dtype, fp32 accumulation.

    ``tt``: a TernaryTensor; ``codes``: ``pack_tc(tt.plus, tt.minus, tt.in_features)`` made once
    (``TernaryTensor.tc_codes()``; packed here on every call when not given). Where K is split, each tile's
    last-arriving program sums the fp32 partials in split order (``cfg={"FIXUP": 1}``), or a second launch,
    ``ternary_gemv_reduce_kernel``, does (``{"FIXUP": 0}``), with the same bits; by default the first when called
    eagerly, the second under CUDA-graph capture (``_fixup_in_kernel``).
    """
    if x2d.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"x2d must be fp16 or bf16 for the tensor-core kernel, got {x2d.dtype}")
    x2d = x2d.contiguous()
    M, K = x2d.shape
    N = tt.out_features
    if K != tt.in_features:
        raise ValueError(f"x2d must have {tt.in_features} columns, got {K}")
    tr = (cfg or {}).get("TR", TILE_ROWS)  # (another tile height: codes packed with pack_tc(..., tile_rows=TR))
    if codes is None:
        codes = pack_tc(tt.plus, tt.minus, tt.in_features, tr)
    scales = tt.kernel_operands()[0]
    bias = None if bias is None else bias.contiguous()
    codes = codes.contiguous()  # the kernel addresses tiles 8 TR words apart
    kc = codes.shape[1]
    if tuple(codes.shape) != (code_rows(N, tr), code_words(K)):
        raise ValueError(f"codes must have shape {(code_rows(N, tr), code_words(K))} (pack_tc) for {N} x {K} weights, "
                         f"got {tuple(codes.shape)}")
    bm, nbk, reps, warps, stages, prefetch, xpre, fixup_on, fix4, pdl, use_tma, wtma, grid, per_split, opts = _tc_plan(
        M, N, K, kc, None if cfg is None else tuple(sorted(cfg.items())))
    splits = grid[2]
    # TMA needs 16-byte row strides and base (else pointer loads); the codes' rows (KC TR words) always are
    tma = use_tma and x2d.data_ptr() % 16 == 0
    wtma = wtma and codes.data_ptr() % 16 == 0
    if wtma:
        prefetch = 1
    if tma or wtma:
        launch.use_tensor_descriptors()
    final = splits == 1
    fixup = not final and (_fixup_in_kernel(x2d) if fixup_on is None else fixup_on)
    rne = _runtime.INTERPRET and x2d.dtype == torch.bfloat16  # the interpreter truncates fp32 -> bf16 casts
    is_bf16 = x2d.dtype == torch.bfloat16
    y = new_output((M, N), x2d.dtype, x2d.device)
    part = y if final else new_output((splits, M, N), torch.float32, x2d.device)
    cnt = split_counters(x2d.device, grid[0] * grid[1]) if fixup else scales
    # PDL where the config allows it (default: M <= 64; at M = 256 it measured slower at 8192^2, 65.4 -> 71.0 us)
    # and the codes are settled
    pdl = pdl and _settled(codes)
    xsize = x2d.element_size()
    launch.launch(
        "ternary_tc", ternary_tc_kernel, grid,
        x2d, codes, scales, bias if bias is not None else scales, y, part, cnt, scales.stride(0),
        MAGIC_BF16 if is_bf16 else MAGIC_F16, M, N, K, kc, per_split, splits,
        nbytes=codes.numel() * 4 + M * K * xsize + M * N * (xsize if final else 8 * splits + xsize),
        BLOCK_M=bm, ROW_REPS=reps, BLOCKS_K=nbk, WARPS=warps, IS_BF16=is_bf16, USE_ASM=not _runtime.INTERPRET,
        TMA=tma, FINAL=final, PREFETCH=prefetch, XPRE=xpre, FIXUP=fixup, FIX4=fix4, HAS_BIAS=bias is not None,
        RNE=rne, TR=tr, WTMA=wtma, num_warps=warps, num_stages=stages, **opts, **launch.pdl_options(pdl),
    )
    if not final and not fixup:
        # RED: (elements per program, every partial loaded at once, PDL) of the reduce launch; the default measured
        # fastest of six (benchmarks/NOTES.md, thirty-fifth session)
        blk, unroll, rpdl = (cfg or {}).get("RED", (256, True, True))
        reduce_splits(part, scales, bias, y, rne, blk, unroll, rpdl)
    return y
