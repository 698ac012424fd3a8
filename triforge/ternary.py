"""Public API of ternary (1.58-bit) weights: ``from triforge.ternary import TernaryTensor, matmul, ...``."""

from triforge.nn.ternary import TernaryLinear
from triforge.ops.ternary import hybrid_attention_scores, matmul, matmul_w158a8, ternary_attention_scores
from triforge.ops.ternary.model import quantize_model
from triforge.ops.ternary.quantize import quantize_absmean, quantize_twn
from triforge.ops.ternary.tensor import SparsityMetadata, TernaryTensor

__all__ = [
    "TernaryTensor",
    "SparsityMetadata",
    "matmul",
    "matmul_w158a8",
    "quantize_model",
    "quantize_twn",
    "quantize_absmean",
    "ternary_attention_scores",
    "hybrid_attention_scores",
    "TernaryLinear",
]
