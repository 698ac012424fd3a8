"""Gated DeltaNet (Qwen3-Next's linear attention): drop-ins for flash-linear-attention 0.6.0.

    o, final = chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                      output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None)
    o, final = fused_recurrent_gated_delta_rule(...same arguments...)      decode / short sequences, forward only

q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H: value head i reads q/k head i // (HV / H));
g (log decay), beta [B, T, HV]; states [N, HV, K, V] fp32 (N = B, or the number of sequences of
cu_seqlens, with B = 1). o has v's dtype. K in {32, 64, 128}, V in {32, 64, 128, 256}; any T >= 1;
fp32, fp16 or bf16 (g and beta: any of the three, read as fp32). g is a log decay: g <= 0 is the caller's contract
(not checked: that would read g on the host every call; a positive g grows the state as e^g per token).

Custom ops (traceable by torch.compile(fullgraph=True)):

    torch.ops.triforge.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state,
        output_final_state, use_qk_l2norm_in_kernel, cu_seqlens) -> (o, final_state)
    torch.ops.triforge.fused_recurrent_gated_delta_rule_fwd(...same as the chunked forward...)

final_state is an empty tensor when output_final_state is False; the public functions turn it
into None.

Backward. Two implementations, picked by the environment variable ``TRIFORGE_DELTANET_BWD`` when
the backward runs (under torch.compile: when its backward graph is traced):

- ``triton`` (the default): the Triton kernels of ``chunk_bwd`` (the stages of
  ``reference.chunk_bwd_ref_stages``), wrapped in the custom op

      torch.ops.triforge.chunk_gated_delta_rule_bwd(do, dht, q, k, v, g, beta, scale, initial_state,
          use_qk_l2norm_in_kernel, cu_seqlens) -> (dq, dk, dv, dg, dbeta, dh0)

  (dht may be None; dh0 is an empty tensor without an initial state). Checked compiled on the H100
  (Triton 3.6), where the WY kernel had to be unpipelined (pipelined at 4 or 8 warps it is
  miscompiled: see chunk_bwd). ``chunk_gated_delta_rule_bwd_stages`` gives its stages for comparison
  with the reference's.
- ``torch``: ``chunk_bwd_torch``, called from the op's registered autograd formula.
  It recomputes the chunked algorithm in fp32 (``reference.chunk_ref_stages``) under autograd and
  differentiates it with torch.autograd.grad: correct, not fast (a Python loop over chunks, every
  chunk's intermediates kept), and not a custom op of its own (autograd is off inside custom op
  implementations); under torch.compile the backward graph is traced through it, unrolled over chunks.

Any other value of ``TRIFORGE_DELTANET_BWD`` raises ValueError when a backward runs.

Residuals. A forward that will be differentiated (grad enabled, an input requiring grad) runs as

    torch.ops.triforge.chunk_gated_delta_rule_fwd_save(q, k, v, g, beta, scale, initial_state,
        output_final_state, use_qk_l2norm_in_kernel, cu_seqlens) -> (o, final_state, gamma, w, T, h, v_new, qn, kn)

keeping what the Triton backward would otherwise recompute with the intra and state kernels (about a fifth of
the backward's time at the bench shapes) and, with the l2norm, the normalised q and k (qn stored by the output
kernel, kn by the intra kernel; empty tensors without the l2norm), and its backward is
``torch.ops.triforge.chunk_gated_delta_rule_bwd_saved(do, dht, q, k, v, g, beta, scale, initial_state,
use_qk_l2norm_in_kernel, cu_seqlens, gamma, w, T, h, v_new, qn, kn)``. The residuals are 1.7-2.5x the bytes of q, k and
v at the bench shapes, plus q and k's bytes again with the l2norm (h: one [K, V] state per chunk and value head in k's
dtype; T: [64] fp32 per token and value head).
``TRIFORGE_DELTANET_SAVE=0`` (read at the forward) keeps only the inputs and recomputes, as fla does.
"""

import functools
import itertools
import os
import warnings
from collections import OrderedDict

import torch

from triforge import launch
from triforge.ops._checks import FLOAT_DTYPES, check_same_device, check_tensor
from triforge.ops.deltanet import chunk, chunk_bwd, fused_recurrent
from triforge.ops.deltanet.reference import (
    abs_l2norm_bwd,
    chunk_bwd_ref_stages,
    chunk_ref_stages,
    error_changes,
    recurrent_ref,
    rounding_samples,
    scales_from_changes,
    stored_error_scales,
)
from triforge.registry import OpSpec, register
from triforge.tune import Tunable
from triforge.tune import register as register_tunable

K_DIMS = (32, 64, 128)  # K = 256 hit an illegal address in the recurrence on sm_90 (Triton 3.6)
V_DIMS = (32, 64, 128, 256)

# ----------------------------------------------------------------------------- validation


