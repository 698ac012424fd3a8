"""SwiGLU activation: the gated product of a Llama/Qwen MLP, computed in fp32.

    s = sigmoid(gate)
    y = gate * s * up                        (fp32, rounded once to the inputs' dtype)

Backward (the kernel recomputes s from gate and writes both grads in one pass):
    d_gate = dy * up * s * (1 + gate * (1 - s))
    d_up   = dy * gate * s
"""

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from triforge import launch
from triforge.launch import new_output
from triforge.ops._checks import check_same_device, check_same_dtype, check_same_shape, check_tensor
from triforge.registry import OpSpec, register
from triforge.tune import Tunable
from triforge.tune import register as register_tunable

# ----------------------------------------------------------------------------- reference


def swiglu_ref(gate, up):
    """Golden reference in the inputs' precision (call it with float64 tensors). Returns stages."""
    y = gate * torch.sigmoid(gate) * up
    return OrderedDict(y=y)


def swiglu_dgate_scale(gate, up, dy, dtype=torch.float32):
    """Each gate gradient's error scale (float64 tensors) for a check at ``dtype``'s tolerance: dgate = dy up s
    (1 + g (1 - s)), s = sigmoid(g), rounds with its terms, |dy up| s (1 + |g| (1 - s)), not with its value: silu' has
    a zero at g ~ -1.2785, where 1 + g (1 - s) cancels (a one-element check there failed fp32 by its own size, rel.
    8.8e-4, session 48). The kernel holds s in fp32, which has nothing below its smallest normal to hold: below
    g ~ -87 s is 0 there (exp(-g) overflows, or the quotient is flushed), an absolute error of up to that normal in s,
    so |dy up| (1 + |g|) tiny / atol is added: the scale's atol multiple covers it."""
    from triforge.testing import tolerance_for

    s = torch.sigmoid(gate)
    held = (1 + gate.abs()) * torch.finfo(torch.float32).tiny / tolerance_for(dtype).atol
    return (dy * up).abs() * (s * (1 + gate.abs() * (1 - s)) + held)


def _magnitudes(inputs, grads, dtype=None):
    """The registry's error scales: y and dup by their rms (products, no cancellation), dgate by its terms."""
    if grads is None:
        return {}
    return {"dgate": swiglu_dgate_scale(inputs["gate"], inputs["up"], grads[0], dtype or torch.float32)}


# ----------------------------------------------------------------------------- kernels


