"""Ternary (1.58-bit) weights: bit-sliced storage, quantizers, reference arithmetic, matmul and attention scores.

``matmul(x, tt, bias=None)``: float activations [..., in_features] times a ``TernaryTensor`` -> [..., out_features]
in x's dtype. ``_dispatch`` picks the implementation: on the kernels' device the decode GEMV for up to
``GEMV_DISPATCH_M`` rows and the tiled tensor-core GEMM above (``kernels.py``; both skip inactive chunks),
elsewhere dense expansion in PyTorch (``_matmul_dense``).
"""

import os

import torch

from triforge import _runtime
from triforge.ops._checks import FLOAT_DTYPES, _dtype_names
from triforge.ops.ternary import kernels as _k
from triforge.ops.ternary.quantize import METHODS, quantize, quantize_absmean, quantize_twn
from triforge.ops.ternary.tensor import CHUNK_COLS, SparsityMetadata, TernaryTensor, popcount32

_ATTN_BLOCK_ELEMS = 1 << 23


# ----------------------------------------------------------------------------- validation


def _check_ternary(name: str, t) -> None:
    if not isinstance(t, TernaryTensor):
        raise TypeError(f"{name} must be a TernaryTensor, got {type(t).__name__}")


def _check_activation(name: str, x, in_features: int, device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype in ({_dtype_names(FLOAT_DTYPES)}), got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least 1 dimension [..., in_features], got shape {tuple(x.shape)}")
    if x.shape[-1] != in_features:
        raise ValueError(
            f"{name} must have a last dimension of in_features={in_features}, got shape {tuple(x.shape)}"
        )
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the ternary weights are on {device}; they must share a device")


def _check_bias(bias, out_features: int, device) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if not bias.is_floating_point():
        raise TypeError(f"bias must be a floating-point tensor, got dtype {bias.dtype}")
    if tuple(bias.shape) != (out_features,):
        raise ValueError(f"bias must have shape ({out_features},) (out_features), got {tuple(bias.shape)}")
    if bias.device != device:
        raise ValueError(f"bias is on {bias.device} but the ternary weights are on {device}; they must share a device")


# ----------------------------------------------------------------------------- matmul


def _matmul_dense(x2d: torch.Tensor, tt: TernaryTensor, bias=None) -> torch.Tensor:
    """x2d [M, K] @ (scales * trits)^T (+ bias) by dense expansion to x's dtype; [M, N] in x's dtype."""
    y = x2d @ tt.to_float(x2d.dtype).T
    if bias is not None:
        y = y + bias.to(x2d.dtype)
    return y


def _matmul_kernel(x2d: torch.Tensor, tt: TernaryTensor, bias=None) -> torch.Tensor:
    """The tiled tensor-core GEMM on the bit planes; inactive 2048-column chunks are skipped when there are any."""
    scales, active = tt.kernel_operands()
    plus, minus = tt.planes()
    return _k.ternary_matmul(x2d.contiguous(), plus, minus, scales, bias=bias, active=active)


def _matmul_decode(x2d: torch.Tensor, tt: TernaryTensor, bias=None) -> torch.Tensor:
    """The decode GEMV (M <= GEMV_DISPATCH_M here) on the bit planes, with the same chunk skipping."""
    scales, active = tt.kernel_operands()
    plus, minus = tt.planes()
    return _k.ternary_gemv(x2d.contiguous(), plus, minus, scales, bias=bias, active=active)


TC_ENV = "TRIFORGE_TERNARY_TC"


def _matmul_tc(x2d: torch.Tensor, tt: TernaryTensor, bias=None) -> torch.Tensor:
    """The tensor-core kernel (``tc.py``) on the cached tc codes."""
    from triforge.ops.ternary import tc

    return tc.ternary_matmul_tc(x2d, tt, bias, codes=tt.tc_codes())


def _use_tc(x2d: torch.Tensor, tt: TernaryTensor) -> bool:
    """fp16/bf16 activations at any M go to the tensor-core kernel (``TRIFORGE_TERNARY_TC``, default 1; 0
    keeps the plane kernels), except where some 2048-column chunk is all zero (the plane kernels skip
    those; the tc kernel does not)."""
    flag = os.environ.get(TC_ENV, "1")
    if flag not in ("0", "1"):
        raise ValueError(f"{TC_ENV} must be 0 or 1, got {flag!r}")
    return flag == "1" and x2d.dtype in (torch.float16, torch.bfloat16) and tt.kernel_operands()[1] is None


def _dispatch(x2d: torch.Tensor, tt: TernaryTensor):
    """Pick the implementation for this call: a callable (x2d, tt, bias) -> y2d.

    Tensors on the kernels' device (CUDA, or the CPU under Triton's interpreter) run a Triton kernel:
    - fp16/bf16 activations, no all-zero 2048-column chunk: the tensor-core kernel on 2-bit codes
      (``tc.py``), at every M. On the H100 (benchmarks/ternary_tc_probe.py, CUDA graphs, commit 1fcce3a)
      it matches or beats the plane GEMV at M = 1 (14.9 against 15.8 us at 8192^2; 40.2 against 52.9 at
      8192 x 28672) and beats the plane kernels 1.5-5x at M >= 4.
    - otherwise (fp32 activations, or chunks to skip): the decode GEMV on the bit planes (bits into fp32
      FMAs) for M <= GEMV_DISPATCH_M = 4 rows, else the tiled tensor-core GEMM on the planes.
    Anything else (CPU tensors in a CUDA process) runs the dense expansion. No cuBLAS fallback where the
    kernels lose to fp16 (M = 256, the 0.5B shapes): it would keep an fp16 copy of the weights, 8x their
    memory.
    """
    kernel_device = "cpu" if _runtime.INTERPRET else "cuda"
    if x2d.device.type == kernel_device and tt.device.type == kernel_device:
        if _use_tc(x2d, tt):
            return _matmul_tc
        return _matmul_decode if x2d.shape[0] <= _k.GEMV_DISPATCH_M else _matmul_kernel
    return _matmul_dense


def matmul(x: torch.Tensor, tt: TernaryTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in_features] (fp16/bf16/fp32) @ ternary weights^T (+ bias) -> [..., out_features] in x's dtype."""
    _check_ternary("tt", tt)
    _check_activation("x", x, tt.in_features, tt.device)
    _check_bias(bias, tt.out_features, tt.device)
    if x.dim() == 2:  # no reshapes on the decode path: each is host time
        if x.shape[0] == 0:
            return x.new_empty(0, tt.out_features)
        return _dispatch(x, tt)(x, tt, bias)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, tt.in_features)
    if x2d.shape[0] == 0:
        return x.new_empty(*lead, tt.out_features)
    y = _dispatch(x2d, tt)(x2d, tt, bias)
    return y.reshape(*lead, tt.out_features)


