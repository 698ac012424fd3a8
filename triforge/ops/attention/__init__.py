"""Exact attention, flash-attn's API and layout: q [B, Sq, H, D], k/v [B, Sk, Hkv, D] (H % Hkv == 0).

    flash_attn_func(q, k, v, causal=False, softmax_scale=None, return_lse=False) -> o (, lse)
    flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal=False, softmax_scale=None, return_lse=False) -> o (, lse)

The varlen form packs B sequences: q [Tq, H, D], k/v [Tk, Hkv, D], sequence b in rows
cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q (cu_seqlens_k for k/v; int32 [B + 1] prefix sums);
lse is [H, Tq]. It runs the same kernels with their VARLEN variant.

Forward and backward are FlashAttention-2 Triton kernels (forward.py, backward.py); on Hopper the forward at head
dim 64/128 may instead be FlashAttention-3's warp-specialized structure written in Gluon (forward_ws.py), where the
sm90 config's ``GLUON`` entry says so (``_gluon_cfg``). They are wrapped as torch.library custom ops with fakes and
autograd:

    torch.ops.triforge.flash_attn_fwd(q, k, v, causal, softmax_scale, residual) -> (o, lse [B, H, Sq] fp32, o_res)
    torch.ops.triforge.flash_attn_bwd(do, q, k, v, o, o_res, lse, dlse, causal, softmax_scale) -> (dq, dk, dv)
    torch.ops.triforge.flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        causal, softmax_scale, residual) -> (o, lse [H, Tq] fp32, o_res)
    torch.ops.triforge.flash_attn_varlen_bwd(do, q, k, v, o, o_res, lse, dlse, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, causal, softmax_scale) -> (dq, dk, dv)

o_res (written only when a backward will need it, 16-bit inputs) is o's rounding error: the
backward's delta = rowsum(dO * O) then uses O to twice its dtype's mantissa bits. With the rounded o
alone, delta's error dominates dq/dk wherever softmax rows are peaked (dP - delta cancels), and they
fail the float64 comparison.

Causal masking is bottom-right aligned (query i sees keys j <= i + Sk - Sq; per sequence for varlen);
a query row that sees no key returns 0 and lse = -inf, and gets zero gradients.
"""

import itertools
import math
import os
from collections import OrderedDict
from typing import NamedTuple

import torch
import torch.utils.checkpoint

from triforge import _runtime, launch
from triforge.launch import new_output
from triforge.ops._checks import check_same_device, check_same_dtype, check_tensor
from triforge.ops.attention.backward import (
    flash_attn_bwd_dkdv_kernel,
    flash_attn_bwd_dq_convert_kernel,
    flash_attn_bwd_dq_kernel,
    flash_attn_bwd_preprocess_kernel,
)
from triforge.ops.attention.forward import LOG2E, flash_attn_fwd_kernel
from triforge.ops.attention.reference import (
    attention_magnitudes,
    attention_ref,
    causal_mask,
    kvcache_attention_ref,
    varlen_attention_ref,
)
from triforge.registry import OpSpec, register
from triforge.tune import Tunable
from triforge.tune import register as register_tunable

HEAD_DIMS = (32, 64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# ----------------------------------------------------------------------------- launch configs


def _c(bm, bn, w, s, **variant):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, **variant}


# Config keys beyond the tiles (each defaults to 0, the portable path):
# - TMA (all three kernels): the streamed tiles through tensor descriptors built on the device (Hopper's
#   bulk tensor copies; the interpreter runs them too), one per (batch or sequence, head); a launch
#   whose q/k/v/do are not 16-byte aligned (base, batch/sequence/head strides) uses plain loads.
# - WARP_SPEC (forward, needs TMA): Triton's Hopper warp specialization: a producer warpgroup issues
#   the TMA loads, num_warps compute warps form two consumer warpgroups of BLOCK_M / 2 rows each
#   (3 warpgroups in all); one key loop with every tile masked when causal or Sk % BLOCK_N != 0.
# - GLUON (forward, sm90 configs only): {BLOCK_N, num_stages[, NUM_WG, SCHED, PERSIST, ...]} of forward_ws.py's
#   warp-specialized Gluon kernel (a TMA loader warp, two or three consumer warpgroups of 64 query rows, FA3's overlap
#   of softmax and PV product; PERSIST: one program per SM walking the tiles; attn_fwd_ws lists the keys), which takes
#   compiled launches of contiguous 16-bit [B, S, H, D] inputs at D = 64 / 128; TRIFORGE_ATTN_GLUON=0 / 1 turns it
#   off / on everywhere it can run (=1 also for packed sequences, which otherwise keep the Triton kernel). `triforge
#   tune flash_attn_fwd` keeps it across re-tunes (tune.write_config keeps an entry's keys that are outside the tuning
#   space) and times its grid without it (the Triton kernel's tiles: Tunable.not_inherited); `triforge tune
#   flash_attn_fwd_gluon` tunes the field itself (Tunable.entry_of).
# - EMU (forward, compiled 16-bit launches): of every 8 exponentials of an unmasked key tile, how many the FMA pipes
#   compute (a degree-4 polynomial in inline PTX, _tl.exp2_emu) instead of the MUFU unit, whose 16 results per clock
#   per SM equal the tensor cores' time at D = 64 (FlashAttention-4's offload). Measured slower on the H100 (session
#   38, attn_ws_probe, each launcher called directly): at D = 64 the Triton kernel 0.95x / 0.94x with EMU 1 / 2
#   ((16, 16, 2048, 64)), the Gluon kernel at D = 128 0.96-0.99x with EMU 1; no sm90 entry sets it.
# - ATOMIC_DQ (dK/dV kernel): FlashAttention-2's backward: dQ accumulated by the dK/dV kernel in fp32
#   (1: atomic adds, 2: TMA bulk reductions), then scaled into q's dtype; no dQ kernel. dq is then
#   not bitwise reproducible: flash_attn_func(deterministic=True) and varlen use the dQ kernel.
#
# On sm90 these are overridden at D = 64 and 128 by triforge/configs/sm90.json (benchmarks/attention_bwd_sweep.py,
# session 23: the backward 1.15-1.36x FA2 with them, 0.60-0.92x with these fallbacks).
# H100 fallbacks, as measured on the H100 (results/h100-2026-11-22-4bc4ed3-*, and the Hopper variants
# by benchmarks/attention_variants.py: results/*-attention-variants-{fwd,bwd}-d128.script.json). Every
# one was compiled for sm90a with Triton 3.6 and checked with ptxas: no register spills
# (test_kernels_compile_for_sm90).
# - forward (16-bit): FlashAttention-2 tiles, 128 query rows x 64-key tiles: the fp32 score tile and
#   the fp32 accumulator (128 x D) stay in registers; 4 warps for D <= 64, 8 warps (two warpgroups of
#   wgmma) at D = 128; 3 stages of K/V loads in flight (128 KiB of shared memory at D = 128).
#   D = 256 halves the query tile (the 64 x 256 accumulator) with 2 stages. Non-causal at D = 128:
#   TMA loads of 128-key tiles, 2 stages (4.74 ms vs 5.61 at (4, 16, 8192, 128)); causal keeps the
#   plain 128 x 64 tiles (2.51 ms vs 2.63 with TMA 128 x 128: half the key blocks are diagonal ones).
# - dK/dV (16-bit): two fp32 accumulators BLOCK_N x D plus K and V stay resident while Q/dO tiles
#   stream; 128 keys x 32 queries with 8 warps for D <= 64 (FA2's 128x32 tile, 244 registers), 32 x 32
#   (mma.sync) at D = 256. D = 128: 128 keys x 32 queries with the Q/dO tiles by TMA and 1 stage (212
#   registers, 80 KiB); the plain-load kernel spills at 128 keys and needed 64 (30.6 ms backward at
#   (4, 16, 8192, 128) vs 24.5 with TMA; causal 15.3 vs 13.0).
# - dQ (16-bit): mirrors the forward loop with one accumulator: 128 queries x 64 keys, 8 warps (K/V by
#   TMA at D = 128); 64 x 32 at D = 256.
# Not fallbacks: WARP_SPEC (wrong results on Triton 3.6 at D = 128: rel. RMS 0.09-0.19, NaN) and
# ATOMIC_DQ (34.2 ms with TMA reductions; 64-query tiles with it spill and are not deterministic).
# D <= 64 keeps the plain loads: the variants there are not measured.
_FWD = {32: _c(128, 64, 4, 3), 64: _c(128, 64, 4, 3), 128: _c(128, 64, 8, 3), 256: _c(64, 64, 8, 2)}
_FWD_NONCAUSAL = {128: _c(128, 128, 8, 2, TMA=1)}  # overrides _FWD when not causal
_BWD_DKDV = {32: _c(32, 128, 8, 2), 64: _c(32, 128, 8, 2), 128: _c(32, 128, 8, 1, TMA=1), 256: _c(32, 32, 8, 2)}
_BWD_DQ = {32: _c(128, 64, 8, 2), 64: _c(128, 64, 8, 2), 128: _c(128, 64, 8, 2, TMA=1), 256: _c(64, 32, 8, 2)}
_FWD_FP32 = {32: _c(32, 32, 4, 2), 64: _c(64, 32, 8, 2), 128: _c(32, 32, 8, 1), 256: _c(32, 16, 8, 1)}
_BWD_DKDV_FP32 = {32: _c(32, 32, 8, 1), 64: _c(32, 32, 8, 1), 128: _c(32, 32, 8, 1), 256: _c(16, 32, 8, 1)}
_BWD_DQ_FP32 = {32: _c(32, 32, 4, 2), 64: _c(32, 32, 4, 2), 128: _c(32, 32, 4, 2), 256: _c(32, 16, 8, 1)}
_FALLBACKS = {
    ("flash_attn_fwd", False): _FWD, ("flash_attn_bwd_dkdv", False): _BWD_DKDV, ("flash_attn_bwd_dq", False): _BWD_DQ,
    ("flash_attn_fwd", True): _FWD_FP32, ("flash_attn_bwd_dkdv", True): _BWD_DKDV_FP32,
    ("flash_attn_bwd_dq", True): _BWD_DQ_FP32,
}


