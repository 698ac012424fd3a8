"""triforge.nn.patch_hf_model: a Hugging Face model with every triforge kernel patched in (RMSNorm, the fused SwiGLU
MLP, the fused RoPE, the attention implementation, Gated DeltaNet) against the same model unpatched (float32):
logits, every parameter's gradient, cached generation, which kernels ran, and the RoPE patch's fallbacks."""

import copy
import functools

import pytest
import torch

import triforge.ops.rope as rope_ops
import triforge.ops.swiglu as swiglu_ops
from triforge.nn import SwiGLUMLP, patch_hf_model, patch_hf_rope, unpatch_hf_rope
from triforge.testing import Tolerance, compare

from .hf_models import assert_cached_decoding_matches, count_calls, random_eager, use_hf_torch_gated_delta

transformers = pytest.importorskip("transformers")
qwen2 = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")

FP32 = Tolerance(rel_rms=1e-5, atol=2e-5, rtol=2e-5)
FP32_GRAD = Tolerance(rel_rms=5e-5, atol=2e-4, rtol=2e-4)


@pytest.fixture
def calls(monkeypatch):
    """Counts the fused kernels' entry points (the patched code imports them at call time)."""
    return count_calls(monkeypatch, [(swiglu_ops, "swiglu"), (rope_ops, "apply_rotary_qk")])


@pytest.fixture
def qwen2_pair(device, gen):
    """(eager Qwen2, patched copy, counts); the RoPE patch (module-wide) is undone afterwards."""
    cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    model = random_eager(transformers.Qwen2ForCausalLM, cfg, device, gen)
    patched = copy.deepcopy(model)
    counts = patch_hf_model(patched)
    yield model, patched, counts
    unpatch_hf_rope(patched)


def test_counts_and_kernels_that_run(qwen2_pair, calls, device, gen):
    eager, patched, counts = qwen2_pair
    assert counts == {"rms_norm": 5, "swiglu": 2, "rope": 1, "gated_deltanet": 0, "attention": 1}
    assert sum(isinstance(m, SwiGLUMLP) for m in patched.modules()) == 2
    assert patched.config._attn_implementation == "triforge"
    assert patch_hf_rope(patched) == 0  # already patched: not wrapped twice
    ids = torch.randint(0, 97, (2, 17), generator=gen).to(device)
    with torch.no_grad():
        patched(ids)
    assert calls == {"swiglu": 2, "apply_rotary_qk": 2}  # one per layer


def _on_original_rope(patched, fn, *args, **kwargs):
    """fn(*args, **kwargs) on the modeling module's original apply_rotary_pos_emb: the RoPE patch is module-wide, so
    an unpatched model of the family runs the fused rotation too unless it is undone around the call."""
    unpatch_hf_rope(patched)
    try:
        return fn(*args, **kwargs)
    finally:
        patch_hf_rope(patched)


def test_logits_gradients_and_generation_match_unpatched(qwen2_pair, device, gen):
    """The unpatched model runs the original apply_rotary_pos_emb: the RoPE patch is undone around its calls."""
    eager, patched, _ = qwen2_pair
    ids = torch.randint(0, 97, (2, 23), generator=gen).to(device)

    run_eager = functools.partial(_on_original_rope, patched)

    with torch.no_grad():
        want = run_eager(lambda: eager(ids).logits)
        got = patched(ids).logits
    assert compare("logits", want, got, tol=FP32).ok
    eager.train()
    patched.train()
    names = [n for n, _ in patched.named_parameters()]
    g_want = run_eager(lambda: torch.autograd.grad(eager(ids, labels=ids).loss, list(eager.parameters())))
    g_got = torch.autograd.grad(patched(ids, labels=ids).loss, list(patched.parameters()))
    for name, w, g in zip(names, g_want, g_got):
        assert compare(f"d{name}", w, g, tol=FP32_GRAD, verbose=False).ok, name
    eager.eval()
    patched.eval()
    out_want = run_eager(lambda: eager.generate(ids, max_new_tokens=4, do_sample=False))
    assert torch.equal(out_want, patched.generate(ids, max_new_tokens=4, do_sample=False))