# ----------------------------------------------------------------------------- attention scores (experimental)


def _popcount_dot(a_plus, a_minus, b_plus, b_minus) -> torch.Tensor:
    """int64 [A, B]: ternary row dot products a_i . b_j from word planes [A, KW] and [B, KW]."""
    na, kw = a_plus.shape
    nb = b_plus.shape[0]
    out = torch.empty((na, nb), dtype=torch.int64, device=a_plus.device)
    rows = max(1, _ATTN_BLOCK_ELEMS // max(1, nb * kw))
    bp, bm = b_plus[None], b_minus[None]
    for r0 in range(0, na, rows):
        r1 = min(na, r0 + rows)
        ap, am = a_plus[r0:r1, None], a_minus[r0:r1, None]
        same = popcount32(ap & bp).sum(-1) + popcount32(am & bm).sum(-1)
        diff = popcount32(ap & bm).sum(-1) + popcount32(am & bp).sum(-1)
        out[r0:r1] = same - diff
    return out


def ternary_attention_scores(q_t: TernaryTensor, k_t: TernaryTensor, causal: bool = False) -> torch.Tensor:
    """Experimental. Scores [Tq, Tk] fp32 of ternary rows q_t [Tq, D] and k_t [Tk, D]:

        s[i, j] = scale_q[i] * scale_k[j] * (popc(q+ & k+) + popc(q- & k-) - popc(q+ & k-) - popc(q- & k+))

    the integer part exact. ``causal`` zeroes j > i (requires Tq == Tk; no bottom-right alignment).
    """
    _check_ternary("q_t", q_t)
    _check_ternary("k_t", k_t)
    if q_t.in_features != k_t.in_features:
        raise ValueError(f"k_t must have the head dimension of q_t ({q_t.in_features}), got {k_t.in_features}")
    if q_t.device != k_t.device:
        raise ValueError(f"k_t is on {k_t.device} but q_t is on {q_t.device}; they must share a device")
    tq, tk = q_t.out_features, k_t.out_features
    if causal and tq != tk:
        raise ValueError(f"causal=True needs as many queries as keys (q_t has {tq} rows, k_t has {tk})")
    dots = _popcount_dot(*q_t.planes(), *k_t.planes())
    s = dots.to(torch.float32) * q_t.row_scales()[:, None] * k_t.row_scales()[None, :]
    if causal:
        s = torch.tril(s)
    return s


def hybrid_attention_scores(q: torch.Tensor, k: torch.Tensor, threshold: float = 0.5, method: str = "absmean",
                            causal: bool = False, return_path: bool = False):
    """Experimental. Q K^T [Tq, Tk] choosing the ternary or float path by sparsity.

    q [Tq, D] and k [Tk, D] are ternarized per row with ``method``; when both ternary tensors have
    sparsity >= ``threshold`` the scores come from ``ternary_attention_scores`` (an approximation of
    q @ k^T), otherwise from float q @ k^T in fp32. Returned in q's dtype (and the path, "ternary" or
    "float", when ``return_path``). ``causal`` zeroes j > i on both paths.
    """
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must have dtype in ({_dtype_names(FLOAT_DTYPES)}), got {t.dtype}")
        if t.dim() != 2 or t.numel() == 0:
            raise ValueError(f"{name} must be a non-empty 2-D tensor [T, D], got shape {tuple(t.shape)}")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k must have the head dimension of q ({q.shape[1]}), got shape {tuple(k.shape)}")
    if k.device != q.device:
        raise ValueError(f"k is on {k.device} but q is on {q.device}; they must share a device")
    if not 0.0 <= float(threshold) <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if causal and q.shape[0] != k.shape[0]:
        raise ValueError(f"causal=True needs as many queries as keys (q has {q.shape[0]} rows, k has {k.shape[0]})")
    q_t = TernaryTensor.from_float(q, method=method, per_row=True)
    k_t = TernaryTensor.from_float(k, method=method, per_row=True)
    if min(q_t.sparsity(), k_t.sparsity()) >= threshold:
        s, path = ternary_attention_scores(q_t, k_t, causal=causal), "ternary"
    else:
        s, path = q.float() @ k.float().T, "float"
        if causal:
            s = torch.tril(s)
    s = s.to(q.dtype)
    return (s, path) if return_path else s


__all__ = [
    "TernaryTensor",
    "SparsityMetadata",
    "CHUNK_COLS",
    "matmul",
    "quantize",
    "quantize_twn",
    "quantize_absmean",
    "ternary_attention_scores",
    "hybrid_attention_scores",
]


# ----------------------------------------------------------------------------- W1.58A8 (popcount kernel)


def matmul_w158a8(x: torch.Tensor, tt: TernaryTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """BitNet b1.58 W1.58A8: per-token absmax int8 activations times ternary weights.

    The integer product runs in the popcount kernel and is exact (it equals ``popcount_matmul_a8``
    of the reference bit for bit); y = acc * dequant_x * scales (+ bias), in x's dtype.
    """
    from triforge.ops.ternary.reference import absmax_quantize_int8

    _check_ternary("tt", tt)
    _check_activation("x", x, tt.in_features, tt.device)
    _check_bias(bias, tt.out_features, tt.device)
    lead = x.shape[:-1]
    q, dq = absmax_quantize_int8(x.reshape(-1, tt.in_features))
    acc = _k.popcount_matmul_a8(q.contiguous(), *tt.planes())
    y = acc.to(torch.float32) * dq * tt.row_scales()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, tt.out_features)


# ----------------------------------------------------------------------------- registry


def _registry_inputs(tier, dtype, device, gen):
    M, N, K = (tier["M"], tier["N"], tier["K"]) if isinstance(tier, dict) else {"tiny": (3, 40, 100), "real": (1, 8192, 8192)}[tier]
    # drawn and quantized on the device (28672 x 8192 weights take seconds on the host), seeded from gen
    g = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    w = torch.randn(N, K, generator=g, device=device)
    # fp16/bf16 (the tc kernel's dtypes): compact, the 2-bit codes the only resident form; fp32 keeps the planes
    # its kernels read (a compact tensor would unpack them in every timed call)
    tt = TernaryTensor.from_float(w, method="absmean", per_row=True)
    if dtype in (torch.float16, torch.bfloat16):
        tt.compact()
    x = torch.randn(M, K, generator=g, device=device).to(dtype)
    return {"x": x, "tt": tt}


def _registry_extras(inputs):
    """The weights' memory after the timed calls: what the TernaryTensor holds, against fp16."""
    import os
    import tempfile

    tt = inputs["tt"]
    held = tt.nbytes("resident")
    n_w = tt.out_features * tt.in_features
    fp16 = 2 * n_w
    # the base-3 checkpoint as written: 5 trits per byte + fp32 scales (packed bytes counted), and the whole
    # safetensors file (its header, shape and format version included)
    base3 = tt.pack_base3().numel() + tt.scales.numel() * tt.scales.element_size()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "w.safetensors")
        tt.save(path, storage="base3")
        file_bytes = os.path.getsize(path)
    return {"weights": {"resident": tt.resident, "resident_bytes": held, "fp16_bytes": fp16,
                        "bits_per_weight": 8 * held / n_w, "x_smaller_than_fp16": fp16 / held,
                        "base3_bytes": base3, "base3_bits_per_weight": 8 * base3 / n_w,
                        "base3_x_smaller_than_fp16": fp16 / base3, "base3_file_bytes": file_bytes,
                        "base3_file_x_smaller_than_fp16": fp16 / file_bytes}}


