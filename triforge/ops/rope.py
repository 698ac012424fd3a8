"""Rotary position embedding, Hugging Face's ``rotate_half`` convention (Llama, Qwen2, Mistral).

x [B, T, H, D]; cos, sin [T, D] or [B, T, D] (broadcast over heads); halves x1 = x[..., :D/2],
x2 = x[..., D/2:] and likewise c1, c2, s1, s2 (the halves of cos/sin need not be equal):

    out  = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x2, x1)
    out1 = x1 * c1 - x2 * s1                 out2 = x2 * c2 + x1 * s2          (fp32 math)

Backward (the transpose of that per-position linear map):
    dx1 = dy1 * c1 + dy2 * s2                dx2 = dy2 * c2 - dy1 * s1
which is the forward with (s1, s2) replaced by (-s2, -s1): the same kernel, BACKWARD constexpr.
When cos/sin require grad: dcos = sum_heads dy * x, dsin = sum_heads dy * rotate_half(x) (PyTorch).
"""

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from triforge import _runtime, launch
from triforge.launch import new_output
from triforge.ops._checks import FLOAT_DTYPES, check_row_width, check_same_device, check_same_shape, check_tensor
from triforge.registry import OpSpec, register
from triforge.tune import Tunable
from triforge.tune import register as register_tunable

# ----------------------------------------------------------------------------- reference


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rope_ref_one(x, cos, sin):
    # cos [T, D] -> [T, 1, D]; [B, T, D] -> [B, T, 1, D]: broadcast over the head axis of [B, T, H, D]
    return x * cos.unsqueeze(-2) + rotate_half(x) * sin.unsqueeze(-2)


