"""Tiny Hugging Face models for the integration tests: eager attention, fresh random weights, eval mode."""

import inspect

import torch

from triforge.testing import compare

# Hugging Face binds these module functions to fla / causal-conv1d when those are importable (a GPU machine with
# the peers installed): fla's fp32 products are tf32, so a reference must unwrap them to HF's plain PyTorch
QWEN3_NEXT_KERNEL_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                               "causal_conv1d_update")


def use_hf_torch_gated_delta(monkeypatch, qwen3_next) -> None:
    """Qwen3-Next's linear attention on HF's own PyTorch functions, even where fla / causal-conv1d are installed."""
    for name in QWEN3_NEXT_KERNEL_FUNCTIONS:
        monkeypatch.setattr(qwen3_next, name, inspect.unwrap(getattr(qwen3_next, name)))


def random_eager(model_cls, cfg, device, gen, scale=0.2):
    """``model_cls(cfg)`` on its eager attention with every parameter drawn from N(0, scale^2) by ``gen``."""
    cfg._attn_implementation = "eager"
    model = model_cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model.to(device).eval()


def count_calls(monkeypatch, targets) -> dict:
    """Wrap each ``(module, function name)`` so its calls are counted; returns {name: count}, live."""
    counts = {name: 0 for _, name in targets}
    for module, name in targets:
        fn = getattr(module, name)

        def counted(*a, _fn=fn, _name=name, **k):
            counts[_name] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(module, name, counted)
    return counts


def cache_keyword(model) -> str:
    """The keyword a Hugging Face model's forward takes its cache by: ``cache`` since transformers 5.2x (where
    ``past_key_values`` is deprecated, to be removed), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def output_cache(out):
    """The cache a forward returned (``out.cache``, or ``out.past_key_values`` on older transformers)."""
    return out.cache if "cache" in out else out.past_key_values


def assert_cached_decoding_matches(reference, model, ids, tol, steps=3):
    """A prefill with the cache and ``steps`` greedy decoding steps of each model from its own cache: logits equal
    within ``tol`` at every step (the tokens fed are the reference's). ``reference`` takes ``model``'s keywords."""
    kw = cache_keyword(model)
    with torch.no_grad():
        want, got = reference(ids, use_cache=True), model(ids, use_cache=True)
        assert compare("prefill logits", want.logits, got.logits, tol=tol).ok
        cache_want, cache_got = output_cache(want), output_cache(got)
        token = want.logits[:, -1:].argmax(-1)
        for step in range(steps):
            want = reference(token, use_cache=True, **{kw: cache_want})
            got = model(token, use_cache=True, **{kw: cache_got})
            assert compare(f"decode logits step {step}", want.logits, got.logits, tol=tol).ok
            token = want.logits[:, -1:].argmax(-1)