def _registry_ref(x, tt):
    from collections import OrderedDict

    return OrderedDict(y=x.to(torch.float64) @ tt.to_float(torch.float64).T)


def _registry_bytes(inputs, mode):
    x, tt = inputs["x"], inputs["tt"]
    out = x.shape[0] * tt.out_features * x.element_size()
    return x.numel() * x.element_size() + tt.out_features * tt.k_words * 8 + tt.out_features * 4 + out


def _per_weight_set(make):
    """A peer call (x, tt) that builds its own form of the weights, ``make(tt)`` -> callable(x) -> outputs, once per
    TernaryTensor it is handed. The bench rotates weight sets past the L2; a peer that kept the first set's form
    would read the same weights every call (from L2 at the 0.5B shapes: 8.7 MB in fp16)."""
    built = {}

    def run(x, tt):
        entry = built.get(id(tt))
        if entry is None or entry[0] is not tt:  # (the tensor held beside its form: its id is not reused)
            entry = built[id(tt)] = (tt, make(tt))
        return entry[1](x)

    return run


def _cublas_fp16_peer(inputs):
    """fp16 weights through torch.matmul (cuBLAS): the dense baseline the ternary kernels must beat."""
    if not torch.cuda.is_available():
        return None

    def make(tt):
        w16 = tt.to_float(torch.float16)
        return lambda x: (x.to(torch.float16) @ w16.T,)

    return _per_weight_set(make)


