"""Every op module; importing this registers them all."""

from triforge.ops import norm  # noqa: F401
