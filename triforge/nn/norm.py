import torch
from torch import nn

from triforge.ops.norm import rms_norm


class RMSNorm(nn.Module):
    """Drop-in for Hugging Face's Qwen2RMSNorm / LlamaRMSNorm (same parameter and attribute names)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, residual)

    @classmethod
    def from_hf(cls, module: nn.Module) -> "RMSNorm":
        """A triforge RMSNorm sharing ``module``'s weight tensor and epsilon."""
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if eps is None or not hasattr(module, "weight"):
            raise TypeError(f"module must have 'weight' and 'variance_epsilon' (or 'eps'); got {type(module).__name__}")
        new = cls(module.weight.shape[0], eps, device=module.weight.device, dtype=module.weight.dtype)
        new.weight = module.weight
        return new

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def patch_hf_rmsnorm(model: nn.Module) -> int:
    """Replace every ``*RMSNorm`` module of a Hugging Face model (Qwen2, Llama, ...) in place.

    Returns the number of modules replaced; weights are shared, not copied.
    """
    targets = []
    for name, module in model.named_modules():
        cls_name = type(module).__name__
        if cls_name.endswith("RMSNorm") and not isinstance(module, RMSNorm) and hasattr(module, "variance_epsilon"):
            targets.append(name)
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, RMSNorm.from_hf(getattr(parent, child)))
    return len(targets)
