"""triforge: fused Triton kernels for LLM layers, each with a golden reference, parity check and benchmark."""

from triforge import _runtime  # noqa: F401  (sets TRITON_INTERPRET before any kernel is defined)
from triforge.ops.norm import rms_norm

__version__ = "0.1.0"

__all__ = ["rms_norm", "__version__"]