def fallback_config(kernel, D, dtype, causal=True) -> dict:
    """The compiled-GPU fallback launch config (what a GPU without a tuned entry uses)."""
    if kernel == "flash_attn_fwd" and not causal and dtype != torch.float32 and D in _FWD_NONCAUSAL:
        return dict(_FWD_NONCAUSAL[D])
    return dict(_FALLBACKS[(kernel, dtype == torch.float32)][D])


# the interpreter's cost is per block op: small tiles, so odd lengths exercise masks and multi-block loops
_INTERPRET_CFG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


def config_key(D, causal, dtype, varlen=False) -> str:
    extra = {"varlen": 1} if varlen else {}
    return launch.config_key(d=D, causal=int(bool(causal)), dtype=launch.dtype_tag(dtype), **extra)


def _cfg(kernel, D, causal, dtype, varlen=False):
    """The tuned config at (D, causal, dtype), else the fallback. A packed (varlen) launch compiles a
    different kernel (sequence bounds read from cu_seqlens): an entry under the key with varlen=1 wins
    for it (sm90's dK/dV at D = 128: the dense tile spills 2 registers in the varlen kernel)."""
    fallback = dict(_INTERPRET_CFG) if _runtime.INTERPRET else fallback_config(kernel, D, dtype, causal)
    cfg = launch.config(kernel, config_key(D, causal, dtype), fallback)
    if varlen and not _runtime.INTERPRET:
        cfg = launch.config(kernel, config_key(D, causal, dtype, varlen=True), cfg)
    return cfg


def _flags(dtype):
    return {"UPCAST": _runtime.INTERPRET and dtype == torch.bfloat16, "IEEE": dtype == torch.float32}


def _strides3(t):
    """(batch, sequence, head) strides of a [B, S, H, D] tensor whose last dim is contiguous."""
    return t.stride(0), t.stride(1), t.stride(2)


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


class Varlen(NamedTuple):
    """Packed sequences for the launchers: the packed q [Tq, H, D] and k/v [Tk, Hkv, D] are passed
    as a batch of one ([1, Tq, H, D], lse [1, H, Tq]); sequence b is rows cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1] - 1 of q (cu_seqlens_k: of k/v), both int32 [B + 1] and contiguous. The grid
    spans B sequences of the max lengths."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def _grid_dims(B, Sq, Sk, varlen):
    """(batch, query rows, key rows) the grid spans: the tensors' own, or the packed sequences'."""
    if varlen is None:
        return B, Sq, Sk
    return varlen.cu_seqlens_q.numel() - 1, varlen.max_seqlen_q, varlen.max_seqlen_k


def _varlen_args(varlen):
    """The kernels' (cu_seqlens_q_ptr, cu_seqlens_k_ptr) and VARLEN flag (None pointers compile away)."""
    if varlen is None:
        return (None, None), {"VARLEN": False}
    return (varlen.cu_seqlens_q, varlen.cu_seqlens_k), {"VARLEN": True}


def _tma_ok(*tensors) -> bool:
    """Whether the kernels may read these [B, S, H, D] tensors through tensor descriptors (one [S, D]
    matrix per batch and head): 16-bit, each (batch, head) start and the row stride 16-byte aligned."""
    for t in tensors:
        e = t.element_size()
        if t.dtype == torch.float32 or t.data_ptr() % 16 or t.stride(1) <= 0:
            return False
        if any(st * e % 16 for st in t.stride()[:-1]):
            return False
    return True


def _guard(cfg, dtype):
    """GUARD of the forward and dQ kernels: each key loop inside ``if lo < hi`` (forward._fwd_inner). On
    for 16-bit inputs (their dots are wgmma, which ptxas otherwise may serialize); config key GUARD = 0 turns
    it off (to time the difference). fp32's dots are not wgmma, and there the guard only costs registers."""
    return bool(cfg.get("GUARD", 1)) and dtype != torch.float32


def _emu(cfg, dtype):
    """EMU of the forward kernels: of every 8 exponentials of an unmasked tile, how many the FMA pipes compute
    (_tl.exp2_emu; inline PTX, so compiled launches only; 16-bit inputs, whose P is rounded to 16 bits anyway)."""
    return 0 if _runtime.INTERPRET or dtype == torch.float32 else int(cfg.get("EMU", 0))


def _fwd_variant(cfg, q, k, v, varlen, Sk):
    """The forward kernel's TMA / WARP_SPEC / EVEN_N flags and warp count for one launch.

    WARP_SPEC's num_warps counts the compute warps (two consumer warpgroups); Triton's Hopper pass
    takes the warps of one of them and adds the producer. Without it (varlen, misaligned inputs) the
    same compute warps run the kernel without warp specialization."""
    ws = bool(cfg.get("WARP_SPEC", 0))
    if ws and not cfg.get("TMA", 0):
        raise ValueError(f"WARP_SPEC needs TMA (config {cfg})")
    tma = bool(cfg.get("TMA", 0)) and _tma_ok(q, k, v)
    ws = ws and tma and varlen is None
    num_warps = cfg["num_warps"] // 2 if ws else cfg["num_warps"]
    flags = {"TMA": tma, "WARP_SPEC": ws, "EVEN_N": ws and Sk % cfg["BLOCK_N"] == 0, "GUARD": _guard(cfg, q.dtype),
             "EMU": _emu(cfg, q.dtype)}
    return flags, num_warps


GLUON_ENV = "TRIFORGE_ATTN_GLUON"