def rope_ref(q, k, cos, sin):
    """Golden reference in the inputs' precision (call it with float64 tensors). Returns stages."""
    stages = OrderedDict()
    stages["q_out"] = _rope_ref_one(q, cos, sin)
    stages["k_out"] = _rope_ref_one(k, cos, sin)
    return stages


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _rope_block(
    x_ptr,  # [B*T*H*D] input, flattened
    o_ptr,  # [B*T*H*D] output
    cos_ptr,
    sin_ptr,
    i_b,  # which BLOCK of the flattened tensor
    n_elem,
    T,
    D: tl.constexpr,
    HD: tl.constexpr,  # H * D: elements per position
    BLOCK: tl.constexpr,
    BATCHED: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """Rotate one contiguous BLOCK of the flattened [B*T, H, D] tensor.

    Each element reads its rotate-half partner (d + D/2 or d - D/2: the same cache lines, a second load
    that hits L1) and cos/sin at its own (position, d) (a few MB read by every head and batch: L2).
    Contiguous blocks keep every load and store fully coalesced; measured on an H100 at 97.5% of copy
    against 92% for [heads, D/2] tiles per position (benchmarks/rowwise_probe.py).
    """
    HALF: tl.constexpr = D // 2
    o_x = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: B*T*H*D may pass 2**31
    m_x = o_x < n_elem
    o_d = (o_x % D).to(tl.int32)
    o_pos = o_x // HD
    if not BATCHED:
        o_pos = o_pos % T
    first = o_d < HALF
    o_partner = tl.where(first, o_x + HALF, o_x - HALF)
    o_cs = o_pos * D + o_d
    b_x = tl.load(x_ptr + o_x, mask=m_x, other=0.0).to(tl.float32)
    b_xp = tl.load(x_ptr + o_partner, mask=m_x, other=0.0).to(tl.float32)
    b_c = tl.load(cos_ptr + o_cs, mask=m_x, other=0.0).to(tl.float32)
    if BACKWARD:
        # dx1 = dy1 c1 + dy2 s2 and dx2 = dy2 c2 - dy1 s1: sin at the partner's d
        b_sp = tl.load(sin_ptr + tl.where(first, o_cs + HALF, o_cs - HALF), mask=m_x, other=0.0).to(tl.float32)
        b_y = b_x * b_c + tl.where(first, b_xp * b_sp, -(b_xp * b_sp))
    else:
        # y1 = x1 c1 - x2 s1 and y2 = x2 c2 + x1 s2
        b_s = tl.load(sin_ptr + o_cs, mask=m_x, other=0.0).to(tl.float32)
        b_y = b_x * b_c + tl.where(first, -(b_xp * b_s), b_xp * b_s)
    tl.store(o_ptr + o_x, b_y.to(o_ptr.dtype.element_ty), mask=m_x)


@triton.jit
def rope_kernel(
    q_ptr,  # [B*T, HQ, D] input (dy of q_out when BACKWARD)
    k_ptr,  # [B*T, HK, D] (read when HAS_K)
    cos_ptr,  # [T, D] or [B*T, D] (BATCHED), any float dtype
    sin_ptr,
    qo_ptr,  # [B*T, HQ, D] output, q's dtype
    ko_ptr,  # [B*T, HK, D] (written when HAS_K)
    n_q,  # elements of q
    n_k,  # elements of k
    n_q_blocks,  # the first n_q_blocks programs rotate q, the rest k
    T,
    D: tl.constexpr,
    HQD: tl.constexpr,
    HKD: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_K: tl.constexpr,
    BATCHED: tl.constexpr,  # cos/sin are [B, T, D] rather than [T, D]
    BACKWARD: tl.constexpr,
):
    i_b = tl.program_id(0)
    if i_b < n_q_blocks:
        _rope_block(q_ptr, qo_ptr, cos_ptr, sin_ptr, i_b, n_q, T, D, HQD, BLOCK, BATCHED, BACKWARD)
    elif HAS_K:
        _rope_block(k_ptr, ko_ptr, cos_ptr, sin_ptr, i_b - n_q_blocks, n_k, T, D, HKD, BLOCK, BATCHED, BACKWARD)


# ----------------------------------------------------------------------------- launchers

MAX_HEAD_DIM = 8192


def _config(kind, D, dtype):
    # fallback measured on an H100 at q 8x4096x32x128 + k 8x4096x8x128 bf16 (benchmarks/rowwise_probe.py):
    # 2048-element blocks with 8 warps (8 elements, 16 bytes per thread) 97.6% of copy; 1024 with 4
    # warps the same; 512 elements 92%. The interpreter's cost is per program: bigger blocks there.
    fallback = {"BLOCK": 8192 if _runtime.INTERPRET else 2048, "num_warps": 8}
    key = launch.config_key(d=D, dtype=launch.dtype_tag(dtype))
    return launch.config(f"rope_{kind}", key, fallback)


def rope_launch(q, k, cos, sin, backward=False, cfg=None):
    """q [B, T, HQ, D], k [B, T, HK, D] or None, cos/sin [T, D] or [B, T, D], all contiguous.

    Returns (q_out, k_out or None) in q's and k's dtypes; with ``backward`` they are the input grads.
    """
    B, T, HQ, D = q.shape
    HK = k.shape[2] if k is not None else 0
    cfg = cfg or _config("bwd" if backward else "fwd", D, q.dtype)
    q_out = new_output(q.shape, q.dtype, q.device)
    k_out = new_output(k.shape, k.dtype, k.device) if k is not None else None
    block = cfg["BLOCK"]
    n_q, n_k = q.numel(), (k.numel() if k is not None else 0)
    n_q_blocks = launch.cdiv(n_q, block)
    # bytes (the registry's model, for triforge trace): q and k read and written, cos and sin read once
    nbytes = (2 * (q.element_size() * n_q + (k.element_size() * n_k if k is not None else 0))
              + cos.element_size() * cos.numel() + sin.element_size() * sin.numel())
    launch.launch(
        "rope_bwd" if backward else "rope_fwd", rope_kernel, (n_q_blocks + launch.cdiv(n_k, block),),
        q, k if k is not None else q, cos, sin, q_out, k_out if k is not None else q_out,
        n_q, n_k, n_q_blocks, T, nbytes=nbytes,
        D=D, HQD=HQ * D, HKD=max(HK, 1) * D, BLOCK=block,
        HAS_K=k is not None, BATCHED=cos.dim() == 3, BACKWARD=backward, num_warps=cfg["num_warps"],
    )
    return q_out, k_out


# ----------------------------------------------------------------------------- custom ops + autograd


def _rope_fwd_impl(x, cos, sin):
    return rope_launch(x.contiguous(), None, cos.contiguous(), sin.contiguous())[0]


def _rope_bwd_impl(dy, cos, sin):
    return rope_launch(dy.contiguous(), None, cos.contiguous(), sin.contiguous(), backward=True)[0]


def _rope_qk_fwd_impl(q, k, cos, sin):
    return rope_launch(q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous())


def _rope_qk_bwd_impl(dq, dk, cos, sin):
    return rope_launch(dq.contiguous(), dk.contiguous(), cos.contiguous(), sin.contiguous(), backward=True)


@torch.library.custom_op("triforge::rope_fwd", mutates_args=())
def _rope_fwd_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rope_fwd_impl(x, cos, sin)


@_rope_fwd_op.register_fake
def _(x, cos, sin):
    return x.new_empty(x.shape)


@torch.library.custom_op("triforge::rope_bwd", mutates_args=())
def _rope_bwd_op(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rope_bwd_impl(dy, cos, sin)


@_rope_bwd_op.register_fake
def _(dy, cos, sin):
    return dy.new_empty(dy.shape)


@torch.library.custom_op("triforge::rope_qk_fwd", mutates_args=())
def _rope_qk_fwd_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_qk_fwd_impl(q, k, cos, sin)


@_rope_qk_fwd_op.register_fake
def _(q, k, cos, sin):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("triforge::rope_qk_bwd", mutates_args=())
def _rope_qk_bwd_op(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_qk_bwd_impl(dq, dk, cos, sin)


@_rope_qk_bwd_op.register_fake
def _(dq, dk, cos, sin):
    return dq.new_empty(dq.shape), dk.new_empty(dk.shape)


def _cos_sin_grads(pairs, cos, sin, need_cos, need_sin):
    """dcos = sum over heads of dy * x, dsin = sum over heads of dy * rotate_half(x), in cos's shape."""
    acc = torch.promote_types(torch.float32, torch.promote_types(cos.dtype, sin.dtype))
    dcos = dsin = None
    for dy, x in pairs:
        dyf, xf = dy.to(acc), x.to(acc)
        if need_cos:
            g = (dyf * xf).sum(2)
            dcos = g if dcos is None else dcos + g
        if need_sin:
            g = (dyf * rotate_half(xf)).sum(2)
            dsin = g if dsin is None else dsin + g
    if cos.dim() == 2:  # [T, D] was broadcast over the batch too
        dcos = dcos.sum(0) if dcos is not None else None
        dsin = dsin.sum(0) if dsin is not None else None
    return (
        dcos.to(cos.dtype) if dcos is not None else None,
        dsin.to(sin.dtype) if dsin is not None else None,
    )


def _fwd_setup(ctx, inputs, output):
    x, cos, sin = inputs
    ctx.need_cs = (cos.requires_grad, sin.requires_grad)
    ctx.save_for_backward(cos, sin, x if any(ctx.need_cs) else None)


def _fwd_backward(ctx, dy):
    cos, sin, x = ctx.saved_tensors
    dx = None
    if ctx.needs_input_grad[0]:
        if launch.eager_backward(dy, cos, sin):
            dx = _rope_bwd_impl(dy, cos, sin)
        else:
            dx = torch.ops.triforge.rope_bwd(dy, cos, sin)
    dcos, dsin = None, None
    if any(ctx.need_cs):
        dcos, dsin = _cos_sin_grads([(dy, x)], cos, sin, *ctx.need_cs)
    return dx, dcos, dsin


_rope_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup)


def _qk_setup(ctx, inputs, output):
    q, k, cos, sin = inputs
    ctx.need_cs = (cos.requires_grad, sin.requires_grad)
    ctx.qk_meta = ((q.shape, q.dtype), (k.shape, k.dtype))
    keep = any(ctx.need_cs)
    ctx.save_for_backward(cos, sin, q if keep else None, k if keep else None)


def _qk_backward(ctx, dq_out, dk_out):
    cos, sin, q, k = ctx.saved_tensors
    dq = dk = None
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
        # an output that took no part in the loss has no gradient: it contributes zero
        g_q, g_k = (
            g if g is not None else torch.zeros(shape, dtype=dtype, device=cos.device)
            for g, (shape, dtype) in zip((dq_out, dk_out), ctx.qk_meta)
        )
        if launch.eager_backward(g_q, g_k, cos, sin):
            dq, dk = _rope_qk_bwd_impl(g_q, g_k, cos, sin)
        else:
            dq, dk = torch.ops.triforge.rope_qk_bwd(g_q, g_k, cos, sin)
    dcos = dsin = None
    if any(ctx.need_cs):
        pairs = [(g, x) for g, x in ((dq_out, q), (dk_out, k)) if g is not None]
        if pairs:
            dcos, dsin = _cos_sin_grads(pairs, cos, sin, *ctx.need_cs)
    return dq, dk, dcos, dsin


_rope_qk_fwd_op.register_autograd(_qk_backward, setup_context=_qk_setup)

# eager twins of the two forward ops (see launch.eager): same bodies, setup and backward
_RopeFunction = launch.eager_function("_RopeFunction", _rope_fwd_impl, _fwd_setup, _fwd_backward)
_RopeQKFunction = launch.eager_function("_RopeQKFunction", _rope_qk_fwd_impl, _qk_setup, _qk_backward)


# ----------------------------------------------------------------------------- public API

_CS_DTYPES = FLOAT_DTYPES + (torch.float64,)


def _validate_x(name, x):
    check_tensor(name, x, ndim=4)
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"{name} must have an even head dimension (last dim), got shape {tuple(x.shape)}")
    check_row_width(name, D, MAX_HEAD_DIM)


def _validate_cos_sin(x_name, x, cos, sin):
    check_tensor("cos", cos, dtypes=_CS_DTYPES, ndim=(2, 3))
    check_tensor("sin", sin, dtypes=_CS_DTYPES, ndim=(2, 3))
    check_same_shape(cos=cos, sin=sin)
    B, T, _, D = x.shape
    allowed = [(T, D), (B, T, D), (1, T, D)]
    if tuple(cos.shape) not in allowed:
        raise ValueError(
            f"cos and sin must have shape [T, D] = {[T, D]} or [B, T, D] = {[B, T, D]} to match {x_name} "
            f"{tuple(x.shape)} ([B, T, H, D]), got {tuple(cos.shape)}"
        )


def _squeeze_cs(cos, sin):
    """[1, T, D] -> [T, D]; autograd maps the gradient back through the view."""
    if cos.dim() == 3 and cos.shape[0] == 1:
        return cos[0], sin[0]
    return cos, sin


def apply_rotary(x, cos, sin):
    """Rotary embedding of ``x`` [B, T, H, D] with ``cos``/``sin`` [T, D] or [B, T, D] (also [1, T, D]).

    ``out = x * cos + rotate_half(x) * sin`` with cos/sin broadcast over heads; output in x's dtype.
    """
    _validate_x("x", x)
    _validate_cos_sin("x", x, cos, sin)
    check_same_device(x=x, cos=cos, sin=sin)
    cos, sin = _squeeze_cs(cos, sin)
    if launch.eager(x, cos, sin):
        return _RopeFunction.apply(x, cos, sin)
    return torch.ops.triforge.rope_fwd(x, cos, sin)


def _validate_qk(q, k, cos, sin):
    _validate_x("q", q)
    _validate_x("k", k)
    if (q.shape[0], q.shape[1], q.shape[3]) != (k.shape[0], k.shape[1], k.shape[3]):
        raise ValueError(
            f"k must have the same batch, sequence and head dims as q [B, T, *, D] = "
            f"{[q.shape[0], q.shape[1], '*', q.shape[3]]}, got {tuple(k.shape)}"
        )
    if k.dtype != q.dtype:
        raise TypeError(f"k must have the same dtype as q ({q.dtype}), got {k.dtype}")
    _validate_cos_sin("q", q, cos, sin)
    check_same_device(q=q, k=k, cos=cos, sin=sin)


def apply_rotary_qk(q, k, cos, sin):
    """Rotary embedding of queries q [B, T, Hq, D] and keys k [B, T, Hk, D] (Hk may differ: GQA)
    in one kernel launch; ``cos``/``sin`` [T, D] or [B, T, D] (also [1, T, D]). Returns (q_out, k_out)."""
    _validate_qk(q, k, cos, sin)
    cos, sin = _squeeze_cs(cos, sin)
    if launch.eager(q, k, cos, sin):
        return _RopeQKFunction.apply(q, k, cos, sin)
    return torch.ops.triforge.rope_qk_fwd(q, k, cos, sin)


def rope_stages(q, k, cos, sin):
    """The kernel's own outputs (q_out, k_out): the only buffers the forward kernel writes."""
    q_out, k_out = apply_rotary_qk(q, k, cos, sin)
    return OrderedDict(q_out=q_out, k_out=k_out)


# ----------------------------------------------------------------------------- registry


def hf_cos_sin(T, D, *, positions=None, base=10000.0, dtype=torch.float32, device="cpu"):
    """cos, sin [T, D] (or [B, T, D] for positions [B, T]) built like Hugging Face's rotary embedding."""
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    pos = torch.arange(T, dtype=torch.float64) if positions is None else positions.to(torch.float64)
    freqs = pos.unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def _make_inputs(tier, dtype, device, gen):
    if tier == "tiny":
        B, T, HQ, HK, D = 2, 37, 6, 2, 64
        # per-sequence positions (as with HF position_ids): cos/sin [B, T, D]
        start = torch.randint(0, 1000, (B, 1), generator=gen)
        cos, sin = hf_cos_sin(T, D, positions=start + torch.arange(T), dtype=dtype, device=device)
    else:
        B, T, HQ, HK, D = {"real": (8, 4096, 32, 8, 128)}[tier]
        cos, sin = hf_cos_sin(T, D, dtype=dtype, device=device)
    q = torch.randn(B, T, HQ, D, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    k = torch.randn(B, T, HK, D, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    return {"q": q, "k": k, "cos": cos, "sin": sin}


def _bytes(inputs, mode):
    q, k, cos, sin = inputs["q"], inputs["k"], inputs["cos"], inputs["sin"]
    qk = q.element_size() * (q.numel() + k.numel())
    cs = cos.element_size() * cos.numel() + sin.element_size() * sin.numel()
    return 2 * qk + cs  # fwd: read q, k, write q_out, k_out; bwd: read dq_out, dk_out, write dq, dk


def _flops(inputs, mode):
    return 3 * (inputs["q"].numel() + inputs["k"].numel())


def _liger(inputs):
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except ImportError:
        return None

    def run(q, k, cos, sin):
        # liger wants [B, H, T, D] (it transposes back to the [B, T, H, D] storage) and cos [1 or B, T, D];
        # note it rotates q and k in place
        if cos.dim() == 2:
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        out = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return out[0].transpose(1, 2), out[1].transpose(1, 2)

    return run


def _torch_compile(inputs):
    def eager(q, k, cos, sin):
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return (q * c + rotate_half(q) * s).to(q.dtype), (k * c + rotate_half(k) * s).to(k.dtype)

    return torch.compile(eager)


def _tune_setup(kind):
    def setup(shape, dtype, device):
        B, T, HQ, HK, D = (shape[n] for n in ("B", "T", "HQ", "HK", "D"))
        q = torch.randn(B, T, HQ, D, device=device, dtype=dtype)
        k = torch.randn(B, T, HK, D, device=device, dtype=dtype)
        cos, sin = hf_cos_sin(T, D, dtype=dtype, device=device)
        key = launch.config_key(d=D, dtype=launch.dtype_tag(dtype))
        return (lambda cfg: rope_launch(q, k, cos, sin, backward=kind == "bwd", cfg=cfg)), key

    return setup


_TUNE_SHAPE = {"B": 8, "T": 4096, "HQ": 32, "HK": 8, "D": 128}

register_tunable(Tunable(
    kernel="rope_fwd",
    space={"num_warps": [2, 4, 8, 16], "BLOCK": [512, 1024, 2048, 4096, 8192]},
    setup=_tune_setup("fwd"), shape_names=("B", "T", "HQ", "HK", "D"), default_shape=dict(_TUNE_SHAPE),
))
register_tunable(Tunable(
    kernel="rope_bwd",
    space={"num_warps": [2, 4, 8, 16], "BLOCK": [512, 1024, 2048, 4096, 8192]},
    setup=_tune_setup("bwd"), shape_names=("B", "T", "HQ", "HK", "D"), default_shape=dict(_TUNE_SHAPE),
))

register(OpSpec(
    name="rope",
    family="rope",
    make_inputs=_make_inputs,
    reference=rope_ref,
    stages=rope_stages,
    call=lambda q, k, cos, sin: apply_rotary_qk(q, k, cos, sin),
    outputs=("q_out", "k_out"),
    grad_inputs=("q", "k"),
    flops=_flops,
    bytes=_bytes,
    peers={"liger": _liger, "torch.compile": _torch_compile},
    describe=lambda inputs: (
        f"q {'x'.join(map(str, inputs['q'].shape))} k {'x'.join(map(str, inputs['k'].shape))} "
        f"cos {'x'.join(map(str, inputs['cos'].shape))}"
    ),
))
