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

import inspect
import sys
import warnings

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
    """The structure of a plain gated SiLU MLP: exactly gate_proj, up_proj, down_proj and a SiLU act_fn as
    children, and no parameter or buffer of its own (an extra scale, gate or clamp would be lost)."""
    if isinstance(module, SwiGLUMLP) or type(getattr(module, "act_fn", None)).__name__ not in _SILU:
        return False
    children = {name for name, _ in module.named_children()}
    own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
    return children == {"gate_proj", "up_proj", "down_proj", "act_fn"} and not own


def _computes_swiglu(module: nn.Module) -> bool:
    """The module's own forward equals down(silu(gate(x)) * up(x)) on a small random input: a class that
    has the structure but another formula (a clamp in forward, a scale from the config) is left alone."""
    weight = getattr(module.gate_proj, "weight", None)
    in_features = getattr(module.gate_proj, "in_features", None)
    if not isinstance(weight, torch.Tensor) or in_features is None or not weight.dtype.is_floating_point:
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, in_features, generator=g).to(weight.device, weight.dtype)
    with torch.no_grad():
        want = module(x)
        got = module.down_proj(torch.nn.functional.silu(module.gate_proj(x)) * module.up_proj(x))
    return want.shape == got.shape and torch.allclose(want.float(), got.float(), rtol=1e-3, atol=1e-3 * float(got.abs().max()))


def patch_hf_swiglu(model: nn.Module) -> int:
    """Replace every gated SiLU MLP of a Hugging Face model in place by SwiGLUMLP; returns the count. A
    class is taken when its structure is the plain one and its forward computes the plain formula (checked
    once per class on a small random input)."""
    verdict = {}

    def takes(m):
        if not _is_swiglu_mlp(m):
            return False
        if type(m) not in verdict:
            verdict[type(m)] = _computes_swiglu(m)
        return verdict[type(m)]

    targets = [name for name, m in model.named_modules() if takes(m)]
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


def _rope_matches(original, fused, device) -> bool:
    """Whether ``original`` is Llama's rotate-half rotation: its signature starts (q, k, cos, sin) and it gives
    the fused rotation's result on random q, k, cos and sin (interleaved pairs, another sign or another
    argument order differ)."""
    params = list(inspect.signature(original).parameters)
    if params[:4] != ["q", "k", "cos", "sin"]:
        return False
    g = torch.Generator().manual_seed(0)
    q, k, cos, sin = (torch.randn(shape, generator=g).to(device) for shape in ((1, 2, 5, 64), (1, 1, 5, 64), (1, 5, 64),
                                                                              (1, 5, 64)))
    try:
        with torch.no_grad():
            want, got = original(q, k, cos, sin), fused(q, k, cos, sin)
    except Exception:
        return False
    return all(a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(want, got))


def patch_hf_rope(model: nn.Module) -> int:
    """Point ``apply_rotary_pos_emb`` of the modeling modules that define this model's layers at the fused
    rotation, where the module's function is Llama's rotate-half form (its signature and its result on a
    random probe; other families keep theirs). The module's function is replaced: every model of the family
    in the process gets it. Returns the number of modules patched now (0 where they already were)."""
    patched = 0
    weight = next(model.parameters(), None)
    device = weight.device if weight is not None else "cpu"
    for module in {sys.modules.get(type(m).__module__) for m in model.modules()}:
        fn = getattr(module, "apply_rotary_pos_emb", None)
        if fn is None or hasattr(fn, "triforge_original") or not module.__name__.startswith("transformers."):
            continue
        fused = _fused_rope(fn)
        if not _rope_matches(fn, fused, device):
            continue
        module.apply_rotary_pos_emb = fused
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
        layers = [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "scaling")]
        if hasattr(model, "set_attn_implementation") and layers:
            why = _unservable(layers)
            if why:
                warnings.warn(f"patch_hf_model: attention left as it is: {why}", stacklevel=2)
            else:
                model.set_attn_implementation(register_hf_attention())
                counts["attention"] = 1
    return counts


def _unservable(layers) -> str:
    """Why triforge's attention cannot serve every one of these attention modules (the implementation is
    switched for the whole model, vision towers included), or ''."""
    from triforge.ops.attention import HEAD_DIMS

    for m in layers:
        head_dim = getattr(m, "head_dim", None)
        if head_dim is not None and head_dim not in HEAD_DIMS:
            return f"{type(m).__name__} has head_dim {head_dim} (the kernels take {', '.join(map(str, HEAD_DIMS))})"
        softcap = getattr(getattr(m, "config", None), "attn_logit_softcapping", None)
        if softcap:
            return f"{type(m).__name__} softcaps its logits ({softcap}), which the kernels do not"
    return ""
