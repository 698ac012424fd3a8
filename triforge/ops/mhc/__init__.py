"""mHC-lite hyper-connection kernels as torch.library custom ops (forward + backward), n = 4 streams.

    torch.ops.triforge.fused_rmsnorm_project(x_flat, W, eps) -> (proj, inv_rms)        K1
    torch.ops.triforge.fused_pre_map(x_streams, h_pre) -> layer_input                  K3
    torch.ops.triforge.fused_post_res(x_streams, layer_output, H_merged, h_post) -> x  K4

K2 (the coefficients, 32 numbers per token) is plain PyTorch: ``coefficients``.
"""

from collections import OrderedDict

import torch

from triforge import _runtime, launch
from triforge.launch import new_output
from triforge.ops._checks import check_same_device, check_tensor
from triforge.ops.mhc.backward import (
    mhc_post_res_bwd_kernel,
    mhc_post_res_bwd_tma_kernel,
    mhc_pre_map_bwd_kernel,
    mhc_project_bwd_kernel,
    mhc_project_bwd_prologue_kernel,
    mhc_project_bwd_reduce_kernel,
)
from triforge.ops.mhc.forward import mhc_post_res_fwd_kernel, mhc_pre_map_fwd_kernel, mhc_project_fwd_kernel
from triforge.ops.mhc.reference import (
    EPS,
    N_STREAMS,
    coefficients_ref,
    permutation_matrices,
    post_res_ref,
    pre_map_ref,
    rmsnorm_project_ref,
)
from triforge.registry import OpSpec, register
from triforge.tune import Tunable
from triforge.tune import register as register_tunable

N_PROJ = 2 * N_STREAMS + 24  # 32 logits per token for n = 4
STREAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# ----------------------------------------------------------------------------- launch configs