def _gemlite_2bit_peer(inputs):
    """gemlite's 2-bit weight-only GEMV/GEMM (A16W2, one scale and zero per row: q = trit + 1, zero 1),
    the same weights in its own packing; None when gemlite is not installed."""
    if not torch.cuda.is_available():
        return None
    try:
        from gemlite.helper import A16Wn
    except ImportError:
        return None

    def make(tt):
        trits = tt.to_float(torch.float32).div(tt.row_scales()[:, None]).round()
        w_q = (trits + 1).to(torch.uint8)
        scales = tt.row_scales().to(torch.float16)[:, None]
        layer = A16Wn(device=str(tt.device), dtype=torch.float16).from_weights(
            w_q, scales, torch.ones_like(scales), W_nbits=2, group_size=tt.in_features
        )
        return lambda x: (layer(x.to(torch.float16)),)

    return _per_weight_set(make)


# the grid: (N, K) of 7B-70B and 0.5B projections at batch 1 .. 256
BENCH_SHAPES = tuple(
    {"M": M, "N": N, "K": K}
    for N, K in ((8192, 8192), (28672, 8192), (8192, 28672), (4864, 896), (896, 4864))
    for M in (1, 4, 16, 64, 256)
)


def _gemv_tune_setup(shape, dtype, device):
    """Tunable setup of the decode GEMV: absmean weights of shape (N, K), x [M, K] of ``dtype``."""
    M, N, K = shape["M"], shape["N"], shape["K"]
    g = torch.Generator(device=device).manual_seed(0)
    tt = TernaryTensor.from_float(torch.randn(N, K, generator=g, device=device), method="absmean", per_row=True)
    x = torch.randn(M, K, generator=g, device=device).to(dtype)
    scales = tt.row_scales()
    return (_rotating_run(lambda s, cfg: _k.ternary_gemv(s[0], s[1], s[2], scales, cfg=cfg), (x, tt.plus, tt.minus)),
            _k._gemv_config_key(M, N, K))