def test_rope_patch_falls_back_where_it_does_not_apply(qwen2_pair, calls, device, gen):
    """Partial rotary (cos narrower than the head), the [B, T, H, D] layout (unsqueeze_dim=2): the original
    function runs and gives its own result; the plain form runs the kernel and equals the original."""
    _, patched, _ = qwen2_pair
    fused = qwen2.apply_rotary_pos_emb
    original = fused.triforge_original
    q = torch.randn(2, 4, 9, 64, generator=gen).to(device)
    k = torch.randn(2, 2, 9, 64, generator=gen).to(device)
    cos, sin = rope_ops.hf_cos_sin(9, 64, device=device)
    cos, sin = cos[None].expand(2, -1, -1), sin[None].expand(2, -1, -1)
    for got, want in zip(fused(q, k, cos, sin), original(q, k, cos, sin)):
        assert compare("plain rope", want, got, tol=FP32).ok
    assert calls["apply_rotary_qk"] == 1
    for args, kwargs in (((q, k, cos[..., :32], sin[..., :32]), {}),  # partial: HF's original refuses it here too
                         ((q.transpose(1, 2), k.transpose(1, 2), cos, sin), {"unsqueeze_dim": 2})):
        try:
            want = original(*args, **kwargs)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                fused(*args, **kwargs)
        else:
            for w, g in zip(want, fused(*args, **kwargs)):
                assert torch.equal(w, g)
    assert calls["apply_rotary_qk"] == 1  # the fallbacks did not reach the kernel


def test_switches_and_a_hybrid_qwen3_next(device, gen, monkeypatch):
    """Keywords switch each patch off; Qwen3-Next (partial rotary: its RoPE calls fall back) gets Gated
    DeltaNet, the attention implementation, the SwiGLU MLP, and its (1 + weight) RMSNorm is left alone.
    The reference runs HF's PyTorch recurrence (where fla is installed HF would call it: tf32 products)."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    use_hf_torch_gated_delta(monkeypatch, qwen3_next)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, num_experts=0, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4)
    model = transformers.Qwen3NextForCausalLM(cfg).to(device).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for layer in model.model.layers:  # decays moderate, as Qwen3-Next initialises them
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.copy_(torch.empty(4).uniform_(0.02, 0.5, generator=gen).log())
    ids = torch.randint(0, 97, (1, 19), generator=gen).to(device)
    with torch.no_grad():
        want = model(ids).logits
    patched = copy.deepcopy(model)
    try:
        counts = patch_hf_model(patched, swiglu=False)
        assert counts == {"rms_norm": 0, "rope": 1, "gated_deltanet": 1, "attention": 1}
        assert not any(isinstance(m, SwiGLUMLP) for m in patched.modules())
        with torch.no_grad():
            got = patched(ids).logits
        # Hugging Face's chunked PyTorch recurrence against the kernels: fp32 rounding in different orders
        assert compare("Qwen3-Next logits", want, got, tol=Tolerance(rel_rms=2e-5, atol=5e-5, rtol=5e-5)).ok
        assert patch_hf_model(patched, rms_norm=False, rope=False, attention=False, gated_deltanet=False) == {"swiglu": 2}
    finally:
        unpatch_hf_rope(patched)
    assert not hasattr(qwen3_next.apply_rotary_pos_emb, "triforge_original")


def test_rope_patch_only_where_the_family_rotates_like_llama(device, gen):
    """A module's apply_rotary_pos_emb is replaced only where it is Llama's rotate-half form on a random probe
    and takes (q, k, cos, sin): Cohere's interleaved pairs and GPT-J's (tensor, sin, cos) keep their own."""
    cohere = transformers.CohereForCausalLM(transformers.CohereConfig(
        vocab_size=97, hidden_size=128, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)).to(device)
    gptj = transformers.GPTJForCausalLM(transformers.GPTJConfig(vocab_size=97, n_embd=128, n_layer=1, n_head=2,
                                                                rotary_dim=16)).to(device)
    for model in (cohere, gptj):
        module = __import__(type(model.model if hasattr(model, "model") else model.transformer).__module__,
                            fromlist=["apply_rotary_pos_emb"])
        before = module.apply_rotary_pos_emb
        assert patch_hf_rope(model) == 0
        assert module.apply_rotary_pos_emb is before


class _ClampedMLP(torch.nn.Module):
    """The plain structure, another formula: must not be replaced."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(hidden, inter), torch.nn.Linear(hidden, inter)
        self.down_proj = torch.nn.Linear(inter, hidden)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)).clamp(max=0.1) * self.up_proj(x))


