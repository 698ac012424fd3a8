"""The Gated DeltaNet chunk recurrence with the output fused, warp-specialized in Gluon for Hopper (sm90).

Used by ``chunk.chunk_fwd`` for forwards that keep nothing for a backward (inference, prefill) on compiled sm90
launches of 16-bit inputs (``use_gluon``); the Triton kernels serve every other case and the interpreter. Gluon
(triton.experimental.gluon) has no interpreter, so this file is imported only on that path.

Inputs are the intra kernel's: w, u, gamma (the chunk-local cumulative gate) and the normalised k (kn). One program
per (V-block of BV columns, sequence x value head); four partitions:

- a loader warp: each chunk's w [64, K], k [64, K], q [64, K] and u [64, BV] tiles by TMA into a ring of STAGES slots
  (``ready`` counts their bytes; a slot is refilled once the state warpgroup and the chunk's output warpgroup have
  both released it on ``empty``); with L2NORM 3 a loader warpgroup that also takes q's inverse row norms from the
  slot one chunk behind its issue (``rn_ready``);
- the state warpgroup (the serial chain): v_new = u - w S_c (wgmma, S_c's 16-bit copy in shared memory), v_new into
  buffer c % NB for the output, then S_{c+1} = e^(g_last) S_c + k^T (e^(g_last - g) v_new) (wgmma into the fp32
  state in registers) and S_{c+1}'s 16-bit copy into buffer (c + 1) % NB (``full``: S_c and v_new_c are there);
- two output warpgroups, chunk c on warpgroup c % 2 (one measured 7-10% slower, session 40), off the state's chain: q l2-normalised (L2NORM 1: in its
  ring slot; 2, 3: q S_c and q k^T scaled by q's inverse row norms instead, not rounding the normalised q), q S_c
  and q k^T (wgmma), P = (q k^T) * e^(g_i - g_j) (j <= i), o = scale (e^g q S_c + P v_new_c) (wgmma with P in
  registers), stored by row; the buffer is released on ``sfree``.

The rounding points are the Triton fused kernel's (chunk.chunk_gated_delta_rule_fwd_kernel_h with FUSE_O): S cast to
the input dtype for its products, v_new and its decayed copy cast for theirs, P cast. Sequence ends: the descriptors
view the tensors as [B T, heads x dim] (packed: [T, ...]), so the last chunk of a sequence may read the next
sequence's rows (or TMA's zero fill): those rows of v_new are set to 0 (no state update, no output contribution), the
chunk's last gate is the last valid row's, and their o rows are not stored.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from triforge import launch
from triforge.ops.deltanet.chunk import BT as _BT
from triforge.ops.deltanet.chunk import L2NORM_EPS

BT = gl.constexpr(_BT)  # the chunk (the intra kernel's)
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _exp(x, FTZ: gl.constexpr):
    """e^x; FTZ: one ex2.approx.ftz (gl.exp's ex2 keeps denormal results with a compare, a select and two multiplies
    around each MUFU.EX2)."""
    if FTZ:
        return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * LOG2E], gl.float32, True, 1)
    else:
        return gl.exp(x)


@gluon.jit
def _span(cu_ptr, i_n, T, VARLEN: gl.constexpr):
    """(first token row, length) of sequence i_n."""
    if VARLEN:
        bos = gl.load(cu_ptr + i_n)
        return bos, gl.load(cu_ptr + i_n + 1) - bos
    else:
        return i_n * T, T


@gluon.jit
def _inv_row_norms(q_op, K: gl.constexpr, layout: gl.constexpr):
    """1 / ||q_i|| of a [BT, K] shared tile (read in two halves: fewer live registers)."""
    qa = q_op.slice(0, K // 2, dim=1).load(layout).to(gl.float32)
    qb = q_op.slice(K // 2, K // 2, dim=1).load(layout).to(gl.float32)
    return gl.rsqrt(gl.sum(qa * qa, 1) + gl.sum(qb * qb, 1) + L2NORM_EPS)


@gluon.jit
def _issue(w_desc, k_desc, q_desc, u_desc, w_s, k_s, q_s, u_s, ready, empty, c, bos, col_w, col_k, col_v,
           STAGES: gl.constexpr):
    """Chunk c's w, k, q and u tiles by TMA into ring slot c % STAGES once chunk c - STAGES has released it."""
    nbytes: gl.constexpr = (w_desc.block_type.nbytes + k_desc.block_type.nbytes + q_desc.block_type.nbytes
                            + u_desc.block_type.nbytes)
    s = c % STAGES
    mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)  # chunk c - STAGES released (first pass: free)
    bar = ready.index(s)
    row = bos + c * BT
    mbarrier.expect(bar, nbytes)
    tma.async_copy_global_to_shared(w_desc, [row, col_w], bar, w_s.index(s))
    tma.async_copy_global_to_shared(k_desc, [row, col_k], bar, k_s.index(s))
    tma.async_copy_global_to_shared(q_desc, [row, col_k], bar, q_s.index(s))
    tma.async_copy_global_to_shared(u_desc, [row, col_v], bar, u_s.index(s))


