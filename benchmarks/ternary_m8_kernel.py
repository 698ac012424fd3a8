"""Ternary x bf16/fp16 at M <= 8 for Hopper, in Gluon, on mma.sync: a probe, not the library's kernel.

Measured slower than the library's kernel at 8192^2 M = 1 in every config (benchmarks/NOTES.md, session 37): best
13.57 us (K split 4, x through the ring) against 10.62-10.68 us; split-free 16.3 us at best. One warp per scheduler
without a split, and mma.sync's B operand costs instructions per element that wgmma (x from shared memory) does not.

The same tc codes, decode and fp32 results as ``triforge.ops.ternary.tc`` (the library's kernel), built differently:

- one program is WARPS warps, each warp 16 weight rows (one storage tile row) over the program's K range; the
  decoded words are mma.sync m16n8k16's A operand in registers, as in the library kernel (the code words are in the
  fragment's order), and x is the B operand in registers too, loaded from global memory (L1/L2: every program reads
  the same x) straight into the fragment's layout, or at M = 1 (XS) copied into the ring beside the words and read
  by ldmatrix; eight accumulators (one per 16-column k-block of each 128 columns) keep the MMAs independent;
- the code words travel by cp.async into a ring of STAGES K steps in shared memory, each thread copying exactly the
  bytes it later reads: STAGES steps of words in flight per warp without registers (the library kernel holds its
  prefetch in registers, PREFETCH <= 3 steps);
- K may be split (grid dim 1): FINAL writes y, else fp32 partials [S, M, N] for ``kernels.reduce_splits``.

Compiled GPUs only (Gluon has no interpreter).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from triforge import launch
from triforge.ops.ternary import tc
from triforge.ops.ternary.kernels import reduce_splits


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _pair(src, mask, c, d, IS_BF16: gl.constexpr):
    """(lo, hi) 16-bit trits of the field pair selected by ``mask`` in ``src`` (tc._decode_asm)."""
    if IS_BF16:
        lo, hi = gl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 t, $2, $3, $4, 0xEA; sub.rn.bf16x2 t, t, $5; mov.b32 {$0, $1}, t; }",
            "=h,=h,r,r,r,r", [src, mask, c, d], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
    else:
        lo, hi = gl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 t, $2, $3, $4, 0xEA; sub.f16x2 t, t, $5; mov.b32 {$0, $1}, t; }",
            "=h,=h,r,r,r,r", [src, mask, c, d], dtype=(gl.float16, gl.float16), is_pure=True, pack=1)
    return lo, hi


@gluon.jit
def _field(words, w6, w12, magic, KB2: gl.constexpr, H: gl.constexpr, IS_BF16: gl.constexpr):
    """Field i = 2 KB2 + H of every word, both halves: [.., e 2] trits (tc._decode_constants, one field)."""
    F: gl.constexpr = 4 * KB2 + 2 * H
    if IS_BF16:
        SH: gl.constexpr = 12 if F >= 12 else (6 if F >= 6 else 0)
        ONE: gl.constexpr = 7
    else:
        SH: gl.constexpr = 6 if F >= 10 else 0
        ONE: gl.constexpr = 10
    J: gl.constexpr = F - SH
    MASK: gl.constexpr = 0x00030003 << J
    c = magic - (J << ONE) * 0x00010001
    d = ((magic & 0xFFFF) - (J << ONE) + (1 << J)) * 0x00010001
    if SH == 12:
        src = w12
    elif SH == 6:
        src = w6
    else:
        src = words
    lo, hi = _pair(src, gl.full(words.shape, MASK, gl.int32, words.type.layout),
                   gl.full(words.shape, c, gl.int32, words.type.layout),
                   gl.full(words.shape, d, gl.int32, words.type.layout), IS_BF16)
    return gl.join(lo, hi)


@gluon.jit
def _piece(words_u, w6, w12, magic, KB2: gl.constexpr, a_l: gl.constexpr, BN: gl.constexpr, BLK: gl.constexpr,
           IS_BF16: gl.constexpr):
    """Words of one u [t 4, rlo 8, w, b3 2, blk] -> the A operand of k-block 4 u + KB2 of every 128-column block:
    [BN, 16 BLK] (rows 16 w + 8 b3 + rlo, columns 16 blk + 8 h + 2 t + e)."""
    p = gl.join(_field(words_u, w6, w12, magic, KB2, 0, IS_BF16), _field(words_u, w6, w12, magic, KB2, 1, IS_BF16))
    p = gl.permute(p, (2, 3, 1, 4, 6, 0, 5))  # [t, rlo, w, b3, blk, e, h] -> [w, b3, rlo, blk, h, t, e]
    return gl.convert_layout(gl.reshape(p, [BN, 16 * BLK]), a_l)


@gluon.jit
def _mma_piece(words_u, w6, w12, magic, p_x, o_kp, k0, K, x_ring, slot, acc, U: gl.constexpr, KB2: gl.constexpr,
               a_l: gl.constexpr, b_l: gl.constexpr, BN: gl.constexpr, BLK: gl.constexpr, IS_BF16: gl.constexpr,
               EVEN_K: gl.constexpr, XS: gl.constexpr):
    """acc += A(piece) B(piece): the piece's BLK k-blocks of 16 (x columns 128 blk + 64 U + 16 KB2 + 0..15)."""
    a = _piece(words_u, w6, w12, magic, KB2, a_l, BN, BLK, IS_BF16)
    if XS:  # M = 1: x row 0 from this step's ring slot, the same values in every B column
        xv = x_ring.index(slot * 8 + 4 * U + KB2).load(gl.SliceLayout(1, b_l))
        b, _ = gl.broadcast(gl.expand_dims(xv, 1), gl.zeros([16 * BLK, 8], xv.dtype, b_l))
    else:
        k = k0 + 64 * U + 16 * KB2 + o_kp
        if not EVEN_K:  # past K the codes are trit 0: any finite x serves
            k = gl.minimum(k, K - 1)
        b = gl.load(p_x + k[:, None])
    return mma_v2(a, b, acc)