def _gluon_cfg(cfg, q, k, v, varlen):
    """The Gluon forward's launch config (forward_ws.py) where it takes this call, else None: the sm90 config's
    ``GLUON`` entry (BLOCK_N, num_stages; NUM_WG, SCHED and the other keys attn_fwd_ws lists) for compiled sm90
    launches of contiguous 16-bit [B, S, H, D] q/k/v at head dim 64 or 128. ``TRIFORGE_ATTN_GLUON=0`` never takes
    it; ``=1`` takes it wherever it can run, packed sequences included, with the entry or a default (128 keys per
    tile, 3 slots at D = 128, 4 at D = 64). Packed (varlen) calls
    take it only then: on the varlen bench (8 sequences, 16k tokens, D = 128, causal) it ran 0.88x the Triton kernel
    (its grid spans the longest sequence; benchmarks/NOTES.md, session 37)."""
    mode = os.environ.get(GLUON_ENV, "")
    ws = cfg.get("GLUON")
    if mode == "0" or (mode != "1" and (ws is None or varlen is not None)):
        return None
    D = q.shape[-1]
    if _runtime.INTERPRET or not q.is_cuda or _runtime.arch() != "sm90":  # (arch: cached per device)
        return None
    if q.dtype not in (torch.float16, torch.bfloat16) or D not in (64, 128):
        return None
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v)) or min(q.shape[1], k.shape[1]) < 1:
        return None
    return ws if ws is not None else {"BLOCK_N": 128, "num_stages": 3 if D == 128 else 4}


# ----------------------------------------------------------------------------- launchers


def attn_fwd(q, k, v, causal, softmax_scale, cfg=None, residual=False, varlen=None):
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] (last dims contiguous); with ``varlen`` (a Varlen) the
    packed sequences as a batch of one.

    Returns (o [B, Sq, H, D], lse [B, H, Sq] fp32, o_res): with ``residual`` (16-bit inputs, for the
    backward) o_res [B, Sq, H, D] holds o's rounding error (o in fp32 minus o), else it is empty."""
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    nb, grid_q, _ = _grid_dims(B, Sq, Sk, varlen)
    cu_ptrs, vl_flag = _varlen_args(varlen)
    cfg = cfg or _cfg("flash_attn_fwd", D, causal, q.dtype, varlen is not None)
    residual = residual and q.dtype != torch.float32
    ws = _gluon_cfg(cfg, q, k, v, varlen)
    if ws is not None:  # Hopper: the warp-specialized Gluon kernel (imported only here: Gluon has no interpreter)
        from triforge.ops.attention.forward_ws import attn_fwd_ws

        return attn_fwd_ws(q, k, v, causal, softmax_scale, ws, residual, varlen)
    o = new_output((B, Sq, H, D), q.dtype, q.device)
    o_res = new_output((B, Sq, H, D), q.dtype, q.device) if residual else q.new_empty(0)
    lse = new_output((B, H, Sq), torch.float32, q.device)
    e = q.element_size()
    variant, num_warps = _fwd_variant(cfg, q, k, v, varlen, Sk)
    if variant["TMA"]:
        launch.use_tensor_descriptors()
    launch.launch(
        "flash_attn_fwd", flash_attn_fwd_kernel, (launch.cdiv(grid_q, cfg["BLOCK_M"]), nb * H),
        q, k, v, o, o_res if residual else o, lse, *cu_ptrs,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(o),
        H, H // Hkv, Sq, Sk, softmax_scale * LOG2E,
        nbytes=e * ((3 if residual else 2) * q.numel() + k.numel() + v.numel()) + 4 * lse.numel(),
        HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=bool(causal), STORE_RES=residual,
        **_flags(q.dtype), **vl_flag, **variant, num_warps=num_warps, num_stages=cfg["num_stages"],
    )
    return o, lse, o_res


