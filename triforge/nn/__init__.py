"""nn.Module wrappers over triforge ops, drop-in for their Hugging Face counterparts."""

from triforge.nn.attention import hf_attention_forward, register_hf_attention
from triforge.nn.hf import SwiGLUMLP, patch_hf_model, patch_hf_rope, patch_hf_swiglu, unpatch_hf_rope
from triforge.nn.deltanet import GatedDeltaNet, HFGatedDeltaNet, patch_hf_gated_deltanet
from triforge.nn.mhc import MHCLiteBlock, expand_streams, reduce_streams
from triforge.nn.norm import RMSNorm, patch_hf_rmsnorm
from triforge.nn.ternary import TernaryLinear

__all__ = ["patch_hf_model", "patch_hf_swiglu", "patch_hf_rope", "unpatch_hf_rope", "SwiGLUMLP",
           "register_hf_attention", "hf_attention_forward", "RMSNorm", "patch_hf_rmsnorm", "MHCLiteBlock", "expand_streams", "reduce_streams", "GatedDeltaNet",
           "HFGatedDeltaNet", "patch_hf_gated_deltanet", "TernaryLinear"]