@gluon.jit
def ternary_m8_kernel(
    x_ptr,  # [M, K] fp16/bf16, M <= 8
    codes_ptr,  # tc codes (tc.pack_tc, 16-row tiles)
    scale_ptr,  # [N] fp32 at n * stride_scale
    bias_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M, N] (FINAL)
    part_ptr,  # [S, M, N] fp32 (not FINAL)
    stride_scale,
    magic,
    M,
    N,
    K,
    KC,
    steps_per_split,
    WARPS: gl.constexpr,
    BLOCKS_K: gl.constexpr,  # 128-column blocks per K step
    STAGES: gl.constexpr,  # K steps of words in flight (cp.async ring)
    IS_BF16: gl.constexpr,
    FINAL: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    PDL: gl.constexpr,
    EVEN_K: gl.constexpr,  # K % (128 BLOCKS_K) == 0 (x loads need no clamp)
    XS: gl.constexpr,  # M = 1: x through the ring (shared memory) instead of loads from global memory per step
):
    BN: gl.constexpr = 16 * WARPS
    BK: gl.constexpr = 128 * BLOCKS_K
    TR: gl.constexpr = 16
    i_n = gl.program_id(0)
    i_s = gl.program_id(1)
    # words of one K step: [t 4, rlo 8, w WARPS, b3 2, blk BLOCKS_K, u 2]; lane = t + 4 rlo, warp = w
    w_l: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 1, 2], [4, 8, 1, 1, 1, 1], [1, 1, WARPS, 1, 1, 1],
                                         [5, 0, 1, 2, 3, 4])
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_l, k_width=2)
    ring_l: gl.constexpr = gl.SwizzledSharedLayout(2, 1, 1, [5, 0, 1, 2, 3, 4])
    ring = gl.allocate_shared_memory(gl.int32, [STAGES, 4, 8, WARPS, 2, BLOCKS_K, 2], ring_l)
    # XS (M = 1): x's step tile (row 0 only) beside the words, per piece p = 4 u + kb2 (columns 128 blk + 16 p + j):
    # rows 8 slot + p of [8 STAGES, 16 BLOCKS_K], one 16-byte copy per piece
    xr_l: gl.constexpr = gl.BlockedLayout([8], [32], [WARPS], [0])
    x_ring = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [8 * STAGES if XS else 1, 16 * BLOCKS_K],
                                       gl.SwizzledSharedLayout(1, 1, 1, [0]))
    o_xj = gl.arange(0, 16 * BLOCKS_K, layout=xr_l)
    o_xr = 128 * (o_xj // 16) + o_xj % 16

    # word offsets within a step (tiled storage: row r of the program's tile row w at 8 r + word, block blk at 128 blk)
    o_t = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(5, w_l))))))
    o_r = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(5, w_l))))))
    o_w = gl.arange(0, WARPS, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(5, w_l))))))
    o_b3 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, gl.SliceLayout(5, w_l))))))
    o_blk = gl.arange(0, BLOCKS_K, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(5, w_l))))))
    o_u = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, w_l))))))
    e_t = o_t[:, None, None, None, None, None]
    e_r = o_r[None, :, None, None, None, None]
    e_w = o_w[None, None, :, None, None, None]
    e_b3 = o_b3[None, None, None, :, None, None]
    e_blk = o_blk[None, None, None, None, :, None]
    e_u = o_u[None, None, None, None, None, :]
    row_tile = i_n * WARPS + e_w  # storage tile row of each word
    o_c = 8 * e_blk + 2 * e_t + e_u  # word within the row's step
    p_c = codes_ptr + row_tile.to(gl.int64) * KC * TR + (8 * e_b3 + e_r) * 8 + (8 * TR) * e_blk + 2 * e_t + e_u
    n_steps = gl.cdiv(KC, 8 * BLOCKS_K)
    s_start = i_s * steps_per_split
    s_end = gl.minimum(s_start + steps_per_split, n_steps)
    n_local = s_end - s_start
    # the ring's first STAGES steps (codes are settled before the launch: read before griddepcontrol.wait)
    for i in gl.static_range(STAGES):
        w0 = (s_start + i) * (8 * BLOCKS_K)
        async_copy.async_copy_global_to_shared(ring.index(i), p_c + w0 * TR, mask=(i < n_local) & (w0 + o_c < KC))
        if not XS:
            async_copy.commit_group()
    if PDL:
        _gdc_wait()
        _gdc_launch_dependents()
    if XS:  # x after the wait (an earlier kernel may write it); the words' groups and x's commit together
        for i in gl.static_range(STAGES):
            for p in gl.static_range(8):
                kx = (s_start + i) * (128 * BLOCKS_K) + 16 * p + o_xr
                async_copy.async_copy_global_to_shared(x_ring.index(8 * i + p), x_ptr + kx, mask=(i < n_local) & (kx < K))
            async_copy.commit_group()
    # x as the B operand: B[k, m] = x[m, k]. Columns m >= M of the product are never stored, so their B columns may
    # hold any finite values: lanes past M read row M - 1 (no masks)
    o_mx = gl.minimum(gl.arange(0, 8, layout=gl.SliceLayout(0, b_l)), M - 1)
    p_x = x_ptr + o_mx.to(gl.int64)[None, :] * K
    o_kp = gl.arange(0, 16 * BLOCKS_K, layout=gl.SliceLayout(1, b_l))
    o_kp = 128 * (o_kp // 16) + o_kp % 16  # a piece's columns within the step
    # eight accumulators (one per k-block of 16 within each 128 columns): independent mma.sync chains
    acc0 = gl.zeros([BN, 8], gl.float32, mma_l)
    acc1 = gl.zeros([BN, 8], gl.float32, mma_l)
    acc2 = gl.zeros([BN, 8], gl.float32, mma_l)
    acc3 = gl.zeros([BN, 8], gl.float32, mma_l)
    acc4 = gl.zeros([BN, 8], gl.float32, mma_l)
    acc5 = gl.zeros([BN, 8], gl.float32, mma_l)
    acc6 = gl.zeros([BN, 8], gl.float32, mma_l)
    acc7 = gl.zeros([BN, 8], gl.float32, mma_l)
    for i in range(0, n_local):
        slot = i % STAGES
        k0 = (s_start + i) * BK
        async_copy.wait_group(STAGES - 1)  # this thread's copies of step i have landed
        words = ring.index(slot).load(w_l)
        wu0, wu1 = gl.split(words)  # [t, rlo, w, b3, blk] per u
        w60 = wu0 >> 6
        w61 = wu1 >> 6
        w120 = wu0 >> 12
        w121 = wu1 >> 12
        acc0 = _mma_piece(wu0, w60, w120, magic, p_x, o_kp, k0, K, x_ring, slot, acc0, 0, 0, a_l, b_l, BN, BLOCKS_K, IS_BF16,
                          EVEN_K, XS)
        acc1 = _mma_piece(wu0, w60, w120, magic, p_x, o_kp, k0, K, x_ring, slot, acc1, 0, 1, a_l, b_l, BN, BLOCKS_K, IS_BF16,
                          EVEN_K, XS)
        acc2 = _mma_piece(wu0, w60, w120, magic, p_x, o_kp, k0, K, x_ring, slot, acc2, 0, 2, a_l, b_l, BN, BLOCKS_K, IS_BF16,
                          EVEN_K, XS)
        acc3 = _mma_piece(wu0, w60, w120, magic, p_x, o_kp, k0, K, x_ring, slot, acc3, 0, 3, a_l, b_l, BN, BLOCKS_K, IS_BF16,
                          EVEN_K, XS)
        acc4 = _mma_piece(wu1, w61, w121, magic, p_x, o_kp, k0, K, x_ring, slot, acc4, 1, 0, a_l, b_l, BN, BLOCKS_K, IS_BF16,
                          EVEN_K, XS)
        acc5 = _mma_piece(wu1, w61, w121, magic, p_x, o_kp, k0, K, x_ring, slot, acc5, 1, 1, a_l, b_l, BN, BLOCKS_K, IS_BF16,
                          EVEN_K, XS)
        acc6 = _mma_piece(wu1, w61, w121, magic, p_x, o_kp, k0, K, x_ring, slot, acc6, 1, 2, a_l, b_l, BN, BLOCKS_K, IS_BF16,
                          EVEN_K, XS)
        acc7 = _mma_piece(wu1, w61, w121, magic, p_x, o_kp, k0, K, x_ring, slot, acc7, 1, 3, a_l, b_l, BN, BLOCKS_K, IS_BF16,
                          EVEN_K, XS)
        # step i + STAGES into the slot just read (the same threads read it above)
        w0 = (s_start + i + STAGES) * (8 * BLOCKS_K)
        async_copy.async_copy_global_to_shared(ring.index(slot), p_c + w0 * TR,
                                               mask=(i + STAGES < n_local) & (w0 + o_c < KC))
        if XS:
            for p in gl.static_range(8):
                kx = k0 + STAGES * BK + 16 * p + o_xr
                async_copy.async_copy_global_to_shared(x_ring.index(slot * 8 + p), x_ptr + kx,
                                                       mask=(i + STAGES < n_local) & (kx < K))
        async_copy.commit_group()
    acc = ((acc0 + acc1) + (acc2 + acc3)) + ((acc4 + acc5) + (acc6 + acc7))
    async_copy.wait_group(0)
    # acc [BN, 8] is y^T
    o_n = i_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_l))
    o_m = gl.arange(0, 8, layout=gl.SliceLayout(0, mma_l))
    m_n = o_n < N
    m_y = m_n[:, None] & (o_m < M)[None, :]
    if FINAL:
        y = acc * gl.load(scale_ptr + o_n * stride_scale, mask=m_n, other=0.0)[:, None]
        if HAS_BIAS:
            y += gl.load(bias_ptr + o_n, mask=m_n, other=0.0).to(gl.float32)[:, None]
        gl.store(y_ptr + o_m.to(gl.int64)[None, :] * N + o_n[:, None], y.to(y_ptr.dtype.element_ty), mask=m_y)
    else:
        o_p = (i_s.to(gl.int64) * M + o_m[None, :]) * N + o_n[:, None]
        gl.store(part_ptr + o_p, acc, mask=m_y)