def attn_bwd_preprocess(o, do, o_res=None, dlse=None):
    """delta [B, H, Sq] fp32 = rowsum(do * (o + o_res)) - dlse."""
    B, Sq, H, D = o.shape
    has_res = o_res is not None and o_res.numel() > 0
    block_m = 16 if _runtime.INTERPRET else max(16, min(128, 8192 // D))
    delta = new_output((B, H, Sq), torch.float32, o.device)
    if has_res and o_res.stride() != o.stride():  # the kernel reads both with o's strides
        o, o_res = o.contiguous(), o_res.contiguous()
    launch.launch(
        "flash_attn_bwd_preprocess", flash_attn_bwd_preprocess_kernel, (launch.cdiv(Sq, block_m), B * H),
        o, do, o_res if has_res else o, dlse if dlse is not None else delta, delta,
        *_strides3(o), *_strides3(do), H, Sq,
        nbytes=o.element_size() * (3 if has_res else 2) * o.numel() + 4 * delta.numel() * (2 if dlse is not None else 1),
        HEAD_DIM=D, BLOCK_M=block_m, HAS_RES=has_res, HAS_DLSE=dlse is not None, num_warps=4,
    )
    return delta


def kv_split_for(n_key_blocks, B, Hkv, group) -> int:
    """How many programs share one kv head's group of query heads in the dK/dV kernel: the smallest
    divisor of the group giving ~2 programs per SM (1 when the kv heads alone fill the GPU)."""
    target = 2 * _runtime.num_sms()
    for s in range(1, group + 1):
        if group % s == 0 and n_key_blocks * B * Hkv * s >= target:
            return s
    return group


def attn_bwd_dkdv(q, k, v, do, lse, delta, causal, softmax_scale, cfg=None, kv_split=None, varlen=None,
                  dq_acc=None):
    """dk, dv in k's shape and dtype. GQA: each program sums its slice of the group's query heads;
    with kv_split > 1 slices, fp32 partial sums [B, Sk, Hkv, kv_split, D] are added in PyTorch.

    ``dq_acc`` (fp32 [B, Sq, H, D], contiguous, zeroed): the kernel also adds the unscaled dQ into it
    (ATOMIC_DQ: the config's method, atomic adds without one)."""
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    nb, _, grid_k = _grid_dims(B, Sq, Sk, varlen)
    cu_ptrs, vl_flag = _varlen_args(varlen)
    group = H // Hkv
    cfg = cfg or _cfg("flash_attn_bwd_dkdv", D, causal, q.dtype, varlen is not None)
    tma = bool(cfg.get("TMA", 0)) and _tma_ok(q, do)
    atomic = 0
    if dq_acc is not None:  # TMA reductions only compiled (Triton 3.6's interpreter lacks them)
        atomic = 2 if cfg.get("ATOMIC_DQ", 1) == 2 and not _runtime.INTERPRET else 1
    if tma or atomic == 2:
        launch.use_tensor_descriptors()
    n_blocks = launch.cdiv(grid_k, cfg["BLOCK_N"])
    split = kv_split or kv_split_for(n_blocks, nb, Hkv, group)
    if group % split:
        raise ValueError(f"kv_split {split} must divide the group size {group}")
    if split == 1:
        dk = new_output((B, Sk, Hkv, D), k.dtype, k.device)
        dv = new_output((B, Sk, Hkv, D), v.dtype, v.device)
    else:
        dk = new_output((B, Sk, Hkv * split, D), torch.float32, k.device)
        dv = new_output((B, Sk, Hkv * split, D), torch.float32, k.device)
    e = q.element_size()
    launch.launch(
        "flash_attn_bwd_dkdv", flash_attn_bwd_dkdv_kernel, (n_blocks, nb * Hkv * split),
        q, k, v, do, lse, delta, dk, dv, *cu_ptrs,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(do), *_strides3(dk),
        H, Hkv, group, group // split, split, Sq, Sk, softmax_scale * LOG2E, softmax_scale,
        dq_acc, *(_strides3(dq_acc) if atomic else (0, 0, 0)),
        nbytes=e * 2 * q.numel() + 8 * lse.numel() + 2 * (k.numel() * e + dk.numel() * dk.element_size())
        + (8 * dq_acc.numel() if atomic else 0),
        HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=bool(causal), **_flags(q.dtype),
        **vl_flag, TMA=tma, ATOMIC_DQ=atomic, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split > 1:  # a fixed-order sum over the slices: deterministic
        dk = dk.view(B, Sk, Hkv, split, D).sum(3).to(k.dtype)
        dv = dv.view(B, Sk, Hkv, split, D).sum(3).to(v.dtype)
    return dk, dv


def attn_bwd_dq(q, k, v, do, lse, delta, causal, softmax_scale, cfg=None, varlen=None):
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    nb, grid_q, _ = _grid_dims(B, Sq, Sk, varlen)
    cu_ptrs, vl_flag = _varlen_args(varlen)
    cfg = cfg or _cfg("flash_attn_bwd_dq", D, causal, q.dtype, varlen is not None)
    dq = new_output((B, Sq, H, D), q.dtype, q.device)
    e = q.element_size()
    tma = bool(cfg.get("TMA", 0)) and _tma_ok(q, k, v, do)
    if tma:
        launch.use_tensor_descriptors()
    launch.launch(
        "flash_attn_bwd_dq", flash_attn_bwd_dq_kernel, (launch.cdiv(grid_q, cfg["BLOCK_M"]), nb * H),
        q, k, v, do, lse, delta, dq, *cu_ptrs,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(do), *_strides3(dq),
        H, H // Hkv, Sq, Sk, softmax_scale * LOG2E, softmax_scale,
        nbytes=e * (3 * q.numel() + k.numel() + v.numel()) + 8 * lse.numel(),
        HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=bool(causal), **_flags(q.dtype),
        **vl_flag, TMA=tma, GUARD=_guard(cfg, q.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return dq


def attn_bwd_dq_convert(dq_acc, softmax_scale, dtype):
    """dq = dq_acc * softmax_scale in ``dtype`` (dq_acc: the ATOMIC_DQ fp32 sums, contiguous)."""
    dq = new_output(dq_acc.shape, dtype, dq_acc.device)
    block = 1024
    launch.launch(
        "flash_attn_bwd_dq_convert", flash_attn_bwd_dq_convert_kernel, (launch.cdiv(dq_acc.numel(), block),),
        dq_acc, dq, dq_acc.numel(), softmax_scale, nbytes=(4 + dq.element_size()) * dq.numel(),
        BLOCK=block, UPCAST=_flags(dtype)["UPCAST"], num_warps=4,
    )
    return dq


def attn_bwd(do, q, k, v, o, o_res, lse, dlse, causal, softmax_scale, varlen=None, deterministic=False,
             cfg_dkdv=None, cfg_dq=None):
    """(dq, dk, dv) in the shapes and dtypes of q, k, v; o_res (optional) is o's rounding residual,
    dlse (optional) the grad of lse. With ``varlen``, packed sequences as a batch of one.

    When the dK/dV config has ATOMIC_DQ (and neither ``deterministic`` nor varlen), the dK/dV kernel
    accumulates dQ too (fp32 additions in a varying order) and a conversion replaces the dQ kernel."""
    D = q.shape[-1]
    delta = attn_bwd_preprocess(o, do, o_res, dlse)  # per row: packed or not is all one to it
    cfg_dkdv = cfg_dkdv or _cfg("flash_attn_bwd_dkdv", D, causal, q.dtype, varlen is not None)
    if cfg_dkdv.get("ATOMIC_DQ", 0) and not deterministic and varlen is None:
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = attn_bwd_dkdv(q, k, v, do, lse, delta, causal, softmax_scale, cfg_dkdv, dq_acc=dq_acc)
        return attn_bwd_dq_convert(dq_acc, softmax_scale, q.dtype), dk, dv
    dk, dv = attn_bwd_dkdv(q, k, v, do, lse, delta, causal, softmax_scale, cfg_dkdv, varlen=varlen)
    dq = attn_bwd_dq(q, k, v, do, lse, delta, causal, softmax_scale, cfg_dq, varlen=varlen)
    return dq, dk, dv


# ----------------------------------------------------------------------------- custom ops + autograd


@torch.library.custom_op("triforge::flash_attn_fwd", mutates_args=())
def flash_attn_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float, residual: bool,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, lse, o_res): o_res is o's rounding residual when ``residual`` and q is 16-bit, else empty.
    ``deterministic`` only reaches the backward (the forward always is)."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    return attn_fwd(q, k, v, causal, softmax_scale, residual=residual)


@flash_attn_fwd_op.register_fake
def _(q, k, v, causal, softmax_scale, residual, deterministic=False):
    B, Sq, H, _ = q.shape
    o_res = q.new_empty(q.shape) if residual and q.dtype != torch.float32 else q.new_empty(0)
    return q.new_empty(q.shape), q.new_empty((B, H, Sq), dtype=torch.float32), o_res


@torch.library.custom_op("triforge::flash_attn_bwd", mutates_args=())
def flash_attn_bwd_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, o_res: torch.Tensor | None,
    lse: torch.Tensor, dlse: torch.Tensor | None, causal: bool, softmax_scale: float, deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    do, q, k, v, o = (_last_dim_contiguous(t) for t in (do, q, k, v, o))
    o_res = _last_dim_contiguous(o_res) if o_res is not None and o_res.numel() else None
    lse = lse.contiguous()
    dlse = dlse.float().contiguous() if dlse is not None else None
    return attn_bwd(do, q, k, v, o, o_res, lse, dlse, causal, softmax_scale, deterministic=deterministic)


@flash_attn_bwd_op.register_fake
def _(do, q, k, v, o, o_res, lse, dlse, causal, softmax_scale, deterministic=False):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup(ctx, inputs, output):
    q, k, v, causal, softmax_scale, residual, *deterministic = inputs
    o, lse, o_res = output
    ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, bool(deterministic and deterministic[0])
    ctx.save_for_backward(q, k, v, o, o_res, lse)


def _fwd_backward(ctx, do, dlse, do_res):
    q, k, v, o, o_res, lse = ctx.saved_tensors
    if do is None:  # only lse took part in the loss
        do = torch.zeros_like(o)
    dq, dk, dv = torch.ops.triforge.flash_attn_bwd(
        do, q, k, v, o, o_res if o_res.numel() else None, lse, dlse, ctx.causal, ctx.softmax_scale, ctx.deterministic
    )
    return dq, dk, dv, None, None, None, None


flash_attn_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup)


@torch.library.custom_op("triforge::flash_attn_varlen_fwd", mutates_args=())
def flash_attn_varlen_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float, residual: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [Tq, H, D], lse [H, Tq] fp32, o_res) of packed sequences. Checks the inputs, cu_seqlens'
    values included (read on the host: one device sync), before any kernel reads through them."""
    q, k, v, cu_seqlens_q, cu_seqlens_k = (t.contiguous() for t in (q, k, v, cu_seqlens_q, cu_seqlens_k))
    _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    o, lse, o_res = attn_fwd(q[None], k[None], v[None], causal, softmax_scale, residual=residual, varlen=varlen)
    return o[0], lse[0], (o_res[0] if o_res.numel() else o_res)


@flash_attn_varlen_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, residual):
    Tq, H, _ = q.shape
    o_res = q.new_empty(q.shape) if residual and q.dtype != torch.float32 else q.new_empty(0)
    return q.new_empty(q.shape), q.new_empty((H, Tq), dtype=torch.float32), o_res


@torch.library.custom_op("triforge::flash_attn_varlen_bwd", mutates_args=())
def flash_attn_varlen_bwd_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, o_res: torch.Tensor | None,
    lse: torch.Tensor, dlse: torch.Tensor | None, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of packed sequences; trusts cu_seqlens (the forward op checked them)."""
    do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k = (
        t.contiguous() for t in (do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
    )
    o_res = o_res.contiguous()[None] if o_res is not None and o_res.numel() else None
    dlse = dlse.float().contiguous()[None] if dlse is not None else None
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dq, dk, dv = attn_bwd(do[None], q[None], k[None], v[None], o[None], o_res, lse[None], dlse, causal, softmax_scale,
                          varlen=varlen)
    return dq[0], dk[0], dv[0]


@flash_attn_varlen_bwd_op.register_fake
def _(do, q, k, v, o, o_res, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
      softmax_scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_fwd_setup(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, residual = inputs
    o, lse, o_res = output
    ctx.max_seqlen = (max_seqlen_q, max_seqlen_k)
    ctx.causal, ctx.softmax_scale = causal, softmax_scale
    ctx.save_for_backward(q, k, v, o, o_res, lse, cu_seqlens_q, cu_seqlens_k)


def _varlen_fwd_backward(ctx, do, dlse, do_res):
    q, k, v, o, o_res, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    if do is None:  # only lse took part in the loss
        do = torch.zeros_like(o)
    dq, dk, dv = torch.ops.triforge.flash_attn_varlen_bwd(
        do, q, k, v, o, o_res if o_res.numel() else None, lse, dlse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlen,
        ctx.causal, ctx.softmax_scale,
    )
    return dq, dk, dv, None, None, None, None, None, None, None


flash_attn_varlen_fwd_op.register_autograd(_varlen_fwd_backward, setup_context=_varlen_fwd_setup)


# ----------------------------------------------------------------------------- validation + public API


def _validate_flags(causal, softmax_scale):
    if not isinstance(causal, bool):
        hint = (" (flash-attn's argument in that position is dropout_p: pass causal and softmax_scale by keyword)"
                if isinstance(causal, float) else "")
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}{hint}")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale must be a positive float or None, got {type(softmax_scale).__name__}")
        if not (math.isfinite(softmax_scale) and softmax_scale > 0):
            raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")


def _validate(q, k, v, causal, softmax_scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dtypes=DTYPES, ndim=4)
    check_same_dtype(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v)
    B, Sq, H, D = q.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"q has head_dim (last dimension) {D}; supported head_dim: {HEAD_DIMS}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(
            f"k must be [B, Sk, Hkv, D] with q's batch {B} and head_dim {D} (q is {tuple(q.shape)}), got {tuple(k.shape)}"
        )
    if v.shape != k.shape:
        raise ValueError(f"v must have the same shape as k {tuple(k.shape)}, got {tuple(v.shape)}")
    if H % k.shape[2]:
        raise ValueError(f"k has {k.shape[2]} heads, which must divide q's {H} heads (GQA/MQA)")
    _validate_flags(causal, softmax_scale)


def _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale):
    """Types, shapes, dtypes and devices (nothing read from the device: it also runs on fake tensors)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dtypes=DTYPES, ndim=3)
    check_same_dtype(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v)
    Tq, H, D = q.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"q has head_dim (last dimension) {D}; supported head_dim: {HEAD_DIMS}")
    if k.shape[2] != D:
        raise ValueError(f"k must be [Tk, Hkv, D] with q's head_dim {D} (q is {tuple(q.shape)}), got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the same shape as k {tuple(k.shape)}, got {tuple(v.shape)}")
    if H % k.shape[1]:
        raise ValueError(f"k has {k.shape[1]} heads, which must divide q's {H} heads (GQA/MQA)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must have dtype int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must be 1-D [B + 1] with B >= 1 sequences, got shape {tuple(cu.shape)}")
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(
            f"cu_seqlens_k must have as many entries as cu_seqlens_q ({cu_seqlens_q.numel()}: one per "
            f"sequence plus one), got {cu_seqlens_k.numel()}"
        )
    check_same_device(q=q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, (int, torch.SymInt)):
            raise TypeError(f"{name} must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"{name} must be non-negative, got {n}")
    _validate_flags(causal, softmax_scale)


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, Tq, Tk, max_seqlen_q, max_seqlen_k):
    """cu_seqlens' values, read on the host in one transfer (a device sync): each starts at 0, never
    decreases, ends at its packed length, and no sequence is longer than its max_seqlen."""
    both = torch.stack((cu_seqlens_q, cu_seqlens_k)).tolist()
    for (name, total, total_name, max_name, max_len), cu in zip(
        (("cu_seqlens_q", Tq, "q.shape[0]", "max_seqlen_q", max_seqlen_q),
         ("cu_seqlens_k", Tk, "k.shape[0]", "max_seqlen_k", max_seqlen_k)),
        both,
    ):
        if cu[0] != 0:
            raise ValueError(f"{name} must start at 0, got {name}[0] = {cu[0]}")
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        for i, n in enumerate(lengths):
            if n < 0:
                raise ValueError(
                    f"{name} must be non-decreasing, got {name}[{i + 1}] = {cu[i + 1]} < {name}[{i}] = {cu[i]}"
                )
        if cu[-1] != total:
            raise ValueError(f"{name} must end at the packed length {total} ({total_name}), got {name}[-1] = {cu[-1]}")
        longest = max(lengths)
        if longest > max_len:
            raise ValueError(
                f"{max_name} = {max_len} is smaller than sequence {lengths.index(longest)}'s length {longest} "
                f"(from {name})"
            )


def _scale(q, softmax_scale):
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def _flash_attn_extras(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs) -> None:
    """flash-attn's further keywords at the values that mean plain exact attention; any other value raises
    NotImplementedError naming it (no dropout, sliding window, softcap, ALiBi or returned probabilities here)."""
    for name, value, plain in (("dropout_p", dropout_p, 0.0), ("softcap", softcap, 0.0)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != plain:
            raise NotImplementedError(f"{name}={value!r} is not supported (only {plain})")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"window_size={window_size!r} is not supported (only (-1, -1), no window)")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not supported (only None)")
    if return_attn_probs is not False:
        raise NotImplementedError(f"return_attn_probs={return_attn_probs!r} is not supported (use return_lse)")


def flash_attn_func(q, k, v, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False,
                    deterministic: bool = False, *, dropout_p: float = 0.0, window_size=(-1, -1), softcap: float = 0.0,
                    alibi_slopes=None, return_attn_probs: bool = False):
    """Exact attention softmax(q k^T * scale) v, flash-attn's layout and causal alignment.

    q [B, Sq, H, D], k/v [B, Sk, Hkv, D] with H % Hkv == 0; fp16, bf16 or fp32; D in (32, 64, 128, 256).
    ``softmax_scale`` defaults to D ** -0.5. Returns o [B, Sq, H, D] in q's dtype, and with
    ``return_lse`` also the natural-log log-sum-exp lse [B, H, Sq] fp32 (-inf where a row sees no key).
    Differentiable in q, k, v (and through lse). The backward's dq may come from fp32 atomic additions
    (the launch config's ATOMIC_DQ), whose order varies: ``deterministic`` makes it bitwise reproducible
    (a separate dQ kernel), as flash-attn's flag does. flash-attn's further keywords (dropout_p, window_size,
    softcap, alibi_slopes, return_attn_probs) are taken at their plain-attention values only.
    """
    _flash_attn_extras(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs)
    _validate(q, k, v, causal, softmax_scale)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    # o's rounding residual is only worth writing when a backward will read it
    residual = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if not residual and _eager_plain(q, k, v):
        # no autograd and no tracing: the launcher itself, without the custom op's dispatch (on the H100 machine's
        # host 118 us per call through the op against 64.5 for the launcher; benchmarks/attn_overhead_probe.py)
        o, lse, _ = attn_fwd(*(_last_dim_contiguous(t) for t in (q, k, v)), causal, _scale(q, softmax_scale))
    else:
        o, lse, _ = torch.ops.triforge.flash_attn_fwd(q, k, v, causal, _scale(q, softmax_scale), residual,
                                                      deterministic)
    return (o, lse) if return_lse else o


def _eager_plain(*tensors) -> bool:
    """Whether a call may skip the custom op: plain tensors (not fake, meta or another subclass) outside torch.compile
    and other tracing, where the op's registration (fake implementation, autograd) is what makes it traceable."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return all(type(t) is torch.Tensor and t.device.type != "meta" for t in tensors)


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
    softmax_scale: float | None = None, return_lse: bool = False, *, dropout_p: float = 0.0, window_size=(-1, -1),
    softcap: float = 0.0, alibi_slopes=None, return_attn_probs: bool = False,
):
    """Exact attention over packed sequences, flash-attn's ``flash_attn_varlen_func``.

    q [Tq, H, D], k/v [Tk, Hkv, D] with H % Hkv == 0 hold B sequences: sequence b is rows
    cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1
    of k/v (int32 [B + 1] prefix sums from 0 to Tq / Tk; a sequence may be empty). max_seqlen_q /
    max_seqlen_k bound the sequences' lengths (they size the grid). Each sequence attends within
    itself; with ``causal``, query i of a sequence sees its keys j <= i + len_k - len_q (bottom-right).
    fp16, bf16 or fp32; D in (32, 64, 128, 256); ``softmax_scale`` defaults to D ** -0.5.

    Returns o [Tq, H, D] in q's dtype, and with ``return_lse`` also lse [H, Tq] fp32 (natural log;
    -inf, with o = 0, where a row sees no key). Differentiable in q, k, v (and through lse). The
    custom op reads cu_seqlens on the host once per call to check it (a device sync). flash-attn's further keywords
    as in :func:`flash_attn_func`.
    """
    _flash_attn_extras(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs)
    _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
    residual = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    o, lse, _ = torch.ops.triforge.flash_attn_varlen_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, _scale(q, softmax_scale), residual
    )
    return (o, lse) if return_lse else o


