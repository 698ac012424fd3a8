"""TernaryLinear and quantize_model on a tiny Hugging Face model built from a config (no hub access)."""

import copy

import pytest
import torch
from torch import nn

from triforge.nn.ternary import TernaryLinear
from triforge.ops.ternary.reference import matmul_dense_ref
from triforge.ternary import TernaryTensor, quantize_model
from triforge.testing import compare


@pytest.mark.parametrize("method", ["twn", "absmean"])
@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "per_tensor"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_from_linear_equals_dense_expansion(method, per_row, bias, device, gen):
    lin = nn.Linear(100, 37, bias=bias).to(device)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(37, 100, generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(37, generator=gen))
    tl = TernaryLinear.from_linear(lin, method=method, per_row=per_row)
    expect = TernaryTensor.from_float(lin.weight.detach(), method=method, per_row=per_row)
    assert torch.equal(tl.plus, expect.plus) and torch.equal(tl.minus, expect.minus)
    assert torch.equal(tl.scales, expect.scales)
    x = torch.randn(2, 3, 100, generator=gen).to(device)
    y = tl(x)
    ref = matmul_dense_ref(x, tl.ternary, lin.bias)
    assert compare(f"TernaryLinear {method}", ref, y, dtype=torch.float32).ok
    r = repr(tl)
    assert "in_features=100" in r and "out_features=37" in r and "bits_per_weight=" in r and "sparsity=" in r


def test_buffers_state_dict_and_to(tmp_path, device, gen):
    lin = nn.Linear(70, 9)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(9, 70, generator=gen))
    tl = TernaryLinear.from_linear(lin, method="twn")
    sd = tl.state_dict()
    assert set(sd) == {"plus", "minus", "scales", "bias"}
    assert sd["plus"].dtype == torch.int32
    other = TernaryLinear(70, 9)
    md_before = other.ternary.sparsity_metadata()
    other.load_state_dict(sd)
    assert other.ternary.sparsity_metadata() is not md_before  # stale metadata dropped
    assert other.ternary.sparsity_metadata().chunk_sparsity() == 0.0
    x = torch.randn(4, 70, generator=gen)
    assert torch.equal(other(x), tl(x))
    moved = tl.to(device)
    assert moved.plus.device.type == device.type and moved.ternary.device.type == device.type
    half = copy.deepcopy(tl).to(torch.float16)  # buffers keep their integer / fp32 dtypes
    assert half.plus.dtype == torch.int32 and half.bias.dtype == torch.float16
    assert half.scales.dtype == torch.float32 and torch.equal(half.scales, tl.scales.to(half.scales.device))
    xh = torch.randn(4, 70, generator=gen).to(device=half.plus.device, dtype=torch.float16)
    assert half(xh).dtype == torch.float16


def test_public_module_exports():
    import triforge.ternary as T

    for name in ("TernaryTensor", "SparsityMetadata", "matmul", "quantize_model", "quantize_twn", "quantize_absmean",
                 "ternary_attention_scores", "hybrid_attention_scores", "TernaryLinear"):
        assert name in T.__all__ and getattr(T, name) is not None


def _tiny_qwen2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    return transformers.Qwen2ForCausalLM(cfg).eval()


def test_quantize_model_on_tiny_qwen2(gen, capsys, device):
    # on the kernels' device: the quantized model's TernaryLinear layers run the Triton kernels (elsewhere
    # matmul falls back to dense expansion)
    model = _tiny_qwen2().to(device)
    ids = torch.randint(0, 128, (2, 11), generator=gen).to(device)
    with torch.no_grad():
        before = model(ids).logits
    lm_head = model.lm_head.weight.detach().clone()
    embed = model.model.embed_tokens.weight.detach().clone()
    norms = {n: p.detach().clone() for n, p in model.named_parameters() if "norm" in n}
    n_linear = sum(isinstance(m, nn.Linear) for n, m in model.named_modules() if "lm_head" not in n)
    fp16_bytes = sum(m.weight.numel() * 2 for n, m in model.named_modules()
                     if isinstance(m, nn.Linear) and "lm_head" not in n)

    report = quantize_model(model, method="absmean")
    assert "quantize_model" in capsys.readouterr().out  # printed with rich
    assert report["replaced"] == n_linear == 2 * 7
    assert isinstance(model.lm_head, nn.Linear) and not isinstance(model.lm_head, TernaryLinear)
    assert isinstance(model.model.embed_tokens, nn.Embedding)
    assert isinstance(model.model.layers[0].self_attn.q_proj, TernaryLinear)
    assert isinstance(model.model.layers[1].mlp.down_proj, TernaryLinear)
    assert torch.equal(model.lm_head.weight, lm_head) and torch.equal(model.model.embed_tokens.weight, embed)
    for n, p in model.named_parameters():
        if "norm" in n:
            assert torch.equal(p, norms[n]), n
    assert report["bytes_before"] == fp16_bytes
    planes = sum(m.ternary.nbytes() for m in model.modules() if isinstance(m, TernaryLinear))
    assert report["bytes_after"] == planes and report["ratio"] == pytest.approx(fp16_bytes / planes)
    assert report["ratio"] > 6 and report["ratio_base3"] > 7  # K = 64 or 160 here: fp32 per-row scales weigh in
    with torch.no_grad():
        after = model(ids).logits
    assert after.shape == before.shape and bool(torch.isfinite(after).all())
    # the quantized model still computes something related to the original
    cos = torch.nn.functional.cosine_similarity(after.flatten(), before.flatten(), dim=0)
    assert float(cos) > 0.3


def test_quantize_model_skip_and_multihead_attention(gen, device):
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8))
    model.add_module("embed_proj", nn.Linear(8, 8))
    mha = nn.MultiheadAttention(8, 2)
    model.add_module("mha", mha)
    report = quantize_model(model, skip=("embed",), method="twn", per_row=False, verbose=False)
    assert report["names"] == ["0", "2"]
    assert isinstance(model[1], nn.LayerNorm) and type(model.embed_proj) is nn.Linear
    assert not isinstance(mha.out_proj, TernaryLinear)
    model.to(device)
    x = torch.randn(3, 16, generator=gen).to(device)
    y = model[2](model[1](model[0](x)))
    assert bool(torch.isfinite(y).all())
    with pytest.raises(ValueError, match="method"):
        quantize_model(nn.Sequential(nn.Linear(2, 2)), method="bad")
    with pytest.raises(TypeError, match="model"):
        quantize_model(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="linear"):
        TernaryLinear.from_linear(nn.Conv1d(2, 2, 1))
