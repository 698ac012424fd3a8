"""Decode attention over a KV cache fused with the output projection and the residual add (one launch).

    q [B, H, D] (one new token per row, RoPE applied), k_cache / v_cache [B, S_max, Hkv, D],
    lengths int32 [B] (keys row b attends to, its new one included), w_o [N, H * D], residual [B, N]:
    o[b, h] = softmax(scale q[b, h] K[b, :n_b, h // G]^T) V[b, :n_b, h // G]        (G = H / Hkv)
    y[b] = round(round(w_o round(o[b])) + residual[b])                               (the eager model's roundings)

For a small decoder's batch-1 step the three kernels it replaces (flash-decoding's split and merge, then
the o_proj GEMV) are each a few microseconds of latency with little data: the o_proj weight is 1.6 MB and
the cache of a few hundred keys 100-200 KB. ``flash_decode_oproj_kernel``, grid (cdiv(N, BLOCK_R), B):
every program computes the whole attention of its batch row (all H heads, every key: the K/V blocks
come from L2 after the first program's miss) and then BLOCK_R rows of y. Its weight tile
[BLOCK_R, HM, D] (HM = H rounded up to a power of two, masked) is loaded before griddepcontrol.wait, so
under programmatic dependent launch the weights stream in while the QKV kernel drains; the cached K/V rows
are asked into L2 then too (prefetch.global.L2, a hint: cfg "PF"), and the residual is loaded right after
the wait, so neither round trip sits at the end of the program.

Attention rows are the H query heads of the row as one [HM, D] tile. Each key block is loaded once per
kv head, and every kv head's dot runs over all rows; a row keeps the scores of its own kv head (and P
is masked to it for the PV dot), so one online softmax covers all heads. The extra dots (Hkv times
the needed work) are small tensor-core products; the point of the kernel is fewer round trips.

Cost grows with the cache length in every program (each reads all K/V of its batch row): the engine
takes this path for short caches and small batches only (``fits``); flash-decoding stays the general
path (triforge.ops.attention.decode).

A row with no key (n_b = 0) gives o = 0 (l = 0 is never divided by). Rows past H are masked out of the
weight tile, so their values (finite: their q is 0) add nothing to y.
"""

import torch
import triton
import triton.language as tl

from triforge import _runtime, launch
from triforge.launch import new_output
from triforge.ops._tl import cast as _cast
from triforge.ops._tl import prefetch_l2
from triforge.ops.attention.decode import LOG2E, _mma

# the engine's limits for this path (beyond them each program's K/V stream or weight tile grows too large)
MAX_BATCH = 2
MAX_KEYS = 2048
MAX_TILE = 8192  # weight-tile elements per program (BLOCK_R * HM * D) the fallback keeps to