def flash_attn_stages(q, k, v, causal: bool = False, softmax_scale: float | None = None):
    """The forward kernel's own buffers, named as the reference's stages: lse, o."""
    o, lse = flash_attn_func(q, k, v, causal, softmax_scale, return_lse=True)
    return OrderedDict(lse=lse, o=o)


def flash_attn_bwd_stages(q, k, v, do, causal: bool = False, softmax_scale: float | None = None, dlse=None):
    """Every buffer of a forward + backward, in kernel order: lse, o, o_res (forward; o_res empty for
    fp32), delta (preprocess), dk, dv, dq. For debugging a gradient stage by stage."""
    _validate(q, k, v, causal, softmax_scale)
    scale = _scale(q, softmax_scale)
    q, k, v, do = (_last_dim_contiguous(t) for t in (q, k, v, do))
    o, lse, o_res = attn_fwd(q, k, v, causal, scale, residual=True)
    delta = attn_bwd_preprocess(o, do, o_res, dlse)
    dk, dv = attn_bwd_dkdv(q, k, v, do, lse, delta, causal, scale)
    dq = attn_bwd_dq(q, k, v, do, lse, delta, causal, scale)
    return OrderedDict(lse=lse, o=o, o_res=o_res, delta=delta, dk=dk, dv=dv, dq=dq)


