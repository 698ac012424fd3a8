"""KV-cache decode attention (flash-decoding), flash-attn's ``flash_attn_with_kvcache``.

    q [B, Sq, H, D], k_cache / v_cache [B, S_max, Hkv, D], cache_seqlens int32 [B]
    (optional) k / v [B, Sn, Hkv, D]: written in place at cache rows cache_seqlens[b] .. + Sn
    row b attends over its first n_b = cache_seqlens[b] + Sn keys; with causal, query i sees
    key j <= i + n_b - Sq (bottom-right aligned, as flash-attn); a query that sees no key gives 0
    and lse -inf.

Two kernels:

1. ``flash_decode_split_kernel``, grid (NUM_SPLITS, B * Hkv, row blocks). The keys of row b (the
   cached ones, then the new tokens k/v when given) are cut into NUM_SPLITS chunks (a whole number of
   BLOCK_N blocks each); a program takes one chunk of one (batch, kv head) for all the query rows
   that read that kv head: the G = H / Hkv query heads times the Sq queries form the rows of one
   tile, so each K/V byte is read once per group. Key positions past the cached length are read from
   k/v in the same loop (a per-row pointer select), so the new tokens cost no extra step; the last
   split (the shortest) then stores them into the caches (no program reads those rows there, so the
   write races with nothing, and the append costs no extra launch). Before the PDL wait it asks L2 for
   its first L2PF key blocks of cached K/V (``prefetch_l2``), while the previous kernel may still run.
   It writes the unnormalised partial output acc [rows, D] (fp32; zeros for a split with no visible
   key), the running max m (log2 domain, -inf then) and the sum l.
2. ``flash_decode_merge_kernel``, grid (B * H * Sq, D / BLOCK_D): log-sum-exp merge of the splits
   into o [B, Sq, H, D] (q's dtype) and lse [B, H, Sq] (fp32, natural log), every split's m, l and
   acc loaded in one trip (``merge_blocks``). Empty splits get weight 0 without ever computing
   exp(-inf - -inf).

Custom ops (the public function picks one; both trace under torch.compile(fullgraph=True)):

    torch.ops.triforge.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, causal,
        softmax_scale, num_splits, check_lengths) -> (o, lse)     mutates k_cache, v_cache (the append)
    torch.ops.triforge.flash_attn_kvcache(q, k_cache, v_cache, cache_seqlens, causal,
        softmax_scale, num_splits, check_lengths) -> (o, lse)     no new tokens, mutates nothing

NUM_SPLITS comes from the cache capacity S_max (not the lengths: no device sync for it) and the
batch: about ``programs_per_sm`` programs per SM (tunable), at least ``min_blocks_per_split`` key
blocks per split, at most MAX_SPLITS; ``num_splits > 0`` forces it (as in flash-attn).

Checking that cache_seqlens + Sn fits S_max reads cache_seqlens on the host: with a tensor
cache_seqlens on the GPU, every call syncs once (a Python int costs nothing). ``check_lengths=False``
skips that (no sync, CUDA-graph capturable); the split kernel clamps every length into
[0, S_max - Sn] either way, so it never reads or writes outside the caches.
"""

import math
from collections import OrderedDict

import torch
import triton
import triton.language as tl

from triforge import _runtime, launch
from triforge.launch import new_output
from triforge.ops._checks import check_same_device, check_tensor
from triforge.ops._tl import prefetch_l2
from triforge.ops.attention.reference import kvcache_attention_ref
from triforge.registry import OpSpec, register
from triforge.tune import Tunable
from triforge.tune import register as register_tunable

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SPLITS = 256
MAX_BLOCK_M = 64  # query rows (G * Sq) per tile; more rows take more programs along grid axis 2
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# ----------------------------------------------------------------------------- kernels


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b. UPCAST (bf16 in Triton 3.6's interpreter, which multiplies bf16 dot operands
    wrongly) and IEEE (fp32 inputs: no tf32 rounding) run the dot in full fp32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)


