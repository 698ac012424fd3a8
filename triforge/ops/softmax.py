"""Softmax over one dimension, computed in fp32, safe for masked (-inf) entries and rows.

    row_max = max_j x_j
    m       = row_max, or 0 when row_max is -inf (every entry masked)
    row_sum = sum_j exp(x_j - m)
    y       = exp(x - m) / row_sum, or 0 everywhere when row_sum is 0 (never NaN)

Rows up to MAX_FUSED_N wide are held in registers, one tile of ROWS rows per program. Wider rows
(up to MAX_N) take a looped path, one row per program: an online pass keeps a running max and a
sum rescaled whenever the max grows, then a second pass writes y.

Backward: dx = y * (dy - sum_j dy_j * y_j), with y recomputed in fp32 from the saved input x and
the forward's fp32 row stats (row_max, row_sum). Reading a rounded bf16/fp16 y instead would cost the
same bytes but put the output's rounding error into every gradient. The forward writes the row stats
(STORE_STAGES) when a gradient may follow, and for ``softmax_stages``.
"""

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from triforge import launch
from triforge.launch import new_output
from triforge.ops._checks import check_tensor
from triforge.registry import OpSpec, register
from triforge.tune import Tunable
from triforge.tune import register as register_tunable

MAX_FUSED_N = 16384  # widest row held whole in registers
MAX_N = 262144  # widest row supported (looped path)

# ----------------------------------------------------------------------------- reference


def softmax_ref(x, dim=-1):
    """Golden reference in the inputs' precision (call it with float64 tensors). Returns stages.

    The shift is detached (softmax does not depend on it) and the divisor is guarded, so autograd
    through a fully -inf row gives zero gradients, not NaN.
    """
    row_max = x.amax(dim, keepdim=True)
    shift = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max).detach()
    e = torch.exp(x - shift)
    row_sum = e.sum(dim, keepdim=True)
    y = e / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
    return OrderedDict(row_max=row_max.squeeze(dim), row_sum=row_sum.squeeze(dim), y=y)


def softmax_dx_scale(x64, dy64, dim=-1):
    """Each input gradient's error scale: dx_i = y_i (dy_i - sum_j y_j dy_j) rounds with its terms,
    y_i (|dy_i| + sum_j y_j |dy_j|), not with its value (which cancels when one y is near one).
    The kernels hold y in float32, where a value below the smallest normal keeps an absolute error of
    half a subnormal spacing (exp(-100) ~ 4e-44 has two significant bits): y_i enters the scale as
    no less than that smallest normal."""
    y = softmax_ref(x64, dim)["y"]
    y_held = y.clamp(min=torch.finfo(torch.float32).tiny)
    return y_held * (dy64.abs() + (y * dy64.abs()).sum(dim, keepdim=True))


def _magnitudes(inputs, grads, dtype=None):
    """The registry's error scales: the forward stages by their rms (the default), dx by its terms
    (softmax_dx_scale; by the rms of dx, a real-tier fp32 check failed 2 of 268M elements where dx cancels)."""
    return {} if grads is None else {"dx": softmax_dx_scale(inputs["x"], grads[0])}


# ----------------------------------------------------------------------------- kernels


@triton.jit
def softmax_fwd_kernel(
    x_ptr,  # [M, N] input
    y_ptr,  # [M, N] output, x.dtype
    max_ptr,  # [M] fp32 row max (written when STORE_STAGES)
    sum_ptr,  # [M] fp32 sum of exp(x - max) (written when STORE_STAGES)
    M,
    N,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    STORE_STAGES: tl.constexpr,
):
    i_m = tl.program_id(0)
    o_m = i_m * ROWS + tl.arange(0, ROWS)
    o_n = tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_mn = m_m[:, None] & (o_n < N)[None, :]
    o_mn = o_m.to(tl.int64)[:, None] * N + o_n[None, :]
    b_x = tl.load(x_ptr + o_mn, mask=m_mn, other=float("-inf")).to(tl.float32)
    b_max = tl.max(b_x, axis=1)
    b_shift = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_e = tl.exp(b_x - b_shift[:, None])
    b_sum = tl.sum(b_e, axis=1)
    b_inv = 1.0 / tl.where(b_sum > 0.0, b_sum, 1.0)
    tl.store(y_ptr + o_mn, (b_e * b_inv[:, None]).to(y_ptr.dtype.element_ty), mask=m_mn)
    if STORE_STAGES:
        tl.store(max_ptr + o_m, b_max, mask=m_m)
        tl.store(sum_ptr + o_m, b_sum, mask=m_m)