@triton.jit
def swiglu_fwd_kernel(
    g_ptr,  # [numel] gate
    u_ptr,  # [numel] up
    y_ptr,  # [numel] output, gate's dtype
    numel,
    BLOCK: tl.constexpr,
):
    i_b = tl.program_id(0)
    o = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < numel
    b_g = tl.load(g_ptr + o, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(u_ptr + o, mask=m, other=0.0).to(tl.float32)
    b_y = b_g * tl.sigmoid(b_g) * b_u
    tl.store(y_ptr + o, b_y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def swiglu_bwd_kernel(
    dy_ptr,  # [numel] grad of y
    g_ptr,  # [numel] gate
    u_ptr,  # [numel] up
    dg_ptr,  # [numel] grad of gate
    du_ptr,  # [numel] grad of up
    numel,
    BLOCK: tl.constexpr,
):
    i_b = tl.program_id(0)
    o = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < numel
    b_dy = tl.load(dy_ptr + o, mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(g_ptr + o, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(u_ptr + o, mask=m, other=0.0).to(tl.float32)
    b_s = tl.sigmoid(b_g)
    b_silu = b_g * b_s
    b_dg = b_dy * b_u * b_s * (1.0 + b_g * (1.0 - b_s))
    b_du = b_dy * b_silu
    tl.store(dg_ptr + o, b_dg.to(dg_ptr.dtype.element_ty), mask=m)
    tl.store(du_ptr + o, b_du.to(du_ptr.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------- launchers



def _fwd_config(dtype):
    fallback = {"BLOCK": 2048, "num_warps": 8}
    return launch.config("swiglu_fwd", launch.config_key(dtype=launch.dtype_tag(dtype)), fallback)


def _bwd_config(dtype):
    fallback = {"BLOCK": 2048, "num_warps": 8}
    return launch.config("swiglu_bwd", launch.config_key(dtype=launch.dtype_tag(dtype)), fallback)


def swiglu_fwd(gate, up, cfg=None):
    """gate, up: contiguous, same shape and dtype. Returns y (gate's shape and dtype)."""
    numel = gate.numel()
    cfg = cfg or _fwd_config(gate.dtype)
    y = new_output(gate.shape, gate.dtype, gate.device)
    block = cfg["BLOCK"]
    launch.launch(
        "swiglu_fwd", swiglu_fwd_kernel, (launch.cdiv(numel, block),),
        gate, up, y, numel,
        nbytes=3 * numel * gate.element_size(),
        BLOCK=block, num_warps=cfg["num_warps"],
    )
    return y


def swiglu_bwd(dy, gate, up, cfg=None):
    """All contiguous, same shape. Returns (d_gate, d_up) in gate's dtype."""
    numel = gate.numel()
    cfg = cfg or _bwd_config(gate.dtype)
    dg = new_output(gate.shape, gate.dtype, gate.device)
    du = new_output(gate.shape, gate.dtype, gate.device)
    block = cfg["BLOCK"]
    launch.launch(
        "swiglu_bwd", swiglu_bwd_kernel, (launch.cdiv(numel, block),),
        dy, gate, up, dg, du, numel,
        nbytes=5 * numel * gate.element_size(),
        BLOCK=block, num_warps=cfg["num_warps"],
    )
    return dg, du


# ----------------------------------------------------------------------------- custom ops + autograd


@torch.library.custom_op("triforge::swiglu_fwd", mutates_args=())
def _swiglu_fwd_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu_fwd(gate.contiguous(), up.contiguous())


@_swiglu_fwd_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("triforge::swiglu_bwd", mutates_args=())
def _swiglu_bwd_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_bwd(dy.contiguous(), gate.contiguous(), up.contiguous())


@_swiglu_bwd_op.register_fake
def _(dy, gate, up):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _fwd_setup(ctx, inputs, output):
    gate, up = inputs
    ctx.save_for_backward(gate, up)


def _fwd_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dg, du = torch.ops.triforge.swiglu_bwd(dy.to(gate.dtype), gate, up)
    return dg, du


_swiglu_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup)


# ----------------------------------------------------------------------------- public API


def _validate(gate, up):
    check_tensor("gate", gate, min_ndim=0)
    check_tensor("up", up, min_ndim=0)
    check_same_shape(gate=gate, up=up)
    check_same_dtype(gate=gate, up=up)
    check_same_device(gate=gate, up=up)


def swiglu(gate, up):
    """``silu(gate) * up`` elementwise (any shape), computed in fp32, returned in the inputs' dtype."""
    _validate(gate, up)
    return torch.ops.triforge.swiglu_fwd(gate, up)


def swiglu_stages(gate, up):
    """The kernel's own stages: only ``y`` (the kernel keeps silu(gate) in registers)."""
    _validate(gate, up)
    return OrderedDict(y=torch.ops.triforge.swiglu_fwd(gate, up))


# ----------------------------------------------------------------------------- registry


def _make_inputs(tier, dtype, device, gen):
    M, N = {"tiny": (37, 300), "real": (65536, 3584)}[tier]
    gate = (2 * torch.randn(M, N, generator=gen)).to(device=device, dtype=dtype)
    up = torch.randn(M, N, generator=gen).to(device=device, dtype=dtype)
    return {"gate": gate, "up": up}


def _bytes(inputs, mode):
    g = inputs["gate"]
    e, n = g.element_size(), g.numel()
    if mode == "fwd":
        return e * n * 3  # read gate, up; write y
    return e * n * 5  # read gate, up, dy; write d_gate, d_up


def _flops(inputs, mode):
    return inputs["gate"].numel() * (5 if mode == "fwd" else 12)


def _liger(inputs):
    """Liger's SiLU-mul. Its backward writes the gradients IN PLACE into the tensors it was given
    (in an MLP they are dead activations), so whoever calls this peer's backward must not read
    ``gate`` / ``up`` again afterwards. No clones here: they would add copies to liger's timing."""
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return None
    return lambda gate, up: (LigerSiLUMulFunction.apply(gate, up),)


def _torch_compile(inputs):
    def eager(gate, up):
        return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)

    compiled = torch.compile(eager)
    return lambda gate, up: (compiled(gate, up),)


def _tune_setup(kind):
    def setup(shape, dtype, device):
        M, N = shape["M"], shape["N"]
        gate = torch.randn(M, N, device=device, dtype=dtype)
        up = torch.randn(M, N, device=device, dtype=dtype)
        key = launch.config_key(dtype=launch.dtype_tag(dtype))
        if kind == "fwd":
            return (lambda cfg: swiglu_fwd(gate, up, cfg)), key
        dy = torch.randn_like(gate)
        return (lambda cfg: swiglu_bwd(dy, gate, up, cfg)), key

    return setup


register_tunable(Tunable(
    kernel="swiglu_fwd",
    space={"BLOCK": [512, 1024, 2048, 4096, 8192], "num_warps": [2, 4, 8, 16]},
    setup=_tune_setup("fwd"), shape_names=("M", "N"), default_shape={"M": 65536, "N": 3584},
))
register_tunable(Tunable(
    kernel="swiglu_bwd",
    space={"BLOCK": [512, 1024, 2048, 4096, 8192], "num_warps": [2, 4, 8, 16]},
    setup=_tune_setup("bwd"), shape_names=("M", "N"), default_shape={"M": 65536, "N": 3584},
))

register(OpSpec(
    name="swiglu",
    family="swiglu",
    make_inputs=_make_inputs,
    reference=swiglu_ref,
    stages=swiglu_stages,
    call=lambda gate, up: (swiglu(gate, up),),
    outputs=("y",),
    grad_inputs=("gate", "up"),
    flops=_flops,
    bytes=_bytes,
    peers={"liger": _liger, "torch.compile": _torch_compile},
    describe=lambda inputs: "x".join(map(str, inputs["gate"].shape)),
    magnitudes=_magnitudes,
))