@triton.jit
def flash_decode_oproj_kernel(
    q_ptr,  # [B, H, D] contiguous
    kc_ptr,  # [B, S_max, HKV, D] key cache
    vc_ptr,  # [B, S_max, HKV, D] value cache
    len_ptr,  # [B] int32 keys per row
    w_ptr,  # [N, H * D] output projection, row-major
    r_ptr,  # [B, N] residual
    y_ptr,  # [B, N] out, q's dtype
    o_ptr,  # [B, H * D] out (STORE_O): the attention output, q's dtype
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    S_max,
    N,
    qk_scale,  # softmax_scale * log2(e)
    H: tl.constexpr,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HM: tl.constexpr,  # H rounded up to a power of two (>= 16: the dot's rows)
    BLOCK_N: tl.constexpr,  # keys per block
    BLOCK_R: tl.constexpr,  # output rows per program
    STORE_O: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    RNE: tl.constexpr,
    PDL: tl.constexpr,
    PF_ROWS: tl.constexpr = 0,  # > 0: cache rows asked into L2 before the wait (PF_ROWS per program, strided)
    PF_LINES: tl.constexpr = 1,  # 128-byte lines per cached row of one head
):
    GROUP: tl.constexpr = H // HKV
    C: tl.constexpr = H * HEAD_DIM
    DT = q_ptr.dtype.element_ty
    i_r = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    o_h = tl.arange(0, HM)
    m_h = o_h < H
    o_d = tl.arange(0, HEAD_DIM)
    o_rr = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_rr = o_rr < N
    # the weight tile [BLOCK_R, HM, D]: w_o[r, h D + d] (constant: loaded before the wait)
    o_w = (o_rr.to(tl.int64) * C)[:, None, None] + (o_h * HEAD_DIM)[None, :, None] + o_d[None, None, :]
    b_w = tl.load(w_ptr + o_w, mask=m_rr[:, None, None] & m_h[None, :, None], other=0.0)
    if PF_ROWS > 0:
        # the cached K/V rows this program will read, asked into L2 while the previous kernel drains: the
        # programs split the rows (program p: rows p, p + P, ...). A hint only: whatever the length read here
        # (read again after the wait), no value the kernel computes depends on it
        n_pf = tl.minimum(tl.maximum(tl.load(len_ptr + i_b), 0), S_max)
        o_pr = i_r + tl.arange(0, PF_ROWS) * tl.num_programs(0)
        o_ln = tl.arange(0, PF_LINES) * (1024 // q_ptr.dtype.element_ty.primitive_bitwidth)  # elements per line
        for g in tl.static_range(HKV):
            prefetch_l2(kc_ptr + i_b * stride_kb + g * stride_kh + o_pr.to(tl.int64)[:, None] * stride_ks
                        + o_ln[None, :], (o_pr < n_pf)[:, None])
            prefetch_l2(vc_ptr + i_b * stride_vb + g * stride_vh + o_pr.to(tl.int64)[:, None] * stride_vs
                        + o_ln[None, :], (o_pr < n_pf)[:, None])
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start: it waits the same way

    # the residual (the previous kernel's output) now: its L2 round trip overlaps the attention
    b_r = tl.load(r_ptr + i_b * N + o_rr, mask=m_rr, other=0.0).to(tl.float32)
    # clamped into the cache, so a bad length never addresses outside it
    n = tl.minimum(tl.maximum(tl.load(len_ptr + i_b), 0), S_max)
    b_q = tl.load(q_ptr + (i_b * H + o_h)[:, None] * HEAD_DIM + o_d[None, :], mask=m_h[:, None], other=0.0)
    grp = o_h // GROUP  # each row's kv head
    b_m = tl.full([HM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([HM], dtype=tl.float32)
    b_acc = tl.zeros([HM, HEAD_DIM], dtype=tl.float32)
    o_n = tl.arange(0, BLOCK_N)
    p_k = kc_ptr + i_b * stride_kb
    p_v = vc_ptr + i_b * stride_vb
    for start in range(0, n, BLOCK_N):
        o_pos = start + o_n
        m_n = o_pos < n
        o_pos64 = o_pos.to(tl.int64)
        b_s = tl.zeros([HM, BLOCK_N], dtype=tl.float32)
        for g in tl.static_range(HKV):
            b_k = tl.load(p_k + g * stride_kh + o_pos64[:, None] * stride_ks + o_d[None, :], mask=m_n[:, None],
                          other=0.0)
            b_s = tl.where((grp == g)[:, None], _mma(b_q, tl.trans(b_k), tl.zeros_like(b_s), UPCAST, IEEE), b_s)
        b_s = tl.where(m_n[None, :], b_s * qk_scale, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(b_s, 1))  # finite: every block holds at least one key
        alpha = tl.exp2(b_m - m_new)
        b_p = tl.exp2(b_s - m_new[:, None])
        b_l = b_l * alpha + tl.sum(b_p, 1)
        b_acc = b_acc * alpha[:, None]
        for g in tl.static_range(HKV):
            b_v = tl.load(p_v + g * stride_vh + o_pos64[:, None] * stride_vs + o_d[None, :], mask=m_n[:, None],
                          other=0.0)
            b_acc = _mma(tl.where((grp == g)[:, None], b_p, 0.0).to(b_v.dtype), b_v, b_acc, UPCAST, IEEE)
        b_m = m_new

    has = b_l > 0
    b_o = tl.where(has[:, None], b_acc / tl.where(has, b_l, 1.0)[:, None], 0.0)
    b_o = _cast(b_o, DT, RNE).to(tl.float32)  # o as the unfused path stores it
    if STORE_O:
        tl.store(o_ptr + (i_b * H + o_h)[:, None] * HEAD_DIM + o_d[None, :], b_o.to(o_ptr.dtype.element_ty),
                 mask=m_h[:, None] & (i_r == 0))
    b_y = tl.sum(tl.sum(b_w.to(tl.float32) * b_o[None, :, :], axis=2), axis=1)  # [BLOCK_R]
    b_y = _cast(b_y, DT, RNE).to(tl.float32)
    b_y += b_r
    tl.store(y_ptr + i_b * N + o_rr, _cast(b_y, y_ptr.dtype.element_ty, RNE), mask=m_rr)


def _hm(H: int) -> int:
    return max(16, launch.next_power_of_2(H))


def fallback_config(H: int, D: int, N: int) -> dict:
    """BLOCK_R rows per program: the weight tile held to MAX_TILE elements (16 KB in 16-bit), halved while there
    are fewer programs than SMs (the tuned Qwen2 entry went the other way: 28 programs of 32 rows, since every
    program streams all of its row's K/V). The interpreter: one program for many rows, small key blocks (short test
    caches still loop)."""
    hm = _hm(H)
    if _runtime.INTERPRET:
        return {"BLOCK_R": max(1, min(launch.next_power_of_2(N), 16384 // (hm * D))), "BLOCK_N": 16, "num_warps": 4,
                "num_stages": 1}
    block_r = max(1, MAX_TILE // (hm * D))
    while block_r > 1 and launch.cdiv(N, block_r) < _runtime.num_sms():
        block_r //= 2
    return {"BLOCK_R": block_r, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def config(H: int, Hkv: int, D: int, N: int, dtype: torch.dtype) -> dict:
    key = launch.config_key(h=H, hkv=Hkv, d=D, n=N, dtype=launch.dtype_tag(dtype))
    return launch.config("flash_decode_oproj", key, fallback_config(H, D, N))


def fits(B: int, S_max: int, H: int, D: int) -> bool:
    """Whether the engine should take this path: few rows, a short cache (each program reads all of it)."""
    return B <= MAX_BATCH and S_max <= MAX_KEYS and _hm(H) * D <= MAX_TILE


def flash_decode_oproj(q, k_cache, v_cache, lengths, w_o, residual, softmax_scale, store_o=False, cfg=None,
                       pdl=False):
    """q [B, H, D], w_o [N, H * D], residual [B, N]: contiguous, one dtype; caches [B, S_max, Hkv, D] with unit
    last stride; lengths int32 [B] (clamped into [0, S_max] by the kernel). Returns (y [B, N], o [B, H * D] or
    None). pdl: a programmatic dependent launch (sm90+): w_o is read before the previous kernel in the stream has
finished (it must not be that kernel's output, as for the GEMVs); everything else is read after the wait."""
    _check(q, k_cache, v_cache, lengths, w_o, residual)
    B, H, D = q.shape
    S_max, Hkv = k_cache.shape[1], k_cache.shape[2]
    N = w_o.shape[0]
    cfg = cfg or config(H, Hkv, D, N, q.dtype)
    y = new_output((B, N), q.dtype, q.device)
    o = new_output((B, H * D), q.dtype, q.device) if store_o else None
    e = q.element_size()
    pdl_opts = launch.pdl_options(pdl)
    launch.launch(
        "flash_decode_oproj", flash_decode_oproj_kernel, (launch.cdiv(N, cfg["BLOCK_R"]), B),
        q, k_cache, v_cache, lengths, w_o, residual, y, o if o is not None else y,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        S_max, N, float(softmax_scale) * LOG2E,
        # byte model: the weight once, the cache rows up to S_max once (L2 serves the other programs)
        nbytes=e * (w_o.numel() + 2 * B * S_max * Hkv * D + q.numel() + 2 * B * N + (o.numel() if o is not None else 0)),
        H=H, HKV=Hkv, HEAD_DIM=D, HM=_hm(H), BLOCK_N=cfg["BLOCK_N"], BLOCK_R=cfg["BLOCK_R"], STORE_O=store_o,
        PF_ROWS=_pf_rows(cfg, pdl_opts["PDL"], S_max, launch.cdiv(N, cfg["BLOCK_R"])), PF_LINES=max(1, D * e // 128),
        UPCAST=_runtime.INTERPRET and q.dtype == torch.bfloat16, IEEE=q.dtype == torch.float32,
        RNE=_runtime.INTERPRET and q.dtype == torch.bfloat16,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_opts,
    )
    return y, o


def _pf_rows(cfg, pdl_on, S_max, programs) -> int:
    """Rows per program of the L2 prefetch before the wait (cfg "PF", default on): compiled, under PDL only."""
    if _runtime.INTERPRET or not pdl_on or not int(cfg.get("PF", 1)):
        return 0
    return launch.next_power_of_2(launch.cdiv(S_max, programs))


def _check(q, k_cache, v_cache, lengths, w_o, residual):
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D], got shape {tuple(q.shape)}")
    B, H, D = q.shape
    if k_cache.dim() != 4 or k_cache.shape[0] != B or k_cache.shape[3] != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache / v_cache must be [B={B}, S_max, Hkv, D={D}] and equal, got "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    Hkv = k_cache.shape[2]
    if H % Hkv:
        raise ValueError(f"q heads ({H}) must be a multiple of the cache's kv heads ({Hkv})")
    if D & (D - 1) or D < 16:
        raise ValueError(f"head dim must be a power of two >= 16, got {D}")
    if w_o.dim() != 2 or w_o.shape[1] != H * D:
        raise ValueError(f"w_o must be [N, H * D = {H * D}], got {tuple(w_o.shape)}")
    if residual.shape != (B, w_o.shape[0]):
        raise ValueError(f"residual must be [{B}, {w_o.shape[0]}], got {tuple(residual.shape)}")
    if lengths.shape != (B,) or lengths.dtype != torch.int32:
        raise ValueError(f"lengths must be int32 [{B}], got {lengths.dtype} {tuple(lengths.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("w_o", w_o), ("residual", residual)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if lengths.device != q.device:
        raise ValueError(f"lengths must be on q's device {q.device}, got {lengths.device}")
    for name, t in (("q", q), ("w_o", w_o), ("residual", residual)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache / v_cache must have unit stride in the head dim")