@gluon.jit
def _loader(w_desc, k_desc, q_desc, u_desc, w_s, k_s, q_s, u_s, rn_s, ready, empty, rn_ready, bos, NT, col_w, col_k,
            col_v, K: gl.constexpr, STAGES: gl.constexpr, NORMS: gl.constexpr):
    """The TMA issue of every chunk; with NORMS (L2NORM 3: a warpgroup) also q's inverse row norms (into rn_s,
    ``rn_ready``) one chunk behind the issue, off the output warpgroups' chain."""
    if NORMS:
        blk_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        r_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        for c in range(NT + 1):
            if c < NT:
                _issue(w_desc, k_desc, q_desc, u_desc, w_s, k_s, q_s, u_s, ready, empty, c, bos, col_w, col_k, col_v,
                       STAGES)
            if c > 0:
                p = c - 1
                s = p % STAGES
                mbarrier.wait(ready.index(s), (p // STAGES) & 1)
                rn = _inv_row_norms(q_s.index(s), K, blk_l)
                rn_s.index(s).store(gl.convert_layout(rn, r_l))
                gl.thread_barrier()
                mbarrier.arrive(rn_ready.index(s))
    else:
        for c in range(NT):
            _issue(w_desc, k_desc, q_desc, u_desc, w_s, k_s, q_s, u_s, ready, empty, c, bos, col_w, col_k, col_v,
                   STAGES)


@gluon.jit
def _gates_state(g_base, c, L, HV: gl.constexpr, t_acc):
    """Chunk c's gates as the state warpgroup uses them: per row (acc layout) and the last valid row's."""
    t0 = c * BT
    n = gl.minimum(L - t0, BT)
    g_acc = gl.load(g_base + (t0 + t_acc).to(gl.int64) * HV, mask=t_acc < n, other=0.0)
    g_last = gl.load(g_base + (t0 + n - 1).to(gl.int64) * HV, mask=n > 0, other=0.0)  # (an empty sequence: none)
    return g_acc, g_last


@gluon.jit
def _state(w_s, k_s, u_s, S_s, vn_s, vs_s, ready, empty, full, sfree, g_base, h0_ptr, ht_ptr, o_state, L, NT,
           v0, h_base, vn_base, zero, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
           STAGES: gl.constexpr, NB: gl.constexpr, USE_H0: gl.constexpr, STORE_FINAL: gl.constexpr, FTZ: gl.constexpr,
           SAVE: gl.constexpr):
    """SAVE (the training forward): also h (S_c in the input dtype, the operand the chain uses) at h_base + c HV K V
    and v_new (rows of the sequence only) at vn_base, by plain stores from registers; their offsets are formed per
    chunk (+ c & zero, a runtime 0: not hoisted out of the loop into registers held through it)."""
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    dtype: gl.constexpr = w_s.dtype
    rows_k = gl.arange(0, K, layout=gl.SliceLayout(1, acc_l))
    cols_v = v0 + gl.arange(0, BV, layout=gl.SliceLayout(0, acc_l))
    t_acc = gl.arange(0, BT, layout=gl.SliceLayout(1, acc_l))
    S = gl.zeros([K, BV], gl.float32, acc_l)
    if USE_H0:
        S = gl.load(h0_ptr + o_state + rows_k[:, None] * V + cols_v[None, :])
    S_s.index(0).store(S.to(dtype))  # buffer 0 starts free
    fence_async_shared()
    gl.thread_barrier()
    n_acc, n_last = _gates_state(g_base, 0, L, HV, t_acc)
    for c in range(NT):
        slot = c % STAGES
        b = c % NB
        g_acc, g_last = n_acc, n_last
        n_acc, n_last = _gates_state(g_base, gl.minimum(c + 1, NT - 1), L, HV, t_acc)  # one chunk ahead
        mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
        ws = warpgroup_mma(w_s.index(slot), S_s.index(b), gl.zeros([BT, BV], gl.float32, acc_l), use_acc=False,
                           is_async=True)
        if SAVE:  # h_c = S_c as the chain's operand (stored while w S_c runs)
            zc = c & zero
            gl.store(h_base + c.to(gl.int64) * (HV * K * V) + (rows_k + zc)[:, None] * V + cols_v[None, :],
                     S.to(dtype))
        ws = warpgroup_mma_wait(0, deps=[ws])
        u = u_s.index(slot).load(acc_l).to(gl.float32)
        in_seq = t_acc < L - c * BT
        vn = gl.where(in_seq[:, None], u - ws, 0.0)  # rows past the sequence's end: no update
        vs = vn * _exp(g_last - g_acc, FTZ)[:, None]
        if SAVE:
            gl.store(vn_base + (c * BT + t_acc + zc).to(gl.int64)[:, None] * (HV * V) + cols_v[None, :], vn.to(dtype),
                     mask=in_seq[:, None])
        vn_s.index(b).store(vn.to(dtype))
        vs_s.store(vs.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(full.index(b))  # S_c and v_new_c are in buffer b
        S = S * _exp(g_last, FTZ)
        S = warpgroup_mma(k_s.index(slot).permute((1, 0)), vs_s, S, is_async=True)
        S = warpgroup_mma_wait(0, deps=[S])
        mbarrier.arrive(empty.index(slot))  # w, k and u of chunk c read
        nb = (c + 1) % NB
        mbarrier.wait(sfree.index(nb), (((c + 1) // NB) & 1) ^ 1)  # chunk c + 1 - NB's output done
        S_s.index(nb).store(S.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
    if STORE_FINAL:
        gl.store(ht_ptr + o_state + rows_k[:, None] * V + cols_v[None, :], S)


@gluon.jit
def _gates_out(g_base, c, L, HV: gl.constexpr, t_acc, t_qk, c_qk):
    t0 = c * BT
    n = L - t0
    g_acc = gl.load(g_base + (t0 + t_acc).to(gl.int64) * HV, mask=t_acc < n, other=0.0)
    g_row = gl.load(g_base + (t0 + t_qk).to(gl.int64) * HV, mask=t_qk < n, other=0.0)
    g_col = gl.load(g_base + (t0 + c_qk).to(gl.int64) * HV, mask=c_qk < n, other=0.0)
    return g_acc, g_row, g_col


@gluon.jit
def _output(q_s, k_s, S_s, vn_s, rn_s, ready, empty, full, sfree, rn_ready, g_base, o_ptr, bos, L, NT, o_col, scale,
            p_base, save_p, zero, J: gl.constexpr, NOUT: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
            V: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr, NB: gl.constexpr, L2NORM: gl.constexpr,
            FTZ: gl.constexpr, SAVE: gl.constexpr, SKIP: gl.constexpr = False):
    """SAVE (the training forward): the program of V-block 0 (``save_p``) also stores P = (q k^T) * decay as the
    output's product uses it, rows of the sequence only, at p_base (row t: its chunk's row of BT values)."""
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    qk_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    blk_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    dtype: gl.constexpr = q_s.dtype
    t_acc = gl.arange(0, BT, layout=gl.SliceLayout(1, acc_l))
    t_qk = gl.arange(0, BT, layout=gl.SliceLayout(1, qk_l))
    c_qk = gl.arange(0, BT, layout=gl.SliceLayout(0, qk_l))
    c_v = gl.arange(0, BV, layout=gl.SliceLayout(0, acc_l))
    keep = t_qk[:, None] >= c_qk[None, :]
    n_acc, n_row, n_col = _gates_out(g_base, J, L, HV, t_acc, t_qk, c_qk)
    for c in range(J, NT, NOUT):
        slot = c % STAGES
        b = c % NB
        g_acc, g_row, g_col = n_acc, n_row, n_col
        n_acc, n_row, n_col = _gates_out(g_base, gl.minimum(c + NOUT, NT - 1), L, HV, t_acc, t_qk, c_qk)
        mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
        if SKIP:  # (probe) no output: the state chain's own time
            mbarrier.wait(full.index(b), (c // NB) & 1)
            mbarrier.arrive(empty.index(slot))
            mbarrier.arrive(sfree.index(b))
        else:
            q_op = q_s.index(slot)
            if L2NORM == 1:  # q normalised in its ring slot (only this warpgroup reads it)
                qx = q_op.load(blk_l).to(gl.float32)
                qx = qx * gl.rsqrt(gl.sum(qx * qx, 1) + L2NORM_EPS)[:, None]
                q_op.store(qx.to(dtype))
                fence_async_shared()
                gl.thread_barrier()
            qk = warpgroup_mma(q_op, k_s.index(slot).permute((1, 0)), gl.zeros([BT, BT], gl.float32, qk_l),
                               use_acc=False, is_async=True)
            if L2NORM == 2:  # q's inverse row norms, read while q k^T runs; q k^T and q S scaled by them afterwards
                rn = _inv_row_norms(q_op, K, blk_l)
            if L2NORM == 3:  # the loader warpgroup's
                mbarrier.wait(rn_ready.index(slot), (c // STAGES) & 1)
                rn_v = rn_s.index(slot)
                rn_qk = rn_v.load(gl.SliceLayout(1, qk_l))
                rn_acc = rn_v.load(gl.SliceLayout(1, acc_l))
            mbarrier.wait(full.index(b), (c // NB) & 1)
            qs = warpgroup_mma(q_op, S_s.index(b), gl.zeros([BT, BV], gl.float32, acc_l), use_acc=False,
                               is_async=True)
            qk, qs = warpgroup_mma_wait(0, deps=[qk, qs])
            if L2NORM == 2:
                qk = qk * gl.convert_layout(rn, gl.SliceLayout(1, qk_l))[:, None]
                qs = qs * gl.convert_layout(rn, gl.SliceLayout(1, acc_l))[:, None]
            if L2NORM == 3:
                qk = qk * rn_qk[:, None]
                qs = qs * rn_acc[:, None]
            mbarrier.arrive(empty.index(slot))  # q and k of chunk c read
            decay = _exp(gl.where(keep, g_row[:, None] - g_col[None, :], float("-inf")), FTZ)
            pd = (qk * decay).to(dtype)
            if SAVE:
                if save_p:
                    zc = c & zero
                    gl.store(p_base + (c * BT + t_qk + zc).to(gl.int64)[:, None] * (HV * BT) + c_qk[None, :], pd,
                             mask=(t_qk < L - c * BT)[:, None])
            p = gl.convert_layout(pd, p_l)
            o = qs * _exp(g_acc, FTZ)[:, None]
            o = warpgroup_mma(p, vn_s.index(b), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=[o])
            mbarrier.arrive(sfree.index(b))  # S_c and v_new_c read
            rows = c * BT + t_acc
            off = (bos + rows).to(gl.int64)[:, None] * (HV * V) + o_col + c_v[None, :]
            gl.store(o_ptr + off, (o * scale).to(dtype), mask=(rows < L)[:, None])


@gluon.jit
def gdn_fwd_ws_kernel(w_desc, k_desc, q_desc, u_desc, gamma_ptr, h0_ptr, ht_ptr, o_ptr, cu_ptr, T, scale,
                      h_ptr, vn_ptr, p_ptr, coff_ptr, zero,
                      H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                      STAGES: gl.constexpr, NB: gl.constexpr, L2NORM: gl.constexpr,
                      USE_H0: gl.constexpr, STORE_FINAL: gl.constexpr, VARLEN: gl.constexpr, FTZ: gl.constexpr,
                      OUT_REGS: gl.constexpr, LOAD_REGS: gl.constexpr, LOAD_WARPS: gl.constexpr,
                      SAVE: gl.constexpr = False, SKIP: gl.constexpr = False):
    """SAVE: the training forward's residuals too (h [chunks, HV, K, V] and v_new [B, T, HV, V] in the input dtype,
    P [B, T, HV, BT] in q's; coff_ptr: each sequence's first chunk, packed); the program of V-block i_v stores its
    columns of h and v_new, V-block 0's also P."""
    gl.static_assert(NB >= 2, "at least two state / v_new buffers")
    i_v = gl.program_id(0)
    i_nh = gl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos, L = _span(cu_ptr, i_n, T, VARLEN)
    NT = gl.cdiv(L, BT)
    col_v = i_hv * V + i_v * BV
    o_state = i_nh.to(gl.int64) * K * V
    g_base = gamma_ptr + bos.to(gl.int64) * HV + i_hv
    h_base = h_ptr
    vn_base = vn_ptr
    p_base = p_ptr
    if SAVE:
        if VARLEN:
            boh = gl.load(coff_ptr + i_n).to(gl.int64)
        else:
            boh = i_n.to(gl.int64) * gl.cdiv(T, BT)
        h_base = h_ptr + (boh * HV + i_hv) * (K * V)
        vn_base = vn_ptr + bos.to(gl.int64) * (HV * V) + i_hv * V
        p_base = p_ptr + bos.to(gl.int64) * (HV * BT) + i_hv * BT
    dtype: gl.constexpr = w_desc.dtype
    s_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, BV], dtype)
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BV], dtype)

    w_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], w_desc.layout)
    k_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], k_desc.layout)
    q_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], q_desc.layout)
    u_s = gl.allocate_shared_memory(dtype, [STAGES, BT, BV], u_desc.layout)
    S_s = gl.allocate_shared_memory(dtype, [NB, K, BV], s_sl)
    vn_s = gl.allocate_shared_memory(dtype, [NB, BT, BV], v_sl)
    vs_s = gl.allocate_shared_memory(dtype, [BT, BV], v_sl)
    rn_s = gl.allocate_shared_memory(gl.float32, [STAGES, BT], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    sfree = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    rn_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # the state warpgroup and the chunk's output warpgroup
        mbarrier.init(rn_ready.index(s), count=1)
    for s in gl.static_range(NB):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(sfree.index(s), count=1)

    # (the partitions' arguments written out in the call: constexprs passed through a tuple variable lose it)
    gl.warp_specialize([
        (_state, (w_s, k_s, u_s, S_s, vn_s, vs_s, ready, empty, full, sfree, g_base, h0_ptr, ht_ptr, o_state, L, NT,
                  i_v * BV, h_base, vn_base, zero, HV, K, V, BV, STAGES, NB, USE_H0, STORE_FINAL, FTZ, SAVE)),
        (_output, (q_s, k_s, S_s, vn_s, rn_s, ready, empty, full, sfree, rn_ready, g_base, o_ptr, bos, L, NT, col_v,
                   scale, p_base, i_v == 0, zero, 0, 2, HV, K, V, BV, STAGES, NB, L2NORM, FTZ, SAVE, SKIP)),
        (_output, (q_s, k_s, S_s, vn_s, rn_s, ready, empty, full, sfree, rn_ready, g_base, o_ptr, bos, L, NT, col_v,
                   scale, p_base, i_v == 0, zero, 1, 2, HV, K, V, BV, STAGES, NB, L2NORM, FTZ, SAVE, SKIP)),
        (_loader, (w_desc, k_desc, q_desc, u_desc, w_s, k_s, q_s, u_s, rn_s, ready, empty, rn_ready, bos, NT, i_hv * K,
                   i_h * K, col_v, K, STAGES, L2NORM == 3)),
    ], [4, 4, LOAD_WARPS], [OUT_REGS, OUT_REGS, LOAD_REGS])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
    for s in gl.static_range(NB):
        mbarrier.invalidate(full.index(s))
        mbarrier.invalidate(sfree.index(s))


DEFAULT_CFG = {"BV": 32, "STAGES": 3, "NB": 3, "FTZ": 1, "L2NORM": 1, "OUT_REGS": 168, "LOAD_REGS": 24}


def fwd_ws(q, kn, w, u, gamma, initial_state, scale, *, l2norm, cu_seqlens=None, output_final_state=True, cfg=None,
           save=False, chunk_offsets=None, n_chunks=None):
    """(o [B, T, HV, V], final state [N, HV, K, V] fp32, or an empty tensor without output_final_state) from the
    intra kernel's outputs (kn: k, normalised when l2norm); q is normalised in the kernel when l2norm; cu_seqlens
    int32 [N + 1] (B = 1). With ``save`` (the training forward) a third item, {h [B, NT, HV, K, V] (packed: [1,
    chunks, ...]) and v_new [B, T, HV, V] in u's dtype, P [B, T, HV, 64] in q's}, what the backward reads
    (chunk_offsets: int32 [N + 1], each packed sequence's first chunk; n_chunks: their total, on the host).
    cfg (DEFAULT_CFG; chunk.gluon_config picks it): BV (V-block), STAGES (ring slots), NB
    (state / v_new buffers), FTZ (exponentials by ex2.approx.ftz), L2NORM (with l2norm:
    1 q normalised in its ring slot, the Triton kernels' bits; 2 q's row norms read by the output warpgroup and
    q k^T, q S scaled by them; 3 the same norms taken by a loader warpgroup), OUT_REGS / LOAD_REGS (registers per
    thread of the output / loader partitions)."""
    cfg = dict(DEFAULT_CFG, **(cfg or {}))
    B, T, H, K = q.shape
    HV, V = u.shape[2], u.shape[3]
    bv = cfg["BV"]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    lk = launch.nvmma_layout([64, K], q.dtype)
    lv = launch.nvmma_layout([64, bv], q.dtype)
    w_desc = TensorDescriptor.from_tensor(w.view(B * T, HV * K), [64, K], lk)
    k_desc = TensorDescriptor.from_tensor(kn.view(B * T, H * K), [64, K], lk)
    q_desc = TensorDescriptor.from_tensor(q.view(B * T, H * K), [64, K], lk)
    u_desc = TensorDescriptor.from_tensor(u.view(B * T, HV * V), [64, bv], lv)
    o = launch.new_output((B, T, HV, V), u.dtype, u.device)
    # (no final state: an empty tensor, as the Triton recurrence returns)
    ht = launch.new_output((N, HV, K, V) if output_final_state else (0,), torch.float32, u.device)
    e = q.element_size()
    l2n = cfg["L2NORM"] if l2norm else 0
    saved = None
    if save:
        if cu_seqlens is not None and (chunk_offsets is None or n_chunks is None):
            raise ValueError("fwd_ws: save with cu_seqlens needs chunk_offsets and n_chunks")
        n_b, n_c = (B, -(-T // _BT)) if cu_seqlens is None else (1, n_chunks)
        saved = {"h": launch.new_output((n_b, n_c, HV, K, V), w.dtype, u.device),
                 "v_new": launch.new_output((B, T, HV, V), u.dtype, u.device),
                 "P": launch.new_output((B, T, HV, _BT), q.dtype, u.device)}
    launch.launch(
        "gated_delta_rule_fwd_ws", gdn_fwd_ws_kernel, (V // bv, N * HV),
        w_desc, k_desc, q_desc, u_desc, gamma, initial_state if initial_state is not None else gamma,
        ht if output_final_state else gamma, o,
        cu_seqlens if cu_seqlens is not None else gamma, T, scale,
        *((saved["h"], saved["v_new"], saved["P"], chunk_offsets if chunk_offsets is not None else gamma) if save
          else (gamma, gamma, gamma, gamma)), 0,
        # each V-block program reads its chunks' w, k and q whole
        nbytes=B * T * HV * ((V // bv) * 3 * K * e + 2 * V * e + 4)
        + N * HV * K * V * 4 * (int(output_final_state) + int(initial_state is not None))
        + (sum(t.numel() for t in saved.values()) * e if save else 0),
        H=H, HV=HV, K=K, V=V, BV=bv, STAGES=cfg["STAGES"], NB=cfg["NB"], L2NORM=l2n,
        USE_H0=initial_state is not None, STORE_FINAL=bool(output_final_state), VARLEN=cu_seqlens is not None,
        FTZ=bool(cfg["FTZ"]), OUT_REGS=cfg["OUT_REGS"], LOAD_REGS=cfg["LOAD_REGS"], LOAD_WARPS=4 if l2n == 3 else 1,
        SAVE=bool(save), SKIP=bool(cfg.get("SKIP", 0)),
        num_warps=4,
    )
    return (o, ht, saved) if save else (o, ht)