# ----------------------------------------------------------------------------- registry


def _dims(tier, causal_default):
    """(B, Sq, Sk, H, Hkv, D, causal) of a tier: tiny, real or a dict {B, H, S, D[, causal, Hkv, Sq, Sk]}."""
    if isinstance(tier, dict):
        S = tier.get("S")
        B, H, D = tier["B"], tier["H"], tier["D"]
        Sq, Sk = tier.get("Sq", S), tier.get("Sk", S)
        if Sq is None or Sk is None:
            raise KeyError("S (or Sq and Sk)")
        causal = bool(tier.get("causal", causal_default))
        return B, Sq, Sk, H, tier.get("Hkv", H), D, causal
    if tier == "tiny":
        # odd lengths (masks, several blocks), GQA; the non-causal op also has Sq != Sk
        return (2, 37, 37, 4, 2, 64, True) if causal_default else (2, 37, 45, 4, 2, 64, False)
    if tier == "real":
        return 4, 8192, 8192, 16, 16, 128, causal_default
    raise KeyError(tier)


def _make_inputs(tier, dtype, device, gen, causal_default=False, force_causal=False):
    B, Sq, Sk, H, Hkv, D, causal = _dims(tier, causal_default)
    if force_causal:
        causal = True

    def rand(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    return {"q": rand(B, Sq, H, D), "k": rand(B, Sk, Hkv, D), "v": rand(B, Sk, Hkv, D), "causal": causal}


def attention_ref_chunked(q, k, v, causal=False, softmax_scale=None, max_scores=1 << 26):
    """attention_ref's stages (lse, o), computed one slice of heads at a time so the float64 score
    matrices of long sequences fit in memory; under autograd each slice is checkpointed."""
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    if B * H * Sq * Sk <= max_scores:
        return attention_ref(q, k, v, causal, softmax_scale)
    group = H // Hkv
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))

    def one(qs, ks, vs):
        st = attention_ref(qs, ks, vs, causal, softmax_scale)
        return st["lse"], st["o"]

    lse_rows, o_rows = [], []
    for b in range(B):
        lses, outs = [], []
        for hk in range(Hkv):
            heads = slice(hk * group, (hk + 1) * group)
            args = (q[b : b + 1, :, heads], k[b : b + 1, :, hk : hk + 1], v[b : b + 1, :, hk : hk + 1])
            if grad:
                lse, o = torch.utils.checkpoint.checkpoint(one, *args, use_reentrant=False)
            else:
                lse, o = one(*args)
            lses.append(lse)  # [1, group, Sq]
            outs.append(o)  # [1, Sq, group, D]
        lse_rows.append(torch.cat(lses, dim=1))
        o_rows.append(torch.cat(outs, dim=2))
    lse, o = torch.cat(lse_rows, dim=0), torch.cat(o_rows, dim=0)
    return OrderedDict(lse=lse, o=o)


def attention_magnitudes_chunked(q, k, v, do=None, causal=False, softmax_scale=None, max_scores=1 << 26, dtype=None):
    """attention_magnitudes one (batch, kv head) slice at a time when the float64 score matrices
    would not fit in memory at once."""
    B, Sq, H, D = q.shape
    Hkv = k.shape[2]
    if B * H * Sq * k.shape[1] <= max_scores:
        return attention_magnitudes(q, k, v, do, causal, softmax_scale, dtype)
    group = H // Hkv
    parts = {}
    for b in range(B):
        for hk in range(Hkv):
            heads = slice(hk * group, (hk + 1) * group)
            one = attention_magnitudes(q[b : b + 1, :, heads], k[b : b + 1, :, hk : hk + 1], v[b : b + 1, :, hk : hk + 1],
                                       None if do is None else do[b : b + 1, :, heads], causal, softmax_scale, dtype)
            for name, t in one.items():
                parts.setdefault(name, []).append((b, hk, t))
    out = OrderedDict()
    for name, items in parts.items():
        dim = 2  # heads: query heads for o / dq, kv heads for dk / dv (each slice holds its own)
        rows = [torch.cat([t for bb, _, t in items if bb == b], dim=dim) for b in range(B)]
        out[name] = torch.cat(rows, dim=0)
    return out


def _magnitudes(inputs, grads, dtype=None):
    """The registry's error scales (see attention_magnitudes): o, and with the upstream gradient dq/dk/dv."""
    do = None if grads is None else grads[0]
    return attention_magnitudes_chunked(inputs["q"], inputs["k"], inputs["v"], do, bool(inputs["causal"]), dtype=dtype)


def _flops(inputs, mode):
    q, k = inputs["q"], inputs["k"]
    B, Sq, H, D = q.shape
    f = 4 * B * H * Sq * k.shape[1] * D
    if inputs.get("causal"):
        f //= 2
    return f if mode == "fwd" else 2.5 * f


