"""Tiny Hugging Face models for the integration tests: eager attention, fresh random weights, eval mode."""

import torch


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