def _n_seqs(q, cu_seqlens):
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _validate(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    """Shapes, dtypes and devices (no device sync: cu_seqlens values are checked by _check_cu_seqlens)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=4)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape [B, T, H, K] = {tuple(q.shape)}, got {tuple(k.shape)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [B, T, HV, V] with q's B, T = {(B, T)}, got shape {tuple(v.shape)}")
    if HV % H:
        raise ValueError(f"v's head count HV = {HV} must be a multiple of q/k's H = {H}")
    if K not in K_DIMS:
        raise ValueError(f"q/k head dim K must be one of {K_DIMS}, got {K}")
    if V not in V_DIMS:
        raise ValueError(f"v head dim V must be one of {V_DIMS}, got {V}")
    for name, t in (("g", g), ("beta", beta)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES)
        if tuple(t.shape) != (B, T, HV):
            raise ValueError(f"{name} must have shape [B, T, HV] = {(B, T, HV)}, got {tuple(t.shape)}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    for name, flag in (("output_final_state", output_final_state), ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32, torch.int64), ndim=1)
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (sequences packed along T), got B = {B}")
        if cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must hold N + 1 >= 2 offsets, got shape {tuple(cu_seqlens.shape)}")
    if initial_state is not None:
        check_tensor("initial_state", initial_state, dtypes=(torch.float32,), ndim=4)
        N = _n_seqs(q, cu_seqlens)
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(f"initial_state must have shape [N, HV, K, V] = {(N, HV, K, V)}, got {tuple(initial_state.shape)}")
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens)


def _check_cu_seqlens(cu_seqlens, T):
    """cu_seqlens starts at 0, never decreases and ends at T (reads it on the host)."""
    if cu_seqlens is None:
        return
    cu = cu_seqlens.tolist()
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
    if cu[-1] != T:
        raise ValueError(f"cu_seqlens must end at the packed length T = {T}, got {cu[-1]}")


def _scale(q, scale):
    return float(q.shape[-1] ** -0.5 if scale is None else scale)


# ----------------------------------------------------------------------------- custom ops


def _contiguous(*ts):
    return [t.contiguous() if t is not None else None for t in ts]


@torch.library.custom_op("triforge::chunk_gated_delta_rule_fwd", mutates_args=())
def _chunk_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _chunk_fwd_impl(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                           cu_seqlens)


def _chunk_fwd_impl(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                    validate=True):
    """The plain forward op's body (and, with ``validate=False``, its eager twin's: chunk_gated_delta_rule validated
    the same arguments just before)."""
    if validate:
        _validate(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    _check_cu_seqlens(cu_seqlens, q.shape[1])
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    return chunk.chunk_fwd(q, k, v, g, beta, scale, initial_state, output_final_state=output_final_state,
                           l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


def _fwd_fake(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    final_shape = (_n_seqs(q, cu_seqlens), HV, K, V) if output_final_state else (0,)
    return v.new_empty(v.shape), q.new_empty(final_shape, dtype=torch.float32)


_chunk_fwd_op.register_fake(_fwd_fake)


def chunk_bwd_torch(do, dht, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens):
    """Interim backward: differentiate the fp32 PyTorch chunked algorithm (recomputed here).

    Returns (dq, dk, dv, dg, dbeta, dh0) in the dtypes of their inputs; dh0 is None without an
    initial state. dht (the final state's gradient) may be None.
    """
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]
        h0 = initial_state.detach().requires_grad_(True) if initial_state is not None else None
        # g floored as the chunked kernels floor it (chunk.G_FLOOR: e^-80 is negligible beside O(1) values; -inf or
        # -1e6 would make this fp32 cumsum NaN or swallow the next g); clamp keeps a NaN
        g_in = leaves[3].clamp_min(chunk.G_FLOOR_VALUE)
        st = chunk_ref_stages(*leaves[:3], g_in, leaves[4], scale=scale, initial_state=h0,
                              output_final_state=dht is not None,
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                              dtype=torch.float32)
        outs, grads = [st["o"]], [do.float()]
        if dht is not None:
            outs.append(st["final_state"])
            grads.append(dht.float())
        wrt = leaves + ([h0] if h0 is not None else [])
        d = torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    d = [torch.zeros_like(x) if dx is None else dx.to(x.dtype) for x, dx in zip(wrt, d)]
    return (*d[:5], d[5] if h0 is not None else None)


BWD_ENV = "TRIFORGE_DELTANET_BWD"
BWD_IMPLS = ("torch", "triton")


def backward_impl() -> str:
    """The chunked backward in use: ``TRIFORGE_DELTANET_BWD`` (triton or torch), triton when unset."""
    impl = os.environ.get(BWD_ENV, "triton")
    if impl not in BWD_IMPLS:
        raise ValueError(f"{BWD_ENV} must be one of {BWD_IMPLS}, got {impl!r}")
    return impl


@torch.library.custom_op("triforge::chunk_gated_delta_rule_bwd", mutates_args=())
def _chunk_bwd_op(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, scale: float, initial_state: torch.Tensor | None, use_qk_l2norm_in_kernel: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _triton_bwd(do, dht, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens)


def _triton_bwd(do, dht, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, saved=None,
                validate=True):
    """Both backward ops' body: checks, contiguous inputs, ``chunk_bwd`` (on the saving forward's residuals when
    ``saved``), dh0 as an empty tensor without an initial state. ``validate=False`` (the eager backward of this
    module's own forward, which validated the same saved inputs) checks only the incoming gradients."""
    if validate:
        _validate(q, k, v, g, beta, scale, initial_state, False, use_qk_l2norm_in_kernel, cu_seqlens)
    _check_bwd_grads(do, dht, q, v, cu_seqlens)
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    do = do.to(v.dtype).contiguous()
    dht = dht.float().contiguous() if dht is not None else None
    dq, dk, dv, dg, dbeta, dh0 = chunk_bwd.chunk_bwd(do, dht, q, k, v, g, beta, scale, initial_state,
                                                     l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, saved=saved)
    return dq, dk, dv, dg, dbeta, dh0 if dh0 is not None else q.new_empty((0,), dtype=torch.float32)


def _check_bwd_grads(do, dht, q, v, cu_seqlens):
    check_tensor("do", do, dtypes=FLOAT_DTYPES, ndim=4)
    if do.shape != v.shape:
        raise ValueError(f"do must have v's shape {tuple(v.shape)}, got {tuple(do.shape)}")
    if dht is not None:
        check_tensor("dht", dht, dtypes=FLOAT_DTYPES, ndim=4)
        want = (_n_seqs(q, cu_seqlens), v.shape[2], q.shape[3], v.shape[3])
        if tuple(dht.shape) != want:
            raise ValueError(f"dht must have the final state's shape [N, HV, K, V] = {want}, got {tuple(dht.shape)}")
    check_same_device(q=q, do=do, dht=dht)


@_chunk_bwd_op.register_fake
def _chunk_bwd_fake(do, dht, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens):
    dh0_shape = initial_state.shape if initial_state is not None else (0,)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), q.new_empty(dh0_shape, dtype=torch.float32))