class _PlainMLP(_ClampedMLP):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _ScaledMLP(_PlainMLP):
    """The plain formula, but a parameter of its own (a scale): must not be replaced (it would be lost)."""

    def __init__(self, hidden, inter):
        super().__init__(hidden, inter)
        self.scale = torch.nn.Parameter(torch.ones(hidden))


def test_swiglu_patch_takes_only_the_plain_formula(device, gen):
    from triforge.nn import patch_hf_swiglu

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"plain": _PlainMLP(16, 24), "clamped": _ClampedMLP(16, 24),
                                 "scaled": _ScaledMLP(16, 24)}).to(device)
    x = torch.randn(2, 5, 16, generator=gen).to(device)
    with torch.no_grad():
        want = model["plain"](x)
    assert patch_hf_swiglu(model) == 1
    assert isinstance(model["plain"], SwiGLUMLP)
    assert type(model["clamped"]) is _ClampedMLP and type(model["scaled"]) is _ScaledMLP
    with torch.no_grad():
        assert compare("patched plain MLP", want, model["plain"](x), tol=FP32).ok


def test_attention_left_alone_where_the_kernels_cannot_serve_it(device, gen):
    """head_dim 80 (Phi-2, Qwen2-VL's vision tower): a warning naming it, attention counted 0, the model's own
    implementation kept (the kernels take head dims 32, 64, 128 and 256)."""
    cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=160, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    cfg._attn_implementation = "eager"
    model = transformers.Qwen2ForCausalLM(cfg).to(device)
    try:
        with pytest.warns(UserWarning, match="head_dim 80"):
            counts = patch_hf_model(model)
        assert counts["attention"] == 0 and model.config._attn_implementation == "eager"
    finally:
        unpatch_hf_rope(model)


def _classes(prefix):
    model_cls, cfg_cls = (getattr(transformers, prefix + suffix, None) for suffix in ("ForCausalLM", "Config"))
    if model_cls is None or cfg_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {prefix}ForCausalLM")
    return model_cls, cfg_cls


def _family(name):
    """(model class, config, the counts patch_hf_model must report) of a tiny two-layer model of a family (skipped
    where this transformers lacks the family)."""
    common = dict(vocab_size=97, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    table = {
        # Llama and Mistral: the Qwen2 structure without biases
        "llama": ("Llama", dict(**common),
                  {"rms_norm": 5, "swiglu": 2, "rope": 1, "gated_deltanet": 0, "attention": 1}),
        "mistral": ("Mistral", dict(**common, sliding_window=None),
                    {"rms_norm": 5, "swiglu": 2, "rope": 1, "gated_deltanet": 0, "attention": 1}),
        # Qwen3: also an RMSNorm over each head's q and k (q_norm, k_norm) before RoPE
        "qwen3": ("Qwen3", dict(**common, head_dim=32),
                  {"rms_norm": 9, "swiglu": 2, "rope": 1, "gated_deltanet": 0, "attention": 1}),
        # Gemma: (1 + weight) RMSNorms and a GELU-gated MLP stay the model's own; its RoPE and attention are Llama's
        "gemma": ("Gemma", dict(**common, head_dim=32, hidden_activation="gelu_pytorch_tanh"),
                  {"rms_norm": 0, "swiglu": 0, "rope": 1, "gated_deltanet": 0, "attention": 1}),
        # Gemma 2 softcaps its attention logits: its attention stays its own (a warning says why)
        "gemma2": ("Gemma2", dict(**common, head_dim=32),
                   {"rms_norm": 0, "swiglu": 0, "rope": 1, "gated_deltanet": 0, "attention": 0}),
        # Phi-3: gate and up in one fused projection (gate_up_proj): not the plain MLP, left alone
        "phi3": ("Phi3", dict(**common, pad_token_id=0),
                 {"rms_norm": 5, "swiglu": 0, "rope": 1, "gated_deltanet": 0, "attention": 1}),
        # OLMo 2: RMSNorms after attention and MLP and over the whole q and k projections
        "olmo2": ("Olmo2", dict(**common),
                  {"rms_norm": 9, "swiglu": 2, "rope": 1, "gated_deltanet": 0, "attention": 1}),
        # Granite: Llama's structure with multipliers outside the MLP and attention modules
        "granite": ("Granite", dict(**common),
                    {"rms_norm": 5, "swiglu": 2, "rope": 1, "gated_deltanet": 0, "attention": 1}),
        # Qwen2-MoE: each layer's shared expert is a plain MLP; the routed experts (fused weights) stay
        "qwen2_moe": ("Qwen2Moe", dict(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=64),
                      {"rms_norm": 5, "swiglu": 2, "rope": 1, "gated_deltanet": 0, "attention": 1}),
    }
    prefix, kwargs, counts = table[name]
    model_cls, cfg_cls = _classes(prefix)
    return model_cls, cfg_cls(**kwargs), counts


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "granite",
                                    "qwen2_moe"])