def _bytes(inputs, mode):
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    e = q.element_size()
    lse = 4 * (q.numel() // q.shape[-1])  # one fp32 per query row and head (packed or not)
    if mode == "fwd":  # read q, k, v; write o, lse
        return e * (2 * q.numel() + k.numel() + v.numel()) + lse
    # read q, k, v, o, do, lse; write dq, dk, dv
    return e * (4 * q.numel() + 2 * k.numel() + 2 * v.numel()) + lse


def _sdpa_peer(backend_name):
    def build(inputs):
        if not torch.cuda.is_available():
            return None
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k = inputs["q"], inputs["k"]
        if inputs.get("causal") and q.shape[1] != k.shape[1]:
            return None  # SDPA's is_causal is top-left aligned; it differs from flash-attn's when Sq != Sk
        backend = getattr(SDPBackend, backend_name)

        def run(q, k, v, causal):
            H, Hkv = q.shape[2], k.shape[2]
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if Hkv != H:
                kt, vt = kt.repeat_interleave(H // Hkv, 1), vt.repeat_interleave(H // Hkv, 1)
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            return (o.transpose(1, 2),)

        return run

    return build


def _describe(inputs):
    q, k = inputs["q"], inputs["k"]
    B, Sq, H, D = q.shape
    s = f"B={B} H={H} S={Sq}" if Sq == k.shape[1] else f"B={B} H={H} Sq={Sq} Sk={k.shape[1]}"
    if k.shape[2] != H:
        s += f" Hkv={k.shape[2]}"
    return s + f" D={D}" + (" causal" if inputs.get("causal") else "")


def _tune_setup(kernel):
    def setup(shape, dtype, device):
        B, H, S, D = shape["B"], shape["H"], shape["S"], shape["D"]
        causal = bool(shape.get("causal", 0))
        Hkv = shape.get("Hkv", H)
        q = torch.randn(B, S, H, D, device=device, dtype=dtype)
        k = torch.randn(B, S, Hkv, D, device=device, dtype=dtype)
        v = torch.randn(B, S, Hkv, D, device=device, dtype=dtype)
        scale = D**-0.5
        key = config_key(D, causal, dtype)
        if kernel == "flash_attn_fwd":
            return (lambda cfg: attn_fwd(q, k, v, causal, scale, cfg)), key
        o, lse, o_res = attn_fwd(q, k, v, causal, scale, residual=True)
        do = torch.randn_like(o)
        delta = attn_bwd_preprocess(o, do, o_res)
        if kernel == "flash_attn_bwd_dkdv":
            return (lambda cfg: _dkdv_and_dq(q, k, v, do, lse, delta, causal, scale, cfg)), key
        return (lambda cfg: attn_bwd_dq(q, k, v, do, lse, delta, causal, scale, cfg)), key

    return setup


def _dkdv_and_dq(q, k, v, do, lse, delta, causal, scale, cfg):
    """What a dK/dV config costs: the kernel, plus the dQ kernel (its own config) or, with ATOMIC_DQ,
    the accumulator's zeroing and conversion."""
    cfg = cfg or _cfg("flash_attn_bwd_dkdv", q.shape[-1], causal, q.dtype)
    if cfg.get("ATOMIC_DQ", 0):
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = attn_bwd_dkdv(q, k, v, do, lse, delta, causal, scale, cfg, dq_acc=dq_acc)
        return attn_bwd_dq_convert(dq_acc, scale, q.dtype), dk, dv
    dk, dv = attn_bwd_dkdv(q, k, v, do, lse, delta, causal, scale, cfg)
    return attn_bwd_dq(q, k, v, do, lse, delta, causal, scale), dk, dv


_TUNE_SHAPE = {"B": 4, "H": 16, "S": 8192, "D": 128, "causal": 0}
_SHAPE_NAMES = ("B", "H", "S", "D", "causal")
# Grids of configs that compile for sm90 without spilling registers at the tune shape (D = 128;
# test_variants_and_tune_spaces_compile_for_sm90): the forward's WARP_SPEC without TMA is refused by the launcher,
# and its 128 x 128 tiles with 3 stages need more shared memory than an H100 has (both are skipped by
# the tuner as failures; the latter fits at D = 64). dK/dV: at D = 128 only 32-query tiles by TMA
# with 1 stage stay spill-free; its timing includes the dQ pass its ATOMIC_DQ implies.
# The sm90 entries of D = 64 / 128 come from benchmarks/attention_bwd_sweep.py (wider grids, each kernel timed
# alone): its dK/dV winner at D = 128 (64 x 64, 4 warps, 2 stages) is not in these grids, because the local ptxas
# of the compile test reports spills for it that the H100's compiled kernel does not have. `triforge tune
# flash_attn_bwd_dkdv --write` times that entry beside the grid and keeps it where it is faster (tune.write_config);
# to search around it, re-run the sweep. Likewise the forward's D = 128 non-causal winner (64 x 64 tiles, 4 warps,
# TMA: --fwd-round 3) is outside its grid. GUARD
# (each key loop inside ``if lo < hi``) is worth 8% in the non-causal D = 64 forward and costs 1-6% elsewhere.
TUNE_SPACES = {
    "flash_attn_fwd": {"BLOCK_M": [128], "BLOCK_N": [64, 128], "num_warps": [8], "num_stages": [2, 3], "TMA": [0, 1],
                       "GUARD": [0, 1]},
    "flash_attn_bwd_dkdv": {"BLOCK_M": [32], "BLOCK_N": [64, 128], "num_warps": [8], "num_stages": [1], "TMA": [1],
                            "ATOMIC_DQ": [0, 1, 2]},
    "flash_attn_bwd_dq": {"BLOCK_M": [64, 128], "BLOCK_N": [64], "num_warps": [8], "num_stages": [2, 3], "TMA": [0, 1],
                          "GUARD": [0, 1]},
}
for _kernel, _space in TUNE_SPACES.items():
    register_tunable(Tunable(
        kernel=_kernel, space=_space, setup=_tune_setup(_kernel), shape_names=_SHAPE_NAMES,
        default_shape=dict(_TUNE_SHAPE), not_inherited=("GLUON",),  # (the grid tunes the Triton kernel's tiles)
    ))


def _gluon_tune_setup(shape, dtype, device):
    """The Gluon forward (forward_ws.py) at ``shape``: run(cfg) launches it with cfg; run(None) is the launcher's own
    choice (the GLUON entry in use, else the Triton kernel), the outputs every config is checked against."""
    q, k, v = (torch.randn(shape["B"], shape["S"], h, shape["D"], device=device, dtype=dtype)
               for h in (shape["H"], shape.get("Hkv", shape["H"]), shape.get("Hkv", shape["H"])))
    causal, scale = bool(shape.get("causal", 0)), shape["D"] ** -0.5
    key = config_key(shape["D"], causal, dtype)

    def gluon(cfg):
        if cfg is None:
            return attn_fwd(q, k, v, causal, scale)[:2]
        if _runtime.INTERPRET or device.type != "cuda" or _runtime.arch() != "sm90":
            raise RuntimeError("the Gluon attention forward needs a compiled sm90 GPU")
        from triforge.ops.attention.forward_ws import attn_fwd_ws

        return attn_fwd_ws(q, k, v, causal, scale, cfg)[:2]

    return gluon, key


def _gluon_canonical(cfg):
    """The Gluon forward's config as it launches: XITEM only with PERSIST."""
    return cfg if cfg.get("PERSIST") else {k: v for k, v in cfg.items() if k != "XITEM"}


# `triforge tune flash_attn_fwd_gluon [--D 64 --S 2048 --B 16 --causal 0]`: the Gluon forward's configs (two or three
# consumer warpgroups, the scheduler barrier, the persistent walk and its overlap across items), stored as the GLUON
# field of flash_attn_fwd's entry (the field that makes the launcher take the Gluon kernel); configs that do not fit
# in shared memory fail to compile and are counted as failures
register_tunable(Tunable(
    kernel="flash_attn_fwd_gluon", setup=_gluon_tune_setup, shape_names=_SHAPE_NAMES,
    space={"BLOCK_N": [128], "num_stages": [2, 3, 4], "NUM_WG": [2, 3], "SCHED": [0, 1], "PERSIST": [0, 1],
           "XITEM": [0, 1, 2]},
    default_shape={"B": 16, "H": 16, "S": 2048, "D": 64, "causal": 0}, canonical=_gluon_canonical,
    entry_of=("flash_attn_fwd", "GLUON"),
))


def _ref_stages(q, k, v, causal):
    return attention_ref_chunked(q, k, v, causal)


def _spec(name, causal_default, force_causal):
    return OpSpec(
        name=name,
        family="attention",
        make_inputs=lambda tier, dtype, device, gen: _make_inputs(tier, dtype, device, gen, causal_default, force_causal),
        reference=_ref_stages,
        stages=lambda q, k, v, causal: flash_attn_stages(q, k, v, causal),
        call=lambda q, k, v, causal: (flash_attn_func(q, k, v, causal),),
        outputs=("o",),
        grad_inputs=("q", "k", "v"),
        flops=_flops,
        bytes=_bytes,
        peers={"sdpa_flash": _sdpa_peer("FLASH_ATTENTION"), "sdpa_cudnn": _sdpa_peer("CUDNN_ATTENTION")},
        describe=_describe,
        bench_shapes=tuple(dict(s, causal=int(causal_default)) for s in BENCH_SHAPES),
        shape_names=("B", "H", "S", "D", "causal", "Hkv", "Sq", "Sk"),  # _make_inputs' dict keys
        magnitudes=_magnitudes,
    )



# the (B, H, S, D) configs, the ones ../shared/ANCHORS.md measured cuDNN and FA2 at
BENCH_SHAPES = (
    {"B": 16, "H": 16, "S": 2048, "D": 64},
    {"B": 8, "H": 16, "S": 4096, "D": 64},
    {"B": 4, "H": 16, "S": 8192, "D": 128},
    {"B": 2, "H": 16, "S": 16384, "D": 128},
)


# flash_attn: non-causal unless a dict tier says causal=1; flash_attn_causal: always causal
register(_spec("flash_attn", causal_default=False, force_causal=False))
register(_spec("flash_attn_causal", causal_default=True, force_causal=True))


# ----------------------------------------------------------------------------- registry: varlen


def _random_lengths(n, total, gen):
    """n random sequence lengths (each >= 1) summing to total."""
    cuts = (torch.randperm(total - 1, generator=gen)[: n - 1] + 1).sort().values.tolist()
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _varlen_dims(tier, gen):
    """(lengths_q, lengths_k, H, Hkv, D, causal) of a tier: tiny, real, or a dict {B, H, S, D[, causal,
    Hkv]}: B self-attention sequences of random lengths averaging S (causal unless causal=0)."""
    if isinstance(tier, dict):
        B, H, S, D = tier["B"], tier["H"], tier["S"], tier["D"]
        lengths = _random_lengths(B, B * S, gen)
        return lengths, lengths, H, tier.get("Hkv", H), D, bool(tier.get("causal", 1))
    if tier == "tiny":
        # odd lengths over 16-row tiles, a single query, an empty query sequence (its keys get zero
        # gradients), len_q > len_k (causal rows that see no key) and len_q < len_k, GQA
        return [17, 1, 0, 30, 9], [17, 5, 9, 23, 14], 4, 2, 64, True
    if tier == "real":
        lengths = _random_lengths(8, 16384, gen)
        return lengths, lengths, 16, 16, 128, True
    raise KeyError(tier)


def _cu_seqlens(lengths, device):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def _varlen_make_inputs(tier, dtype, device, gen):
    lengths_q, lengths_k, H, Hkv, D, causal = _varlen_dims(tier, gen)

    def rand(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    return {
        "q": rand(sum(lengths_q), H, D), "k": rand(sum(lengths_k), Hkv, D), "v": rand(sum(lengths_k), Hkv, D),
        "cu_seqlens_q": _cu_seqlens(lengths_q, device), "cu_seqlens_k": _cu_seqlens(lengths_k, device),
        "max_seqlen_q": max(lengths_q), "max_seqlen_k": max(lengths_k), "causal": causal,
    }


def varlen_attention_ref_chunked(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, softmax_scale=None):
    """varlen_attention_ref's stages (lse [H, Tq], o [Tq, H, D]), each sequence through
    attention_ref_chunked, so long sequences' float64 scores fit in memory."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    lses, outs = [], []
    for b in range(len(cu_q) - 1):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        st = attention_ref_chunked(q[None, rows_q], k[None, rows_k], v[None, rows_k], causal, softmax_scale)
        lses.append(st["lse"][0])
        outs.append(st["o"][0])
    return OrderedDict(lse=torch.cat(lses, dim=1), o=torch.cat(outs, dim=0))


def varlen_attention_magnitudes(q, k, v, cu_seqlens_q, cu_seqlens_k, do=None, causal=False, softmax_scale=None, dtype=None):
    """attention_magnitudes of packed sequences, each on its own: o / dq [Tq, H, D], dk / dv [Tk, Hkv, D]."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    parts = {}
    for b in range(len(cu_q) - 1):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = attention_magnitudes_chunked(q[None, rows_q], k[None, rows_k], v[None, rows_k],
                                           None if do is None else do[None, rows_q], causal, softmax_scale, dtype=dtype)
        for name, t in one.items():
            parts.setdefault(name, []).append(t[0])
    return OrderedDict((name, torch.cat(ts, dim=0)) for name, ts in parts.items())


def _varlen_lengths(inputs):
    cu_q, cu_k = inputs["cu_seqlens_q"].tolist(), inputs["cu_seqlens_k"].tolist()
    return [b - a for a, b in zip(cu_q, cu_q[1:])], [b - a for a, b in zip(cu_k, cu_k[1:])]


def _varlen_flops(inputs, mode):
    """4 H D flops per visible (query, key) pair, counted per sequence (causal: bottom-right)."""
    _, H, D = inputs["q"].shape
    pairs = 0
    for lq, lk in zip(*_varlen_lengths(inputs)):
        if inputs.get("causal"):  # query i sees min(lk, max(0, i + lk - lq + 1)) keys
            pairs += sum(min(lk, max(0, i + lk - lq + 1)) for i in range(lq))
        else:
            pairs += lq * lk
    f = 4 * H * D * pairs
    return f if mode == "fwd" else 2.5 * f


def _varlen_describe(inputs):
    q, k = inputs["q"], inputs["k"]
    Tq, H, D = q.shape
    s = f"B={inputs['cu_seqlens_q'].numel() - 1} H={H} Tq={Tq}" + (f" Tk={k.shape[0]}" if k.shape[0] != Tq else "")
    if k.shape[1] != H:
        s += f" Hkv={k.shape[1]}"
    return s + f" D={D}" + (" causal" if inputs.get("causal") else "")


def flash_attn_varlen_stages(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                             softmax_scale=None):
    """The forward kernel's own buffers, named as the reference's stages: lse [H, Tq], o [Tq, H, D]."""
    o, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                    softmax_scale, return_lse=True)
    return OrderedDict(lse=lse, o=o)


# packed sequences: causal unless a dict tier says causal=0; no peer (flash-attn is not a dependency)
register(OpSpec(
    name="flash_attn_varlen",
    family="attention",
    make_inputs=_varlen_make_inputs,
    reference=lambda q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal: (
        varlen_attention_ref_chunked(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    ),
    stages=flash_attn_varlen_stages,
    call=lambda q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal: (
        flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal),
    ),
    outputs=("o",),
    grad_inputs=("q", "k", "v"),
    flops=_varlen_flops,
    bytes=_bytes,
    describe=_varlen_describe,
    magnitudes=lambda inputs, grads, dtype=None: varlen_attention_magnitudes(
        inputs["q"], inputs["k"], inputs["v"], inputs["cu_seqlens_q"], inputs["cu_seqlens_k"],
        None if grads is None else grads[0], bool(inputs["causal"]), dtype=dtype),
))

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_stages",
    "flash_attn_bwd_stages",
    "flash_attn_varlen_stages",
    "attention_ref",
    "attention_ref_chunked",
    "attention_magnitudes",
    "attention_magnitudes_chunked",
    "varlen_attention_magnitudes",
    "causal_mask",
    "varlen_attention_ref",
    "varlen_attention_ref_chunked",
    "kvcache_attention_ref",
]
