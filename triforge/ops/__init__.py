"""Every op module; importing this registers them all."""

from triforge.ops import mhc, norm, rope, softmax, swiglu, ternary  # noqa: F401
