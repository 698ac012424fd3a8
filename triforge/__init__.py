"""triforge: fused Triton kernels for LLM layers, each with a golden reference, parity check and benchmark."""

from triforge import _runtime  # noqa: F401  (sets TRITON_INTERPRET before any kernel is defined)
from triforge import nn, ternary  # noqa: F401
from triforge.ops.attention import flash_attn_func, flash_attn_varlen_func
from triforge.ops.attention.decode import flash_attn_with_kvcache
from triforge.ops.deltanet import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from triforge.ops.gemv import gemv
from triforge.ops.mhc import coefficients as mhc_coefficients
from triforge.ops.mhc import fused_post_res, fused_pre_map, fused_rmsnorm_project
from triforge.ops.norm import rms_norm
from triforge.ops.rope import apply_rotary, apply_rotary_qk
from triforge.ops.softmax import softmax
from triforge.ops.swiglu import swiglu

__version__ = "0.1.0"

__all__ = [
    "rms_norm",
    "swiglu",
    "apply_rotary",
    "apply_rotary_qk",
    "softmax",
    "gemv",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_rmsnorm_project",
    "fused_pre_map",
    "fused_post_res",
    "mhc_coefficients",
    "nn",
    "ternary",
    "__version__",
]
