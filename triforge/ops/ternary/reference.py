"""Golden reference arithmetic for ternary weights (CPU or any device, plain PyTorch).

- ``absmax_quantize_int8``: BitNet's per-token absmax int8 activation quantization.
- ``popcount_matmul_a8``: the exact integer product x_int8 @ trits^T computed through bit planes:
      sum_b w_b * (popcount(plus & a_b) - popcount(minus & a_b)),  w_b = 2^b for b < 7, w_7 = -128
  where a_b is bit b of the two's-complement int8 activations packed into int32 words like the planes.
- ``matmul_w158a8_ref``: W1.58A8 (quantized activations x ternary weights) back to float64.
- ``matmul_dense_ref``: float64 dense expansion, the reference for the float-activation path.
- ``attention_scores_ref``: float64 dense Q K^T of two ternary tensors, causal entries zeroed.
"""

import torch

from triforge.ops.ternary.tensor import TernaryTensor, bits_to_words, popcount32

A8_BITS = 8
_BLOCK_ELEMS = 1 << 23  # bound on the [rows, N, KW] temporaries


def absmax_quantize_int8(x: torch.Tensor):
    """Per-row (token) absmax int8 quantization, computed in fp32.

    q = clamp(round(127 x / max|x|), -128, 127) per row (x / max|x| first: 127 / max|x| overflows to inf for
    max|x| < 3.7e-37, and inf * 0 is NaN); all-zero rows: q 0, dequant 1. Below max|x| ~1.5e-36 the dequant
    max|x| / 127 is subnormal in fp32 and loses bits (0 below ~9e-44): such rows come back as ~0.
    Returns (q int8 [..., K], dequant fp32 [..., 1]) with x ~= q * dequant (dequant = max|x| / 127).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"x must be a non-empty tensor [..., K], got shape {tuple(x.shape)}")
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    nonzero = amax > 0
    safe = torch.where(nonzero, amax, torch.ones_like(amax))
    q = torch.round(xf / safe * 127.0).clamp(-128, 127).to(torch.int8)
    return q, torch.where(nonzero, safe / 127.0, torch.ones_like(amax))


def activation_bit_planes(x_int8: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] -> int32 [8, M, KW]: plane b holds bit b of each two's-complement byte."""
    u = x_int8.to(torch.int16) & 0xFF
    return torch.stack([bits_to_words(((u >> b) & 1).bool()) for b in range(A8_BITS)])


def _check_tt(name, tt) -> None:
    if not isinstance(tt, TernaryTensor):
        raise TypeError(f"{name} must be a TernaryTensor, got {type(tt).__name__}")


def popcount_matmul_a8(x_int8: torch.Tensor, tt: TernaryTensor) -> torch.Tensor:
    """Exact int64 [M, N] = x_int8 [M, K] @ trits^T, through word-level popcounts of bit planes."""
    _check_tt("tt", tt)
    if not isinstance(x_int8, torch.Tensor):
        raise TypeError(f"x_int8 must be a torch.Tensor, got {type(x_int8).__name__}")
    if x_int8.dtype != torch.int8:
        raise TypeError(f"x_int8 must have dtype int8, got {x_int8.dtype}")
    if x_int8.dim() != 2:
        raise ValueError(f"x_int8 must have 2 dimensions [M, K], got shape {tuple(x_int8.shape)}")
    if x_int8.shape[1] != tt.in_features:
        raise ValueError(f"x_int8 has {x_int8.shape[1]} columns but tt has in_features={tt.in_features}")
    if x_int8.device != tt.device:
        raise ValueError(f"x_int8 is on {x_int8.device} but tt is on {tt.device}; they must share a device")
    m = x_int8.shape[0]
    plus, minus = tt.planes()
    n, kw = plus.shape
    planes = activation_bit_planes(x_int8)  # [8, M, KW]
    out = torch.zeros((m, n), dtype=torch.int64, device=x_int8.device)
    rows = max(1, _BLOCK_ELEMS // max(1, n * kw))
    plus, minus = plus[None], minus[None]  # [1, N, KW]
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        for b in range(A8_BITS):
            a = planes[b, r0:r1, None, :]  # [rows, 1, KW]
            d = popcount32(plus & a).sum(-1) - popcount32(minus & a).sum(-1)
            out[r0:r1] += d * (-(1 << b) if b == A8_BITS - 1 else (1 << b))
    return out


def matmul_w158a8_ref(x: torch.Tensor, tt: TernaryTensor, bias=None) -> torch.Tensor:
    """W1.58A8: absmax-int8 activations x ternary weights -> float64 [..., N].

    y = (x_int8 @ trits^T) * dequant_x[:, None] * scales[None, :] (+ bias), the product exact in int64.
    """
    _check_tt("tt", tt)
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != tt.in_features:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must have a last dimension of in_features={tt.in_features}, got {shape}")
    lead = x.shape[:-1]
    q, dq = absmax_quantize_int8(x.reshape(-1, tt.in_features))
    acc = popcount_matmul_a8(q, tt)
    y = acc.to(torch.float64) * dq.to(torch.float64) * tt.row_scales().to(torch.float64)[None, :]
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.reshape(*lead, tt.out_features)


def matmul_dense_ref(x: torch.Tensor, tt: TernaryTensor, bias=None) -> torch.Tensor:
    """float64 x @ (scales * trits)^T (+ bias), [..., K] -> [..., N]."""
    _check_tt("tt", tt)
    y = x.to(torch.float64) @ tt.to_float(torch.float64).T
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y


def attention_scores_ref(q_t: TernaryTensor, k_t: TernaryTensor, causal: bool = False) -> torch.Tensor:
    """float64 [Tq, Tk] dense expansion of q_t @ k_t^T; entries with j > i zeroed when causal."""
    _check_tt("q_t", q_t)
    _check_tt("k_t", k_t)
    s = q_t.to_float(torch.float64) @ k_t.to_float(torch.float64).T
    if causal:
        s = torch.tril(s)
    return s


__all__ = [
    "absmax_quantize_int8",
    "activation_bit_planes",
    "popcount_matmul_a8",
    "matmul_w158a8_ref",
    "matmul_dense_ref",
    "attention_scores_ref",
]