@triton.jit
def _attend_block(
    b_q, b_k, b_v, o_pos, m_n, lim, b_m, b_l, b_acc, qk_scale,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """One key block: online softmax in the log2 domain. o_pos [BLOCK_N] key positions, m_n the
    keys that exist, lim [BLOCK_M] the last key each row may see (causal)."""
    b_s = _mma(b_q, tl.trans(b_k), tl.zeros([b_q.shape[0], b_k.shape[0]], dtype=tl.float32), UPCAST, IEEE)
    b_s = b_s * qk_scale
    valid = m_n[None, :]
    if CAUSAL:
        valid = valid & (o_pos[None, :] <= lim[:, None])
    b_s = tl.where(valid, b_s, float("-inf"))
    m_new = tl.maximum(b_m, tl.max(b_s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet: no -inf - -inf
    alpha = tl.exp2(b_m - m_safe)
    b_p = tl.exp2(b_s - m_safe[:, None])
    b_l = b_l * alpha + tl.sum(b_p, 1)
    b_acc = _mma(b_p.to(b_v.dtype), b_v, b_acc * alpha[:, None], UPCAST, IEEE)
    return m_new, b_l, b_acc


@triton.jit
def _load_attend(pk, pv, o_d, o_pos, m_n, lim, b_q, b_m, b_l, b_acc, qk_scale,
                 CAUSAL: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """The K and V rows at pk / pv ([BLOCK_N, 1] row pointers; rows outside m_n read as 0) through _attend_block."""
    b_k = tl.load(pk + o_d[None, :], mask=m_n[:, None], other=0.0)
    b_v = tl.load(pv + o_d[None, :], mask=m_n[:, None], other=0.0)
    return _attend_block(b_q, b_k, b_v, o_pos, m_n, lim, b_m, b_l, b_acc, qk_scale, CAUSAL, UPCAST, IEEE)


@triton.jit
def _split_keys(n_total, i_s, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """Split i_s's share [lo, hi) of the keys 0 .. n_total - 1: a whole number of blocks; splits past the end
    are empty."""
    chunk = tl.cdiv(tl.cdiv(n_total, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = i_s * chunk
    return lo, tl.minimum(lo + chunk, n_total)


@triton.jit
def flash_decode_split_kernel(
    q_ptr,  # [B, Sq, H, D]
    kc_ptr,  # [B, S_max, Hkv, D] key cache (rows cache_seqlens[b] .. + Sn written when APPEND)
    vc_ptr,  # [B, S_max, Hkv, D] value cache
    kn_ptr,  # [B, Sn, Hkv, D] new keys (read when APPEND)
    vn_ptr,  # [B, Sn, Hkv, D] new values (read when APPEND)
    seqlens_ptr,  # [B] int32 cached lengths before the append
    acc_ptr,  # [B * Hkv, NUM_SPLITS, M_ROWS, D] fp32 unnormalised partial outputs
    m_ptr,  # [B * Hkv, NUM_SPLITS, M_ROWS] fp32 running max (log2 domain), -inf when empty
    l_ptr,  # [B * Hkv, NUM_SPLITS, M_ROWS] fp32 sum of exp2(s - m)
    o_ptr,  # [B, Sq, H, D] q's dtype (written when DIRECT)
    lse_ptr,  # [B, H, Sq] fp32, natural log (written when DIRECT)
    stride_qb, stride_qs, stride_qh,
    stride_ob, stride_os, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_knb, stride_kns, stride_knh,
    stride_vnb, stride_vns, stride_vnh,
    Sq,
    S_new,  # new tokens per row (0 without APPEND)
    S_max,  # cache rows
    M_ROWS,  # G * Sq query rows per (batch, kv head)
    NUM_SPLITS,
    qk_scale,  # softmax_scale * log2(e)
    H: tl.constexpr,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_NEW: tl.constexpr,
    CAUSAL: tl.constexpr,
    APPEND: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch: wait for the previous kernel before any access
    DIRECT: tl.constexpr,  # NUM_SPLITS == 1: write the normalised o and lse (no merge kernel)
    L2PF: tl.constexpr,  # key blocks of this split's cached K/V rows asked of L2 before the PDL wait (0: none)
):
    i_s = tl.program_id(0)
    i_bg = tl.program_id(1)
    i_mb = tl.program_id(2)
    i_b = (i_bg // HKV).to(tl.int64)
    i_g = (i_bg % HKV).to(tl.int64)
    p_k = kc_ptr + i_b * stride_kb + i_g * stride_kh  # this (batch, kv head)'s cached K and V rows
    p_v = vc_ptr + i_b * stride_vb + i_g * stride_vh
    if L2PF > 0:
        # the first L2PF blocks of this split's cached rows, requested while the previous kernel may still run:
        # prefetches only (prefetch_l2), so a length or a cache row that kernel is still writing cannot be read
        # stale. The length is read past L1 (.cg) for the addresses alone and read again after the wait.
        n_c0 = tl.minimum(tl.maximum(tl.load(seqlens_ptr + i_b, cache_modifier=".cg"), 0), S_max - S_new)
        lo0, hi0 = _split_keys(n_c0 + S_new, i_s, NUM_SPLITS, BLOCK_N)
        hi0 = tl.minimum(tl.minimum(hi0, n_c0), lo0 + L2PF * BLOCK_N)
        LINE: tl.constexpr = 128 // (kc_ptr.dtype.element_ty.primitive_bitwidth // 8)  # elements per 128-byte line
        LINES: tl.constexpr = (HEAD_DIM + LINE - 1) // LINE
        o_line = (tl.arange(0, LINES) * LINE)[None, :]
        o_pf = tl.arange(0, BLOCK_N)
        for start in range(lo0, hi0, BLOCK_N):
            o_row = (start + o_pf).to(tl.int64)[:, None]
            m_pf = ((start + o_pf) < hi0)[:, None] & (o_line >= 0)
            prefetch_l2(p_k + o_row * stride_ks + o_line, m_pf)
            prefetch_l2(p_v + o_row * stride_vs + o_line, m_pf)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start: it waits the same way
    # clamped into the cache, so unchecked lengths (check_lengths=False) never address outside it
    n_cache = tl.minimum(tl.maximum(tl.load(seqlens_ptr + i_b), 0), S_max - S_new)
    n_total = n_cache + S_new

    # query rows: row r is query position r // GROUP of head i_g * GROUP + r % GROUP
    o_r = i_mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_r = o_r < M_ROWS
    o_qi = o_r // GROUP
    o_h = i_g * GROUP + (o_r % GROUP)
    o_d = tl.arange(0, HEAD_DIM)
    p_q = q_ptr + i_b * stride_qb + o_qi.to(tl.int64)[:, None] * stride_qs + o_h[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None], other=0.0)
    lim = o_qi + (n_total - Sq)  # causal: row sees key j iff j <= lim

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # this split's share of the keys: positions below n_cache come from the caches, the new tokens (APPEND) from
    # k/v, in the same loop, so the split that holds the tail runs no extra step for them
    lo, hi = _split_keys(n_total, i_s, NUM_SPLITS, BLOCK_N)
    p_kn = kn_ptr + i_b * stride_knb + i_g * stride_knh
    p_vn = vn_ptr + i_b * stride_vnb + i_g * stride_vnh
    o_n = tl.arange(0, BLOCK_N)
    if APPEND:
        # the blocks wholly inside the cache first, without the per-row source select (it cost the large shapes
        # 1-1.6% when every block ran it: results/h100-2026-11-24-166c1a9-decode.json); the rest, which may hold
        # new tokens, after
        mid = lo + tl.maximum(tl.minimum(hi, n_cache) - lo, 0) // BLOCK_N * BLOCK_N
    else:
        mid = hi
    for start in range(lo, mid, BLOCK_N):
        o_pos = start + o_n
        m_n = o_pos < hi
        o_pos64 = o_pos.to(tl.int64)[:, None]
        b_m, b_l, b_acc = _load_attend(p_k + o_pos64 * stride_ks, p_v + o_pos64 * stride_vs, o_d, o_pos, m_n, lim, b_q,
                                       b_m, b_l, b_acc, qk_scale, CAUSAL, UPCAST, IEEE)
    if APPEND:
        for start in range(mid, hi, BLOCK_N):
            o_pos = start + o_n
            m_n = o_pos < hi
            o_pos64 = o_pos.to(tl.int64)[:, None]
            new = (o_pos >= n_cache)[:, None]
            o_t64 = (o_pos - n_cache).to(tl.int64)[:, None]
            pk = tl.where(new, p_kn + o_t64 * stride_kns, p_k + o_pos64 * stride_ks)
            pv = tl.where(new, p_vn + o_t64 * stride_vns, p_v + o_pos64 * stride_vs)
            b_m, b_l, b_acc = _load_attend(pk, pv, o_d, o_pos, m_n, lim, b_q, b_m, b_l, b_acc, qk_scale, CAUSAL, UPCAST,
                                           IEEE)

    if APPEND:
        # the new tokens into the caches (no program reads those rows there), written by the last split: the
        # shortest (the rounding leaves it the remainder), often empty; one writer per row even with several row
        # blocks. The rows come from k/v again (L2), after the loop, so no other program waits on the load
        n_new = tl.where((i_s == NUM_SPLITS - 1) & (i_mb == 0), S_new, 0)
        o_t0 = tl.arange(0, BLOCK_NEW)
        for t0 in range(0, n_new, BLOCK_NEW):
            o_t = t0 + o_t0
            m_t = (o_t < S_new)[:, None]
            o_t64 = o_t.to(tl.int64)[:, None]
            o_w64 = (n_cache + o_t).to(tl.int64)[:, None]
            tl.store(p_k + o_w64 * stride_ks + o_d[None, :],
                     tl.load(p_kn + o_t64 * stride_kns + o_d[None, :], mask=m_t, other=0.0), mask=m_t)
            tl.store(p_v + o_w64 * stride_vs + o_d[None, :],
                     tl.load(p_vn + o_t64 * stride_vns + o_d[None, :], mask=m_t, other=0.0), mask=m_t)

    if DIRECT:
        # the only split: normalise here (a row that saw no key gives 0 and lse -inf, never 0 / 0)
        has = b_l > 0
        b_o = tl.where(has[:, None], b_acc / tl.where(has, b_l, 1.0)[:, None], 0.0)
        b_lse = tl.where(has, (b_m + tl.log2(tl.where(has, b_l, 1.0))) * 0.6931471805599453, float("-inf"))
        p_o = (o_ptr + i_b * stride_ob + o_qi.to(tl.int64)[:, None] * stride_os + o_h.to(tl.int64)[:, None] * stride_oh
               + o_d[None, :])
        tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_r[:, None])
        tl.store(lse_ptr + (i_b * H + o_h) * Sq + o_qi, b_lse, mask=m_r)
    else:
        o_part = (i_bg.to(tl.int64) * NUM_SPLITS + i_s) * M_ROWS + o_r
        tl.store(m_ptr + o_part, b_m, mask=m_r)
        tl.store(l_ptr + o_part, b_l, mask=m_r)
        # every row's acc, zeros where the split saw no key, so the merge loads all splits at once, unmasked
        seen = b_m > float("-inf")
        tl.store(acc_ptr + o_part[:, None] * HEAD_DIM + o_d[None, :], tl.where(seen[:, None], b_acc, 0.0),
                 mask=m_r[:, None])


@triton.jit
def flash_decode_merge_kernel(
    acc_ptr,  # [B * Hkv, NUM_SPLITS, M_ROWS, D] fp32 (zeros for a split that saw no key)
    m_ptr,  # [B * Hkv, NUM_SPLITS, M_ROWS] fp32 (log2 domain)
    l_ptr,  # [B * Hkv, NUM_SPLITS, M_ROWS] fp32
    o_ptr,  # [B, Sq, H, D] q's dtype
    lse_ptr,  # [B, H, Sq] fp32, natural log
    stride_ob, stride_os, stride_oh,
    Sq,
    M_ROWS,
    NUM_SPLITS,
    H: tl.constexpr,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # splits per trip: all of them in one (the launcher's choice) unless there are more
    BLOCK_D: tl.constexpr,  # head-dim columns per program (grid axis 1)
    PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start: it waits the same way
    pid = tl.program_id(0)
    i_dd = tl.program_id(1)
    i_bg = pid // M_ROWS
    i_r = pid % M_ROWS
    i_b = (i_bg // HKV).to(tl.int64)
    i_h = (i_bg % HKV) * GROUP + i_r % GROUP
    i_q = i_r // GROUP
    o_d = i_dd * BLOCK_D + tl.arange(0, BLOCK_D)
    o_s0 = tl.arange(0, BLOCK_S)
    base = i_bg.to(tl.int64) * NUM_SPLITS

    b_mx = tl.full([1], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([1], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        o_s = s0 + o_s0
        m_s = o_s < NUM_SPLITS
        o_part = (base + o_s) * M_ROWS + i_r
        # m, l and acc in one round trip: the split kernel writes every split's acc (zeros where it saw no key)
        b_ms = tl.load(m_ptr + o_part, mask=m_s, other=float("-inf"))
        b_ls = tl.load(l_ptr + o_part, mask=m_s, other=0.0)
        b_os = tl.load(acc_ptr + o_part[:, None] * HEAD_DIM + o_d[None, :], mask=m_s[:, None], other=0.0)
        m_new = tl.maximum(b_mx, tl.max(b_ms, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(b_mx - m_safe)
        b_w = tl.exp2(b_ms - m_safe)  # 0 for empty splits (m = -inf, m_safe finite)
        b_l = b_l * alpha + tl.sum(b_w * b_ls, 0)
        b_acc = b_acc * alpha + tl.sum(b_w[:, None] * b_os, 0)
        b_mx = m_new

    has = b_l > 0
    b_o = tl.where(has, b_acc / tl.where(has, b_l, 1.0), 0.0)
    b_lse = tl.where(has, (b_mx + tl.log2(tl.where(has, b_l, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(o_ptr + i_b * stride_ob + tl.cast(i_q, tl.int64) * stride_os + tl.cast(i_h, tl.int64) * stride_oh + o_d,
             b_o.to(o_ptr.dtype.element_ty))
    tl.store(lse_ptr + (i_b * H + i_h) * Sq + i_q + tl.arange(0, 1), b_lse, mask=i_dd == 0)  # one writer


# ----------------------------------------------------------------------------- launch configs



def _block_m(m_rows: int) -> int:
    return max(16, min(MAX_BLOCK_M, launch.next_power_of_2(m_rows)))


def _split_key(D, dtype, block_m):
    return launch.config_key(d=D, dtype=launch.dtype_tag(dtype), rows=block_m)


def _split_config(D, dtype, block_m):
    if _runtime.INTERPRET:  # small key blocks: short test caches still run multi-block loops
        fallback = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "programs_per_sm": 4, "min_blocks_per_split": 1}
    elif dtype == torch.float32:  # fp32 dots run on FMA units (ieee): smaller tiles, no spills
        fallback = {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "programs_per_sm": 4, "min_blocks_per_split": 2}
    else:
        # sm90 compile (ptxas): ~100 registers, 70 KB shared memory -> 3 programs per SM resident; but one program
        # per SM in all is fastest (benchmarks/decode_splits_probe.py, H100, graph-timed at the shapes, 16 / 2
        # heads, D 128): B=64 one split 92.5 / 687 us at 4k / 32k against 106 / 778 with 4 (3 per SM), B=8 8 splits
        # 18.2 / 95.3 / 347 us at 4k / 32k / 128k against 20.9 / 104 / 389 with 25, B=1 48-64 splits 20.6 / 53.4 us at
        # 32k / 128k against 28.8 / 63.7 with 198: more, shorter splits cost more in per-program start and merge
        # than their extra loads in flight buy. L2PF 1: each split's first key block asked of L2 before the PDL wait
        # (decode_splits_probe --l2pf, two calls, us without -> with: B=1 4k 8.8 -> 7.8, B=8 4k 18.2 / 18.4 -> 17.6 /
        # 17.7, B=1 32k 17.4 / 17.2 -> 17.2 / 17.5, B=1 128k 50.4 -> 50.0, B=8 32k 95.7 -> 95.2, B=64 92.4 / 686 both;
        # deeper measured slower)
        fallback = {
            "BLOCK_N": 64 if D >= 128 else 128,
            "num_warps": 4,
            "num_stages": 3,
            "programs_per_sm": 1,
            "min_blocks_per_split": 2,
            "L2PF": 1,
        }
    return launch.config("flash_decode_split", _split_key(D, dtype, block_m), fallback)


def _merge_config(D, dtype):
    # tile: the most partial-output elements (splits x head-dim columns) one merge program loads at once
    fallback = {"tile": 64 if _runtime.INTERPRET else 4096, "num_warps": 4 if D >= 128 else 2}
    return launch.config("flash_decode_merge", launch.config_key(d=D, dtype=launch.dtype_tag(dtype)), fallback)


def merge_blocks(num_splits, D, tile):
    """(BLOCK_S, BLOCK_D) of the merge: every split in one trip (BLOCK_S the next power of two of num_splits, up to
    ``tile`` / 16 of them), and as many head-dim columns as fit in ``tile`` elements (16 at least, a power of two
    dividing D), the rest of D on more programs. Each trip is one round trip to L2 for m, l and acc together: with
    16 splits per trip and one program per query row, 66 splits (B=1, 32k cache) cost 5 such trips in series,
    the merge alone 5.2 us against 2.1 for 8 splits in one trip (H100, benchmarks/decode_floor_probe.py)."""
    block_s = min(launch.next_power_of_2(max(num_splits, 1)), max(1, tile // 16))
    fit = max(1, tile // block_s)
    block_d = max(16, min(D, 1 << (fit.bit_length() - 1)))
    return block_s, block_d


def choose_num_splits(B, Hkv, S_max, row_blocks, block_n, programs_per_sm, min_blocks_per_split, num_sms=None):
    """Splits per (batch, kv head) so the split kernel runs at most ~programs_per_sm programs per SM (rounded down:
    B=64 with 2 kv heads is 128 programs unsplit on 132 SMs, and 2 splits, 256 programs, measured 111 against 92.5 us),
    each split keeping at least min_blocks_per_split key blocks of the cache capacity S_max."""
    num_sms = num_sms or _runtime.num_sms()
    programs = B * Hkv * row_blocks
    want = (num_sms * programs_per_sm) // programs
    most = max(1, launch.cdiv(S_max, block_n) // max(1, min_blocks_per_split))
    return max(1, min(want, most, MAX_SPLITS))


# ----------------------------------------------------------------------------- launcher


def flash_decode_split(q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale, num_splits=0, cfg=None,
                       pdl=False):
    """The split kernel alone. q, k, v contiguous; caches with unit last stride (written in place when
    k/v are given); cache_seqlens int32 [B]. Returns ``(o, lse)`` (o [B, Sq, H, D], lse [B, H, Sq]
    fp32) when there is one split (the kernel normalises and writes them itself), else the partials
    ``(acc [B * Hkv, S, G * Sq, D], m [B * Hkv, S, G * Sq], l)`` (fp32; m in the log2 domain, -inf
    for a split that saw no key) for flash_decode_merge. pdl: a programmatic dependent launch (sm90+)."""
    B, Sq, H, D = q.shape
    S_max, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = H // Hkv
    m_rows = G * Sq
    block_m = _block_m(m_rows)
    row_blocks = launch.cdiv(m_rows, block_m)
    cfg = cfg or _split_config(D, q.dtype, block_m)
    append = k is not None
    S_new = k.shape[1] if append else 0
    block_n = cfg["BLOCK_N"]
    if num_splits <= 0:
        num_splits = choose_num_splits(B, Hkv, S_max, row_blocks, block_n, cfg["programs_per_sm"],
                                       cfg["min_blocks_per_split"])
    dev = q.device
    direct = num_splits == 1
    e = q.element_size()
    if direct:  # no partials: their pointers are never used
        o = new_output((B, Sq, H, D), q.dtype, dev)
        lse = new_output((B, H, Sq), torch.float32, dev)
        acc, m_part, l_part = o, lse, lse
        out_bytes = o.numel() * e + lse.numel() * 4
    else:  # no output: its pointers are never used
        acc = new_output((B * Hkv, num_splits, m_rows, D), torch.float32, dev)
        m_part = new_output((B * Hkv, num_splits, m_rows), torch.float32, dev)
        l_part = new_output((B * Hkv, num_splits, m_rows), torch.float32, dev)
        o, lse = q, m_part
        out_bytes = acc.numel() * 4 + 8 * m_part.numel()
    kn, vn = (k, v) if append else (k_cache, v_cache)
    # byte model: the cached rows up to S_max at most (lengths are on the device), new rows read + written
    kv_bytes = 2 * B * S_max * Hkv * D * e + 4 * B * S_new * Hkv * D * e
    launch.launch(
        "flash_decode_split", flash_decode_split_kernel, (num_splits, B * Hkv, row_blocks),
        q, k_cache, v_cache, kn, vn, cache_seqlens, acc, m_part, l_part, o, lse,
        q.stride(0), q.stride(1), q.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        kn.stride(0), kn.stride(1), kn.stride(2),
        vn.stride(0), vn.stride(1), vn.stride(2),
        Sq, S_new, S_max, m_rows, num_splits, float(softmax_scale) * LOG2E,
        nbytes=kv_bytes + q.numel() * e + out_bytes,
        H=H, HKV=Hkv, GROUP=G, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_NEW=max(16, min(block_n, launch.next_power_of_2(max(S_new, 1)))),
        CAUSAL=bool(causal) and Sq > 1, APPEND=append,
        UPCAST=_runtime.INTERPRET and q.dtype == torch.bfloat16, IEEE=q.dtype == torch.float32,
        DIRECT=direct, L2PF=0 if _runtime.INTERPRET else cfg.get("L2PF", 0),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch.pdl_options(pdl),
    )
    return (o, lse) if direct else (acc, m_part, l_part)


def flash_decode_merge(q, k_cache, partials, merge_cfg=None, pdl=False):
    """The merge kernel on flash_decode_split's partials (acc, m, l) for queries q [B, Sq, H, D]
    against caches shaped like k_cache. Returns (o [B, Sq, H, D], lse [B, H, Sq] fp32)."""
    acc, m_part, l_part = partials
    B, Sq, H, D = q.shape
    Hkv = k_cache.shape[2]
    G = H // Hkv
    m_rows = G * Sq
    num_splits = acc.shape[1]
    merge_cfg = merge_cfg or _merge_config(D, q.dtype)
    o = new_output((B, Sq, H, D), q.dtype, q.device)
    lse = new_output((B, H, Sq), torch.float32, q.device)
    block_s, block_d = merge_blocks(num_splits, D, merge_cfg["tile"])
    launch.launch(
        "flash_decode_merge", flash_decode_merge_kernel, (B * Hkv * m_rows, D // block_d),
        acc, m_part, l_part, o, lse, o.stride(0), o.stride(1), o.stride(2), Sq, m_rows, num_splits,
        nbytes=acc.numel() * 4 + 8 * m_part.numel() * (D // block_d) + o.numel() * q.element_size() + lse.numel() * 4,
        H=H, HKV=Hkv, GROUP=G, HEAD_DIM=D, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=merge_cfg["num_warps"],
        **launch.pdl_options(pdl),
    )
    return o, lse


def flash_decode_fwd(q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale, num_splits=0, cfg=None,
                     merge_cfg=None, pdl=False):
    """Both kernels (the split kernel alone when there is one split; see flash_decode_split).
    Returns (o [B, Sq, H, D], lse [B, H, Sq] fp32)."""
    out = flash_decode_split(q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale, num_splits, cfg, pdl)
    return out if len(out) == 2 else flash_decode_merge(q, k_cache, out, merge_cfg, pdl)


# ----------------------------------------------------------------------------- validation


def _validate(q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale, num_splits):
    """Static checks (shapes, dtypes, devices); returns the new-token count."""
    check_tensor("q", q, dtypes=DTYPES, ndim=4)
    check_tensor("k_cache", k_cache, dtypes=DTYPES, ndim=4)
    check_tensor("v_cache", v_cache, dtypes=DTYPES, ndim=4)
    B, Sq, H, D = q.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"q has head_dim {D}; flash_attn_with_kvcache supports head_dim in {HEAD_DIMS}")
    if k_cache.dtype != q.dtype:
        raise TypeError(f"k_cache must have q's dtype ({q.dtype}), got {k_cache.dtype}")
    if v_cache.dtype != q.dtype:
        raise TypeError(f"v_cache must have q's dtype ({q.dtype}), got {v_cache.dtype}")
    if k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(
            f"k_cache must be [B, S_max, Hkv, D] with B = {B} and D = {D} to match q {tuple(q.shape)}, "
            f"got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    Hkv = k_cache.shape[2]
    if H % Hkv:
        raise ValueError(f"k_cache has {Hkv} kv heads, which must divide q's {H} heads")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")
    S_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values), or neither")
    if k is not None:
        check_tensor("k", k, dtypes=DTYPES, ndim=4)
        check_tensor("v", v, dtypes=DTYPES, ndim=4)
        if k.dtype != q.dtype:
            raise TypeError(f"k must have q's dtype ({q.dtype}), got {k.dtype}")
        if v.dtype != q.dtype:
            raise TypeError(f"v must have q's dtype ({q.dtype}), got {v.dtype}")
        if k.shape[0] != B or k.shape[2] != Hkv or k.shape[3] != D:
            raise ValueError(
                f"k must be [B, Sn, Hkv, D] = [{B}, Sn, {Hkv}, {D}] to match q and k_cache, got {tuple(k.shape)}"
            )
        if v.shape != k.shape:
            raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        S_new = k.shape[1]
        if S_new > k_cache.shape[1]:
            raise ValueError(f"k has {S_new} new tokens, more than the cache holds (S_max = {k_cache.shape[1]})")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    S_max = k_cache.shape[1]
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens must be an int32 tensor, got {cache_seqlens.dtype}")
        if tuple(cache_seqlens.shape) != (B,):
            raise ValueError(
                f"cache_seqlens must have shape ({B},) (one length per batch row), got {tuple(cache_seqlens.shape)}"
            )
        if cache_seqlens.device != q.device:
            raise ValueError(
                f"cache_seqlens is on {cache_seqlens.device} but q is on {q.device}; they must share a device"
            )
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= S_max - S_new:
            raise ValueError(
                f"cache_seqlens = {cache_seqlens} plus {S_new} new tokens must lie in [0, S_max = {S_max}] "
                f"(the cache length k_cache.shape[1])"
            )
    else:
        raise TypeError(
            f"cache_seqlens must be an int32 tensor [B] or a Python int, got {type(cache_seqlens).__name__}"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale must be a positive float or None, got {type(softmax_scale).__name__}")
        if not (math.isfinite(softmax_scale) and softmax_scale > 0):  # as flash_attn_func
            raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int (0: heuristic), got {type(num_splits).__name__}")
    if not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must lie in [0, {MAX_SPLITS}] (0: heuristic), got {num_splits}")
    return S_new


def _check_lengths(cache_seqlens, S_new, S_max):
    """cache_seqlens + S_new within [0, S_max]: reads the lengths on the host (one device sync)."""
    lo, hi = (int(x) for x in torch.aminmax(cache_seqlens))
    if lo < 0:
        raise ValueError(f"cache_seqlens must be non-negative, got a minimum of {lo}")
    if hi + S_new > S_max:
        raise ValueError(
            f"cache_seqlens + new tokens overflow the cache: max(cache_seqlens) = {hi} plus {S_new} new "
            f"token(s) > S_max = {S_max} (k_cache.shape[1])"
        )


# ----------------------------------------------------------------------------- custom ops


def _run(q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale, num_splits, check_lengths):
    S_new = _validate(q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale, num_splits)
    if check_lengths:
        _check_lengths(cache_seqlens, S_new, k_cache.shape[1])
    k = k.contiguous() if k is not None else None
    v = v.contiguous() if v is not None else None
    # programmatic dependent launch (sm90+; TRIFORGE_PDL=0 turns it off): both kernels wait for the previous kernel
    # before any access, so it is safe after any producer; the merge launch then overlaps the split kernel's tail
    return flash_decode_fwd(q.contiguous(), k_cache, v_cache, cache_seqlens.contiguous(), k, v, causal,
                            softmax_scale, num_splits, pdl=launch.pdl_wanted())


def _fake(q, cache_seqlens):
    B, Sq, H, D = q.shape
    return q.new_empty((B, Sq, H, D)), q.new_empty((B, H, Sq), dtype=torch.float32)


@torch.library.custom_op("triforge::flash_attn_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _kvcache_append_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
    k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float, num_splits: int, check_lengths: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append k/v into the caches at cache_seqlens (in place), then attend: (o, lse)."""
    return _run(q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale, num_splits, check_lengths)


@_kvcache_append_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale, num_splits, check_lengths):
    return _fake(q, cache_seqlens)


@torch.library.custom_op("triforge::flash_attn_kvcache", mutates_args=())
def _kvcache_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
    causal: bool, softmax_scale: float, num_splits: int, check_lengths: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend over the cached prefix only (nothing written): (o, lse)."""
    return _run(q, k_cache, v_cache, cache_seqlens, None, None, causal, softmax_scale, num_splits, check_lengths)


@_kvcache_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, causal, softmax_scale, num_splits, check_lengths):
    return _fake(q, cache_seqlens)


# ----------------------------------------------------------------------------- public API


def flash_attn_with_kvcache(
    q, k_cache, v_cache, cache_seqlens, k=None, v=None, causal: bool = True, softmax_scale=None,
    return_lse: bool = False, num_splits: int = 0, check_lengths: bool = True,
):
    """Decode attention against a KV cache (flash-attn's ``flash_attn_with_kvcache``, forward only).

    q [B, Sq, H, D] (Sq small, typically 1); k_cache, v_cache [B, S_max, Hkv, D] with Hkv dividing H;
    cache_seqlens int32 [B] (or a Python int for every row): the cached length of each row. When
    k, v [B, Sn, Hkv, D] are given they are written into the caches IN PLACE at rows
    cache_seqlens[b] .. cache_seqlens[b] + Sn - 1 before attending. Row b attends over its first
    cache_seqlens[b] + Sn keys, with bottom-right causal alignment when ``causal`` and Sq > 1.
    fp16, bf16 or fp32; head_dim 64 or 128. ``softmax_scale`` defaults to D ** -0.5;
    ``num_splits`` > 0 forces the KV split count (0: heuristic).

    Returns o [B, Sq, H, D] in q's dtype, and with ``return_lse`` also lse [B, H, Sq] (fp32,
    natural log; -inf for a query that sees no key, whose o is 0).

    A tensor cache_seqlens is read on the host to check that 0 <= cache_seqlens and
    cache_seqlens + Sn <= S_max: one device sync per call. ``check_lengths=False`` skips it (no sync,
    CUDA-graph capturable); the kernel then clamps each length into [0, S_max - Sn], so memory
    outside the caches is never touched, but a row whose length was out of range gets a meaningless
    result (and its new rows land at the end of the cache).
    """
    S_new = _validate(q, k_cache, v_cache, cache_seqlens, k, v, causal, softmax_scale, num_splits)
    if not isinstance(check_lengths, bool):
        raise TypeError(f"check_lengths must be a bool, got {type(check_lengths).__name__}")
    scale = float(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)
    if not isinstance(cache_seqlens, torch.Tensor):
        # a Python int was checked on the host by _validate: the op need not read the tensor made of it
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
        check_lengths = False
    elif check_lengths and launch.eager(q, k_cache, v_cache, cache_seqlens):
        # early, before the op, which then skips its own check (one device sync per call, not two); under any tracer
        # (dynamo, make_fx, torch.jit.trace) the op keeps its check, so a traced graph checks every replay
        _check_lengths(cache_seqlens, S_new, k_cache.shape[1])
        check_lengths = False
    if k is not None:
        o, lse = torch.ops.triforge.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, causal, scale,
                                                            num_splits, bool(check_lengths))
    else:
        o, lse = torch.ops.triforge.flash_attn_kvcache(q, k_cache, v_cache, cache_seqlens, causal, scale, num_splits,
                                                       bool(check_lengths))
    return (o, lse) if return_lse else o


# ----------------------------------------------------------------------------- registry

_REAL = {"B": 1, "S": 32768, "H": 16, "Hkv": 2, "D": 128, "Sq": 1, "Sn": 1}


def _randn(shape, dtype, device, gen):
    """Standard normal values; big device tensors are drawn on the device (seeded from gen)."""
    if torch.device(device).type == "cuda":
        g = torch.Generator(device=device)
        g.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def _make_inputs(tier, dtype, device, gen):
    if tier == "tiny":
        B, S, H, Hkv, D, Sq, Sn = 3, 80, 4, 2, 64, 1, 1
        seqlens = torch.randint(1, 71, (B,), generator=gen, dtype=torch.int32)
    else:
        dims = dict(_REAL)
        if isinstance(tier, dict):
            dims.update(tier)
        elif tier != "real":
            raise KeyError(f"unknown tier {tier!r}")
        B, S, H, Hkv, D, Sq, Sn = (int(dims[n]) for n in ("B", "S", "H", "Hkv", "D", "Sq", "Sn"))
        seqlens = torch.full((B,), S - Sn, dtype=torch.int32)  # a full cache after the append
    inputs = {
        "q": _randn((B, Sq, H, D), dtype, device, gen),
        "k_cache": _randn((B, S, Hkv, D), dtype, device, gen),  # random past the lengths too: must be ignored
        "v_cache": _randn((B, S, Hkv, D), dtype, device, gen),
        "cache_seqlens": seqlens.to(device),
    }
    if Sn:
        inputs["k"] = _randn((B, Sn, Hkv, D), dtype, device, gen)
        inputs["v"] = _randn((B, Sn, Hkv, D), dtype, device, gen)
    return inputs


def _reference(q, k_cache, v_cache, cache_seqlens, k=None, v=None):
    """kvcache_attention_ref one batch row at a time (it clones the caches it is given)."""
    lses, outs = [], []
    for b in range(q.shape[0]):
        sl = slice(b, b + 1)
        st, _, _ = kvcache_attention_ref(
            q[sl], k_cache[sl], v_cache[sl], cache_seqlens[sl],
            None if k is None else k[sl], None if v is None else v[sl], causal=True,
        )
        lses.append(st["lse"])
        outs.append(st["o"])
    return OrderedDict(lse=torch.cat(lses), o=torch.cat(outs))


def _stages(q, k_cache, v_cache, cache_seqlens, k=None, v=None):
    o, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, causal=True, return_lse=True)
    return OrderedDict(lse=lse, o=o)


def _keys(inputs):
    """Keys attended, summed over the batch (reads the lengths on the host)."""
    k = inputs.get("k")
    n = int(inputs["cache_seqlens"].to(torch.int64).sum())
    return n + (0 if k is None else k.shape[0] * k.shape[1])


def _bytes(inputs, mode):
    q, kc = inputs["q"], inputs["k_cache"]
    Hkv, D, e = kc.shape[2], kc.shape[3], kc.element_size()
    k = inputs.get("k")
    new_rows = 0 if k is None else k.shape[0] * k.shape[1]
    # K/V rows attended (cached rows from the caches, new rows from k/v), the new rows written to the
    # caches, q read and o written
    return 2 * _keys(inputs) * Hkv * D * e + 2 * new_rows * Hkv * D * e + 2 * q.numel() * e


def _flops(inputs, mode):
    B, Sq, H, D = inputs["q"].shape
    return 4 * H * Sq * D * _keys(inputs)


def sdpa_decode(q, k_cache, v_cache, cache_seqlens, k=None, v=None, causal=True, softmax_scale=None, s_used=None):
    """The same decode step in PyTorch: index_put the new rows, then one batched SDPA over the first
    ``s_used`` cache rows (default S_max) with a [B, 1, Sq, s_used] boolean mask. Returns (o,)."""
    B, Sq, H, D = q.shape
    S_max = k_cache.shape[1]
    s_used = S_max if s_used is None else s_used
    n = cache_seqlens.to(torch.int64)
    if k is not None:
        pos = n[:, None] + torch.arange(k.shape[1], device=q.device)
        b_idx = torch.arange(B, device=q.device)[:, None]
        k_cache[b_idx, pos] = k
        v_cache[b_idx, pos] = v
        n = n + k.shape[1]
    j = torch.arange(s_used, device=q.device)
    mask = j[None, None, :] < n[:, None, None]  # [B, 1, s_used]
    if causal and Sq > 1:
        i = torch.arange(Sq, device=q.device)
        mask = mask & (j[None, None, :] <= i[None, :, None] + n[:, None, None] - Sq)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k_cache[:, :s_used].transpose(1, 2), v_cache[:, :s_used].transpose(1, 2),
        attn_mask=mask[:, None].expand(B, 1, Sq, s_used), scale=softmax_scale, enable_gqa=True,
    )
    return (o.transpose(1, 2),)


def _sdpa_peer(inputs):
    if not torch.cuda.is_available():
        return None
    k = inputs.get("k")
    s_used = int(inputs["cache_seqlens"].max()) + (0 if k is None else k.shape[1])

    def run(q, k_cache, v_cache, cache_seqlens, k=None, v=None):
        return sdpa_decode(q, k_cache, v_cache, cache_seqlens, k, v, causal=True, s_used=s_used)

    return run


def _describe(inputs):
    B, Sq, H, D = inputs["q"].shape
    S, Hkv = inputs["k_cache"].shape[1:3]
    k = inputs.get("k")
    return f"B={B} S={S} H={H} Hkv={Hkv} D={D} Sq={Sq} Sn={0 if k is None else k.shape[1]}"


def _tune_setup(shape, dtype, device):
    gen = torch.Generator().manual_seed(0)
    inputs = _make_inputs(dict(shape), dtype, device, gen)
    q, kc, vc, sl, k, v = (inputs.get(n) for n in ("q", "k_cache", "v_cache", "cache_seqlens", "k", "v"))
    B, Sq, H, D = q.shape
    block_m = _block_m(H // kc.shape[2] * Sq)
    scale = D**-0.5
    return (lambda cfg: flash_decode_fwd(q, kc, vc, sl, k, v, True, scale, 0, cfg)), _split_key(D, dtype, block_m)


register_tunable(Tunable(
    kernel="flash_decode_split",
    space={
        "BLOCK_N": [32, 64, 128],
        "num_warps": [2, 4, 8],
        "num_stages": [2, 3, 4],
        "programs_per_sm": [1, 2, 3, 4, 8],
        "min_blocks_per_split": [2],
        "L2PF": [0, 1],
    },
    setup=_tune_setup,
    shape_names=("B", "S", "H", "Hkv", "D"),
    default_shape={k: _REAL[k] for k in ("B", "S", "H", "Hkv", "D")},
))

register(OpSpec(
    name="flash_decode",
    family="attention_decode",
    make_inputs=_make_inputs,
    reference=_reference,
    stages=_stages,
    # timed calls skip the host-side length check (a device sync per call, which would time the
    # host round trip; the peer checks nothing either); check_op's stages keep it
    call=lambda q, k_cache, v_cache, cache_seqlens, k=None, v=None: (
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, causal=True, check_lengths=False),
    ),
    outputs=("o",),
    grad_inputs=(),
    flops=_flops,
    bytes=_bytes,
    peers={"sdpa": _sdpa_peer},
    dtypes=(torch.float16, torch.bfloat16, torch.float32),
    describe=_describe,
    # the grid: batch 1, 8, 64 against caches of 4k, 32k, 128k (16 q heads / 2 kv heads, D 128)
    bench_shapes=tuple(dict(_REAL, B=B, S=S) for B in (1, 8, 64) for S in (4096, 32768, 131072)),
    shape_names=tuple(_REAL),
    # timed as CUDA-graph replay (the peer too): decode runs inside a captured step, and per call a 5-50 us kernel
    # times the host's launch (0.30-0.33 ms per call at every batch-1 and batch-8 shape at 4bc4ed3)
    bench_graph=True,
))

__all__ = ["flash_attn_with_kvcache", "choose_num_splits", "sdpa_decode"]