def _chunk_setup(ctx, inputs, output):
    """Both chunked forward ops: output[2:] are the saving forward's residuals (none for the plain one)."""
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, *output[2:])
    ctx.scale, ctx.output_final_state, ctx.l2norm = scale, output_final_state, use_qk_l2norm_in_kernel
    if len(output) > 2:
        # the residuals get no gradient, and none is materialised for them (zero tensors of their size: 0.2 ms at
        # (4, 8192, 16, 16)); so an unused o or final state comes back as None too
        ctx.mark_non_differentiable(*output[2:])
        ctx.set_materialize_grads(False)


def _chunk_backward(ctx, do, dht, *_residual_grads):
    q, k, v, g, beta, initial_state, cu_seqlens, *saved = ctx.saved_tensors
    if do is None:  # (saving forward) only the final state is differentiated
        do = torch.zeros_like(v)
    dht = dht if ctx.output_final_state and dht is not None else None
    args = (do, dht, q, k, v, g, beta, ctx.scale, initial_state, ctx.l2norm, cu_seqlens)
    if backward_impl() != "triton":
        dq, dk, dv, dg, dbeta, dh0 = chunk_bwd_torch(*args)
    elif launch.eager_backward(do, dht, q, k, v, g, beta, initial_state, *saved):
        # eager (see launch.eager): the backward ops' body without torch.library's dispatch
        residuals = dict(zip(chunk.SAVED_NAMES, _contiguous(*saved))) if saved else None
        dq, dk, dv, dg, dbeta, dh0 = _triton_bwd(*args, residuals, validate=False)
    elif saved:
        dq, dk, dv, dg, dbeta, dh0 = torch.ops.triforge.chunk_gated_delta_rule_bwd_saved(*args, *saved)
    else:
        dq, dk, dv, dg, dbeta, dh0 = torch.ops.triforge.chunk_gated_delta_rule_bwd(*args)
    return dq, dk, dv, dg, dbeta, None, dh0 if initial_state is not None else None, None, None, None


_chunk_fwd_op.register_autograd(_chunk_backward, setup_context=_chunk_setup)


# The training forward: the same forward, and the intra and state kernels' outputs that the Triton backward
# would otherwise recompute (chunk.SAVED_NAMES: gamma, w, T, h, v_new; with l2norm also the normalised q and k,
# so the backward's l2norm kernel does not run: 179 us at (1, 32768, 16, 32); and the output kernel's P, which the
# dh kernel would otherwise compute in its serial loop), kept for it. At (1, 32768, 16, 32) the
# recompute is 1.9 of the backward's 8.7 ms (benchmarks/deltanet_kernel_times.py); the residuals hold
# 1.7-2.5x the bytes of q, k and v at the bench shapes (h alone NT x HV x K x V in k's dtype).
# ``TRIFORGE_DELTANET_SAVE=0`` recomputes.
SAVE_ENV = "TRIFORGE_DELTANET_SAVE"


def save_residuals() -> bool:
    """Whether a differentiable chunked forward keeps its intermediates for the backward (``TRIFORGE_DELTANET_SAVE``,
    1 when unset; 0 recomputes them in the backward, as fla does, for less memory)."""
    flag = os.environ.get(SAVE_ENV, "1")
    if flag not in ("0", "1"):
        raise ValueError(f"{SAVE_ENV} must be 0 or 1, got {flag!r}")
    return flag == "1"


@torch.library.custom_op("triforge::chunk_gated_delta_rule_fwd_save", mutates_args=())
def _chunk_fwd_save_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    return _chunk_fwd_save_impl(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                                cu_seqlens)


