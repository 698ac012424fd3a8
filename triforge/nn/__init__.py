"""nn.Module wrappers over triforge ops, drop-in for their Hugging Face counterparts."""

from triforge.nn.norm import RMSNorm, patch_hf_rmsnorm

__all__ = ["RMSNorm", "patch_hf_rmsnorm"]