_FALLBACK = {
    "mhc_project_fwd": {"BLOCK_T": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
    "mhc_project_bwd": {"BLOCK_T": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 3},
    "mhc_pre_map_fwd": {"BLOCK": 4096, "num_warps": 4},
    "mhc_pre_map_bwd": {"BLOCK_T": 4, "BLOCK_C": 256, "num_warps": 4},
    "mhc_post_res_fwd": {"BLOCK_T": 2, "BLOCK_C": 256, "num_warps": 4},
    "mhc_post_res_bwd": {"BLOCK_T": 2, "BLOCK_C": 256, "num_warps": 4},
}


@launch.config_cache  # once per (kernel, C, dtype): the lookup ran on every call (read-only: callers never mutate it)
def _cfg(kernel, C, dtype):
    fallback = dict(_FALLBACK[kernel])
    if _runtime.INTERPRET:  # keep interpreter blocks small so odd sizes exercise masks and loops
        fallback.update({k: 16 for k in ("BLOCK_T", "BLOCK_K") if k in fallback and kernel.startswith("mhc_project")})
        fallback.update({"BLOCK_C": 32} if "BLOCK_C" in fallback else {})
        fallback.update({"BLOCK": 64} if "BLOCK" in fallback else {})
    bucket = "C" + str(launch.next_power_of_2(C))
    return launch.config(kernel, launch.config_key(c=bucket, dtype=launch.dtype_tag(dtype)), fallback)


_PROLOGUE_T = 64  # tokens per program of K1 backward's prologue ([64, 32] fp32 tiles)


def _split16(t, dtype):
    """t (fp32) as hi + lo in a 16-bit dtype, keeping ~16 mantissa bits for a tensor-core dot."""
    hi = t.to(dtype)
    return hi, (t - hi.float()).to(dtype)


# ----------------------------------------------------------------------------- launchers


def project_fwd(x_flat, W, eps, cfg=None):
    T, K = x_flat.shape
    cfg = cfg or _cfg("mhc_project_fwd", K // N_STREAMS, x_flat.dtype)
    proj = new_output((T, W.shape[0]), torch.float32, x_flat.device)
    inv_rms = new_output((T,), torch.float32, x_flat.device)
    w = W.float().contiguous()
    # TMA: x and W through tensor descriptors (compiled kernels; rows 16-byte multiples, 16-byte aligned bases)
    tma = bool(cfg.get("TMA", 0)) and not _runtime.INTERPRET and (K * x_flat.element_size()) % 16 == 0 \
        and K % 4 == 0 and x_flat.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
    if tma:
        launch.use_tensor_descriptors()
    launch.launch(
        "mhc_project_fwd", mhc_project_fwd_kernel, (launch.cdiv(T, cfg["BLOCK_T"]),),
        x_flat, w, proj, inv_rms, T, K, eps,
        nbytes=x_flat.numel() * x_flat.element_size() + T * (W.shape[0] + 1) * 4,
        R=W.shape[0], BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"], SPLIT_W=x_flat.dtype != torch.float32,
        UPCAST=_runtime.INTERPRET and x_flat.dtype == torch.bfloat16, RNE=_runtime.INTERPRET, TMA=tma,
        STACK=int(cfg.get("STACK", 0)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return proj, inv_rms


def project_bwd_grid(T, K, cfg):
    """K1 backward's persistent grid: (n_t token tiles, U units, P programs, J dW slots per program).
    U = column blocks x token tiles; P = SMs x programs_per_sm (at most U), each a run of ~U / P units."""
    n_t = launch.cdiv(T, cfg["BLOCK_T"])
    U = launch.cdiv(K, cfg["BLOCK_K"]) * n_t
    P = max(1, min(U, _runtime.num_sms() * cfg["programs_per_sm"]))
    J = launch.cdiv(U, P) // n_t + 2  # column blocks one run can touch
    return n_t, U, P, J


def project_bwd(x_flat, W, proj, inv_rms, dproj, dinv, cfg=None):
    T, K = x_flat.shape
    R = W.shape[0]
    cfg = cfg or _cfg("mhc_project_bwd", K // N_STREAMS, x_flat.dtype)
    split = x_flat.dtype != torch.float32
    # a = inv_rms * dproj (in two 16-bit parts for dW when split) and coef, one prologue kernel
    a_hi = new_output((T, R), x_flat.dtype if split else torch.float32, x_flat.device)
    a_lo = new_output((T, R), x_flat.dtype, x_flat.device) if split else a_hi
    coef = new_output((T,), torch.float32, x_flat.device)
    # bytes: dproj and proj read, inv_rms (and dinv) read, a_hi (and a_lo) and coef written
    nbytes = (dproj.numel() * dproj.element_size() + proj.numel() * proj.element_size()
              + inv_rms.numel() * inv_rms.element_size() * (1 + int(dinv is not None))
              + a_hi.numel() * a_hi.element_size() * (1 + int(split)) + coef.numel() * 4)
    launch.launch(
        "mhc_project_bwd_prologue", mhc_project_bwd_prologue_kernel, (launch.cdiv(T, _PROLOGUE_T),),
        dproj, proj, inv_rms, dinv if dinv is not None else inv_rms, a_hi, a_lo, coef, T, K, nbytes=nbytes,
        R=R, BLOCK_T=_PROLOGUE_T, HAS_DINV=dinv is not None, SPLIT=split, RNE=_runtime.INTERPRET, num_warps=4,
    )
    dx, dw_part = project_bwd_main(x_flat, a_hi, a_lo, coef, W.float().contiguous(), cfg)
    return dx, project_bwd_reduce(dw_part, T, K, cfg, W.dtype)


def project_bwd_reduce(dw_part, T, K, cfg, dtype):
    """dW [R, K] in ``dtype`` from K1 backward's per-program partials, summed in a fixed order."""
    R = dw_part.shape[2]
    n_t, U, P, J = project_bwd_grid(T, K, cfg)
    dW = new_output((R, K), dtype, dw_part.device)
    launch.launch(
        "mhc_project_bwd_reduce", mhc_project_bwd_reduce_kernel, (launch.cdiv(K, cfg["BLOCK_K"]),),
        dw_part, dW, K, n_t, U, P, J, nbytes=dw_part.numel() * 4 + dW.numel() * dW.element_size(),
        R=R, BLOCK_K=cfg["BLOCK_K"], num_warps=4,
    )
    return dW


def project_bwd_main(x_flat, a_hi, a_lo, coef, w, cfg):
    """K1 backward's streaming kernel alone (the prologue's outputs and fp32 W in): (dx, dW partials
    [P, J, R, BLOCK_K])."""
    T, K = x_flat.shape
    R = w.shape[0]
    n_t, U, P, J = project_bwd_grid(T, K, cfg)
    dx = new_output((T, K), x_flat.dtype, x_flat.device)
    dw_part = new_output((P, J, R, cfg["BLOCK_K"]), torch.float32, x_flat.device)
    # tensor descriptors: compiled kernels only, rows 16-byte aligned (x and dx are fresh contiguous buffers)
    # (TMA 1: x and dx through descriptors; 2: x through a descriptor, dx stored from registers; 3: as 1, and
    # a_hi, a_lo, coef through descriptors: their rows are R elements, 16-byte multiples for R = 32)
    aligned = not _runtime.INTERPRET and (K * x_flat.element_size()) % 16 == 0 and x_flat.data_ptr() % 16 == 0
    if int(cfg.get("TMA", 0)) == 3:
        aligned = aligned and (R * a_hi.element_size()) % 16 == 0 and all(
            t.data_ptr() % 16 == 0 and t.is_contiguous() for t in (a_hi, a_lo, coef))
    tma = int(cfg.get("TMA", 0)) if aligned else 0
    if tma:
        launch.use_tensor_descriptors()
    launch.launch(
        "mhc_project_bwd", mhc_project_bwd_kernel, (P,),
        x_flat, a_hi, a_lo, coef, w, dx, dw_part, T, K, n_t, U, P, J,
        nbytes=2 * x_flat.numel() * x_flat.element_size() + T * (R + 1) * 4,
        R=R, BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"], SPLIT=x_flat.dtype != torch.float32,
        UPCAST=_runtime.INTERPRET and x_flat.dtype == torch.bfloat16, RNE=_runtime.INTERPRET, TMA=tma,
        PREFETCH=int(cfg.get("PREFETCH", 0)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch.maxnreg_option(cfg),
    )
    return dx, dw_part


def pre_map_fwd(x, h_pre, cfg=None):
    T, _, C = x.shape
    cfg = cfg or _cfg("mhc_pre_map_fwd", C, x.dtype)
    y = new_output((T, C), x.dtype, x.device)
    n, block = T * C, cfg["BLOCK"]
    launch.launch("mhc_pre_map_fwd", mhc_pre_map_fwd_kernel, (launch.cdiv(n, block),), x, h_pre, y, n,
                  nbytes=5 * T * C * x.element_size() + 16 * T,
                  C=C, BLOCK=block, EVEN=n % block == 0, I64=x.numel() + block >= 2**31, num_warps=cfg["num_warps"])
    return y


def pre_map_bwd(dy, x, h_pre, cfg=None):
    T, _, C = x.shape
    cfg = cfg or _cfg("mhc_pre_map_bwd", C, x.dtype)
    dx = new_output((T, N_STREAMS, C), x.dtype, x.device)
    dh = new_output((T, N_STREAMS), torch.float32, x.device)
    launch.launch("mhc_pre_map_bwd", mhc_pre_map_bwd_kernel, (launch.cdiv(T, cfg["BLOCK_T"]),), dy, x, h_pre, dx, dh, T, C,
                  nbytes=9 * T * C * x.element_size() + 32 * T,
                  BLOCK_T=cfg["BLOCK_T"], BLOCK_C=cfg["BLOCK_C"], num_warps=cfg["num_warps"])
    return dx, dh


def post_res_fwd(x, f, H, h_post, cfg=None):
    T, _, C = x.shape
    cfg = cfg or _cfg("mhc_post_res_fwd", C, x.dtype)
    y = new_output((T, N_STREAMS, C), x.dtype, x.device)
    grid = (launch.cdiv(T, cfg["BLOCK_T"]), launch.cdiv(C, cfg["BLOCK_C"]))
    launch.launch("mhc_post_res_fwd", mhc_post_res_fwd_kernel, grid, x, f, H, h_post, y, T, C,
                  nbytes=9 * T * C * x.element_size() + 80 * T,
                  BLOCK_T=cfg["BLOCK_T"], BLOCK_C=cfg["BLOCK_C"], num_warps=cfg["num_warps"])
    return y


def _post_res_bwd_tma_tile(cfg) -> bool:
    """Whether ``cfg`` asks for the K4 backward's descriptor kernel at a tile it runs: TMA, BLOCK_C <= 256 (the sizes
    compiled and timed on a GPU; larger ones run the register kernel)."""
    return bool(cfg.get("TMA", 0)) and cfg["BLOCK_C"] <= 256


def post_res_bwd_uses_tma(cfg, g, x, f) -> bool:
    """Whether the K4 backward at ``cfg`` runs the descriptor kernel: a tile it runs (_post_res_bwd_tma_tile), and
    g, x, f contiguous with 16-byte aligned bases and rows of a 16-byte multiple (each stream's [T, C] view starts C
    elements after the previous one). The interpreter runs it too."""
    return _post_res_bwd_tma_tile(cfg) and all(
        t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0 for t in (g, x, f))


def post_res_bwd(g, x, f, H, h_post, cfg=None):
    T, _, C = x.shape
    cfg = cfg or _cfg("mhc_post_res_bwd", C, x.dtype)
    dx = new_output((T, N_STREAMS, C), x.dtype, x.device)
    df = new_output((T, C), f.dtype, x.device)
    dH = new_output((T, N_STREAMS, N_STREAMS), torch.float32, x.device)
    dhp = new_output((T, N_STREAMS), torch.float32, x.device)
    tma = post_res_bwd_uses_tma(cfg, g, x, f)
    nbytes = 14 * T * C * x.element_size() + 160 * T
    if tma:
        launch.use_tensor_descriptors()
        n_t = launch.cdiv(T, cfg["BLOCK_T"])
        grid = (max(1, min(n_t, _runtime.num_sms() * int(cfg.get("programs_per_sm", 2)))),)
        launch.launch("mhc_post_res_bwd", mhc_post_res_bwd_tma_kernel, grid, g, x, f, H, h_post, dx, df, dH, dhp,
                      T, C, nbytes=nbytes, BLOCK_T=cfg["BLOCK_T"], BLOCK_C=cfg["BLOCK_C"],
                      STAGES=int(cfg.get("num_stages", 3)), num_warps=cfg["num_warps"])
    else:
        launch.launch("mhc_post_res_bwd", mhc_post_res_bwd_kernel, (launch.cdiv(T, cfg["BLOCK_T"]),),
                      g, x, f, H, h_post, dx, df, dH, dhp, T, C, nbytes=nbytes,
                      BLOCK_T=cfg["BLOCK_T"], BLOCK_C=cfg["BLOCK_C"], num_warps=cfg["num_warps"])
    return dx, df, dH, dhp


# ----------------------------------------------------------------------------- validation


def _check_streams(name, x, ndim):
    check_tensor(name, x, dtypes=STREAM_DTYPES, ndim=ndim)
    if ndim == 3 and x.shape[1] != N_STREAMS:
        raise ValueError(f"{name} must be [T, {N_STREAMS}, C]: the kernels are specialised for n = {N_STREAMS} streams, got shape {tuple(x.shape)}")


def _check_coeff(name, t, shape):
    check_tensor(name, t, dtypes=(torch.float32,))
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _check_contiguous(name, x):
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the stream kernels read [T, n, C] rows directly); call .contiguous()")


def _validate_project(x_flat, W, eps):
    _check_streams("x_flat", x_flat, 2)
    check_tensor("W", W, dtypes=(torch.float32,), ndim=2)
    if W.shape[1] != x_flat.shape[1]:
        raise ValueError(f"W must be [{N_PROJ}, {x_flat.shape[1]}] to match x_flat's n*C = {x_flat.shape[1]}, got {tuple(W.shape)}")
    if W.shape[0] != N_PROJ:
        raise ValueError(f"W must have {N_PROJ} rows (2n + n! for n = 4), got {W.shape[0]}")
    if x_flat.shape[1] % N_STREAMS:
        raise ValueError(f"x_flat's width must be n*C with n = {N_STREAMS}, got {x_flat.shape[1]}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    check_same_device(x_flat=x_flat, W=W)


def _validate_pre_map(x, h_pre):
    _check_streams("x_streams", x, 3)
    _check_coeff("h_pre", h_pre, (x.shape[0], N_STREAMS))
    check_same_device(x_streams=x, h_pre=h_pre)


def _validate_post_res(x, f, H, h_post):
    _check_streams("x_streams", x, 3)
    T, _, C = x.shape
    _check_streams("layer_output", f, 2)
    if tuple(f.shape) != (T, C):
        raise ValueError(f"layer_output must be [T, C] = {(T, C)} to match x_streams, got {tuple(f.shape)}")
    if f.dtype != x.dtype:
        raise TypeError(f"layer_output must have x_streams' dtype {x.dtype}, got {f.dtype}")
    _check_coeff("H_merged", H, (T, N_STREAMS, N_STREAMS))
    _check_coeff("h_post", h_post, (T, N_STREAMS))
    check_same_device(x_streams=x, layer_output=f, H_merged=H, h_post=h_post)


# ----------------------------------------------------------------------------- custom ops + autograd


@torch.library.custom_op("triforge::fused_rmsnorm_project", mutates_args=())
def fused_rmsnorm_project_op(x_flat: torch.Tensor, W: torch.Tensor, eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor]:
    _validate_project(x_flat, W, eps)
    return _project_impl(x_flat, W, eps)


def _project_impl(x_flat, W, eps):
    return project_fwd(x_flat.contiguous(), W.contiguous(), eps)


@fused_rmsnorm_project_op.register_fake
def _(x_flat, W, eps=EPS):
    T = x_flat.shape[0]
    return x_flat.new_empty((T, W.shape[0]), dtype=torch.float32), x_flat.new_empty((T,), dtype=torch.float32)


@torch.library.custom_op("triforge::fused_rmsnorm_project_bwd", mutates_args=())
def _project_bwd_op(
    x_flat: torch.Tensor, W: torch.Tensor, proj: torch.Tensor, inv_rms: torch.Tensor,
    dproj: torch.Tensor, dinv: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _project_bwd_impl(x_flat, W, proj, inv_rms, dproj, dinv)


def _project_bwd_impl(x_flat, W, proj, inv_rms, dproj, dinv):
    dinv = dinv.contiguous() if dinv is not None else None
    return project_bwd(x_flat.contiguous(), W.contiguous(), proj.contiguous(), inv_rms.contiguous(), dproj.contiguous(), dinv)


@_project_bwd_op.register_fake
def _(x_flat, W, proj, inv_rms, dproj, dinv):
    return x_flat.new_empty(x_flat.shape), W.new_empty(W.shape)


def _project_setup(ctx, inputs, output):
    x_flat, W, _ = inputs
    ctx.save_for_backward(x_flat, W, *output)


def _project_backward(ctx, dproj, dinv):
    x_flat, W, proj, inv_rms = ctx.saved_tensors
    if dproj is None:
        dproj = torch.zeros_like(proj)
    if launch.eager_backward(x_flat, W, proj, inv_rms, dproj, dinv):
        dx, dW = _project_bwd_impl(x_flat, W, proj, inv_rms, dproj, dinv)
    else:
        dx, dW = torch.ops.triforge.fused_rmsnorm_project_bwd(x_flat, W, proj, inv_rms, dproj, dinv)
    return dx, dW, None


fused_rmsnorm_project_op.register_autograd(_project_backward, setup_context=_project_setup)


@torch.library.custom_op("triforge::fused_pre_map", mutates_args=())
def fused_pre_map_op(x_streams: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    _validate_pre_map(x_streams, h_pre)
    return _pre_map_impl(x_streams, h_pre)


def _pre_map_impl(x_streams, h_pre):
    return pre_map_fwd(x_streams.contiguous(), h_pre.contiguous())


@fused_pre_map_op.register_fake
def _(x_streams, h_pre):
    return x_streams.new_empty((x_streams.shape[0], x_streams.shape[2]))


@torch.library.custom_op("triforge::fused_pre_map_bwd", mutates_args=())
def _pre_map_bwd_op(dy: torch.Tensor, x_streams: torch.Tensor, h_pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _pre_map_bwd_impl(dy, x_streams, h_pre)


def _pre_map_bwd_impl(dy, x_streams, h_pre):
    return pre_map_bwd(dy.contiguous(), x_streams.contiguous(), h_pre.contiguous())


@_pre_map_bwd_op.register_fake
def _(dy, x_streams, h_pre):
    return x_streams.new_empty(x_streams.shape), h_pre.new_empty(h_pre.shape)


def _pre_map_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _pre_map_backward(ctx, dy):
    x, h_pre = ctx.saved_tensors
    if launch.eager_backward(dy, x, h_pre):
        return _pre_map_bwd_impl(dy, x, h_pre)
    return torch.ops.triforge.fused_pre_map_bwd(dy, x, h_pre)


fused_pre_map_op.register_autograd(_pre_map_backward, setup_context=_pre_map_setup)


@torch.library.custom_op("triforge::fused_post_res", mutates_args=())
def fused_post_res_op(
    x_streams: torch.Tensor, layer_output: torch.Tensor, H_merged: torch.Tensor, h_post: torch.Tensor
) -> torch.Tensor:
    _validate_post_res(x_streams, layer_output, H_merged, h_post)
    return _post_res_impl(x_streams, layer_output, H_merged, h_post)


def _post_res_impl(x_streams, layer_output, H_merged, h_post):
    return post_res_fwd(x_streams.contiguous(), layer_output.contiguous(), H_merged.contiguous(), h_post.contiguous())


@fused_post_res_op.register_fake
def _(x_streams, layer_output, H_merged, h_post):
    return x_streams.new_empty(x_streams.shape)


@torch.library.custom_op("triforge::fused_post_res_bwd", mutates_args=())
def _post_res_bwd_op(
    g: torch.Tensor, x_streams: torch.Tensor, layer_output: torch.Tensor, H_merged: torch.Tensor, h_post: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _post_res_bwd_impl(g, x_streams, layer_output, H_merged, h_post)


def _post_res_bwd_impl(g, x_streams, layer_output, H_merged, h_post):
    return post_res_bwd(g.contiguous(), x_streams.contiguous(), layer_output.contiguous(), H_merged.contiguous(), h_post.contiguous())


@_post_res_bwd_op.register_fake
def _(g, x_streams, layer_output, H_merged, h_post):
    return (x_streams.new_empty(x_streams.shape), layer_output.new_empty(layer_output.shape),
            H_merged.new_empty(H_merged.shape), h_post.new_empty(h_post.shape))


def _post_res_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _post_res_backward(ctx, g):
    if launch.eager_backward(g, *ctx.saved_tensors):
        return _post_res_bwd_impl(g, *ctx.saved_tensors)
    return torch.ops.triforge.fused_post_res_bwd(g, *ctx.saved_tensors)


fused_post_res_op.register_autograd(_post_res_backward, setup_context=_post_res_setup)

# eager twins of the three forward ops (launch.eager: plain tensors, nothing tracing): the same bodies, setup and
# backward under an autograd.Function, without torch.library's dispatch and autograd wrappers on the host path
_ProjectFunction = launch.eager_function("_ProjectFunction", _project_impl, _project_setup, _project_backward)
_PreMapFunction = launch.eager_function("_PreMapFunction", _pre_map_impl, _pre_map_setup, _pre_map_backward)
_PostResFunction = launch.eager_function("_PostResFunction", _post_res_impl, _post_res_setup, _post_res_backward)


# ----------------------------------------------------------------------------- public API


def fused_rmsnorm_project(x_flat, W, eps: float = EPS):
    """K1: x_flat [T, n*C] (bf16/fp16/fp32), W [32, n*C] fp32 -> (proj [T, 32] fp32, inv_rms [T] fp32)."""
    _validate_project(x_flat, W, eps)
    _check_contiguous("x_flat", x_flat)
    if launch.eager(x_flat, W):
        return _ProjectFunction.apply(x_flat, W, eps)
    return torch.ops.triforge.fused_rmsnorm_project(x_flat, W, eps)


def fused_pre_map(x_streams, h_pre):
    """K3: x_streams [T, 4, C], h_pre [T, 4] fp32 -> layer input [T, C] in the streams' dtype."""
    _validate_pre_map(x_streams, h_pre)
    _check_contiguous("x_streams", x_streams)
    if launch.eager(x_streams, h_pre):
        return _PreMapFunction.apply(x_streams, h_pre)
    return torch.ops.triforge.fused_pre_map(x_streams, h_pre)


def fused_post_res(x_streams, layer_output, H_merged, h_post):
    """K4: sum_j H[t, i, j] x[t, j, :] + h_post[t, i] layer_output[t, :] -> [T, 4, C]."""
    _validate_post_res(x_streams, layer_output, H_merged, h_post)
    _check_contiguous("x_streams", x_streams)
    if launch.eager(x_streams, layer_output, H_merged, h_post):
        return _PostResFunction.apply(x_streams, layer_output, H_merged, h_post)
    return torch.ops.triforge.fused_post_res(x_streams, layer_output, H_merged, h_post)


def coefficients(proj, alpha_pre, alpha_post, alpha_res, b_pre, b_post, b_res):
    """K2 in PyTorch: (h_pre [T, 4], h_post [T, 4], H_res [T, 4, 4]) from proj [T, 32]."""
    return coefficients_ref(proj, alpha_pre, alpha_post, alpha_res, b_pre, b_post, b_res, N_STREAMS)


# ----------------------------------------------------------------------------- registry


def _shape(tier):
    if isinstance(tier, dict):
        return tier["T"], tier["C"]
    return {"tiny": (37, 40), "real": (65536, 2560)}[tier]


def _streams(tier, dtype, device, gen):
    T, C = _shape(tier)
    return T, C, torch.randn(T, N_STREAMS, C, generator=gen).to(device=device, dtype=dtype)


def _inputs_project(tier, dtype, device, gen):
    T, C, x = _streams(tier, dtype, device, gen)
    W = (torch.randn(N_PROJ, N_STREAMS * C, generator=gen) / (N_STREAMS * C) ** 0.5).to(device)
    return {"x_flat": x.view(T, N_STREAMS * C), "W": W}


def _random_coeffs(T, device, gen):
    h_pre = torch.sigmoid(torch.randn(T, N_STREAMS, generator=gen))
    h_post = 2 * torch.sigmoid(torch.randn(T, N_STREAMS, generator=gen))
    a = torch.softmax(torch.randn(T, 24, generator=gen), -1)
    H = torch.einsum("tk,kij->tij", a, permutation_matrices()) - h_post[:, :, None] * h_pre[:, None, :]
    return h_pre.to(device), h_post.to(device), H.contiguous().to(device)


def _inputs_pre_map(tier, dtype, device, gen):
    T, C, x = _streams(tier, dtype, device, gen)
    h_pre, _, _ = _random_coeffs(T, device, gen)
    return {"x_streams": x, "h_pre": h_pre}


def _inputs_post_res(tier, dtype, device, gen):
    T, C, x = _streams(tier, dtype, device, gen)
    _, h_post, H = _random_coeffs(T, device, gen)
    f = torch.randn(T, C, generator=gen).to(device=device, dtype=dtype)
    return {"x_streams": x, "layer_output": f, "H_merged": H, "h_post": h_post}


def _tc(inputs):
    x = inputs.get("x_streams", inputs.get("x_flat"))
    T = x.shape[0]
    C = x.shape[-1] if x.dim() == 3 else x.shape[1] // N_STREAMS
    return T, C, x.element_size()


def _bytes_project(inputs, mode):
    T, C, e = _tc(inputs)
    stream = T * N_STREAMS * C * e
    return stream + T * (N_PROJ + 1) * 4 if mode == "fwd" else 2 * stream + T * (N_PROJ + 1) * 4


def _bytes_pre_map(inputs, mode):
    T, C, e = _tc(inputs)
    return T * C * e * (5 if mode == "fwd" else 9) + T * N_STREAMS * 4


def _bytes_post_res(inputs, mode):
    T, C, e = _tc(inputs)
    coeff = T * (N_STREAMS * N_STREAMS + N_STREAMS) * 4
    return T * C * e * (9 if mode == "fwd" else 14) + coeff


def _eager_project(x_flat, W):
    xf = x_flat.float()
    return rmsnorm_project_ref(xf, W)


def _compile_peer_project(inputs):
    compiled = torch.compile(_eager_project)
    return lambda x_flat, W: tuple(compiled(x_flat, W))


def _compile_peer_pre_map(inputs):
    def eager(x_streams, h_pre):
        return (h_pre[:, :, None] * x_streams.float()).sum(1).to(x_streams.dtype)

    compiled = torch.compile(eager)
    return lambda x_streams, h_pre: (compiled(x_streams, h_pre),)


def _eager_post_res(x_streams, layer_output, H_merged, h_post):
    out = torch.einsum("tij,tjc->tic", H_merged, x_streams.float()) + h_post[:, :, None] * layer_output.float()[:, None, :]
    return out.to(x_streams.dtype)


def _compile_peer_post_res(inputs):
    compiled = torch.compile(_eager_post_res)
    return lambda **kw: (compiled(**kw),)


def _eager_peer_post_res(inputs):
    return lambda **kw: (_eager_post_res(**kw),)


def _describe(inputs):
    T, C, _ = _tc(inputs)
    return f"T={T} C={C} n=4"


def _tunable(kernel, space, build, canonical=None):
    def setup(shape, dtype, device):
        gen = torch.Generator().manual_seed(0)
        tier = {"T": shape["T"], "C": shape["C"]}
        run = build(tier, dtype, device, gen)
        bucket = "C" + str(launch.next_power_of_2(shape["C"]))
        return run, launch.config_key(c=bucket, dtype=launch.dtype_tag(dtype))

    register_tunable(Tunable(kernel=kernel, space=space, setup=setup, shape_names=("T", "C"),
                             default_shape={"T": 65536, "C": 2560}, canonical=canonical))


def _post_res_bwd_canonical(cfg):
    """The K4 backward config as it launches: the register kernel (TMA 0, or BLOCK_C > 256) reads neither num_stages
    nor programs_per_sm."""
    if _post_res_bwd_tma_tile(cfg):
        return cfg
    return {k: v for k, v in cfg.items() if k not in ("TMA", "num_stages", "programs_per_sm")}


def _run_project_fwd(tier, dtype, device, gen):
    i = _inputs_project(tier, dtype, device, gen)
    return lambda cfg: project_fwd(i["x_flat"], i["W"], EPS, cfg)


def _run_project_bwd(tier, dtype, device, gen):
    i = _inputs_project(tier, dtype, device, gen)
    proj, inv = project_fwd(i["x_flat"], i["W"], EPS)
    dproj = torch.randn_like(proj)
    return lambda cfg: project_bwd(i["x_flat"], i["W"], proj, inv, dproj, None, cfg)


def _run_pre_map(kind):
    def build(tier, dtype, device, gen):
        i = _inputs_pre_map(tier, dtype, device, gen)
        if kind == "fwd":
            return lambda cfg: pre_map_fwd(i["x_streams"], i["h_pre"], cfg)
        dy = torch.randn(i["x_streams"].shape[0], i["x_streams"].shape[2], device=device, dtype=dtype)
        return lambda cfg: pre_map_bwd(dy, i["x_streams"], i["h_pre"], cfg)

    return build


def _run_post_res(kind):
    def build(tier, dtype, device, gen):
        i = _inputs_post_res(tier, dtype, device, gen)
        args = (i["x_streams"], i["layer_output"], i["H_merged"], i["h_post"])
        if kind == "fwd":
            return lambda cfg: post_res_fwd(*args, cfg)
        g = torch.randn_like(i["x_streams"])
        return lambda cfg: post_res_bwd(g, *args, cfg)

    return build


_ROW_SPACE = {"BLOCK_T": [1, 2, 4], "BLOCK_C": [256, 512, 1024], "num_warps": [4, 8]}
# K1 forward: BLOCK_K 256 never placed in the top 3 of the 54-point sweep at C=1024 on the H100 (8f802a2), but is
# in the space for the H200 (session 47: x is read in runs of BLOCK_K * 2 bytes per token, rows 8-20 KB apart); TMA:
# x and W through tensor descriptors. A persistent grid (equal token shares per program, nested tile/K loops)
# measured 0.2055 vs 0.2036 ms at C=1024 and 0.4741 vs 0.4781 at C=2560 (session 25): not kept. STACK: one N = 64 dot
# of x against W_hi and W_lo interleaved per tile instead of two N = 32 dots (16-bit x only: fp32 x runs its tf32x3
# dot either way); on the H200 (session 49) it measured 0.2020 vs 0.1611 ms at C=1024 and 0.5004 vs 0.3922 at
# C=2560 (BLOCK_T 256, 8 warps, TMA): never the winner. BLOCK_T 512 (with BLOCK_K 64, so a stage stays 64 KB):
# every program reloads all of W (32 x K fp32) from L2, 1/4 of x's bytes at BLOCK_T 256, 1/8 at 512; ncu of the
# BLOCK_T 256 tile on the H200 showed L2 at 87% of its throughput with DRAM at 76%, and BLOCK_T 512 took the kernel
# from 0.3637 to 0.3396 ms at C=2560 and 0.1600 to 0.1490 at C=1024 (session 49, the H200's entries)
_tunable("mhc_project_fwd", {"BLOCK_T": [128, 256, 512], "BLOCK_K": [64, 128, 256], "num_warps": [4, 8, 16],
                             "num_stages": [2, 3, 4], "TMA": [0, 1], "STACK": [0, 1]},
         _run_project_fwd)
# K1 backward: programs_per_sm sets the persistent grid (one wave); TMA: x and dx through tensor descriptors
# (won at both benchmark shapes at fc53703; BLOCK_K 64 and the pointer path lost every earlier sweep)
# (8 warps, 4 stages, BLOCK_K 64/256, register caps and -coef x as diagonal dots lost every sweep at
# 62da871-635e0f6: mhc_k1_probe.py, NOTES "Ninth session")
_tunable("mhc_project_bwd", {"BLOCK_T": [32, 64], "BLOCK_K": [128], "num_warps": [4], "num_stages": [3, 4],
                             "programs_per_sm": [2, 3, 4], "TMA": [0, 1, 2, 3], "PREFETCH": [0, 1]},
         _run_project_bwd)
_tunable("mhc_pre_map_fwd", {"BLOCK": [1024, 2048, 4096, 8192], "num_warps": [4, 8]}, _run_pre_map("fwd"))
_tunable("mhc_pre_map_bwd", _ROW_SPACE, _run_pre_map("bwd"))
_tunable("mhc_post_res_fwd", _ROW_SPACE, _run_post_res("fwd"))
# K4 backward, TMA 1: g, f and x through descriptors into a num_stages-deep shared-memory pipeline, persistent
# (programs_per_sm); at BLOCK_C <= 256 only (the sizes timed on a GPU: larger ones run the register kernel, which
# reads neither num_stages nor programs_per_sm; the tune runs each distinct launch once: 96 of the 288 points)
_tunable("mhc_post_res_bwd", {**_ROW_SPACE, "BLOCK_C": [128, 256, 512, 1024], "TMA": [0, 1], "num_stages": [2, 3, 4],
                              "programs_per_sm": [2, 3]},
         _run_post_res("bwd"), canonical=_post_res_bwd_canonical)


def _project_ref(x_flat, W):
    proj, inv_rms = rmsnorm_project_ref(x_flat, W)
    return OrderedDict(inv_rms=inv_rms, proj=proj)


def _project_stages(x_flat, W):
    proj, inv_rms = fused_rmsnorm_project(x_flat, W)
    return OrderedDict(inv_rms=inv_rms, proj=proj)


register(OpSpec(
    shape_names=("T", "C"),
    name="mhc_project", family="mhc", make_inputs=_inputs_project, reference=_project_ref, stages=_project_stages,
    call=lambda x_flat, W: fused_rmsnorm_project(x_flat, W), outputs=("proj", "inv_rms"), grad_inputs=("x_flat", "W"),
    flops=lambda i, mode: 2 * i["x_flat"].numel() * N_PROJ * (1 if mode == "fwd" else 2),
    bytes=_bytes_project, peers={"torch.compile": _compile_peer_project}, describe=_describe,
))
register(OpSpec(
    shape_names=("T", "C"),
    name="mhc_pre_map", family="mhc", make_inputs=_inputs_pre_map,
    reference=lambda x_streams, h_pre: OrderedDict(y=pre_map_ref(x_streams, h_pre)),
    stages=lambda x_streams, h_pre: OrderedDict(y=fused_pre_map(x_streams, h_pre)),
    call=lambda x_streams, h_pre: (fused_pre_map(x_streams, h_pre),), outputs=("y",), grad_inputs=("x_streams", "h_pre"),
    flops=lambda i, mode: 2 * i["x_streams"].numel() * (1 if mode == "fwd" else 2),
    bytes=_bytes_pre_map, peers={"torch.compile": _compile_peer_pre_map}, describe=_describe,
))
register(OpSpec(
    shape_names=("T", "C"),
    name="mhc_post_res", family="mhc", make_inputs=_inputs_post_res,
    reference=lambda x_streams, layer_output, H_merged, h_post: OrderedDict(y=post_res_ref(x_streams, layer_output, H_merged, h_post)),
    stages=lambda **kw: OrderedDict(y=fused_post_res(**kw)),
    call=lambda **kw: (fused_post_res(**kw),), outputs=("y",),
    grad_inputs=("x_streams", "layer_output", "H_merged", "h_post"),
    flops=lambda i, mode: 10 * i["x_streams"].numel() * (1 if mode == "fwd" else 2),
    bytes=_bytes_post_res, peers={"torch.compile": _compile_peer_post_res, "eager": _eager_peer_post_res}, describe=_describe,
))
