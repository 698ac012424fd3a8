"""Attention forward for Hopper (sm90), warp-specialized in Gluon: FlashAttention-3's structure.

Used by ``attn_fwd`` where the sm90 config says ``GLUON`` (16-bit q/k/v contiguous as [B, S, H, D] or packed
[T, H, D] sequences, head_dim 64 or 128, compiled on sm90); the Triton kernel (forward.py) serves every other case and
the interpreter.
Gluon (triton.experimental.gluon) states layouts, shared memory, mbarriers and the warp partition explicitly; it has
no interpreter, so this file is imported only on that path.

One program = one (batch, head, 64 NUM_WG query rows) tile, heaviest tiles first under causal masking (PERSIST:
flash_attn_fwd_ws_persist_kernel, one program per SM walking the tiles, each as below); partitions:
- a loader warp: a tile's NUM_WG 64-row Q blocks, then K and V tiles of BN keys by TMA into a ring of STAGES slots
  (``k_ready`` / ``v_ready`` mbarriers with the byte count; a slot is refilled once every consumer released it on
  ``kv_empty``);
- NUM_WG (2, or 3: FlashAttention-3's 192-row tiles at head dim 64) consumer warpgroups, 64 query rows each: S = Q K^T
  by wgmma from shared memory, the online softmax in registers (log2 domain), P converted in registers into the A
  operand of O += P V (V from shared memory). S_j and P_{j-1} V_{j-1} are issued together and the softmax of S_j runs
  while the PV product is on the tensor cores (FA3's intra-warpgroup overlap). The warpgroups interleave on their own,
  or with SCHED take turns issuing their products (FA3's scheduler barrier), so one's softmax runs while another's
  products hold the tensor cores.

Masks: the descriptors view q/k/v as [B S, H D] (packed: [T, H D]) matrices, one row per token, so a tile that crosses
the end of a sequence reads the next sequence's rows (or TMA's zero fill past the tensor): their scores are set to
-inf (keys >= S_k; causal: key j > query i + S_k - S_q, bottom-right aligned, per sequence) and query rows >= S_q are
not stored.
A row that sees no key gets o = 0 and lse = -inf (the max is taken as 0 there: no -inf - -inf).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from triforge import _runtime, launch
from triforge.ops._tl import EXP2_ASM, EXP2_CONSTRAINTS, EXP2_PACK
from triforge.ops.attention.forward import LN2, LOG2E


@gluon.jit
def _exp2(x, EMU: gl.constexpr):
    """2^x with EMU (1-8) of every 8 exponentials on the FMA pipes (triforge.ops._tl.exp2_emu: the same PTX)."""
    gl.static_assert(0 < EMU and EMU <= 8, "EMU is 0-8 of every 8")
    return gl.inline_asm_elementwise(EXP2_ASM[EMU], EXP2_CONSTRAINTS, [x], gl.float32, True, EXP2_PACK)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, k_ready, v_ready, kv_empty, q_row, kv_row, q_col, kv_col,
            n_kv, BMW: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, NUM_WG: gl.constexpr):
    mbarrier.expect(q_bar, NUM_WG * q_desc.block_type.nbytes)
    for w in gl.static_range(NUM_WG):
        tma.async_copy_global_to_shared(q_desc, [q_row + w * BMW, q_col], q_bar, q_s.index(w))
    for j in range(n_kv):
        s = j % STAGES
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)  # every consumer freed slot s (first pass: free)
        row = kv_row + j * BN
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(s), k_s.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_ready.index(s), v_s.index(s))


@gluon.jit
def _softmax(s, m_i, l_i, j, rows, S_k, diag, qk_scale, BN: gl.constexpr, CAUSAL: gl.constexpr, MASK: gl.constexpr,
             s_l: gl.constexpr, EMU: gl.constexpr):
    """One key tile of the online softmax: (p, alpha, m, l). MASK: keys >= S_k (causal: key > row + diag) score -inf,
    and a row that has seen no key yet takes 0 as its max (no -inf - -inf). Without MASK every key of the tile is
    visible to every row, so the new max is finite (and EMU of every 8 exponentials may go to the FMA pipes)."""
    if MASK:
        cols = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
        valid = (cols < S_k)[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= (rows + diag)[:, None])
        s = gl.where(valid, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    if MASK:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    if MASK or EMU == 0:
        p = gl.exp2(s * qk_scale - m_use[:, None])
    else:
        p = _exp2(s * qk_scale - m_use[:, None], EMU)
    alpha = gl.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _turn(q, k_ready, sched, p, it, sc, STAGES: gl.constexpr, p_l: gl.constexpr, P16: gl.constexpr, WG: gl.constexpr,
          SCHED: gl.constexpr):
    """The start of a key step at ring position it (this warpgroup's turn sc): (slot of this tile, slot of the tile
    before, the previous P as the 16-bit operand), once this tile's K has landed and, with SCHED, the turn has come."""
    st = (it % STAGES).to(gl.int32)
    sp = ((it - 1) % STAGES).to(gl.int32)
    if P16:
        pa = p
    else:
        pa = gl.convert_layout(p.to(q.dtype), p_l)
    mbarrier.wait(k_ready.index(st), ((it // STAGES) & 1).to(gl.int32))
    if SCHED:
        if WG == 0:
            mbarrier.wait(sched.index(WG), ((sc & 1) ^ 1).to(gl.int32))
        else:
            mbarrier.wait(sched.index(WG), (sc & 1).to(gl.int32))
    return st, sp, pa


@gluon.jit
def _step(q, k_s, v_s, k_ready, v_ready, kv_empty, sched, acc, p, m_i, l_i, j, it, sc, rows, S_k, diag, qk_scale,
          BMW: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASK: gl.constexpr,
          s_l: gl.constexpr, o_l: gl.constexpr, p_l: gl.constexpr, EMU: gl.constexpr, P16: gl.constexpr,
          WG: gl.constexpr, NUM_WG: gl.constexpr, SCHED: gl.constexpr):
    """Key tile j >= 1: S_j = Q K_j^T and O += P_{j-1} V_{j-1} issued together; the softmax of S_j runs while the PV
    product is on the tensor cores; then O is rescaled. P crosses iterations in fp32 and becomes the 16-bit A operand
    inside the iteration that reads it (a 16-bit P carried between the two key loops cost ptxas 32-64 PRMTs per tile
    to re-pack its halves); with P16 it crosses as that 16-bit operand, converted once the PV product that read the
    previous one is done (half the registers: three warpgroups' 160 registers hold a 128-key tile only so).
    SCHED: the warpgroups issue their two products in turn (FlashAttention-3's scheduler barrier: warpgroup WG waits
    for its turn on sched[WG] and passes it on to the next), so one warpgroup's softmax runs while another's products
    hold the tensor cores; warpgroup 0's first wait passes at once (the parity of the phase before the first)."""
    # it: the ring position of key tile j (sc: this warpgroup's turns so far)
    st, sp, pa = _turn(q, k_ready, sched, p, it, sc, STAGES, p_l, P16, WG, SCHED)
    s_j = warpgroup_mma(q, k_s.index(st).permute((1, 0)), gl.zeros([BMW, BN], gl.float32, s_l), use_acc=False,
                        is_async=True)
    mbarrier.wait(v_ready.index(sp), (((it - 1) // STAGES) & 1).to(gl.int32))
    acc = warpgroup_mma(pa, v_s.index(sp), acc, is_async=True)
    if SCHED:
        mbarrier.arrive(sched.index((WG + 1) % NUM_WG))
    s_j = warpgroup_mma_wait(1, deps=[s_j])  # S_j done; the PV product may still run
    p, alpha, m_i, l_i = _softmax(s_j, m_i, l_i, j, rows, S_k, diag, qk_scale, BN, CAUSAL, MASK, s_l, EMU)
    acc, pa = warpgroup_mma_wait(0, deps=[acc, pa])
    mbarrier.arrive(kv_empty.index(sp))  # K_{j-1} and V_{j-1} read
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
    if P16:
        p = gl.convert_layout(p.to(q.dtype), p_l)
    return acc, p, m_i, l_i


@gluon.jit
def _pipeline(q, k_s, v_s, k_ready, v_ready, kv_empty, sched, acc, m_i, l_i, n_kv, n_full, it0, sc0, rows, S_k, diag,
              qk_scale,
              BMW: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, s_l: gl.constexpr,
              o_l: gl.constexpr, p_l: gl.constexpr, EMU: gl.constexpr, P16: gl.constexpr, WG: gl.constexpr,
              NUM_WG: gl.constexpr, SCHED: gl.constexpr):
    """One warpgroup's key loop over n_kv >= 1 tiles, the first at ring position it0 (sc0: scheduler turns taken
    before): (acc, m, l)."""
    acc, p, m_i, l_i = _open(q, k_s, v_s, k_ready, v_ready, kv_empty, sched, acc, m_i, l_i, n_kv, n_full, it0, sc0,
                             rows, S_k, diag, qk_scale, BMW, BN, STAGES, CAUSAL, s_l, o_l, p_l, EMU, P16, WG, NUM_WG,
                             SCHED)
    return _last_pv(q, v_s, v_ready, kv_empty, acc, p, it0 + n_kv - 1, STAGES, p_l, P16), m_i, l_i


@gluon.jit
def _open(q, k_s, v_s, k_ready, v_ready, kv_empty, sched, acc, m_i, l_i, n_kv, n_full, it0, sc0, rows, S_k, diag,
          qk_scale, BMW: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, s_l: gl.constexpr,
          o_l: gl.constexpr, p_l: gl.constexpr, EMU: gl.constexpr, P16: gl.constexpr, WG: gl.constexpr,
          NUM_WG: gl.constexpr, SCHED: gl.constexpr):
    """_pipeline without its last P V: the first tile's S product and softmax, then _keys; (acc, p, m, l)."""
    s_first = (it0 % STAGES).to(gl.int32)
    mbarrier.wait(k_ready.index(s_first), ((it0 // STAGES) & 1).to(gl.int32))
    s0 = warpgroup_mma(q, k_s.index(s_first).permute((1, 0)), gl.zeros([BMW, BN], gl.float32, s_l), use_acc=False,
                       is_async=True)
    s0 = warpgroup_mma_wait(0, deps=[s0])
    # the first tile takes the masked path whether or not it needs it (once per work item: no branch)
    p, alpha, m_i, l_i = _softmax(s0, m_i, l_i, 0, rows, S_k, diag, qk_scale, BN, CAUSAL, True, s_l, 0)
    if P16:
        p = gl.convert_layout(p.to(q.dtype), p_l)
    return _keys(q, k_s, v_s, k_ready, v_ready, kv_empty, sched, acc, p, m_i, l_i, n_kv, n_full, it0, sc0, rows, S_k,
                 diag, qk_scale, BMW, BN, STAGES, CAUSAL, s_l, o_l, p_l, EMU, P16, WG, NUM_WG, SCHED)


@gluon.jit
def _keys(q, k_s, v_s, k_ready, v_ready, kv_empty, sched, acc, p, m_i, l_i, n_kv, n_full, it0, sc0, rows, S_k, diag,
          qk_scale, BMW: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, s_l: gl.constexpr,
          o_l: gl.constexpr, p_l: gl.constexpr, EMU: gl.constexpr, P16: gl.constexpr, WG: gl.constexpr,
          NUM_WG: gl.constexpr, SCHED: gl.constexpr):
    """Key tiles 1 .. n_kv - 1 (tile 0's P given): the tiles every row sees whole, then the masked ones (the causal
    diagonal, keys past S_k); (acc, p, m, l) with the last tile's P V still to add."""
    for j in range(1, n_full):
        acc, p, m_i, l_i = _step(q, k_s, v_s, k_ready, v_ready, kv_empty, sched, acc, p, m_i, l_i, j, it0 + j,
                                 sc0 + j - 1, rows, S_k,
                                 diag, qk_scale, BMW, BN, STAGES, CAUSAL, False, s_l, o_l, p_l, EMU, P16, WG, NUM_WG,
                                 SCHED)
    for j in range(gl.maximum(n_full, 1), n_kv):
        acc, p, m_i, l_i = _step(q, k_s, v_s, k_ready, v_ready, kv_empty, sched, acc, p, m_i, l_i, j, it0 + j,
                                 sc0 + j - 1, rows, S_k,
                                 diag, qk_scale, BMW, BN, STAGES, CAUSAL, True, s_l, o_l, p_l, 0, P16, WG, NUM_WG,
                                 SCHED)
    return acc, p, m_i, l_i


@gluon.jit
def _last_pv(q, v_s, v_ready, kv_empty, acc, p, it, STAGES: gl.constexpr, p_l: gl.constexpr, P16: gl.constexpr):
    """acc + P V for the key tile at ring position it (the last of a work item), its slot then released."""
    sl = (it % STAGES).to(gl.int32)
    if P16:
        pa = p
    else:
        pa = gl.convert_layout(p.to(q.dtype), p_l)
    mbarrier.wait(v_ready.index(sl), ((it // STAGES) & 1).to(gl.int32))
    acc = warpgroup_mma(pa, v_s.index(sl), acc, is_async=True)
    acc, pa = warpgroup_mma_wait(0, deps=[acc, pa])
    mbarrier.arrive(kv_empty.index(sl))
    return acc


@gluon.jit
def _consumer(q_s, k_s, v_s, q_bar, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr, WG: gl.constexpr,
              q_tok0, m0,
              o_col, lse_base, n_kv, n_full, S_q, S_k, qk_scale, stride_o, BMW: gl.constexpr, BN: gl.constexpr,
              D: gl.constexpr, STAGES: gl.constexpr, GUARD: gl.constexpr, CAUSAL: gl.constexpr,
              STORE_RES: gl.constexpr, EMU: gl.constexpr, P16: gl.constexpr, NUM_WG: gl.constexpr,
              SCHED: gl.constexpr):
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    dtype: gl.constexpr = q_s.dtype
    q = q_s.index(WG)
    rows = m0 + WG * BMW + gl.arange(0, BMW, layout=gl.SliceLayout(1, s_l))  # query positions in the sequence
    diag = S_k - S_q
    m_i = gl.full([BMW], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
    l_i = gl.zeros([BMW], gl.float32, gl.SliceLayout(1, s_l))
    acc = gl.zeros([BMW, D], gl.float32, o_l)
    mbarrier.wait(q_bar, 0)
    zero = gl.to_tensor(0)  # one work item per program: its first key tile at ring position 0, no scheduler turns yet
    if GUARD:  # causal or packed: a tile may see no key at all
        if n_kv > 0:
            acc, m_i, l_i = _pipeline(q, k_s, v_s, k_ready, v_ready, kv_empty, sched, acc, m_i, l_i, n_kv, n_full,
                                      zero, zero, rows, S_k, diag, qk_scale, BMW, BN, STAGES, CAUSAL, s_l, o_l, p_l,
                                      EMU, P16, WG, NUM_WG, SCHED)
    else:  # dense, S_k >= 1: every tile has keys
        acc, m_i, l_i = _pipeline(q, k_s, v_s, k_ready, v_ready, kv_empty, sched, acc, m_i, l_i, n_kv, n_full,
                                  zero, zero, rows, S_k, diag, qk_scale, BMW, BN, STAGES, CAUSAL, s_l, o_l, p_l, EMU,
                                  P16, WG, NUM_WG, SCHED)
    _epilogue(acc, m_i, l_i, o_ptr, res_ptr, lse_ptr, WG, m0, q_tok0, o_col, lse_base, S_q, stride_o, BMW, D,
              STORE_RES, s_l, o_l)


@gluon.jit
def _epilogue(acc, m_i, l_i, o_ptr, res_ptr, lse_ptr, WG: gl.constexpr, m0, q_tok0, o_col, lse_base, len_q, stride_o,
              BMW: gl.constexpr, D: gl.constexpr, STORE_RES: gl.constexpr, s_l: gl.constexpr, o_l: gl.constexpr):
    """o = acc / l (rows with no key: acc = 0, o = 0), its rounding residual, lse = m + log2(l) (-inf where no key)
    for warpgroup WG's 64 rows of the query tile at row m0; rows >= len_q are not stored."""
    rows = m0 + WG * BMW + gl.arange(0, BMW, layout=gl.SliceLayout(1, s_l))
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    l_o = gl.convert_layout(l_safe, gl.SliceLayout(1, o_l))
    o = acc / l_o[:, None]
    r_o = m0 + WG * BMW + gl.arange(0, BMW, layout=gl.SliceLayout(1, o_l))
    c_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_l))
    off = (q_tok0 + r_o).to(gl.int64)[:, None] * stride_o + o_col + c_o[None, :]
    m_o = (r_o < len_q)[:, None]
    o16 = o.to(o_ptr.dtype.element_ty)
    gl.store(o_ptr + off, o16, mask=m_o)
    if STORE_RES:  # o's rounding error, for the backward's delta
        gl.store(res_ptr + off, (o - o16.to(gl.float32)).to(o_ptr.dtype.element_ty), mask=m_o)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
    gl.store(lse_ptr + lse_base + rows, lse, mask=rows < len_q)


@gluon.jit
def _tile_bounds(pid_m, bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr,
                 VARLEN: gl.constexpr):
    """Query tile pid_m of batch-head bh: (m0, h, q_tok0, k_tok0, len_q, len_k, lse_base, n_kv, n_full): its first row,
    head, token offsets, lengths, lse offset, key tiles, and key tiles every row sees whole."""
    b = bh // H
    h = bh % H
    m0 = pid_m * BM
    if VARLEN:  # sequence b: rows cu_q[b] .. cu_q[b + 1] - 1 of the packed q (S_q: all of them), cu_k for k / v
        q_tok0 = gl.load(cu_q_ptr + b)
        k_tok0 = gl.load(cu_k_ptr + b)
        len_q = gl.load(cu_q_ptr + b + 1) - q_tok0
        len_k = gl.load(cu_k_ptr + b + 1) - k_tok0
        lse_base = h.to(gl.int64) * S_q + q_tok0  # lse [1, H, S_q]
    else:
        q_tok0 = b * S_q  # token rows of the [B S, H D] views
        k_tok0 = b * S_k
        len_q = S_q
        len_k = S_k
        lse_base = bh.to(gl.int64) * S_q
    n_all = gl.cdiv(len_k, BN)
    if CAUSAL:
        # keys 0 .. last row + len_k - len_q are visible to some row of the tile; tiles past the first row's last key
        # (or holding keys >= len_k) need the mask
        n_kv = gl.minimum(n_all, gl.maximum(gl.cdiv(gl.minimum(m0 + BM, len_q) + len_k - len_q, BN), 0))
        n_full = gl.minimum(len_k // BN, gl.maximum((m0 + len_k - len_q + 1) // BN, 0))
    else:
        n_kv = n_all
        n_full = len_k // BN
    if VARLEN:  # the grid spans the longest sequence: a tile past this one's end loads nothing and stores nothing
        n_kv = gl.where(m0 < len_q, n_kv, 0)
    return m0, h, q_tok0, k_tok0, len_q, len_k, lse_base, n_kv, n_full


@gluon.jit
def flash_attn_fwd_ws_kernel(q_desc, k_desc, v_desc, o_ptr, res_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, S_q, S_k, H, GROUP,
                             qk_scale, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                             CAUSAL: gl.constexpr, STORE_RES: gl.constexpr, VARLEN: gl.constexpr,
                             CONS_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, EMU: gl.constexpr = 0,
                             NUM_WG: gl.constexpr = 2, P16: gl.constexpr = False, SCHED: gl.constexpr = False):
    gl.static_assert(NUM_WG == 2 or NUM_WG == 3, "two or three consumer warpgroups")
    BMW: gl.constexpr = BM // NUM_WG
    if CAUSAL:  # the longest rows first
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    else:
        pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    m0, h, q_tok0, k_tok0, len_q, len_k, lse_base, n_kv, n_full = _tile_bounds(pid_m, bh, H, S_q, S_k, cu_q_ptr,
                                                                              cu_k_ptr, BM, BN, CAUSAL, VARLEN)
    q_s = gl.allocate_shared_memory(q_desc.dtype, [NUM_WG, BMW, D], q_desc.layout)
    k_s = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
    v_s = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sched = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for w in gl.static_range(NUM_WG):
        mbarrier.init(sched.index(w), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=NUM_WG)
    stride_o = H * D
    GUARD: gl.constexpr = CAUSAL or VARLEN
    if NUM_WG == 2:
        gl.warp_specialize([
            (_consumer, (q_s, k_s, v_s, q_bar, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr, 0, q_tok0,
                         m0, h * D, lse_base, n_kv, n_full, len_q, len_k, qk_scale, stride_o, BMW, BN, D, STAGES, GUARD,
                         CAUSAL, STORE_RES, EMU, P16, NUM_WG, SCHED)),
            (_consumer, (q_s, k_s, v_s, q_bar, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr, 1, q_tok0,
                         m0, h * D, lse_base, n_kv, n_full, len_q, len_k, qk_scale, stride_o, BMW, BN, D, STAGES, GUARD,
                         CAUSAL, STORE_RES, EMU, P16, NUM_WG, SCHED)),
            (_loader, (q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, k_ready, v_ready, kv_empty, q_tok0 + m0, k_tok0,
                       h * D, (h // GROUP) * D, n_kv, BMW, BN, STAGES, NUM_WG)),
        ], [4, 1], [CONS_REGS, LOADER_REGS])
    else:  # three consumer warpgroups (FlashAttention-3's 192-row tiles at head_dim 64)
        gl.warp_specialize([
            (_consumer, (q_s, k_s, v_s, q_bar, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr, 0, q_tok0,
                         m0, h * D, lse_base, n_kv, n_full, len_q, len_k, qk_scale, stride_o, BMW, BN, D, STAGES, GUARD,
                         CAUSAL, STORE_RES, EMU, P16, NUM_WG, SCHED)),
            (_consumer, (q_s, k_s, v_s, q_bar, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr, 1, q_tok0,
                         m0, h * D, lse_base, n_kv, n_full, len_q, len_k, qk_scale, stride_o, BMW, BN, D, STAGES, GUARD,
                         CAUSAL, STORE_RES, EMU, P16, NUM_WG, SCHED)),
            (_consumer, (q_s, k_s, v_s, q_bar, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr, 2, q_tok0,
                         m0, h * D, lse_base, n_kv, n_full, len_q, len_k, qk_scale, stride_o, BMW, BN, D, STAGES, GUARD,
                         CAUSAL, STORE_RES, EMU, P16, NUM_WG, SCHED)),
            (_loader, (q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, k_ready, v_ready, kv_empty, q_tok0 + m0, k_tok0,
                       h * D, (h // GROUP) * D, n_kv, BMW, BN, STAGES, NUM_WG)),
        ], [4, 4, 1], [CONS_REGS, CONS_REGS, LOADER_REGS])
    mbarrier.invalidate(q_bar)
    for w in gl.static_range(NUM_WG):
        mbarrier.invalidate(sched.index(w))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(s))
        mbarrier.invalidate(v_ready.index(s))
        mbarrier.invalidate(kv_empty.index(s))


@gluon.jit
def _item(t, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr,
          VARLEN: gl.constexpr):
    """Work item t of the persistent kernel's n_m x n_bh query tiles, as _tile_bounds returns it: t = pid_m + n_m bh,
    or under causal masking every head's longest rows before any shorter ones (t = bh + n_bh (n_m - 1 - pid_m)), so
    the programs, taking items in turn, meet the short tiles last."""
    if CAUSAL:
        pid_m = n_m - 1 - t // n_bh
        bh = t % n_bh
    else:
        pid_m = t % n_m
        bh = t // n_m
    return _tile_bounds(pid_m, bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, BM, BN, CAUSAL, VARLEN)


@gluon.jit
def _loader_persist(q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, n_m, n_bh, H,
                    GROUP, S_q, S_k, cu_q_ptr, cu_k_ptr, D: gl.constexpr, BM: gl.constexpr, BMW: gl.constexpr,
                    BN: gl.constexpr, STAGES: gl.constexpr, NUM_WG: gl.constexpr, CAUSAL: gl.constexpr,
                    VARLEN: gl.constexpr):
    """The persistent loader: for each work item Q into one of two buffers (once the consumers released it), then its
    K/V tiles through the ring, whose position runs on across items."""
    it = 0  # K/V tiles loaded so far (the ring's position)
    i = 0  # work items so far (Q's buffer and phase)
    for t in range(gl.program_id(0), n_m * n_bh, gl.num_programs(0)):
        m0, h, q_tok0, k_tok0, len_q, len_k, lse_base, n_kv, n_full = _item(t, n_m, n_bh, H, S_q, S_k, cu_q_ptr,
                                                                            cu_k_ptr, BM, BN, CAUSAL, VARLEN)
        qb = i % 2
        mbarrier.wait(q_empty.index(qb), ((i // 2) & 1) ^ 1)  # every consumer done with this buffer's last Q
        mbarrier.expect(q_bar.index(qb), NUM_WG * q_desc.block_type.nbytes)
        for w in gl.static_range(NUM_WG):
            tma.async_copy_global_to_shared(q_desc, [q_tok0 + m0 + w * BMW, h * D], q_bar.index(qb),
                                            q_s.index(qb * NUM_WG + w))
        kv_col = (h // GROUP) * D
        for j in range(n_kv):
            s = it % STAGES
            mbarrier.wait(kv_empty.index(s), ((it // STAGES) & 1) ^ 1)  # every consumer freed slot s (first pass: free)
            row = k_tok0 + j * BN
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(s), k_s.index(s))
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_ready.index(s), v_s.index(s))
            it += 1
        i += 1


@gluon.jit
def _consumer_persist(q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr,
                      WG: gl.constexpr, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, qk_scale, BM: gl.constexpr,
                      BMW: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, GUARD: gl.constexpr,
                      CAUSAL: gl.constexpr, VARLEN: gl.constexpr, STORE_RES: gl.constexpr, EMU: gl.constexpr,
                      P16: gl.constexpr, NUM_WG: gl.constexpr, SCHED: gl.constexpr, XITEM: gl.constexpr):
    """A persistent consumer warpgroup: the work items in turn, each as _consumer runs its one; the epilogue's tile
    values are computed again after the key loop rather than held in registers across it. XITEM: _walk_overlapped."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    if XITEM:
        _walk_overlapped(q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr, WG,
                         n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, qk_scale, BM, BMW, BN, D, STAGES, GUARD, CAUSAL,
                         VARLEN, STORE_RES, EMU, P16, NUM_WG, SCHED, XITEM, s_l, o_l, p_l)
    else:
        _walk(q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr, WG, n_m, n_bh,
              H, S_q, S_k, cu_q_ptr, cu_k_ptr, qk_scale, BM, BMW, BN, D, STAGES, GUARD, CAUSAL, VARLEN, STORE_RES, EMU,
              P16, NUM_WG, SCHED, s_l, o_l, p_l)


@gluon.jit
def _walk(q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr, WG: gl.constexpr,
          n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, qk_scale, BM: gl.constexpr, BMW: gl.constexpr, BN: gl.constexpr,
          D: gl.constexpr, STAGES: gl.constexpr, GUARD: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr,
          STORE_RES: gl.constexpr, EMU: gl.constexpr, P16: gl.constexpr, NUM_WG: gl.constexpr, SCHED: gl.constexpr,
          s_l: gl.constexpr, o_l: gl.constexpr, p_l: gl.constexpr):
    """The work items one after another, each with its own key loop (_pipeline) and epilogue."""
    stride_o = H * D
    # the ring position of this item's first key tile and the scheduler turns taken so far: unsigned, so that the
    # ring's slot and phase are a mask and a shift (int32: signed-division fix-ups in the key loop)
    it0 = gl.to_tensor(0).to(gl.uint32)
    sc0 = gl.to_tensor(0).to(gl.uint32)
    i = 0
    for t in range(gl.program_id(0), n_m * n_bh, gl.num_programs(0)):
        m0, h, q_tok0, k_tok0, len_q, len_k, lse_base, n_kv, n_full = _item(t, n_m, n_bh, H, S_q, S_k, cu_q_ptr,
                                                                            cu_k_ptr, BM, BN, CAUSAL, VARLEN)
        qb = i % 2
        q = q_s.index(qb * NUM_WG + WG)
        rows = m0 + WG * BMW + gl.arange(0, BMW, layout=gl.SliceLayout(1, s_l))  # query positions in the sequence
        m_i = gl.full([BMW], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
        l_i = gl.zeros([BMW], gl.float32, gl.SliceLayout(1, s_l))
        acc = gl.zeros([BMW, D], gl.float32, o_l)
        mbarrier.wait(q_bar.index(qb), (i // 2) & 1)
        if GUARD:  # causal or packed: a tile may see no key at all
            if n_kv > 0:
                acc, m_i, l_i = _pipeline(q, k_s, v_s, k_ready, v_ready, kv_empty, sched, acc, m_i, l_i, n_kv, n_full,
                                          it0, sc0, rows, len_k, len_k - len_q, qk_scale, BMW, BN, STAGES, CAUSAL,
                                          s_l, o_l, p_l, EMU, P16, WG, NUM_WG, SCHED)
        else:  # dense, S_k >= 1: every tile has keys
            acc, m_i, l_i = _pipeline(q, k_s, v_s, k_ready, v_ready, kv_empty, sched, acc, m_i, l_i, n_kv, n_full,
                                      it0, sc0, rows, len_k, len_k - len_q, qk_scale, BMW, BN, STAGES, CAUSAL, s_l,
                                      o_l, p_l, EMU, P16, WG, NUM_WG, SCHED)
        mbarrier.arrive(q_empty.index(qb))  # this Q read: the loader may refill its buffer
        m0, h, q_tok0, k_tok0, len_q, len_k, lse_base, n_kv, n_full = _item(t, n_m, n_bh, H, S_q, S_k, cu_q_ptr,
                                                                            cu_k_ptr, BM, BN, CAUSAL, VARLEN)
        _epilogue(acc, m_i, l_i, o_ptr, res_ptr, lse_ptr, WG, m0, q_tok0, h * D, lse_base, len_q, stride_o, BMW, D,
                  STORE_RES, s_l, o_l)
        it0 += n_kv.to(gl.uint32)
        sc0 += gl.maximum(n_kv - 1, 0).to(gl.uint32)
        i += 1


@gluon.jit
def _walk_overlapped(q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr, lse_ptr,
                     WG: gl.constexpr, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, qk_scale, BM: gl.constexpr,
                     BMW: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, GUARD: gl.constexpr,
                     CAUSAL: gl.constexpr, VARLEN: gl.constexpr, STORE_RES: gl.constexpr, EMU: gl.constexpr,
                     P16: gl.constexpr, NUM_WG: gl.constexpr, SCHED: gl.constexpr, XITEM: gl.constexpr,
                     s_l: gl.constexpr, o_l: gl.constexpr, p_l: gl.constexpr):
    """The work items as one stream of key tiles: an item's first S = Q K^T is issued together with the previous
    item's last P V (a step like the key loop's, a scheduler turn with SCHED), the new item's first softmax runs while
    that product is on the tensor cores, and the previous item's output is stored after it (XITEM 1; XITEM 2 issues
    the P V first and stores the output under the S product). Every item needs a key tile: dense inputs, under causal
    masking only with S_q <= S_k (attn_fwd_ws takes the one-by-one walk otherwise)."""
    gl.static_assert(not VARLEN, "every work item needs a key tile")
    stride_o = H * D
    pid = gl.program_id(0)
    n_prog = gl.num_programs(0)
    m0, h, q_tok0, k_tok0, len_q, len_k, lse_base, n_kv, n_full = _item(pid, n_m, n_bh, H, S_q, S_k, cu_q_ptr,
                                                                        cu_k_ptr, BM, BN, CAUSAL, VARLEN)
    q0 = q_s.index(WG)
    rows0 = m0 + WG * BMW + gl.arange(0, BMW, layout=gl.SliceLayout(1, s_l))
    m_i = gl.full([BMW], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
    l_i = gl.zeros([BMW], gl.float32, gl.SliceLayout(1, s_l))
    acc = gl.zeros([BMW, D], gl.float32, o_l)
    it0 = gl.to_tensor(0).to(gl.uint32)  # the ring position of the item's first key tile
    sc0 = gl.to_tensor(0).to(gl.uint32)  # scheduler turns taken
    mbarrier.wait(q_bar.index(0), 0)
    acc, p, m_i, l_i = _open(q0, k_s, v_s, k_ready, v_ready, kv_empty, sched, acc, m_i, l_i, n_kv, n_full, it0, sc0,
                             rows0, len_k, len_k - len_q, qk_scale, BMW, BN, STAGES, CAUSAL, s_l, o_l, p_l, EMU, P16,
                             WG, NUM_WG, SCHED)
    it0 += n_kv.to(gl.uint32)
    sc0 += (n_kv - 1).to(gl.uint32)
    i = 1
    for t in range(pid + n_prog, n_m * n_bh, n_prog):
        mbarrier.arrive(q_empty.index((i - 1) % 2))  # the previous item's last S is done: its Q buffer may refill
        m0, h, q_tok0, k_tok0, len_q, len_k, lse_base, n_kv, n_full = _item(t, n_m, n_bh, H, S_q, S_k, cu_q_ptr,
                                                                            cu_k_ptr, BM, BN, CAUSAL, VARLEN)
        qb = i % 2
        q = q_s.index(qb * NUM_WG + WG)
        rows = m0 + WG * BMW + gl.arange(0, BMW, layout=gl.SliceLayout(1, s_l))
        mbarrier.wait(q_bar.index(qb), (i // 2) & 1)
        st, sp, pa = _turn(q, k_ready, sched, p, it0, sc0, STAGES, p_l, P16, WG, SCHED)
        m_n = gl.full([BMW], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
        l_n = gl.zeros([BMW], gl.float32, gl.SliceLayout(1, s_l))
        if XITEM == 1:  # S first: the new item's softmax under the P V product, then the previous item's output
            s0 = warpgroup_mma(q, k_s.index(st).permute((1, 0)), gl.zeros([BMW, BN], gl.float32, s_l),
                               use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(sp), (((it0 - 1) // STAGES) & 1).to(gl.int32))
            acc = warpgroup_mma(pa, v_s.index(sp), acc, is_async=True)
            if SCHED:
                mbarrier.arrive(sched.index((WG + 1) % NUM_WG))
            s0 = warpgroup_mma_wait(1, deps=[s0])
            p, alpha, m_n, l_n = _softmax(s0, m_n, l_n, 0, rows, len_k, len_k - len_q, qk_scale, BN, CAUSAL, True, s_l,
                                          0)
            acc, pa = warpgroup_mma_wait(0, deps=[acc, pa])
            mbarrier.arrive(kv_empty.index(sp))
            pm0, ph, pq_tok0, pk_tok0, plen_q, plen_k, plse_base, pn_kv, pn_full = _item(
                t - n_prog, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, BM, BN, CAUSAL, VARLEN)
            _epilogue(acc, m_i, l_i, o_ptr, res_ptr, lse_ptr, WG, pm0, pq_tok0, ph * D, plse_base, plen_q, stride_o,
                      BMW, D, STORE_RES, s_l, o_l)
        else:  # P V first: the previous item's output under the S product (fewer registers live at once)
            mbarrier.wait(v_ready.index(sp), (((it0 - 1) // STAGES) & 1).to(gl.int32))
            acc = warpgroup_mma(pa, v_s.index(sp), acc, is_async=True)
            s0 = warpgroup_mma(q, k_s.index(st).permute((1, 0)), gl.zeros([BMW, BN], gl.float32, s_l),
                               use_acc=False, is_async=True)
            if SCHED:
                mbarrier.arrive(sched.index((WG + 1) % NUM_WG))
            acc, pa = warpgroup_mma_wait(1, deps=[acc, pa])
            mbarrier.arrive(kv_empty.index(sp))
            pm0, ph, pq_tok0, pk_tok0, plen_q, plen_k, plse_base, pn_kv, pn_full = _item(
                t - n_prog, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, BM, BN, CAUSAL, VARLEN)
            _epilogue(acc, m_i, l_i, o_ptr, res_ptr, lse_ptr, WG, pm0, pq_tok0, ph * D, plse_base, plen_q, stride_o,
                      BMW, D, STORE_RES, s_l, o_l)
            s0 = warpgroup_mma_wait(0, deps=[s0])
            p, alpha, m_n, l_n = _softmax(s0, m_n, l_n, 0, rows, len_k, len_k - len_q, qk_scale, BN, CAUSAL, True, s_l,
                                          0)
        acc = gl.zeros([BMW, D], gl.float32, o_l)
        if P16:
            p = gl.convert_layout(p.to(q.dtype), p_l)
        acc, p, m_i, l_i = _keys(q, k_s, v_s, k_ready, v_ready, kv_empty, sched, acc, p, m_n, l_n, n_kv, n_full, it0,
                                 sc0 + 1, rows, len_k, len_k - len_q, qk_scale, BMW, BN, STAGES, CAUSAL, s_l, o_l, p_l,
                                 EMU, P16, WG, NUM_WG, SCHED)
        it0 += n_kv.to(gl.uint32)
        sc0 += n_kv.to(gl.uint32)
        i += 1
    mbarrier.arrive(q_empty.index((i - 1) % 2))
    acc = _last_pv(q0, v_s, v_ready, kv_empty, acc, p, it0 - 1, STAGES, p_l, P16)
    m0, h, q_tok0, k_tok0, len_q, len_k, lse_base, n_kv, n_full = _item(pid + (i - 1) * n_prog, n_m, n_bh, H, S_q,
                                                                        S_k, cu_q_ptr, cu_k_ptr, BM, BN, CAUSAL,
                                                                        VARLEN)
    _epilogue(acc, m_i, l_i, o_ptr, res_ptr, lse_ptr, WG, m0, q_tok0, h * D, lse_base, len_q, stride_o, BMW, D,
              STORE_RES, s_l, o_l)


@gluon.jit
def flash_attn_fwd_ws_persist_kernel(q_desc, k_desc, v_desc, o_ptr, res_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, S_q, S_k, H,
                                     GROUP, n_m, n_bh, qk_scale, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                                     STAGES: gl.constexpr, CAUSAL: gl.constexpr, STORE_RES: gl.constexpr,
                                     VARLEN: gl.constexpr, CONS_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                                     EMU: gl.constexpr = 0, NUM_WG: gl.constexpr = 2, P16: gl.constexpr = False,
                                     SCHED: gl.constexpr = False, XITEM: gl.constexpr = 0):
    """flash_attn_fwd_ws_kernel's persistent form: a grid of resident programs (one per SM) takes the n_m x n_bh work
    items (query tiles x batch-heads) t = pid, pid + programs, ...; Q has two buffers, so the loader fetches the next
    item's Q and first K/V tiles while the consumers finish the current one (the K/V ring runs on across items)."""
    gl.static_assert(NUM_WG == 2 or NUM_WG == 3, "two or three consumer warpgroups")
    BMW: gl.constexpr = BM // NUM_WG
    q_s = gl.allocate_shared_memory(q_desc.dtype, [2 * NUM_WG, BMW, D], q_desc.layout)
    k_s = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
    v_s = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sched = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(q_bar.index(b), count=1)
        mbarrier.init(q_empty.index(b), count=NUM_WG)
    for w in gl.static_range(NUM_WG):
        mbarrier.init(sched.index(w), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=NUM_WG)
    GUARD: gl.constexpr = CAUSAL or VARLEN
    if NUM_WG == 2:  # (a partition list cannot be built from tuples here)
        gl.warp_specialize([
            (_consumer_persist, (q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr,
                                 lse_ptr, 0, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, qk_scale, BM, BMW, BN, D,
                                 STAGES, GUARD, CAUSAL, VARLEN, STORE_RES, EMU, P16, NUM_WG, SCHED, XITEM)),
            (_consumer_persist, (q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr,
                                 lse_ptr, 1, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, qk_scale, BM, BMW, BN, D,
                                 STAGES, GUARD, CAUSAL, VARLEN, STORE_RES, EMU, P16, NUM_WG, SCHED, XITEM)),
            (_loader_persist, (q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty,
                               n_m, n_bh, H, GROUP, S_q, S_k, cu_q_ptr, cu_k_ptr, D, BM, BMW, BN, STAGES, NUM_WG,
                               CAUSAL, VARLEN)),
        ], [4, 1], [CONS_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer_persist, (q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr,
                                 lse_ptr, 0, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, qk_scale, BM, BMW, BN, D,
                                 STAGES, GUARD, CAUSAL, VARLEN, STORE_RES, EMU, P16, NUM_WG, SCHED, XITEM)),
            (_consumer_persist, (q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr,
                                 lse_ptr, 1, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, qk_scale, BM, BMW, BN, D,
                                 STAGES, GUARD, CAUSAL, VARLEN, STORE_RES, EMU, P16, NUM_WG, SCHED, XITEM)),
            (_consumer_persist, (q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty, sched, o_ptr, res_ptr,
                                 lse_ptr, 2, n_m, n_bh, H, S_q, S_k, cu_q_ptr, cu_k_ptr, qk_scale, BM, BMW, BN, D,
                                 STAGES, GUARD, CAUSAL, VARLEN, STORE_RES, EMU, P16, NUM_WG, SCHED, XITEM)),
            (_loader_persist, (q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, q_empty, k_ready, v_ready, kv_empty,
                               n_m, n_bh, H, GROUP, S_q, S_k, cu_q_ptr, cu_k_ptr, D, BM, BMW, BN, STAGES, NUM_WG,
                               CAUSAL, VARLEN)),
        ], [4, 4, 1], [CONS_REGS, CONS_REGS, LOADER_REGS])
    for b in gl.static_range(2):
        mbarrier.invalidate(q_bar.index(b))
        mbarrier.invalidate(q_empty.index(b))
    for w in gl.static_range(NUM_WG):
        mbarrier.invalidate(sched.index(w))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(s))
        mbarrier.invalidate(v_ready.index(s))
        mbarrier.invalidate(kv_empty.index(s))


def _check_cfg(cfg):
    """A config the kernels can run, else ValueError naming the key (a ring of one slot would hang the GPU: a key step
    waits for tile j's K before it releases tile j - 1's slot)."""
    if cfg.get("BLOCK_N") not in (64, 128):
        raise ValueError(f"flash_attn_fwd GLUON config: BLOCK_N must be 64 or 128, got {cfg.get('BLOCK_N')!r}")
    if not isinstance(cfg.get("num_stages"), int) or cfg["num_stages"] < 2:
        raise ValueError(f"flash_attn_fwd GLUON config: num_stages must be an int >= 2 (the key loop holds two K/V "
                         f"tiles), got {cfg.get('num_stages')!r}")
    if cfg.get("NUM_WG", 2) not in (2, 3):
        raise ValueError(f"flash_attn_fwd GLUON config: NUM_WG must be 2 or 3, got {cfg.get('NUM_WG')!r}")
    if cfg.get("XITEM", 0) not in (0, 1, 2):
        raise ValueError(f"flash_attn_fwd GLUON config: XITEM must be 0, 1 or 2, got {cfg.get('XITEM')!r}")
    if cfg.get("XITEM") and not cfg.get("PERSIST"):
        raise ValueError("flash_attn_fwd GLUON config: XITEM needs PERSIST (it overlaps a program's work items)")
    if "PROGRAMS" in cfg and not (isinstance(cfg["PROGRAMS"], int) and cfg["PROGRAMS"] >= 1):
        raise ValueError(f"flash_attn_fwd GLUON config: PROGRAMS must be an int >= 1, got {cfg['PROGRAMS']!r}")


def attn_fwd_ws(q, k, v, causal, softmax_scale, cfg, residual=False, varlen=None):
    """(o, lse, o_res) as ``attn_fwd`` returns them, by ``flash_attn_fwd_ws_kernel`` (the inputs ``attention._gluon_cfg``
    admits: contiguous 16-bit [B, S, H, D], head_dim 64 or 128, sm90); with ``varlen`` (attention.Varlen) the packed
    sequences as a batch of one. cfg:
    - BLOCK_N (keys per tile), num_stages (ring slots);
    - NUM_WG: consumer warpgroups of 64 query rows, 2 (the default) or 3;
    - P16: P carried across key tiles as the 16-bit wgmma operand (the default at NUM_WG 3, where an fp32 P does not
      fit in the registers);
    - SCHED: the warpgroups take turns issuing their products (a scheduler barrier);
    - PERSIST: flash_attn_fwd_ws_persist_kernel, one program per SM walking the work items with two Q buffers (its
      shared memory: 2 x NUM_WG 64-row Q blocks beside the ring); PROGRAMS caps its grid (default: the SM count;
      the tests take a few programs, so that each walks many items); XITEM (dense inputs, causal ones with S_q <= S_k): an
      item's first S product issued with the previous item's last P V (_walk_overlapped; 1: S first, 2: P V first);
    - CONS_REGS / LOADER_REGS: setmaxnreg of the worker consumer warpgroups / the loader, 240 / 24 at two warpgroups,
      160 / 24 at three (the loader warp's group is padded to four warps; the default partition's warpgroup takes the
      rest of the launch's 128 x 512 registers, 168);
    - EMU: of every 8 exponentials of unmasked tiles, how many the FMA pipes compute (_tl.exp2_emu).
    Session 52 (H200): three warpgroups with SCHED ran 1.05-1.10x the Triton kernel at D = 64 non-causal (session 37's
    three warpgroups, with 64-key tiles, had not; benchmarks/NOTES.md)."""
    _check_cfg(cfg)
    B, S_q, H, D = q.shape
    S_k, H_kv = k.shape[1], k.shape[2]
    n_wg = cfg.get("NUM_WG", 2)
    bm, bn, stages = 64 * n_wg, cfg["BLOCK_N"], cfg["num_stages"]
    q_l = launch.nvmma_layout([64, D], q.dtype)
    k_l = launch.nvmma_layout([bn, D], q.dtype)
    q_desc = TensorDescriptor.from_tensor(q.view(B * S_q, H * D), [64, D], q_l)
    k_desc = TensorDescriptor.from_tensor(k.view(B * S_k, H_kv * D), [bn, D], k_l)
    v_desc = TensorDescriptor.from_tensor(v.view(B * S_k, H_kv * D), [bn, D], k_l)
    o = launch.new_output((B, S_q, H, D), q.dtype, q.device)
    o_res = launch.new_output((B, S_q, H, D), q.dtype, q.device) if residual else q.new_empty(0)
    lse = launch.new_output((B, H, S_q), torch.float32, q.device)
    e = q.element_size()
    if varlen is None:
        n_m, n_bh, cu = launch.cdiv(S_q, bm), B * H, (lse, lse)
    else:
        n_m, n_bh = launch.cdiv(varlen.max_seqlen_q, bm), (varlen.cu_seqlens_q.numel() - 1) * H
        cu = (varlen.cu_seqlens_q, varlen.cu_seqlens_k)
    if cfg.get("PERSIST", 0):  # one program per SM (each holds an SM's registers and most of its shared memory)
        programs = min(n_m * n_bh, cfg.get("PROGRAMS", _runtime.num_sms()))
        kernel, grid, items = flash_attn_fwd_ws_persist_kernel, (programs,), (n_m, n_bh)
        # the overlapped walk needs a key tile in every item: dense inputs, and under causal masking no query row
        # without a key (S_q <= S_k: row i sees keys 0 .. i + S_k - S_q)
        xitem = dict(XITEM=int(cfg.get("XITEM", 0)) if varlen is None and (not causal or S_q <= S_k) else 0)
    else:
        kernel, grid, items, xitem = flash_attn_fwd_ws_kernel, (n_m, n_bh), (), {}
    launch.launch(
        "flash_attn_fwd", kernel, grid,
        q_desc, k_desc, v_desc, o, o_res if residual else o, lse, *cu, S_q, S_k, H, H // H_kv, *items,
        softmax_scale * LOG2E,
        nbytes=e * ((3 if residual else 2) * q.numel() + k.numel() + v.numel()) + 4 * lse.numel(),
        BM=bm, BN=bn, D=D, STAGES=stages, CAUSAL=bool(causal), STORE_RES=bool(residual), VARLEN=varlen is not None,
        CONS_REGS=cfg.get("CONS_REGS", 240 if n_wg == 2 else 160), LOADER_REGS=cfg.get("LOADER_REGS", 24),
        EMU=cfg.get("EMU", 0), NUM_WG=n_wg, P16=bool(cfg.get("P16", n_wg == 3)),
        SCHED=bool(cfg.get("SCHED", 0)), num_warps=4, **xitem,
    )
    return o, lse, o_res