def test_other_families_drop_in(family, calls, device, gen):
    """patch_hf_model on other families: what it replaces (and leaves) per family, prompt logits against the
    unpatched model (the original RoPE restored around its calls), and cached decoding step by step."""
    model_cls, cfg, counts_want = _family(family)
    eager = random_eager(model_cls, cfg, device, gen)
    patched = copy.deepcopy(eager)
    try:
        if counts_want["attention"]:
            assert patch_hf_model(patched) == counts_want
        else:
            with pytest.warns(UserWarning, match="softcaps"):
                assert patch_hf_model(patched) == counts_want

        reference = functools.partial(_on_original_rope, patched, eager)  # the unpatched model, HF's own RoPE

        ids = torch.randint(0, 97, (2, 19), generator=gen).to(device)
        with torch.no_grad():
            want = reference(ids).logits
            calls.update(dict.fromkeys(calls, 0))  # (re-patching after the reference probes the kernel once)
            got = patched(ids).logits
        assert calls == {"swiglu": counts_want["swiglu"], "apply_rotary_qk": 2}  # one per layer (two layers)
        assert compare(f"{family} logits", want, got, tol=FP32).ok
        assert_cached_decoding_matches(reference, patched, ids[:1], FP32, steps=2)
    finally:
        unpatch_hf_rope(patched)


def test_patched_model_under_torch_compile_fullgraph(qwen2_pair, device, gen):
    """A patched model traces whole under torch.compile(fullgraph=True) (every kernel a custom op with a fake
    implementation): logits equal the unpatched model's, and a training step's loss and every gradient equal the
    patched model's eager ones."""
    eager, patched, _ = qwen2_pair
    ids = torch.randint(0, 97, (2, 17), generator=gen).to(device)
    with torch.no_grad():
        want = _on_original_rope(patched, eager, ids, use_cache=False).logits
    traced = []

    def recording(gm, example_inputs):  # the graph dynamo hands a backend, run as it is
        traced.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    with torch.no_grad():
        got = torch.compile(patched, fullgraph=True, backend=recording)(ids, use_cache=False).logits
    assert compare("compiled logits", want, got, tol=FP32).ok
    for op in ("rms_norm", "swiglu", "rope", "flash_attn"):  # the kernels are in the graph, not HF's fallbacks
        assert any(t.startswith("triforge.") and op in t for t in traced), (op, sorted(set(traced)))
    with torch.no_grad():
        got = torch.compile(patched, fullgraph=True)(ids, use_cache=False).logits
    assert compare("compiled (inductor) logits", want, got, tol=FP32).ok
    patched.train()
    params = [p for p in patched.parameters() if p.requires_grad]
    loss_want = patched(ids, labels=ids, use_cache=False).loss
    g_want = torch.autograd.grad(loss_want, params)
    loss_got = torch.compile(lambda i: patched(i, labels=i, use_cache=False).loss, fullgraph=True)(ids)
    g_got = torch.autograd.grad(loss_got, params)
    assert compare("compiled loss", loss_want, loss_got, tol=FP32).ok
    for (name, _), w, g in zip(((n, p) for n, p in patched.named_parameters() if p.requires_grad), g_want, g_got):
        assert compare(f"compiled d{name}", w, g, tol=FP32_GRAD, verbose=False).ok, name
