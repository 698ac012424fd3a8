"""RMSNorm with an optional fused residual add, numerics of Hugging Face's Qwen2RMSNorm.

    h    = x + residual                      (rounded to x's dtype, as the eager model does)
    rstd = 1 / sqrt(mean(h^2) + eps)         (fp32)
    y    = weight * (h * rstd).to(x.dtype)   (y's dtype: promote(x.dtype, weight.dtype))

Backward (x_hat = h * rstd, g = dy * weight):
    dh = rstd * (g - x_hat * mean(g * x_hat)) + d(h output)
    dw = sum over rows of dy * x_hat
"""

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from triforge import _runtime, launch
from triforge.launch import new_output
from triforge.ops._checks import check_row_width, check_same_device, check_same_dtype, check_same_shape, check_tensor
from triforge.registry import OpSpec, register
from triforge.tune import Tunable
from triforge.tune import register as register_tunable

# ----------------------------------------------------------------------------- reference


def rms_norm_ref(x, weight, eps=1e-6, residual=None):
    """Golden reference in the inputs' precision (call it with float64 tensors). Returns stages."""
    h = x if residual is None else x + residual
    rstd = torch.rsqrt(h.square().mean(-1) + eps)
    y = weight * (h * rstd.unsqueeze(-1))
    stages = OrderedDict()
    if residual is not None:
        stages["h"] = h
    stages["rstd"] = rstd
    stages["y"] = y
    return stages


# ----------------------------------------------------------------------------- kernels


