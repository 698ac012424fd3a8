"""Every op module; importing this registers them all."""

from triforge.ops import gemv, mhc, norm, rope, softmax, swiglu, ternary  # noqa: F401
from triforge.ops.attention import decode  # noqa: F401  (flash_attn registers through the package)
from triforge.ops import deltanet  # noqa: F401