def _tune_sets(tensors: tuple) -> list:
    """The tensors and as many copies of them as ``tune.rotation_sets`` asks for their bytes on their device."""
    from triforge import tune

    n = tune.rotation_sets(sum(t.numel() * t.element_size() for t in tensors), tensors[0].device)
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(n - 1)]


def _rotating_run(run_on, tensors: tuple):
    """A tune setup's run (``tune.rotating``) over ``tensors`` and their copies (``_tune_sets``): the timed calls
    rotate through copies that together exceed the L2, as the bench's do (a 16 MB weight set would stay resident)."""
    from triforge import tune

    return tune.rotating(run_on, _tune_sets(tensors))


def _tc_tune_setup(shape, dtype, device):
    """Tunable setup of the tensor-core kernel: absmean weights (N, K) as tc codes, x [M, K] of ``dtype``
    (fp32 is not a dtype of this kernel: it tunes at fp16)."""
    from triforge.ops.ternary import tc

    M, N, K = shape["M"], shape["N"], shape["K"]
    g = torch.Generator(device=device).manual_seed(0)
    tt = TernaryTensor.from_float(torch.randn(N, K, generator=g, device=device), method="absmean", per_row=True)
    x = torch.randn(M, K, generator=g, device=device).to(dtype if dtype != torch.float32 else torch.float16)
    # (the row scales, N floats, are shared: they stay in L2 in the bench too)
    return (_rotating_run(lambda s, cfg: tc.ternary_matmul_tc(s[0], tt, codes=s[1], cfg=cfg), (x, tt.tc_codes())),
            tc.tc_config_key(M, N, K))


# the decode GEMV's launch grid; points whose tile is narrower than 4 words x 32 lanes x num_warps are slower
# (M is then spread over threads) but valid
GEMV_TUNE_SPACE = {"BLOCK_N": [8, 16, 32], "BLOCK_W": [32, 64], "BIT_UNROLL": [4, 16], "num_warps": [4, 8],
                   "programs_per_sm": [4, 8]}


def _register():
    from collections import OrderedDict

    from triforge.registry import OpSpec, register
    from triforge.tune import Tunable
    from triforge.tune import register as register_tunable

    register_tunable(Tunable(
        kernel="ternary_gemv", space=GEMV_TUNE_SPACE, setup=_gemv_tune_setup, shape_names=("M", "N", "K"),
        default_shape={"M": 1, "N": 8192, "K": 8192}, graph=True,  # timed as the bench times the op
    ))

    from triforge.ops.ternary.tc import TC_TUNE_SPACE

    register_tunable(Tunable(
        kernel="ternary_tc", space=TC_TUNE_SPACE, setup=_tc_tune_setup, shape_names=("M", "N", "K"),
        default_shape={"M": 16, "N": 8192, "K": 8192}, graph=True,
    ))

    register(OpSpec(
        name="ternary_matmul", family="ternary", make_inputs=_registry_inputs, reference=_registry_ref,
        stages=lambda x, tt: OrderedDict(y=matmul(x, tt)), call=lambda x, tt: (matmul(x, tt),), outputs=("y",),
        flops=lambda i, mode: 2 * i["x"].shape[0] * i["tt"].out_features * i["tt"].in_features,
        bytes=_registry_bytes, peers={"cublas_fp16": _cublas_fp16_peer, "gemlite_2bit": _gemlite_2bit_peer},
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        describe=lambda i: f"M={i['x'].shape[0]} N={i['tt'].out_features} K={i['tt'].in_features}",
        bench_shapes=BENCH_SHAPES, bench_graph=True, extras=_registry_extras, shape_names=("M", "N", "K"),
    ))


_register()