@triton.jit
def rms_norm_fwd_kernel(
    x_ptr,  # [M, N] input, x.dtype
    r_ptr,  # [M, N] residual, x.dtype (read when HAS_RESIDUAL)
    w_ptr,  # [N] weight
    y_ptr,  # [M, N] output, promote(x.dtype, w.dtype)
    h_ptr,  # [M, N] x + residual, x.dtype (written when HAS_RESIDUAL)
    rstd_ptr,  # [M] fp32
    M,
    N,
    eps,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    i_m = tl.program_id(0)
    o_m = i_m * ROWS + tl.arange(0, ROWS)
    o_n = tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_n = o_n < N
    m_mn = m_m[:, None] & m_n[None, :]
    o_mn = o_m.to(tl.int64)[:, None] * N + o_n[None, :]
    b_x = tl.load(x_ptr + o_mn, mask=m_mn, other=0.0)
    if HAS_RESIDUAL:
        b_r = tl.load(r_ptr + o_mn, mask=m_mn, other=0.0)
        b_x = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + o_mn, b_x, mask=m_mn)
    b_xf = b_x.to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_xf * b_xf, axis=1) / N + eps)
    tl.store(rstd_ptr + o_m, b_rstd, mask=m_m)
    b_xhat = (b_xf * b_rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    b_w = tl.load(w_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + o_mn, (b_xhat * b_w[None, :]).to(y_ptr.dtype.element_ty), mask=m_mn)


@triton.jit
def _rms_bwd_row_loads(dy_ptr, x_ptr, dh_ptr, o_row, o_n, m, HAS_DH: tl.constexpr):
    b_x = tl.load(x_ptr + o_row + o_n, mask=m, other=0.0)
    b_dy = tl.load(dy_ptr + o_row + o_n, mask=m, other=0.0)
    if HAS_DH:
        b_dh = tl.load(dh_ptr + o_row + o_n, mask=m, other=0.0)
    else:
        b_dh = b_x  # unused
    return b_x, b_dy, b_dh


@triton.jit
def rms_norm_bwd_kernel(
    dy_ptr,  # [M, N] grad of y
    x_ptr,  # [M, N] the normalised input (h when there was a residual)
    w_ptr,  # [N]
    rstd_ptr,  # [M] fp32
    dh_ptr,  # [M, N] grad of the h output (read when HAS_DH)
    dx_ptr,  # [M, N] grad of x (and of residual)
    dw_part_ptr,  # [G, N] fp32, one partial weight gradient per program
    M,
    N,
    rows_per_program,
    BLOCK_N: tl.constexpr,
    HAS_DH: tl.constexpr,
):
    """Persistent over rows_per_program rows; the next row's loads are issued before this row's math
    and store, so two rows of every input are in flight per program (measured on an H100 at
    65536 x 4096 bf16 with a residual: 96% of copy against 88% loading each row when its turn comes;
    benchmarks/rowwise_probe.py)."""
    i_g = tl.program_id(0)
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_w = tl.load(w_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = i_g * rows_per_program  # every program has at least one row (the launcher's grid)
    row_end = tl.minimum(row_start + rows_per_program, M)
    b_x, b_dy, b_dh = _rms_bwd_row_loads(dy_ptr, x_ptr, dh_ptr, tl.cast(row_start, tl.int64) * N, o_n, m_n, HAS_DH)
    b_rstd = tl.load(rstd_ptr + row_start)
    for i_m in range(row_start, row_end):
        # prefetch row i_m + 1 (masked off past this program's rows)
        n_x, n_dy, n_dh = _rms_bwd_row_loads(
            dy_ptr, x_ptr, dh_ptr, tl.cast(i_m + 1, tl.int64) * N, o_n, m_n & (i_m + 1 < row_end), HAS_DH
        )
        n_rstd = tl.load(rstd_ptr + tl.minimum(i_m + 1, M - 1))
        b_xhat = b_x.to(tl.float32) * b_rstd
        b_dyf = b_dy.to(tl.float32)
        b_g = b_dyf * b_w
        b_dw += b_dyf * b_xhat
        b_c = tl.sum(b_g * b_xhat, axis=0) / N
        b_dx = b_rstd * (b_g - b_xhat * b_c)
        if HAS_DH:
            b_dx += b_dh.to(tl.float32)
        tl.store(dx_ptr + tl.cast(i_m, tl.int64) * N + o_n, b_dx.to(dx_ptr.dtype.element_ty), mask=m_n)
        b_x, b_dy, b_dh, b_rstd = n_x, n_dy, n_dh, n_rstd
    tl.store(dw_part_ptr + i_g.to(tl.int64) * N + o_n, b_dw, mask=m_n)


# ----------------------------------------------------------------------------- launchers



def _warps_for(block_n: int) -> int:
    return 4 if block_n <= 1024 else 8 if block_n <= 4096 else 16


def _fwd_config(block_n, dtype, residual):
    fallback = {"num_warps": _warps_for(block_n), "ROWS": max(1, min(16, 2048 // block_n))}
    key = launch.config_key(block_n=block_n, dtype=launch.dtype_tag(dtype), residual=int(residual))
    return launch.config("rms_norm_fwd", key, fallback)


def _bwd_config(block_n, dtype, residual):
    # fallback: 2 programs per SM (measured on an H100 at 65536 x 4096 bf16 with the prefetching
    # kernel: 4, 8 or 16 warps at 2 per SM within 0.2%, 96% of copy; 1 per SM 93%)
    fallback = {"num_warps": _warps_for(block_n), "programs_per_sm": 2}
    key = launch.config_key(block_n=block_n, dtype=launch.dtype_tag(dtype), residual=int(residual))
    return launch.config("rms_norm_bwd", key, fallback)


def rms_norm_fwd(x, weight, residual, eps, cfg=None):
    """x, residual [M, N]; weight [N]. Returns (y, h or an empty tensor, rstd [M] fp32)."""
    M, N = x.shape
    block_n = launch.next_power_of_2(N)
    cfg = cfg or _fwd_config(block_n, x.dtype, residual is not None)
    y = new_output((M, N), torch.promote_types(x.dtype, weight.dtype), x.device)
    h = new_output((M, N), x.dtype, x.device) if residual is not None else x.new_empty(0)
    rstd = new_output((M,), torch.float32, x.device)
    rows = cfg["ROWS"]
    launch.launch(
        "rms_norm_fwd", rms_norm_fwd_kernel, (launch.cdiv(M, rows),),
        x, residual if residual is not None else x, weight, y, h, rstd, M, N, eps,
        nbytes=(2 if residual is None else 4) * x.numel() * x.element_size() + 4 * M,
        BLOCK_N=block_n, ROWS=rows, HAS_RESIDUAL=residual is not None, num_warps=cfg["num_warps"],
    )
    return y, h, rstd


def rms_norm_bwd(dy, x, weight, rstd, dh, cfg=None):
    """Returns (dx [M, N] in x.dtype, dw [N] in weight.dtype)."""
    M, N = x.shape
    block_n = launch.next_power_of_2(N)
    cfg = cfg or _bwd_config(block_n, x.dtype, dh is not None)
    n_programs = max(1, min(M, _runtime.num_sms() * cfg["programs_per_sm"]))
    rows_per_program = launch.cdiv(M, n_programs)
    n_programs = launch.cdiv(M, rows_per_program)
    dx = new_output((M, N), x.dtype, x.device)
    dw_part = new_output((n_programs, N), torch.float32, x.device)
    launch.launch(
        "rms_norm_bwd", rms_norm_bwd_kernel, (n_programs,),
        dy, x, weight, rstd, dh if dh is not None else dy, dx, dw_part, M, N, rows_per_program,
        nbytes=(3 if dh is None else 4) * x.numel() * x.element_size() + 4 * M + 4 * n_programs * N,
        BLOCK_N=block_n, HAS_DH=dh is not None, num_warps=cfg["num_warps"],
    )
    return dx, dw_part.sum(0).to(weight.dtype)


# ----------------------------------------------------------------------------- custom ops + autograd


@torch.library.custom_op("triforge::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    y, h, rstd = rms_norm_fwd(x, weight.contiguous(), residual, eps)
    return y, h, rstd


@_rms_norm_fwd_op.register_fake
def _(x, weight, residual, eps):
    M, N = x.shape
    y = x.new_empty((M, N), dtype=torch.promote_types(x.dtype, weight.dtype))
    h = x.new_empty((M, N)) if residual is not None else x.new_empty(0)
    return y, h, x.new_empty((M,), dtype=torch.float32)


@torch.library.custom_op("triforge::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dh: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    dh = dh.contiguous() if dh is not None else None
    return rms_norm_bwd(dy.contiguous(), x.contiguous(), weight.contiguous(), rstd.contiguous(), dh)


@_rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd, dh):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _fwd_setup(ctx, inputs, output):
    x, weight, residual, eps = inputs
    y, h, rstd = output
    ctx.has_residual = residual is not None
    ctx.save_for_backward(h if ctx.has_residual else x, weight, rstd)


def _fwd_backward(ctx, dy, dh, drstd):
    xn, weight, rstd = ctx.saved_tensors
    dh = dh if ctx.has_residual else None
    dx, dw = torch.ops.triforge.rms_norm_bwd(dy, xn, weight, rstd, dh)
    return dx, dw, (dx if ctx.has_residual else None), None


_rms_norm_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup)


# ----------------------------------------------------------------------------- public API


def _validate(x, weight, eps, residual):
    check_tensor("x", x)
    check_tensor("weight", weight, ndim=1)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have shape ({x.shape[-1]},) to match x's last dimension, got {tuple(weight.shape)}")
    check_row_width("x", x.shape[-1])
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    if residual is not None:
        check_tensor("residual", residual)
        check_same_shape(x=x, residual=residual)
        check_same_dtype(x=x, residual=residual)
    check_same_device(x=x, weight=weight, residual=residual)


def rms_norm(x, weight, eps: float = 1e-6, residual=None):
    """RMSNorm over the last dimension of ``x`` (any leading shape).

    Returns ``y``; with ``residual``, the add is fused and it returns ``(y, x + residual)``.
    """
    _validate(x, weight, eps, residual)
    N = x.shape[-1]
    r2 = residual.reshape(-1, N) if residual is not None else None
    y, h, _ = torch.ops.triforge.rms_norm_fwd(x.reshape(-1, N), weight, r2, float(eps))
    y = y.view(x.shape)
    return y if residual is None else (y, h.view(x.shape))


def rms_norm_stages(x, weight, eps: float = 1e-6, residual=None):
    """The kernel's own stages (h, rstd, y): the buffers the forward kernel writes."""
    _validate(x, weight, eps, residual)
    N = x.shape[-1]
    r2 = residual.reshape(-1, N) if residual is not None else None
    y, h, rstd = torch.ops.triforge.rms_norm_fwd(x.reshape(-1, N), weight, r2, float(eps))
    stages = OrderedDict()
    if residual is not None:
        stages["h"] = h.view(x.shape)
    stages["rstd"] = rstd.view(x.shape[:-1])
    stages["y"] = y.view(x.shape)
    return stages


# ----------------------------------------------------------------------------- registry


def _make_inputs(tier, dtype, device, gen, residual=False):
    M, N = {"tiny": (37, 300), "real": (65536, 4096)}[tier]
    x = torch.randn(M, N, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(N, generator=gen)).to(device=device, dtype=dtype)
    inputs = {"x": x, "weight": w, "eps": 1e-6}
    if residual:
        inputs["residual"] = torch.randn(M, N, generator=gen).to(device=device, dtype=dtype)
    return inputs


def _bytes(inputs, mode, residual=False):
    x = inputs["x"]
    e, n = x.element_size(), x.numel()
    if mode == "fwd":
        return e * n * (2 + (2 if residual else 0))  # read x (+residual), write y (+h)
    return e * n * (3 + (1 if residual else 0))  # read x, dy (+dh), write dx


def _flops(inputs, mode):
    return inputs["x"].numel() * (4 if mode == "fwd" else 8)


def _liger(inputs):
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None
    return lambda x, weight, eps: (LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama"),)


def _liger_fused_add(inputs):
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    except ImportError:
        return None
    return lambda x, weight, eps, residual: tuple(LigerFusedAddRMSNormFunction.apply(x, residual, weight, eps, 0.0, "llama"))


def _torch_compile(inputs):
    def eager(x, weight, eps):
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)

    compiled = torch.compile(eager)
    return lambda x, weight, eps: (compiled(x, weight, eps),)


def _tune_setup(kind):
    def setup(shape, dtype, device):
        M, N = shape["M"], shape["N"]
        x = torch.randn(M, N, device=device, dtype=dtype)
        w = torch.randn(N, device=device, dtype=dtype)
        block_n = launch.next_power_of_2(N)
        # R=1: the residual form (forward: adds and stores h too; backward: also reads h's gradient)
        residual = bool(shape.get("R", 0))
        key = launch.config_key(block_n=block_n, dtype=launch.dtype_tag(dtype), residual=int(residual))
        if kind == "fwd":
            r = torch.randn_like(x) if residual else None
            return (lambda cfg: rms_norm_fwd(x, w, r, 1e-6, cfg)), key
        _, _, rstd = rms_norm_fwd(x, w, None, 1e-6)
        dy = torch.randn_like(x)
        dh = torch.randn_like(x) if residual else None
        return (lambda cfg: rms_norm_bwd(dy, x, w, rstd, dh, cfg)), key

    return setup


register_tunable(Tunable(
    kernel="rms_norm_fwd",
    space={"num_warps": [1, 2, 4, 8, 16, 32], "ROWS": [1, 2, 4, 8]},
    setup=_tune_setup("fwd"), shape_names=("M", "N", "R"), default_shape={"M": 65536, "N": 4096, "R": 1},
))
register_tunable(Tunable(
    kernel="rms_norm_bwd",
    space={"num_warps": [4, 8, 16, 32], "programs_per_sm": [1, 2, 4, 8, 16]},
    setup=_tune_setup("bwd"), shape_names=("M", "N", "R"), default_shape={"M": 65536, "N": 4096, "R": 1},
))

register(OpSpec(
    name="rms_norm",
    family="norm",
    make_inputs=_make_inputs,
    reference=rms_norm_ref,
    stages=rms_norm_stages,
    call=lambda x, weight, eps: (rms_norm(x, weight, eps),),
    outputs=("y",),
    grad_inputs=("x", "weight"),
    flops=_flops,
    bytes=_bytes,
    peers={"liger": _liger, "torch.compile": _torch_compile},
    describe=lambda inputs: "x".join(map(str, inputs["x"].shape)),
))

register(OpSpec(
    name="rms_norm_residual",
    family="norm",
    make_inputs=lambda tier, dtype, device, gen: _make_inputs(tier, dtype, device, gen, residual=True),
    reference=rms_norm_ref,
    stages=rms_norm_stages,
    call=lambda x, weight, eps, residual: rms_norm(x, weight, eps, residual),
    outputs=("y", "h"),
    grad_inputs=("x", "weight", "residual"),
    flops=_flops,
    bytes=lambda inputs, mode: _bytes(inputs, mode, residual=True),
    peers={"liger": _liger_fused_add},
    describe=lambda inputs: "x".join(map(str, inputs["x"].shape)),
))
