"""A warp-specialized M <= 16 ternary matmul in Gluon for Hopper (issue 6): a probe, not the library's.

Measured (session 52, H200, benchmarks/ternary_floor_probe.py ``wsk`` rows, CUDA-graph replay over code copies past
the L2): it matches the float64 product, and it is slower than the library kernel: 8192^2 M = 1 12.3 us at two
programs per SM (14.0-14.8 at one) against ``ternary.matmul``'s 10.3; 28672 x 8192 33.5 against 30.4. Its own TMA ring
with a consumer that only waits and releases (``ws`` rows, 4 KB boxes) already takes 9.5 us at 8192^2 (the plain
register stream of the same bytes 5.8, Triton's pipelined descriptor loads of 16 KB boxes 6.9): the approach was
stopped there (NOTES, session 52).

Session 51 found the library's M = 1 kernel (triforge/ops/ternary/tc.py) bound by a per-step chain that nothing
overlaps: the code words' load, their decode, the x tile staged in shared memory behind CTA barriers, one wgmma and a
wait for it (Triton waits for each wgmma right after issuing it, ``pendings = 0``). Its loads alone take 6.3-6.8 us at
8192^2 on the H200, its decode ~1 us, the tensor-core step ~2.6 us, and they add up (10.4 us; 5x cuBLAS asks 8.26).

Here each program keeps the library's tile (128 weight rows, the split-K grid and partials, the same codes and
decode) but splits the work across partitions that only meet at mbarriers:

- a loader warp: each K step's [8 row tiles, 128 words] box of the codes (seen as [row tiles, KC 16 words], the tc
  codes' tiled storage) and x's [16, 128] tile (rows past M zero-filled) into a ring of STAGES slots, by TMA;
- two consumer warpgroups, warpgroup J owning rows 64 J .. 64 J + 63: wait for a slot, read its 4 row tiles' words
  from shared memory straight into the decode's register layout, decode (the library's LOP3 + SUB per pair of
  weights, as ``tc._decode_asm``), issue the wgmma (A = the decoded weights in registers, B = x's tile in shared
  memory) asynchronously, decode the next step while it runs, issue that one, wait for both and release both slots.
  No CTA barrier: the partitions meet at mbarriers only.

The decoded tile's layout is written out (``L7`` below, as the library kernel's TTGIR has it) so that the words' load,
the decode's broadcast over the 8 fields of a word, the join of each pair's halves, a permute and a reshape land on
the wgmma's A-operand layout with no data movement (checked on the local sm90 build: no shared-memory round trip of
the weights, no PRMT).

The partials are summed by the library's reduce launch (``kernels.reduce_splits``). Compiled sm90 launches only
(Gluon has no interpreter): benchmarks/ternary_floor_probe.py times it (``wsk`` rows) and checks it against
``ternary.matmul`` and float64.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from triforge import _runtime
from triforge.ops.ternary import tc
from triforge.ops.ternary.kernels import gemv_splits, reduce_splits

BM = gl.constexpr(16)  # x rows per program (the wgmma's N)
ROWS = gl.constexpr(64)  # weight rows per consumer warpgroup
NWG = gl.constexpr(2)  # consumer warpgroups: 128 weight rows per program (8 row tiles of 16)


@gluon.jit
def _loader(w_desc, x_desc, w_s, x_s, ready, empty, tile0, m0, s0, n, STAGES: gl.constexpr):
    nbytes: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes
    for i in range(n):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), nbytes)
        tma.async_copy_global_to_shared(w_desc, [tile0, (s0 + i) * 128], ready.index(slot), w_s.index(slot))
        tma.async_copy_global_to_shared(x_desc, [m0, (s0 + i) * 128], ready.index(slot), x_s.index(slot))


@gluon.jit
def _lead5(x):
    """[4, 2] (kb2, h) constants -> [1, 1, 1, 1, 1, 4, 2]: five leading dims (their layouts nest SliceLayout(0, ..))."""
    return gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(x, 0), 0), 0), 0), 0)


@gluon.jit
def _decode(words, sh, mask, c, d, W5: gl.constexpr, a_l: gl.constexpr, IS_BF16: gl.constexpr):
    """[4 row tiles, 128 words] -> the [64, 128] 16-bit trits in the A operand's layout (tc.py's decode)."""
    w5 = gl.convert_layout(gl.permute(gl.reshape(words, [4, 2, 8, 4, 2]), (3, 2, 0, 1, 4)), W5)  # [t, rlo, w, b3, u]
    w7 = w5[:, :, :, :, :, None, None]
    src = gl.where(sh == 12, w7 >> 12, gl.where(sh == 6, w7 >> 6, w7))  # [t, rlo, w, b3, u, kb2, h]
    lo, hi = tc._decode_asm(src, mask, c, d, IS_BF16)
    w8 = gl.permute(gl.join(lo, hi), (2, 3, 1, 4, 5, 6, 0, 7))  # [w, b3, rlo, u, kb2, h, t, e]
    return gl.convert_layout(gl.reshape(w8, [64, 128]), a_l)


@gluon.jit
def _consumer(w_s, x_s, ready, empty, part_ptr, magic, row0, m0, M, N, i_s, n, J: gl.constexpr,
              STAGES: gl.constexpr, IS_BF16: gl.constexpr, WL: gl.constexpr, W5: gl.constexpr, KH: gl.constexpr,
              acc_l: gl.constexpr, a_l: gl.constexpr):
    # the decode's constants per field (kb2, h) (tc._decode_constants), broadcast over the words' dims
    f = (4 * gl.arange(0, 4, layout=gl.SliceLayout(1, KH))[:, None]
         + 2 * gl.arange(0, 2, layout=gl.SliceLayout(0, KH))[None, :])
    sh2, j2, mask2, c2, d2 = tc._field_constants(f, magic, IS_BF16)
    sh, mask, c, d = _lead5(sh2), _lead5(mask2), _lead5(c2), _lead5(d2)
    # two steps per trip, their decoded tiles in two register sets: the second step's decode runs while the first
    # step's product is on the tensor cores; the trip ends waiting for both products, so no register set is carried
    # across the back edge while a product still reads it (carrying one, for an overlap at every step, made ptxas
    # serialize every wgmma: C7512, insufficient registers at the 168 a three-warpgroup program allows)
    acc = gl.zeros([64, BM], gl.float32, acc_l)
    for k in range(0, n // 2):
        i = 2 * k
        slot0 = i % STAGES
        mbarrier.wait(ready.index(slot0), (i // STAGES) & 1)
        a0 = _decode(w_s.index(slot0).slice(4 * J, 4, dim=0).load(WL), sh, mask, c, d, W5, a_l, IS_BF16)
        tok = warpgroup_mma(a0, x_s.index(slot0).permute((1, 0)), acc, is_async=True)
        slot1 = (i + 1) % STAGES
        mbarrier.wait(ready.index(slot1), ((i + 1) // STAGES) & 1)
        a1 = _decode(w_s.index(slot1).slice(4 * J, 4, dim=0).load(WL), sh, mask, c, d, W5, a_l, IS_BF16)
        tok = warpgroup_mma(a1, x_s.index(slot1).permute((1, 0)), tok, is_async=True)
        acc, a0, a1 = warpgroup_mma_wait(0, deps=[tok, a0, a1])
        mbarrier.arrive(empty.index(slot0))
        mbarrier.arrive(empty.index(slot1))
    if n % 2 == 1:  # the split's last step
        i = n - 1
        slot0 = i % STAGES
        mbarrier.wait(ready.index(slot0), (i // STAGES) & 1)
        a0 = _decode(w_s.index(slot0).slice(4 * J, 4, dim=0).load(WL), sh, mask, c, d, W5, a_l, IS_BF16)
        tok = warpgroup_mma(a0, x_s.index(slot0).permute((1, 0)), acc, is_async=True)
        acc, a0 = warpgroup_mma_wait(0, deps=[tok, a0])
        mbarrier.arrive(empty.index(slot0))
    # acc [64 weight rows, BM x rows] is y^T: the split's fp32 partial
    o_n = row0 + 64 * J + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
    o_m = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_l))
    o_p = (i_s.to(gl.int64) * M + o_m[None, :]) * N + o_n[:, None]
    gl.store(part_ptr + o_p, acc, mask=(o_n < N)[:, None] & (o_m < M)[None, :])


@gluon.jit
def ternary_ws_kernel(w_desc, x_desc, part_ptr, magic, M, N, n_steps, per_split, STAGES: gl.constexpr,
                      IS_BF16: gl.constexpr, CONS_REGS: gl.constexpr, LOAD_REGS: gl.constexpr):
    # the decode's 7-d layout over [t 4, rlo 8, w 4, b3 2, u 2, kb2 4, h 2] (a word of row 16 w + 8 b3 + rlo holds the
    # 16 weights of fields (kb2, h) in its halves e): registers b3, h, kb2, u (after the join's e: the A operand's
    # register order), lanes t then rlo, warps w (the library kernel's TTGIR has it so)
    L7: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 2, 0],
                   [0, 0, 0, 0, 1, 0, 0]],
        lane_bases=[[1, 0, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0], [0, 2, 0, 0, 0, 0, 0],
                    [0, 4, 0, 0, 0, 0, 0]],
        warp_bases=[[0, 0, 1, 0, 0, 0, 0], [0, 0, 2, 0, 0, 0, 0]], block_bases=[], shape=[4, 8, 4, 2, 2, 4, 2])
    W5: gl.constexpr = gl.SliceLayout(5, gl.SliceLayout(6, L7))  # the words [t, rlo, w, b3, u]
    KH: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, L7)))))
    # a warpgroup's [4 row tiles, 128 words] of a slot (word 8 (8 b3 + rlo) + 2 t + u of row tile w), loaded so that the
    # reshape and permute to [t, rlo, w, b3, u] give W5
    WL: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 64], [0, 1]],
                                                  lane_bases=[[0, 2], [0, 4], [0, 8], [0, 16], [0, 32]],
                                                  warp_bases=[[1, 0], [2, 0]], block_bases=[], shape=[4, 128])
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    gl.static_assert(STAGES >= 2, "two steps per trip: a ring of two slots at least")
    i_n = gl.program_id(0)
    i_m = gl.program_id(1)
    i_s = gl.program_id(2)
    s0 = i_s * per_split
    n = gl.minimum(per_split, n_steps - s0)
    w_s = gl.allocate_shared_memory(gl.int32, [STAGES, 8, 128], w_desc.layout)
    x_s = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, 128], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=NWG)
    row0 = i_n * (NWG * ROWS)
    m0 = i_m * BM
    gl.warp_specialize([
        (_consumer, (w_s, x_s, ready, empty, part_ptr, magic, row0, m0, M, N, i_s, n, 0, STAGES, IS_BF16, WL, W5,
                     KH, acc_l, a_l)),
        (_consumer, (w_s, x_s, ready, empty, part_ptr, magic, row0, m0, M, N, i_s, n, 1, STAGES, IS_BF16, WL, W5,
                     KH, acc_l, a_l)),
        (_loader, (w_desc, x_desc, w_s, x_s, ready, empty, i_n * 8, m0, s0, n, STAGES)),
    ], [4, 1], [CONS_REGS, LOAD_REGS])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


# the words' slots unswizzled: each consumer warpgroup reads its 4 of the 8 row tiles (a swizzled [8, 128] int32 slot
# cannot be split by rows), 8 bytes per lane over 256 contiguous bytes per load (no bank conflict)
WORDS_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)

# 168 registers a thread (three warpgroups' worth of launch registers): one program per SM, so K is split to about one
# program per SM and the ring is deep. The consumers need ~104 registers (local sm90 builds: 96 made ptxas serialize
# the wgmma, C7512): {"maxnreg": 80, "CONS_REGS": 104} launches at 80 a thread (30 KB of registers a program) and
# moves the loader's share to the consumers, so two programs fit on an SM (programs_per_sm 2)
DEFAULT_CFG = {"STAGES": 8, "programs_per_sm": 1, "CONS_REGS": 152, "LOAD_REGS": 24}
TWO_PER_SM = {"maxnreg": 80, "CONS_REGS": 104, "programs_per_sm": 2}


def ternary_ws_matmul(x2d: torch.Tensor, tt, codes: torch.Tensor, cfg: dict | None = None, descs: dict | None = None):
    """x2d [M <= 16, K] fp16/bf16 (K % 8 == 0) @ (scales * trits)^T -> [M, N] in x's dtype, through the kernel above
    and the library's reduce launch (the same fp32 partials' sum in split order). ``codes``: ``tt.tc_codes()``
    (16-row tiles). ``descs``: a dict to cache the codes' descriptor in (keyed by its data pointer and shape)."""
    _runtime.require_gpu("ternary_ws_matmul")
    cfg = dict(DEFAULT_CFG, **(cfg or {}))
    M, K = x2d.shape
    N = tt.out_features
    kc = codes.shape[1]
    n_steps = kc // 8
    tiles = triton.cdiv(N, NWG.value * ROWS.value)
    splits = gemv_splits(tiles, n_steps, cfg["programs_per_sm"])
    per = triton.cdiv(n_steps, splits)
    splits = triton.cdiv(n_steps, per)
    gdt = gl.bfloat16 if x2d.dtype == torch.bfloat16 else gl.float16
    if K % 8 or codes.shape != (tc.code_rows(N), tc.code_words(K)) or not codes.is_contiguous():
        raise ValueError("ternary_ws_matmul needs K % 8 == 0 (x's rows 16-byte aligned for TMA) and contiguous tc codes "
                         f"in 16-row tiles of shape {(tc.code_rows(N), tc.code_words(K))}, got K={K}, {tuple(codes.shape)}")
    key = (codes.data_ptr(), tuple(codes.shape))
    w_desc = None if descs is None else descs.get(key)
    if w_desc is None:
        w_desc = TensorDescriptor.from_tensor(codes.view(-1, kc * tc.TILE_ROWS), [8, 128], WORDS_SMEM)
        if descs is not None:
            descs[key] = w_desc
    x_desc = TensorDescriptor.from_tensor(x2d, [BM.value, 128], gl.NVMMASharedLayout.get_default_for([BM.value, 128], gdt))
    part = torch.empty((splits, M, N), dtype=torch.float32, device=x2d.device)
    grid = (tiles, triton.cdiv(M, BM.value), splits)
    ternary_ws_kernel[grid](w_desc, x_desc, part, tc.MAGIC_BF16 if x2d.dtype == torch.bfloat16 else tc.MAGIC_F16, M,
                            N, n_steps, per, STAGES=cfg["STAGES"], IS_BF16=x2d.dtype == torch.bfloat16,
                            CONS_REGS=cfg["CONS_REGS"], LOAD_REGS=cfg["LOAD_REGS"], num_warps=4,
                            **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}))
    y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    reduce_splits(part, tt.kernel_operands()[0], None, y, False, 256, True, False)
    return y
