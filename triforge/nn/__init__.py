"""nn.Module wrappers over triforge ops, drop-in for their Hugging Face counterparts."""

from triforge.nn.attention import hf_attention_forward, register_hf_attention
from triforge.nn.deltanet import GatedDeltaNet, HFGatedDeltaNet, patch_hf_gated_deltanet
from triforge.nn.mhc import MHCLiteBlock, expand_streams, reduce_streams
from triforge.nn.norm import RMSNorm, patch_hf_rmsnorm
from triforge.nn.ternary import TernaryLinear

__all__ = ["register_hf_attention", "hf_attention_forward", "RMSNorm", "patch_hf_rmsnorm", "MHCLiteBlock", "expand_streams", "reduce_streams", "GatedDeltaNet",
           "HFGatedDeltaNet", "patch_hf_gated_deltanet", "TernaryLinear"]
