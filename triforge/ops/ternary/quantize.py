"""Ternary weight quantizers: W (float [N, K]) -> (trits int8 [N, K] in {-1, 0, 1}, scales fp32).

- TWN (Li & Liu, "Ternary Weight Networks"): delta = 0.7 * mean|W|; trits = sign(W) where |W| > delta;
  alpha = mean of |W| over the entries with |W| > delta.
- BitNet b1.58 absmean: gamma = mean|W| + 1e-8; trits = RoundClip(W / gamma, -1, 1); scale gamma.

``per_row=True`` computes the statistics per output row (scales [N]); otherwise over the whole tensor
(scales [1]). Statistics are computed in float64 and the scales rounded once to fp32.

All-zero rows (or an all-zero tensor): every trit is 0 and the scale is 0 (both quantizers, by one
rule: a row, or tensor, whose trits are all zero gets scale 0), so no NaN appears and the dense
expansion is exactly zero.
"""

import torch

METHODS = ("twn", "absmean")
TWN_DELTA_FACTOR = 0.7
ABSMEAN_EPS = 1e-8


def _check_weight(w) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if not w.is_floating_point():
        raise TypeError(f"w must be a floating-point tensor, got dtype {w.dtype}")
    if w.dim() != 2:
        raise ValueError(f"w must have 2 dimensions [out_features, in_features], got shape {tuple(w.shape)}")
    if w.numel() == 0:
        raise ValueError(f"w must not be empty, got shape {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("w must contain only finite values (found NaN or Inf)")


def _stat_dims(per_row: bool):
    return dict(dim=1, keepdim=True) if per_row else dict(dim=(0, 1), keepdim=True)


def _finish(trits: torch.Tensor, scales64: torch.Tensor, per_row: bool):
    """Zero the scale of all-zero rows (tensor) and shape the scales [N] or [1] fp32."""
    nz = (trits != 0).any(dim=1, keepdim=True) if per_row else (trits != 0).any().reshape(1, 1)
    scales64 = torch.where(nz, scales64, torch.zeros_like(scales64))
    scales = scales64.reshape(-1).to(torch.float32).contiguous()
    return trits.to(torch.int8).contiguous(), scales


def quantize_twn(w: torch.Tensor, per_row: bool = True):
    """TWN ternarization. Returns (trits int8 [N, K], scales fp32 [N] or [1])."""
    _check_weight(w)
    a = w.detach().to(torch.float64).abs()
    dims = _stat_dims(per_row)
    delta = TWN_DELTA_FACTOR * a.mean(**dims)
    keep = a > delta
    count = keep.sum(**dims).to(torch.float64)
    alpha = torch.where(count > 0, (a * keep).sum(**dims) / count.clamp(min=1), torch.zeros_like(count))
    trits = torch.where(keep, torch.sign(w.detach()).to(torch.int8), torch.zeros((), dtype=torch.int8, device=w.device))
    return _finish(trits, alpha, per_row)


def quantize_absmean(w: torch.Tensor, per_row: bool = True):
    """BitNet b1.58 absmean ternarization. Returns (trits int8 [N, K], scales fp32 [N] or [1])."""
    _check_weight(w)
    w64 = w.detach().to(torch.float64)
    gamma = w64.abs().mean(**_stat_dims(per_row)) + ABSMEAN_EPS
    trits = torch.round(w64 / gamma).clamp(-1, 1).to(torch.int8)
    return _finish(trits, gamma, per_row)


def quantize(w: torch.Tensor, method: str = "absmean", per_row: bool = True):
    """Dispatch to ``quantize_twn`` or ``quantize_absmean`` by ``method``."""
    if method == "twn":
        return quantize_twn(w, per_row=per_row)
    if method == "absmean":
        return quantize_absmean(w, per_row=per_row)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


__all__ = ["quantize_twn", "quantize_absmean", "quantize", "METHODS"]