def _chunk_fwd_save_impl(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                         cu_seqlens, validate=True):
    """The saving forward op's body (and, with ``validate=False``, its eager twin's): o, the final state and the
    residuals."""
    if validate:
        _validate(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    _check_cu_seqlens(cu_seqlens, q.shape[1])
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    o, final, saved = chunk.chunk_fwd(q, k, v, g, beta, scale, initial_state, output_final_state=output_final_state,
                                      l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, save=True)
    return (o, final, *(saved[n] for n in chunk.SAVED_NAMES))


@_chunk_fwd_save_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    o, final = _fwd_fake(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                         cu_seqlens)
    B, T, HV = v.shape[0], v.shape[1], v.shape[2]
    Kp, Vp = chunk.padded_dims(q.shape[3], v.shape[3])
    # h holds a state per chunk: with cu_seqlens the chunks of every sequence, a count that depends on its values
    nt = (T + chunk.BT - 1) // chunk.BT if cu_seqlens is None else torch.library.get_ctx().new_dynamic_size()
    # qn, kn: the normalised q and k with l2norm, else empty
    qk_shape = (B, T, q.shape[2], Kp) if use_qk_l2norm_in_kernel else (0,)
    return (o, final, g.new_empty((B, T, HV), dtype=torch.float32), k.new_empty((B, T, HV, Kp)),
            g.new_empty((B, T, HV, chunk.BT), dtype=torch.float32), k.new_empty((B, nt, HV, Kp, Vp)),
            v.new_empty((B, T, HV, Vp)), q.new_empty(qk_shape), k.new_empty(qk_shape), q.new_empty((B, T, HV, chunk.BT)))


@torch.library.custom_op("triforge::chunk_gated_delta_rule_bwd_saved", mutates_args=())
def _chunk_bwd_saved_op(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, scale: float, initial_state: torch.Tensor | None, use_qk_l2norm_in_kernel: bool,
    cu_seqlens: torch.Tensor | None, gamma: torch.Tensor, w: torch.Tensor, t: torch.Tensor, h: torch.Tensor,
    v_new: torch.Tensor, qn: torch.Tensor, kn: torch.Tensor, p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton backward on the training forward's residuals (no intra / state recompute, and with l2norm no
    normalisation of q and k; P read by the dh kernel)."""
    saved = dict(zip(chunk.SAVED_NAMES, _contiguous(gamma, w, t, h, v_new, qn, kn, p)))
    return _triton_bwd(do, dht, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, saved)


@_chunk_bwd_saved_op.register_fake
def _(do, dht, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, gamma, w, t, h, v_new,
      qn, kn, p):
    return _chunk_bwd_fake(do, dht, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens)


_chunk_fwd_save_op.register_autograd(_chunk_backward, setup_context=_chunk_setup)


# eager twins of the two chunked forward ops (see launch.eager): the same bodies, setup and backward; their backward
# calls _triton_bwd itself where launch.eager holds
_ChunkFwdFunction = launch.eager_function("_ChunkFwdFunction", functools.partial(_chunk_fwd_impl, validate=False),
                                          _chunk_setup, _chunk_backward)
_ChunkFwdSaveFunction = launch.eager_function("_ChunkFwdSaveFunction",
                                              functools.partial(_chunk_fwd_save_impl, validate=False), _chunk_setup,
                                              _chunk_backward)


def _wants_residuals(q, k, v, g, beta, initial_state):
    """A forward whose result will be differentiated, with saving on."""
    return (torch.is_grad_enabled() and save_residuals()
            and any(t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state)))


@torch.library.custom_op("triforge::fused_recurrent_gated_delta_rule_fwd", mutates_args=())
def _recurrent_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _validate(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    _check_cu_seqlens(cu_seqlens, q.shape[1])
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    return fused_recurrent.fused_recurrent_fwd(q, k, v, g, beta, scale, initial_state,
                                               output_final_state=output_final_state,
                                               l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


_recurrent_fwd_op.register_fake(_fwd_fake)


def _recurrent_backward(ctx, do, dht):
    raise NotImplementedError(
        "fused_recurrent_gated_delta_rule is forward only (decode); use chunk_gated_delta_rule for training")


_recurrent_fwd_op.register_autograd(_recurrent_backward, setup_context=lambda ctx, inputs, output: None)


# ----------------------------------------------------------------------------- public API


_SHAPE_NAMES = ("B", "T", "H", "HV", "K", "V")  # a shape dict's keys (bench, tune; K and V optional, 128)

# fla 0.6.0's further keyword arguments: options we run only off (False) or absent (None), and its chunk size
_FLA_OFF = ("use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first", "transpose_state_layout",
            "use_gate_in_kernel", "head_first")
_FLA_NONE = ("cp_context", "A_log", "dt_bias", "gk", "gv")
_FLA_UNNEEDED = ("cu_seqlens_cpu", "chunk_indices")  # fla's host copy of cu_seqlens and the chunk table made from it


def _fla_kwargs(fn: str, kwargs: dict) -> None:
    """fla's extra keywords, as its functions take them (``**kwargs``): an option on that the kernels do not have
    raises NotImplementedError naming it; chunk_size must be 64; cu_seqlens_cpu and chunk_indices (fla's host copy
    of cu_seqlens and its chunk table) are not needed; anything else (e.g. the attention kwargs Hugging Face's
    Qwen3-Next layer passes through to these calls) is ignored, as fla ignores it, with a warning naming it (not
    under torch.compile, which cannot trace a warning without a graph break)."""
    unknown = []
    for name, value in kwargs.items():
        if name in _FLA_OFF:
            if value:
                raise NotImplementedError(f"{fn}: {name}={value!r} is not supported (fla's option; only False)")
        elif name in _FLA_NONE:
            if value is not None:
                raise NotImplementedError(f"{fn}: {name} is not supported (fla's option; only None)")
        elif name == "chunk_size":
            if value != chunk.BT:
                raise ValueError(f"{fn}: chunk_size must be {chunk.BT} (the kernels' chunk), got {value!r}")
        elif name not in _FLA_UNNEEDED:
            unknown.append(name)
    if unknown and not torch.compiler.is_compiling():
        warnings.warn(f"{fn}: ignoring keyword argument(s) {', '.join(sorted(unknown))}", stacklevel=3)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """Chunked Gated DeltaNet (fla's ``chunk_gated_delta_rule``): forward kernels, differentiable.

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV] (any float dtype, read as fp32); scale
    defaults to K^-1/2; initial_state [N, HV, K, V] fp32; cu_seqlens int32/int64 [N + 1] with
    B = 1. Returns (o [B, T, HV, V] in v's dtype, final state [N, HV, K, V] fp32 or None).
    Gradients (q, k, v, g, beta, initial_state) come from the Triton backward kernels
    (``TRIFORGE_DELTANET_BWD=torch`` picks an fp32 PyTorch recompute instead). A forward that will be
    differentiated keeps the intra and state kernels' outputs for the backward
    (``TRIFORGE_DELTANET_SAVE=0``: recomputed there instead, less memory). Further keywords as fla takes them
    (``_fla_kwargs``).
    """
    if kwargs:
        _fla_kwargs("chunk_gated_delta_rule", kwargs)
    _validate(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    args = (q, k, v, g, beta, _scale(q, scale), initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    eager = launch.eager(q, k, v, g, beta, initial_state, cu_seqlens)  # the ops' eager twins: no dispatch cost
    if _wants_residuals(q, k, v, g, beta, initial_state):
        fwd = _ChunkFwdSaveFunction.apply if eager else torch.ops.triforge.chunk_gated_delta_rule_fwd_save
        o, final, *_ = fwd(*args)
    else:
        o, final = (_ChunkFwdFunction.apply if eager else torch.ops.triforge.chunk_gated_delta_rule_fwd)(*args)
    return o, (final if output_final_state else None)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """Token-by-token Gated DeltaNet (decode: T = 1 with a state; short sequences). Forward only.

    Same arguments and results as :func:`chunk_gated_delta_rule`; all arithmetic in fp32. (fla's own puts gk and
    gv between g and beta: pass beta by keyword to call either.)
    """
    if kwargs:
        _fla_kwargs("fused_recurrent_gated_delta_rule", kwargs)
    _validate(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    o, final = torch.ops.triforge.fused_recurrent_gated_delta_rule_fwd(
        q, k, v, g, beta, _scale(q, scale), initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    return o, (final if output_final_state else None)


STAGE_NAMES = ("gamma", "decay", "A", "T", "w", "u", "h", "v_new", "o", "final_state")


def chunk_gated_delta_rule_stages(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, fuse_o=None):
    """The chunked forward's own buffers, named as ``reference.chunk_ref_stages`` names them:
    gamma, decay, A, T, w, u, h, v_new, o (and final_state when ``output_final_state``).
    ``fuse_o`` picks the fused or the unfused recurrence (None: as the public function does)."""
    _validate(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    _check_cu_seqlens(cu_seqlens, q.shape[1])
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    got = chunk.chunk_fwd(q, k, v, g, beta, _scale(q, scale), initial_state, l2norm=use_qk_l2norm_in_kernel,
                          cu_seqlens=cu_seqlens, stages=True, fuse_o=fuse_o)
    names = STAGE_NAMES if output_final_state else STAGE_NAMES[:-1]
    return OrderedDict((n, got[n]) for n in names)


def chunk_gated_delta_rule_bwd_stages(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None,
                                      use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """The Triton backward's own buffers, named as ``reference.chunk_bwd_ref_stages`` names them
    (``chunk_bwd.BWD_STAGE_NAMES``; dh0 only with an initial state). do [B, T, HV, V] in v's
    dtype, dht [N, HV, K, V] or None."""
    _validate(q, k, v, g, beta, scale, initial_state, False, use_qk_l2norm_in_kernel, cu_seqlens)
    _check_cu_seqlens(cu_seqlens, q.shape[1])
    _check_bwd_grads(do, dht, q, v, cu_seqlens)
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    dht = dht.float().contiguous() if dht is not None else None
    return chunk_bwd.chunk_bwd(do.to(v.dtype).contiguous(), dht, q, k, v, g, beta, _scale(q, scale), initial_state,
                               l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, stages=True)


# ----------------------------------------------------------------------------- registry


def _dims(tier, real):
    """(B, T, H, HV, K, V) of a tier: tiny, real, or a dict with B, T, H, HV[, K, V]."""
    if isinstance(tier, dict):
        return tier["B"], tier["T"], tier["H"], tier["HV"], tier.get("K", 128), tier.get("V", 128)
    if tier == "tiny":
        return real[0]
    if tier == "real":
        return real[1]
    raise KeyError(tier)


def _make_inputs(tier, dtype, device, gen, dims):
    """Qwen3-Next-like inputs: l2-normalised q/k in the kernel, g = logsigmoid (fp32), beta = sigmoid."""
    B, T, H, HV, K, V = _dims(tier, dims)

    def rand(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    return {
        "q": rand(B, T, H, K).to(device=device, dtype=dtype),
        "k": rand(B, T, H, K).to(device=device, dtype=dtype),
        "v": rand(B, T, HV, V).to(device=device, dtype=dtype),
        "g": torch.nn.functional.logsigmoid(rand(B, T, HV) + 2.0).to(device),
        "beta": torch.sigmoid(rand(B, T, HV)).to(device=device, dtype=dtype),
        "initial_state": (0.1 * rand(B, HV, K, V)).to(device),
        "output_final_state": True,
        "use_qk_l2norm_in_kernel": True,
    }


_CHUNK_DIMS = ((2, 100, 2, 4, 32, 32), (8, 4096, 16, 32, 128, 128))
_DECODE_DIMS = ((3, 1, 2, 4, 32, 32), (64, 1, 16, 32, 128, 128))


def _shape_of(inputs):
    B, T, H, K = inputs["q"].shape
    return B, T, H, inputs["v"].shape[2], K, inputs["v"].shape[3]


def _describe(inputs):
    B, T, H, HV, K, V = _shape_of(inputs)
    return f"B={B} T={T} H={H} HV={HV} K={K} V={V}"


def _chunk_flops(inputs, mode):
    """Per chunk and value head: k k^T, q k^T, w (BT^2 K each), u, P v_new (BT^2 V each) and the three
    state products w S, q S, k^T v_new (BT K V each), 2 FLOPs a multiply-add; the solve is not
    counted. The backward is counted as twice the forward."""
    B, T, H, HV, K, V = _shape_of(inputs)
    per_token = 2 * chunk.BT * (3 * K + 2 * V) + 6 * K * V
    f = B * T * HV * per_token
    return f if mode == "fwd" else 2 * f


def _io_bytes(inputs, mode):
    """Each input read once, each output written once (the floor); backward: inputs + do read, grads written."""
    B, T, H, HV, K, V = _shape_of(inputs)
    e = inputs["q"].element_size()
    qkv = B * T * (2 * H * K + HV * V) * e
    gb = B * T * HV * (inputs["g"].element_size() + inputs["beta"].element_size())
    o = B * T * HV * V * e
    state = HV * K * V * 4 * (inputs["initial_state"].shape[0] if inputs.get("initial_state") is not None else B)
    n_state = int(inputs.get("initial_state") is not None) + int(inputs.get("output_final_state", False))
    if mode == "fwd":
        return qkv + gb + o + state * n_state
    return 2 * (qkv + gb) + o + 2 * state * n_state


def _chunk_reference(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    return chunk_ref_stages(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def _chunk_magnitudes(inputs, grads, dtype=None):
    """Error scales of a 16-bit run (``reference.stored_error_scales``): the float64 reference again,
    ``ROUNDING_SAMPLES`` times with the kernels' 16-bit roundings (stores and tensor-core operands),
    forward stages (grads None) or input gradients (grads: the upstream gradients of o and
    final_state). fp32 runs store in fp32: the same model with fp32
    stores (the fp32 backward's dk failed the rms-scaled bound by 2.8e-6 where the l2norm's backward
    cancels, at the real shape on the H100), plus one more instance: the same stage algorithm evaluated
    in fp32. In fp32 the arithmetic itself (the products' sums, the recurrence, the solve) errs as much
    as the roundings at the store points: at the last rows of a sequence, where the final state's
    gradient makes dk's value-head terms ~10 (their sum and the l2norm's projection cancel to ~5e-3),
    the fp32 evaluation's error is 1.3x the dithered instances' change in rms and up to 8x at single
    elements (CPU, (1, 4096, 16, 32); elsewhere 0.07x), and two fp32 backwards (Triton on the H100,
    PyTorch autograd) failed the store-only bound at a few of those elements."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None if grads is None else {}
    from triforge.testing import tolerance_for

    atol = tolerance_for(dtype).atol
    args = {n: inputs[n] for n in ("q", "k", "v", "g", "beta", "initial_state")}
    l2 = bool(inputs.get("use_qk_l2norm_in_kernel", False))
    if grads is None:
        kw = dict(output_final_state=bool(inputs.get("output_final_state", False)), use_qk_l2norm_in_kernel=l2)
        if inputs.get("cu_seqlens") is not None:  # (packed sequences: the tests' forward checks)
            kw["cu_seqlens"] = inputs["cu_seqlens"]
        exact = chunk_ref_stages(**args, **kw)
        samples = rounding_samples(lambda **r: chunk_ref_stages(**args, **kw, **r), dtype, lazy=True)
        if dtype == torch.float32:
            samples = itertools.chain(samples, _fp32_instance(chunk_ref_stages, args, kw))
        return stored_error_scales(exact, samples, atol)
    dht = grads[1] if len(grads) > 1 and grads[1] is not None and grads[1].numel() else None
    kw = dict(do=grads[0], dht=dht, use_qk_l2norm_in_kernel=l2)
    names = {"dq": "dq", "dk": "dk", "dv": "dv", "dg": "dg", "dbeta": "dbeta", "dh0": "dinitial_state"}

    per_head = ("dq_hv", "dk_hv")

    def grads_only(stages):  # the input gradients (and dq/dk per value head); the rest (states: gigabytes in
        return {n: t for n, t in stages.items() if n in names or n in per_head}  # float64) dropped at once

    exact = grads_only(chunk_bwd_ref_stages(**args, **kw))
    samples = rounding_samples(lambda **r: chunk_bwd_ref_stages(**args, **kw, **r), dtype, lazy=True)
    if dtype == torch.float32:
        samples = itertools.chain(samples, _fp32_instance(chunk_bwd_ref_stages, args, kw))
    samples = (grads_only(st) for st in samples)
    change = error_changes(exact, samples)
    # fp32: dq and dk are sums over a group's value heads of dq_hv / dk_hv, then (l2norm) a projection, and
    # both cancel (at the last rows of a sequence with a final-state gradient the terms are ~10, dk ~5e-3).
    # There the fp32 arithmetic's error has a single instance (the fp32 evaluation; the store instances are
    # far smaller), whose dq/dk change can cancel by chance where the kernel's does not, so each element's
    # change is at least the per-head changes carried through those two steps in absolute value. (The fp32
    # real tier at (8, 4096, 16, 32) failed 1-8 dk elements of 67M without it. 16-bit runs have several
    # instances of the roundings that dominate them, and pass: their bound is left as it is.)
    B, T, H, K = inputs["q"].shape
    HV = inputs["v"].shape[2]
    scale = abs(_scale(inputs["q"], inputs.get("scale")))
    for hv_name, name, x, mult in (("dq_hv", "dq", inputs["q"], scale), ("dk_hv", "dk", inputs["k"], 1.0)):
        if dtype == torch.float32 and hv_name in change and name in change:
            d = mult * change[hv_name].view(B, T, H, HV // H, K).sum(3)
            if l2:
                d = abs_l2norm_bwd(x.to(d.dtype), d)
            change[name] = torch.maximum(change[name], d)
    scales = scales_from_changes(exact, {n: change[n] for n in names if n in change}, atol)
    return {names[n]: t for n, t in scales.items()}


def _fp32_instance(stages_fn, args, kw):
    """One instance of an fp32 run's arithmetic error: ``stages_fn`` evaluated in fp32 on the fp32 inputs
    (the float64 copies an fp32 run's check holds are exact), lazily, as ``rounding_samples`` yields."""
    def f32(t):
        return t.float() if isinstance(t, torch.Tensor) else t

    yield stages_fn(**{n: f32(t) for n, t in args.items()}, **{n: f32(t) for n, t in kw.items()}, dtype=torch.float32)


def _fla_peer(name):
    def build(inputs):
        if not torch.cuda.is_available():
            return None
        try:
            import fla.ops.gated_delta_rule as fla_gdr
        except ImportError:
            return None
        if name == "fused_recurrent_gated_delta_rule" and inputs["q"].shape[0] != 1:
            return None  # fla 0.6.0 hits an illegal memory access at B = 64 with grouped value heads
        fn = getattr(fla_gdr, name)

        def run(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel):
            return tuple(fn(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel))

        return run

    return build


register(OpSpec(
    name="gated_delta_rule",
    family="deltanet",
    make_inputs=lambda tier, dtype, device, gen: _make_inputs(tier, dtype, device, gen, _CHUNK_DIMS),
    reference=_chunk_reference,
    stages=lambda **kw: chunk_gated_delta_rule_stages(**kw),
    magnitudes=_chunk_magnitudes,
    call=lambda **kw: chunk_gated_delta_rule(**kw),
    outputs=("o", "final_state"),
    grad_inputs=("q", "k", "v", "g", "beta", "initial_state"),
    flops=_chunk_flops,
    bytes=_io_bytes,
    peers={"fla": _fla_peer("chunk_gated_delta_rule")},
    describe=_describe,
    shape_names=_SHAPE_NAMES,
    bench_shapes=tuple({"B": B, "T": T, "H": H, "HV": HV, "K": 128, "V": 128}
                       for B, T, H, HV in ((1, 32768, 16, 32), (8, 4096, 16, 32), (4, 8192, 16, 16), (1, 8192, 32, 32))),
))


def _decode_reference(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    o, final = recurrent_ref(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return OrderedDict(o=o, final_state=final)


def _decode_stages(**kw):
    o, final = fused_recurrent_gated_delta_rule(**kw)
    return OrderedDict(o=o, final_state=final)


register(OpSpec(
    name="gated_delta_rule_decode",
    family="deltanet",
    make_inputs=lambda tier, dtype, device, gen: _make_inputs(tier, dtype, device, gen, _DECODE_DIMS),
    reference=_decode_reference,
    stages=_decode_stages,
    call=lambda **kw: fused_recurrent_gated_delta_rule(**kw),
    outputs=("o", "final_state"),
    flops=lambda inputs, mode: 6 * inputs["q"].shape[0] * inputs["q"].shape[1] * inputs["v"].shape[2]
    * inputs["q"].shape[3] * inputs["v"].shape[3],
    bytes=_io_bytes,
    peers={"fla": _fla_peer("fused_recurrent_gated_delta_rule")},
    describe=_describe,
    bench_shapes=tuple({"B": B, "T": 1, "H": 16, "HV": 32, "K": 128, "V": 128} for B in (1, 64, 256)),
    shape_names=_SHAPE_NAMES,
    bench_graph=True,  # decode runs inside a captured step: CUDA-graph replay, the fla peer too
))


# ----------------------------------------------------------------------------- tunables


def _tune_inputs(shape, dtype, device):
    gen = torch.Generator().manual_seed(0)
    dims = (shape["B"], shape["T"], shape["H"], shape["HV"], shape.get("K", 128), shape.get("V", 128))
    return _make_inputs("real", dtype, device, gen, (dims, dims))


def _tune_setup(kernel):
    def setup(shape, dtype, device):
        i = _tune_inputs(shape, dtype, device)
        q, k, v, g, beta, h0 = (i[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
        B, T, H, HV, K, V = _shape_of(i)
        scale = K**-0.5
        if kernel == "gated_delta_rule_fwd_recurrent":
            return (lambda cfg: fused_recurrent.fused_recurrent_fwd(q, k, v, g, beta, scale, h0, l2norm=True, cfg=cfg),
                    fused_recurrent.config_key(K, V, dtype, B * HV))
        if kernel == "gated_delta_rule_fwd_intra":  # as the inference forward runs it (kn stored, no T)
            return (lambda cfg: chunk.chunk_fwd_intra(k, v, g, beta, l2norm=True, cfg=cfg, store_kn=True),
                    chunk.config_key(K, V, dtype))
        # as chunk_fwd runs them: k normalised once by the intra kernel (kn)
        intra = chunk.chunk_fwd_intra(k, v, g, beta, l2norm=True, store_kn=True)
        w, u, gamma, kn = intra["w"], intra["u"], intra["gamma"], intra["kn"]
        if kernel == "gated_delta_rule_fwd_h_o":
            return (lambda cfg: chunk.chunk_fwd_h_o(q, kn, w, u, gamma, h0, scale, l2norm=True, cfg=cfg, k_normed=True),
                    chunk.config_key(K, V, dtype, B * HV))
        if kernel == "gated_delta_rule_fwd_h":
            return (lambda cfg: chunk.chunk_fwd_h(kn, w, u, gamma, h0, l2norm=True, cfg=cfg, k_normed=True),
                    chunk.config_key(K, V, dtype, B * HV))
        h, v_new, _ = chunk.chunk_fwd_h(kn, w, u, gamma, h0, l2norm=True, k_normed=True)
        return (lambda cfg: chunk.chunk_fwd_o(q, kn, v_new, h, gamma, scale, l2norm=True, cfg=cfg, k_normed=True),
                chunk.config_key(K, V, dtype))

    return setup


def _tune_bwd_setup(kernel):
    """The Triton backward's kernels at a shape: the ones before ``kernel`` run once for its inputs."""

    def setup(shape, dtype, device):
        i = _tune_inputs(shape, dtype, device)
        q, k, v, g, beta, h0 = (i[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
        B, T, H, HV, K, V = _shape_of(i)
        scale = K**-0.5
        do = torch.randn(v.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        intra = chunk.chunk_fwd_intra(k, v, g, beta, l2norm=True, store_t=True)
        gamma, w = intra["gamma"], intra["w"]
        h, v_new, _ = chunk.chunk_fwd_h(k, w, intra["u"], gamma, h0, l2norm=True, output_final_state=False)
        qn, kn = chunk_bwd.chunk_bwd_l2norm(q, k)
        if kernel == "gated_delta_rule_bwd_dh":  # with P, as after a training forward
            p = torch.empty((B, T, HV, chunk.BT), dtype=q.dtype, device=q.device)
            chunk.chunk_fwd_o(q, k, v_new, h, gamma, scale, l2norm=True, p=p)
            return (lambda cfg: chunk_bwd.chunk_bwd_dh(qn, kn, w, gamma, do, None, scale, cfg=cfg, p=p),
                    chunk_bwd.config_key(K, V, dtype, B * HV))
        dh, dv_new, _ = chunk_bwd.chunk_bwd_dh(qn, kn, w, gamma, do, None, scale)
        if kernel == "gated_delta_rule_bwd_dqkw":
            def dqkw(cfg):  # dgamma_local's partials are one per K-block of the config: their sum
                out = chunk_bwd.chunk_bwd_dqkw(qn, kn, v_new, h, dh, do, dv_new, gamma, scale, cfg=cfg)
                return {**out, "dgamma_local": out["dgamma_local"].sum(0)}

            return dqkw, chunk_bwd.config_key(K, V, dtype)
        local = chunk_bwd.chunk_bwd_dqkw(qn, kn, v_new, h, dh, do, dv_new, gamma, scale)
        dk_local, dk_work = local["dk_local"], torch.empty_like(local["dk_local"])

        def wy(cfg):  # the kernel writes dk over its dk_local input: each run starts from a copy (timed too)
            dk_work.copy_(dk_local)
            return chunk_bwd.chunk_bwd_wy(kn, v, beta, g.dtype, gamma, intra["T"], local["dw"], dv_new, dk_work,
                                          local["dgamma_local"], cfg=cfg)

        return wy, chunk_bwd.config_key(K, V, dtype)

    return setup


_TUNE_SHAPE = {"B": 8, "T": 4096, "H": 16, "HV": 32, "K": 128, "V": 128}
for _kernel, _space, _shape in (
    # maxnreg: the register cap (sm90.json's entry in sessions 25-26; 128 lets 8-warp programs run two per SM);
    # DIAG_PRODUCT: the solve's diagonal blocks by dense products (1, session 27's entry), by substitution (0) or
    # by batched [4, 16, 16] products (2, session 44; the entry since session 45). Left out (36 points instead of
    # 162): 2 warps and 3 stages (never the fastest in sessions 24-35), V_LATE 0 (spills at 4 warps; 250 registers
    # at 8). ORDER 2 (the grid's order by the reuse distance of a k tile, session 45) is kept as the only value: at
    # the tuning shape (8, 4096) it picks 0, so a sweep of it would time one grid twice
    ("gated_delta_rule_fwd_intra", {"num_warps": [4, 8], "num_stages": [1, 2], "V_LATE": [1],
                                    "maxnreg": [0, 128, 168], "DIAG_PRODUCT": [0, 1, 2], "ORDER": [2]}, _TUNE_SHAPE),
    ("gated_delta_rule_fwd_h", {"BV": [16, 32, 64], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3]},
     {"B": 1, "T": 32768, "H": 16, "HV": 32, "K": 128, "V": 128}),
    # only the V-blocks the fused kernel compiles correctly (chunk.FUSED_BV)
    ("gated_delta_rule_fwd_h_o", {"BV": list(chunk.FUSED_BV), "num_warps": [4, 8], "num_stages": [1, 2, 3]}, _TUNE_SHAPE),
    ("gated_delta_rule_fwd_o", {"BV": [32, 64, 128], "num_warps": [4, 8], "num_stages": [1, 2, 3]}, _TUNE_SHAPE),
    ("gated_delta_rule_fwd_recurrent", {"BV": [8, 16, 32, 64], "num_warps": [1, 2, 4, 8]},
     {"B": 64, "T": 1, "H": 16, "HV": 32, "K": 128, "V": 128}),
):
    register_tunable(Tunable(kernel=_kernel, space=_space, setup=_tune_setup(_kernel), shape_names=_SHAPE_NAMES,
                             default_shape=dict(_shape)))
# the Triton backward (the fallback configs were timed on the H100 by deltanet_probe.py; not tuned)
for _kernel, _space in (
    # BV 32 at K = 128: an illegal address on sm90 with 1 stage (Triton 3.6, H100, benchmarks/deltanet_dh_probe.py,
    # 2026-11-24); with 2-3 stages it runs, memcheck-clean and bit-equal to BV 64, and at B = 1 (nh 32: 64
    # programs at BV 64) it is the fastest. The first tune (2026-11-23) had hit the fault at every point it tried.
    ("gated_delta_rule_bwd_dh", {"BV": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3]}),
    # maxnreg 168: 3 programs per SM instead of 2 at BK 32 / 4 warps / 2 stages (229 registers, 56 KB shared; the
    # cap spills 104 bytes on the wheel's ptxas); 0: no cap. The first tune (2026-11-23, H100, 8 warps and 1 stage
    # included) chose 4 warps / 3 stages, and 1 stage at BK 32 miscompiled there: both left out to keep the sweep short
    ("gated_delta_rule_bwd_dqkw", {"BK": [32, 64], "BV": [32, 64], "num_warps": [4], "num_stages": [2, 3],
                                   "maxnreg": [0, 168]}),
    # 1 stage only: pipelined (2 stages) it miscompiles on sm90 (chunk_bwd._FALLBACK); the tuner would
    # also refuse those points now (their outputs disagree with the fallback's)
    ("gated_delta_rule_bwd_wy", {"BK": [32, 64], "BV": [32, 64], "num_warps": [2, 4, 8], "num_stages": [1]}),
):
    register_tunable(Tunable(kernel=_kernel, space=_space, setup=_tune_bwd_setup(_kernel), shape_names=_SHAPE_NAMES,
                             default_shape=dict(_TUNE_SHAPE)))

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_gated_delta_rule_stages",
           "chunk_gated_delta_rule_bwd_stages", "backward_impl", "chunk_bwd_torch", "recurrent_ref", "chunk_ref_stages",
           "chunk_bwd_ref_stages"]
