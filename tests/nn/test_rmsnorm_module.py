"""triforge.nn.RMSNorm as a drop-in for Hugging Face's Qwen2RMSNorm, alone and inside a model."""

import copy

import pytest
import torch

from triforge.launch import poisoned
from triforge.nn import RMSNorm, patch_hf_rmsnorm
from triforge.testing import compare

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_module_matches_hf_module(dtype, device):
    hidden = 200
    hf = Qwen2RMSNorm(hidden, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.1 * torch.randn(hidden))
    ours = RMSNorm.from_hf(hf)
    assert ours.weight is hf.weight and ours.variance_epsilon == hf.variance_epsilon
    x = torch.randn(3, 7, hidden, device=device, dtype=dtype, requires_grad=True)
    ref = hf(x.detach().double().requires_grad_()) if dtype == torch.float32 else None
    with poisoned():
        got = ours(x)
    want = hf(x)
    assert compare("RMSNorm vs Qwen2RMSNorm", want, got, dtype=dtype).ok
    if ref is not None:
        g = torch.randn_like(got)
        (dx,) = torch.autograd.grad(got, x, g)
        (dx_hf,) = torch.autograd.grad(want, x, g)
        assert compare("dx vs HF autograd", dx_hf, dx, dtype=dtype).ok


def test_module_init_and_repr():
    m = RMSNorm(64, eps=1e-5)
    assert m.weight.shape == (64,) and torch.equal(m.weight, torch.ones(64))
    assert "eps=1e-05" in repr(m)
    with pytest.raises(TypeError, match="module"):
        RMSNorm.from_hf(torch.nn.Linear(4, 4))


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg).eval()
    for m in model.modules():
        if isinstance(m, Qwen2RMSNorm):
            with torch.no_grad():
                m.weight.copy_(1 + 0.1 * torch.randn_like(m.weight))
    return model


def test_patch_hf_model_keeps_logits(device):
    model = _tiny_qwen2().to(device)
    patched = copy.deepcopy(model)
    n = patch_hf_rmsnorm(patched)
    assert n == 2 * 2 + 1  # input + post-attention norm per layer, and the final norm
    assert not any(isinstance(m, Qwen2RMSNorm) for m in patched.modules())
    ids = torch.randint(0, 97, (2, 11), device=device)
    with torch.no_grad():
        want = model(ids).logits
        with poisoned():
            got = patched(ids).logits
    assert compare("qwen2 logits with triforge RMSNorm", want, got, dtype=torch.float32).ok
    # gradients still flow to the (shared) norm weights
    patched(ids).logits.square().mean().backward()
    norm_grads = [m.weight.grad for m in patched.modules() if isinstance(m, RMSNorm)]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in norm_grads)