def ternary_matmul_m8(x2d: torch.Tensor, tt, codes: torch.Tensor, cfg: dict, bias=None, pdl=False) -> torch.Tensor:
    """x2d [M <= 8, K] fp16/bf16 @ (scales * trits)^T (+ bias) with ``ternary_m8_kernel`` (sm90, compiled).
    cfg: WARPS, BLOCKS_K, STAGES, splits (K splits; > 1: partials and ``reduce_splits``)."""
    M, K = x2d.shape
    N = tt.out_features
    assert M <= 8 and x2d.dtype in (torch.float16, torch.bfloat16)
    x2d = x2d.contiguous()
    kc = codes.shape[1]
    warps, nbk = cfg["WARPS"], cfg["BLOCKS_K"]
    n_steps = launch.cdiv(kc, 8 * nbk)
    per_split = launch.cdiv(n_steps, cfg.get("splits", 1))
    splits = launch.cdiv(n_steps, per_split)
    scales = tt.kernel_operands()[0]
    final = splits == 1
    y = launch.new_output((M, N), x2d.dtype, x2d.device)
    part = y if final else launch.new_output((splits, M, N), torch.float32, x2d.device)
    is_bf16 = x2d.dtype == torch.bfloat16
    ternary_m8_kernel[(launch.cdiv(N, 16 * warps), splits)](
        x2d, codes, scales, bias if bias is not None else scales, y, part, scales.stride(0),
        tc.MAGIC_BF16 if is_bf16 else tc.MAGIC_F16, M, N, K, kc, per_split,
        WARPS=warps, BLOCKS_K=nbk, STAGES=cfg.get("STAGES", 8), IS_BF16=is_bf16, FINAL=final,
        HAS_BIAS=bias is not None, XS=bool(cfg.get("XS", 0)) and M == 1, EVEN_K=K % (128 * nbk) == 0, num_warps=warps, **launch.pdl_options(pdl),
    )
    if not final:
        reduce_splits(part, scales, bias, y, False, 256, True, pdl)
    return y