@triton.jit
def softmax_fwd_looped_kernel(
    x_ptr,  # [M, N] input
    y_ptr,  # [M, N] output, x.dtype
    max_ptr,  # [M] fp32 (written when STORE_STAGES)
    sum_ptr,  # [M] fp32 (written when STORE_STAGES)
    M,
    N,
    BLOCK_N: tl.constexpr,
    STORE_STAGES: tl.constexpr,
):
    i_m = tl.program_id(0)
    o_row = i_m.to(tl.int64) * N
    o_n = tl.arange(0, BLOCK_N)
    b_max = tl.full([], float("-inf"), tl.float32)
    b_sum = tl.full([], 0.0, tl.float32)
    # pass 1: running max, and the sum rescaled to the current max whenever the max grows
    for i_n in range(0, N, BLOCK_N):
        o = i_n + o_n
        b_x = tl.load(x_ptr + o_row + o, mask=o < N, other=float("-inf")).to(tl.float32)
        b_new = tl.maximum(b_max, tl.max(b_x, axis=0))
        b_shift = tl.where(b_new == float("-inf"), 0.0, b_new)
        b_sum = b_sum * tl.exp(b_max - b_shift) + tl.sum(tl.exp(b_x - b_shift), axis=0)
        b_max = b_new
    b_shift = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_inv = 1.0 / tl.where(b_sum > 0.0, b_sum, 1.0)
    # pass 2: normalise
    for i_n in range(0, N, BLOCK_N):
        o = i_n + o_n
        m = o < N
        b_x = tl.load(x_ptr + o_row + o, mask=m, other=float("-inf")).to(tl.float32)
        b_y = tl.exp(b_x - b_shift) * b_inv
        tl.store(y_ptr + o_row + o, b_y.to(y_ptr.dtype.element_ty), mask=m)
    if STORE_STAGES:
        tl.store(max_ptr + i_m, b_max)
        tl.store(sum_ptr + i_m, b_sum)


@triton.jit
def softmax_bwd_kernel(
    dy_ptr,  # [M, N] grad of y
    x_ptr,  # [M, N] saved input
    max_ptr,  # [M] fp32 row max from the forward
    sum_ptr,  # [M] fp32 row sum from the forward
    dx_ptr,  # [M, N] grad of x, x.dtype
    M,
    N,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
):
    i_m = tl.program_id(0)
    o_m = i_m * ROWS + tl.arange(0, ROWS)
    o_n = tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_mn = m_m[:, None] & (o_n < N)[None, :]
    o_mn = o_m.to(tl.int64)[:, None] * N + o_n[None, :]
    b_x = tl.load(x_ptr + o_mn, mask=m_mn, other=float("-inf")).to(tl.float32)
    b_dy = tl.load(dy_ptr + o_mn, mask=m_mn, other=0.0).to(tl.float32)
    b_max = tl.load(max_ptr + o_m, mask=m_m, other=0.0)
    b_sum = tl.load(sum_ptr + o_m, mask=m_m, other=1.0)
    b_shift = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_inv = 1.0 / tl.where(b_sum > 0.0, b_sum, 1.0)
    b_y = tl.exp(b_x - b_shift[:, None]) * b_inv[:, None]  # y in fp32, as the forward computed it
    b_c = tl.sum(b_y * b_dy, axis=1)
    b_dx = b_y * (b_dy - b_c[:, None])
    tl.store(dx_ptr + o_mn, b_dx.to(dx_ptr.dtype.element_ty), mask=m_mn)


