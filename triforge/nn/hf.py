"""One call that puts triforge's kernels into a Hugging Face model, as Liger's ``apply_liger_kernel_to_*`` does.

    counts = triforge.nn.patch_hf_model(model)   # {"rms_norm": 49, "swiglu": 24, "rope": 1, "attention": 1, ...}

- ``rms_norm``: every ``*RMSNorm`` with Qwen2 / Llama numerics -> triforge.nn.RMSNorm (weights shared);
- ``swiglu``: every gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, SiLU) -> SwiGLUMLP, whose
  silu(gate) * up is one fused kernel (the projections are the model's own nn.Linear);
- ``rope``: the model's modeling module's ``apply_rotary_pos_emb`` -> the fused q and k rotation, where the
  call is the full-width rotate-half form on [B, H, T, D] tensors (anything else goes to the original).
  Like Liger's, this patches the module, so every model of that family in the process gets it;
- ``attention``: ``attn_implementation="triforge"`` (register_hf_attention) where the model has attention
  layers that dispatch by name;
- ``gated_deltanet``: Qwen3-Next's Qwen3NextGatedDeltaNet -> HFGatedDeltaNet.

Each is on by default and can be switched off by keyword; the counts say what was replaced.
"""

import sys

import torch
from torch import nn

from triforge.nn.attention import register_hf_attention
from triforge.nn.deltanet import patch_hf_gated_deltanet
from triforge.nn.norm import patch_hf_rmsnorm

_SILU = ("SiLU", "SiLUActivation")


class SwiGLUMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) with the product fused (triforge.swiglu); the three
    projections are taken as they are (any nn.Module), so weights, biases and quantized layers are kept."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    @classmethod
    def from_hf(cls, module: nn.Module) -> "SwiGLUMLP":
        if not _is_swiglu_mlp(module):
            raise ValueError(f"{type(module).__name__} is not a gated SiLU MLP (gate_proj, up_proj, down_proj, "
                             "act_fn SiLU)")
        return cls(module.gate_proj, module.up_proj, module.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from triforge.ops.swiglu import swiglu

        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _is_swiglu_mlp(module: nn.Module) -> bool:
    return (not isinstance(module, SwiGLUMLP) and all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj"))
            and type(getattr(module, "act_fn", None)).__name__ in _SILU)


def patch_hf_swiglu(model: nn.Module) -> int:
    """Replace every gated SiLU MLP of a Hugging Face model in place by SwiGLUMLP; returns the count."""
    targets = [name for name, m in model.named_modules() if _is_swiglu_mlp(m)]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, SwiGLUMLP.from_hf(getattr(parent, child)))
    return len(targets)


def _fused_rope(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
        """Hugging Face's apply_rotary_pos_emb, by triforge's fused q / k rotation where it applies."""
        from triforge.ops.rope import apply_rotary_qk

        plain = (not args and not kwargs and unsqueeze_dim == 1 and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3
                 and cos.shape[-1] == q.shape[-1] == k.shape[-1] and q.shape[2] == k.shape[2] == cos.shape[1]
                 and cos.shape[0] in (1, q.shape[0]) and q.dtype in (torch.float16, torch.bfloat16, torch.float32))
        if not plain:  # partial rotary, interleaved layouts, position_ids of older versions: the original
            return original(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
        q_out, k_out = apply_rotary_qk(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, T, H, D]
        return q_out.transpose(1, 2), k_out.transpose(1, 2)

    apply_rotary_pos_emb.triforge_original = original
    return apply_rotary_pos_emb


def patch_hf_rope(model: nn.Module) -> int:
    """Point ``apply_rotary_pos_emb`` of the modeling modules that define this model's layers at the fused
    rotation (the module's function is replaced: every model of the family in the process gets it);
    returns the number of modules patched now (0 where they already were)."""
    patched = 0
    for module in {sys.modules.get(type(m).__module__) for m in model.modules()}:
        fn = getattr(module, "apply_rotary_pos_emb", None)
        if fn is None or hasattr(fn, "triforge_original") or not module.__name__.startswith("transformers."):
            continue
        module.apply_rotary_pos_emb = _fused_rope(fn)
        patched += 1
    return patched


def unpatch_hf_rope(model: nn.Module) -> int:
    """Undo patch_hf_rope for this model's modeling modules; returns the number restored."""
    restored = 0
    for module in {sys.modules.get(type(m).__module__) for m in model.modules()}:
        fn = getattr(module, "apply_rotary_pos_emb", None)
        if fn is not None and hasattr(fn, "triforge_original"):
            module.apply_rotary_pos_emb = fn.triforge_original
            restored += 1
    return restored


def patch_hf_model(model: nn.Module, *, rms_norm: bool = True, swiglu: bool = True, rope: bool = True,
                   attention: bool = True, gated_deltanet: bool = True) -> dict:
    """Put triforge's kernels into a Hugging Face model in place (see the module docstring); returns how many
    of each were replaced."""
    counts = {}
    if rms_norm:
        counts["rms_norm"] = patch_hf_rmsnorm(model)
    if swiglu:
        counts["swiglu"] = patch_hf_swiglu(model)
    if rope:
        counts["rope"] = patch_hf_rope(model)
    if gated_deltanet:
        counts["gated_deltanet"] = patch_hf_gated_deltanet(model)
    if attention:
        counts["attention"] = 0
        if hasattr(model, "set_attn_implementation") and any(
                hasattr(m, "is_causal") and hasattr(m, "scaling") for m in model.modules()):
            model.set_attn_implementation(register_hf_attention())
            counts["attention"] = 1
    return counts