@triton.jit
def softmax_bwd_looped_kernel(
    dy_ptr,  # [M, N] grad of y
    x_ptr,  # [M, N] saved input
    max_ptr,  # [M] fp32 row max from the forward
    sum_ptr,  # [M] fp32 row sum from the forward
    dx_ptr,  # [M, N] grad of x, x.dtype
    M,
    N,
    BLOCK_N: tl.constexpr,
):
    i_m = tl.program_id(0)
    o_row = i_m.to(tl.int64) * N
    o_n = tl.arange(0, BLOCK_N)
    b_max = tl.load(max_ptr + i_m)
    b_sum = tl.load(sum_ptr + i_m)
    b_shift = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_inv = 1.0 / tl.where(b_sum > 0.0, b_sum, 1.0)
    # pass 1: c = sum(y * dy), y recomputed in fp32
    b_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i_n in range(0, N, BLOCK_N):
        o = i_n + o_n
        m = o < N
        b_x = tl.load(x_ptr + o_row + o, mask=m, other=float("-inf")).to(tl.float32)
        b_dy = tl.load(dy_ptr + o_row + o, mask=m, other=0.0).to(tl.float32)
        b_acc += tl.exp(b_x - b_shift) * b_inv * b_dy
    b_c = tl.sum(b_acc, axis=0)
    # pass 2: dx = y * (dy - c)
    for i_n in range(0, N, BLOCK_N):
        o = i_n + o_n
        m = o < N
        b_x = tl.load(x_ptr + o_row + o, mask=m, other=float("-inf")).to(tl.float32)
        b_dy = tl.load(dy_ptr + o_row + o, mask=m, other=0.0).to(tl.float32)
        b_y = tl.exp(b_x - b_shift) * b_inv
        tl.store(dx_ptr + o_row + o, (b_y * (b_dy - b_c)).to(dx_ptr.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------- launchers



def _warps_for(block_n: int) -> int:
    return 4 if block_n <= 1024 else 8 if block_n <= 4096 else 16


def _row_config(kernel, block_n, dtype):
    fallback = {"num_warps": _warps_for(block_n), "ROWS": max(1, min(16, 2048 // block_n))}
    return launch.config(kernel, launch.config_key(block_n=block_n, dtype=launch.dtype_tag(dtype)), fallback)


def _looped_config(kernel, dtype):
    fallback = {"BLOCK_N": 4096, "num_warps": 8}
    return launch.config(kernel, launch.config_key(dtype=launch.dtype_tag(dtype)), fallback)


def _use_looped(N, looped):
    return N > MAX_FUSED_N if looped is None else looped


def softmax_fwd(x, store_stages=False, cfg=None, looped=None):
    """Softmax over the last dimension of a contiguous [M, N] ``x``.

    Returns (y [M, N] in x.dtype, row_max [M] fp32, row_sum [M] fp32); the two row buffers are
    empty unless ``store_stages``. ``looped`` forces (True) or forbids (False) the looped path.
    """
    M, N = x.shape
    y = new_output((M, N), x.dtype, x.device)
    nbytes = 2 * x.numel() * x.element_size() + (8 * M if store_stages else 0)  # DRAM-ideal: x read once
    if store_stages:
        row_max = new_output((M,), torch.float32, x.device)
        row_sum = new_output((M,), torch.float32, x.device)
        max_arg, sum_arg = row_max, row_sum
    else:
        row_max = torch.empty(0, dtype=torch.float32, device=x.device)
        row_sum = torch.empty(0, dtype=torch.float32, device=x.device)
        max_arg = sum_arg = y  # never written when STORE_STAGES is off
    if _use_looped(N, looped):
        cfg = cfg or _looped_config("softmax_fwd_looped", x.dtype)
        launch.launch(
            "softmax_fwd_looped", softmax_fwd_looped_kernel, (M,),
            x, y, max_arg, sum_arg, M, N,
            nbytes=nbytes,
            BLOCK_N=cfg["BLOCK_N"], STORE_STAGES=store_stages, num_warps=cfg["num_warps"],
        )
    else:
        block_n = launch.next_power_of_2(N)
        cfg = cfg or _row_config("softmax_fwd", block_n, x.dtype)
        rows = cfg["ROWS"]
        launch.launch(
            "softmax_fwd", softmax_fwd_kernel, (launch.cdiv(M, rows),),
            x, y, max_arg, sum_arg, M, N,
            nbytes=nbytes,
            BLOCK_N=block_n, ROWS=rows, STORE_STAGES=store_stages, num_warps=cfg["num_warps"],
        )
    return y, row_max, row_sum


def softmax_bwd(dy, x, row_max, row_sum, cfg=None, looped=None):
    """dy, x: contiguous [M, N]; row_max, row_sum: the forward's [M] fp32 row stats.

    Recomputes y in fp32 from x (no rounded copy of y is read). Returns dx [M, N] in x.dtype.
    """
    M, N = x.shape
    dx = new_output((M, N), x.dtype, x.device)
    nbytes = 3 * x.numel() * x.element_size() + 8 * M  # DRAM-ideal: x, dy read once
    if _use_looped(N, looped):
        cfg = cfg or _looped_config("softmax_bwd_looped", x.dtype)
        launch.launch(
            "softmax_bwd_looped", softmax_bwd_looped_kernel, (M,),
            dy, x, row_max, row_sum, dx, M, N,
            nbytes=nbytes,
            BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
        )
    else:
        block_n = launch.next_power_of_2(N)
        cfg = cfg or _row_config("softmax_bwd", block_n, x.dtype)
        rows = cfg["ROWS"]
        launch.launch(
            "softmax_bwd", softmax_bwd_kernel, (launch.cdiv(M, rows),),
            dy, x, row_max, row_sum, dx, M, N,
            nbytes=nbytes,
            BLOCK_N=block_n, ROWS=rows, num_warps=cfg["num_warps"],
        )
    return dx


# ----------------------------------------------------------------------------- custom ops + autograd


@torch.library.custom_op("triforge::softmax_fwd", mutates_args=())
def _softmax_fwd_op(x: torch.Tensor, store_stages: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return softmax_fwd(x.contiguous(), store_stages)


@_softmax_fwd_op.register_fake
def _(x, store_stages):
    M, N = x.shape
    n_rows = M if store_stages else 0
    return (
        x.new_empty((M, N)),
        x.new_empty((n_rows,), dtype=torch.float32),
        x.new_empty((n_rows,), dtype=torch.float32),
    )


@torch.library.custom_op("triforge::softmax_bwd", mutates_args=())
def _softmax_bwd_op(dy: torch.Tensor, x: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor) -> torch.Tensor:
    return softmax_bwd(dy.contiguous(), x.contiguous(), row_max.contiguous(), row_sum.contiguous())


@_softmax_bwd_op.register_fake
def _(dy, x, row_max, row_sum):
    return x.new_empty(x.shape)


def _fwd_setup(ctx, inputs, output):
    x, _ = inputs
    y, row_max, row_sum = output
    ctx.mark_non_differentiable(row_max, row_sum)
    ctx.save_for_backward(x, row_max, row_sum)


def _fwd_backward(ctx, dy, drow_max, drow_sum):
    x, row_max, row_sum = ctx.saved_tensors
    if dy is None:
        return None, None
    if row_max.numel() != x.shape[0]:  # the forward ran without its row stats: one more pass for them
        _, row_max, row_sum = torch.ops.triforge.softmax_fwd(x, True)
    return torch.ops.triforge.softmax_bwd(dy.to(x.dtype), x, row_max, row_sum), None


_softmax_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup)


# ----------------------------------------------------------------------------- public API


def _validate(x, dim):
    check_tensor("x", x)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be in [{-x.dim()}, {x.dim() - 1}] for x of shape {tuple(x.shape)}, got {dim}")
    n = x.shape[dim]
    if n > MAX_N:
        raise ValueError(f"x has {n} elements along dim {dim}; softmax supports rows up to {MAX_N} wide")
    return dim % x.dim()


def _run(x, dim, store_stages):
    d = _validate(x, dim)
    # the backward recomputes y from x and the row stats, so keep them when a gradient may follow
    store_stages = store_stages or (torch.is_grad_enabled() and x.requires_grad)
    last = d == x.dim() - 1
    xt = x if last else x.movedim(d, -1)
    N = xt.shape[-1]
    y, row_max, row_sum = torch.ops.triforge.softmax_fwd(xt.reshape(-1, N), store_stages)
    y = y.view(xt.shape)
    if not last:
        y = y.movedim(-1, d)
    return y, row_max, row_sum, xt.shape[:-1]


def softmax(x, dim: int = -1):
    """Softmax of ``x`` along ``dim`` (any shape, fp32/fp16/bf16), computed in fp32, in x's dtype.

    Rows whose entries are all -inf give zeros.
    """
    return _run(x, dim, False)[0]


def softmax_stages(x, dim: int = -1):
    """The kernel's own stages (row_max, row_sum, y): the buffers the forward kernel writes."""
    y, row_max, row_sum, row_shape = _run(x, dim, True)
    return OrderedDict(row_max=row_max.view(row_shape), row_sum=row_sum.view(row_shape), y=y)


# ----------------------------------------------------------------------------- registry


def _make_inputs(tier, dtype, device, gen):
    """Scaled normal logits with ~10% entries masked to -inf and one row masked whole."""
    M, N = {"tiny": (37, 300), "real": (65536, 4096)}[tier]
    x = 3 * torch.randn(M, N, generator=gen)
    x = x.masked_fill(torch.rand(M, N, generator=gen) < 0.1, float("-inf"))
    x[M // 3] = float("-inf")
    return {"x": x.to(device=device, dtype=dtype)}


def _bytes(inputs, mode):
    x = inputs["x"]
    e, n = x.element_size(), x.numel()
    if mode == "fwd":
        return e * n * 2  # read x, write y
    return e * n * 3  # read x, dy, write dx (the [M] fp32 row stats are negligible)


def _flops(inputs, mode):
    return inputs["x"].numel() * (5 if mode == "fwd" else 4)


def _liger(inputs):
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except ImportError:
        return None
    return lambda x: (LigerSoftmaxFunction.apply(x),)


def _torch_compile(inputs):
    compiled = torch.compile(lambda x: torch.softmax(x, dim=-1))
    return lambda x: (compiled(x),)


def _tune_setup(kind, looped):
    def setup(shape, dtype, device):
        M, N = shape["M"], shape["N"]
        x = torch.randn(M, N, device=device, dtype=dtype)
        if looped:
            key = launch.config_key(dtype=launch.dtype_tag(dtype))
        else:
            key = launch.config_key(block_n=launch.next_power_of_2(N), dtype=launch.dtype_tag(dtype))
        if kind == "fwd":
            return (lambda cfg: softmax_fwd(x, False, cfg, looped=looped)), key
        _, row_max, row_sum = softmax_fwd(x, True, looped=looped)
        dy = torch.randn_like(x)
        return (lambda cfg: softmax_bwd(dy, x, row_max, row_sum, cfg, looped=looped)), key

    return setup


for _kind in ("fwd", "bwd"):
    register_tunable(Tunable(
        kernel=f"softmax_{_kind}",
        space={"num_warps": [1, 2, 4, 8, 16, 32], "ROWS": [1, 2, 4, 8]},
        setup=_tune_setup(_kind, looped=False), shape_names=("M", "N"), default_shape={"M": 65536, "N": 4096},
    ))
    register_tunable(Tunable(
        kernel=f"softmax_{_kind}_looped",
        space={"BLOCK_N": [1024, 2048, 4096, 8192, 16384], "num_warps": [4, 8, 16, 32]},
        setup=_tune_setup(_kind, looped=True), shape_names=("M", "N"), default_shape={"M": 4096, "N": 131072},
    ))

register(OpSpec(
    name="softmax",
    family="softmax",
    make_inputs=_make_inputs,
    reference=softmax_ref,
    stages=softmax_stages,
    call=lambda x: (softmax(x),),
    outputs=("y",),
    grad_inputs=("x",),
    flops=_flops,
    bytes=_bytes,
    peers={"liger": _liger, "torch.compile": _torch_compile},
    describe=lambda inputs: "x".join(map(str, inputs["x"].shape)),
    magnitudes=_magnitudes,
))
