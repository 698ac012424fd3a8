"""triforge.nn.register_hf_attention: a Hugging Face model with attn_implementation="triforge" against the same
model on its eager attention (float32): logits, padded batches, cached generation, packed sequences, gradients of
every parameter, and the refusals."""

import copy

import pytest
import torch

import triforge.ops.attention as attn_ops
import triforge.ops.attention.decode as decode_ops
from triforge.nn import register_hf_attention
from triforge.testing import Tolerance, compare

from .hf_models import assert_cached_decoding_matches, cache_keyword, count_calls, random_eager

transformers = pytest.importorskip("transformers")

# two float32 attention implementations: rounding of different summation orders
FP32 = Tolerance(rel_rms=1e-5, atol=2e-5, rtol=2e-5)
FP32_GRAD = Tolerance(rel_rms=5e-5, atol=2e-4, rtol=2e-4)


@pytest.fixture
def pair(device, gen):
    """(eager model, the same weights on triforge's attention, calls) for a tiny Qwen2 (GQA 2:1, head dim 64);
    ``calls`` counts the kernels' entry points, so a test knows which path ran."""
    register_hf_attention()
    cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    eager = random_eager(transformers.Qwen2ForCausalLM, cfg, device, gen)
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation("triforge")
    assert ours.config._attn_implementation == "triforge" and eager.config._attn_implementation == "eager"
    return eager, ours


@pytest.fixture
def calls(monkeypatch):
    return count_calls(monkeypatch, [(attn_ops, "flash_attn_func"), (attn_ops, "flash_attn_varlen_func"),
                                     (decode_ops, "flash_attn_with_kvcache")])


def _ids(B, T, device, gen):
    return torch.randint(0, 97, (B, T), generator=gen).to(device)


def test_logits_match_eager(pair, calls, device, gen):
    eager, ours = pair
    ids = _ids(2, 37, device, gen)
    with torch.no_grad():
        assert compare("logits", eager(ids).logits, ours(ids).logits, tol=FP32).ok
    assert calls["flash_attn_func"] == 2 and calls["flash_attn_varlen_func"] == 0  # one per layer


def test_cached_decoding_runs_flash_decoding(pair, calls, device, gen):
    """Decoding steps (one token against the cached keys, no gradient) go to flash_attn_with_kvcache over HF's
    cache tensors as they are (strided [B, S, Hkv, D] views); logits of every step equal eager's."""
    eager, ours = pair
    assert_cached_decoding_matches(eager, ours, _ids(2, 11, device, gen), FP32, steps=3)
    assert calls["flash_attn_with_kvcache"] == 6 and calls["flash_attn_func"] == 2  # 3 steps x 2 layers; the prefill


def test_padded_batch_and_cached_generation_match_eager(pair, calls, device, gen):
    """Left padding (the 2D mask): rows unpadded into packed sequences; kept positions equal eager's, and
    greedy generation with the cache (decode steps see Sq = 1 against the cached keys) gives the same tokens."""
    eager, ours = pair
    ids = _ids(3, 21, device, gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :20] = 0  # one real token
    with torch.no_grad():
        want, got = eager(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert calls["flash_attn_varlen_func"] == 2
    keep = mask.bool()
    assert compare("padded logits (kept positions)", want[keep], got[keep], tol=FP32).ok
    g_want = eager.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    g_got = ours.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(g_want, g_got)


def test_packed_sequences_match_separate_calls(pair, calls, device, gen):
    """Packed input with per-sequence position ids and cu_seq_lens (as DataCollatorWithFlattening passes
    them): each sequence attends only to itself, equal to eager runs of each sequence alone."""
    eager, ours = pair
    lengths = (9, 1, 30)
    ids = _ids(1, sum(lengths), device, gen)
    cu = torch.tensor([0, 9, 10, 40], dtype=torch.int32, device=device)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    with torch.no_grad():
        got = ours(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=30, max_length_k=30).logits
        want = torch.cat([eager(ids[:, a:b]).logits for a, b in ((0, 9), (9, 10), (10, 40))], 1)
    assert calls["flash_attn_varlen_func"] == 2
    assert compare("packed logits", want, got, tol=FP32).ok
    # DataCollatorWithFlattening's default form: only the restarting position ids mark the sequences
    with torch.no_grad():
        got = ours(ids, position_ids=pos, use_cache=False).logits
    assert calls["flash_attn_varlen_func"] == 4
    assert compare("packed logits from position ids", want, got, tol=FP32).ok


def test_static_cache_matches_eager(pair, device, gen):
    """A static cache's keys run past the tokens seen (zeros in the unused slots): without a mask as well as
    with padding, prefill logits and greedy generation equal eager's (the mask cuts the unused slots off)."""
    eager, ours = pair
    ids = _ids(2, 7, device, gen)
    with torch.no_grad():
        want = eager(ids).logits
        cache = transformers.StaticCache(config=ours.config, max_cache_len=32)
        got = ours(ids, use_cache=True, **{cache_keyword(ours): cache}).logits
    assert compare("static-cache prefill", want, got, tol=FP32).ok
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    for kwargs in ({}, {"attention_mask": mask}):
        g_want = eager.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static", **kwargs)
        g_got = ours.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static", **kwargs)
        assert torch.equal(g_want, g_got), kwargs


def test_sliding_window_that_spans_every_key_is_full_attention(pair, device, gen):
    """Mistral passes its sliding window (4096 by default) on every call: taken while it spans all keys
    (query i sees key j where i - j < window), refused once it would cut one off."""
    from triforge.nn import hf_attention_forward

    q = torch.randn(1, 2, 9, 64, generator=gen).to(device)
    kv = torch.randn(1, 1, 9, 64, generator=gen).to(device)
    module = torch.nn.Module()
    full, _ = hf_attention_forward(module, q, kv, kv, None)
    spanning, _ = hf_attention_forward(module, q, kv, kv, None, sliding_window=9)
    assert torch.equal(full, spanning)
    with pytest.raises(NotImplementedError, match="sliding_window=8 shorter than the 9 keys"):
        hf_attention_forward(module, q, kv, kv, None, sliding_window=8)


def test_gradients_match_eager(pair, device, gen):
    """Training with a padded row: every parameter's gradient equals eager's (the loss skips padding)."""
    eager, ours = pair
    eager.train()
    ours.train()
    ids = _ids(2, 19, device, gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    # padded positions' outputs differ (eager: a softmax over masked keys; ours: 0), so the loss must not read them:
    # label t is predicted from position t - 1, ignored where that position (or t itself) is padding
    ignore = mask == 0
    ignore[:, 1:] |= mask[:, :-1] == 0
    labels = ids.masked_fill(ignore, -100)
    names = [n for n, _ in ours.named_parameters()]
    grads = []
    for model in (eager, ours):
        loss = model(ids, attention_mask=mask, labels=labels).loss
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    for name, w, g in zip(names, *grads):
        assert compare(f"d{name}", w, g, tol=FP32_GRAD, verbose=False).ok, name


def test_refusals_name_the_feature(pair, device, gen):
    from triforge.nn import hf_attention_forward

    q = torch.randn(1, 2, 5, 64, generator=gen).to(device)
    kv = torch.randn(1, 1, 5, 64, generator=gen).to(device)
    module = torch.nn.Module()
    for kwargs, what in (({"dropout": 0.1}, "dropout"), ({"softcap": 30.0}, "softcap"),
                         ({"s_aux": torch.zeros(2)}, "s_aux")):
        with pytest.raises(NotImplementedError, match=what):
            hf_attention_forward(module, q, kv, kv, None, **kwargs)
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k"):
        hf_attention_forward(module, q, kv, kv, None, cu_seq_lens_q=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="flash-attention mask"):
        hf_attention_forward(module, q, kv, kv, torch.ones(1, 1, 5, 5, dtype=torch.bool, device=device))
    # the kernels' own checks still apply: an unsupported head dim is refused by name
    with pytest.raises(ValueError, match="head_dim|D "):
        hf_attention_forward(module, q[..., :48], kv[..., :48], kv[..., :48], None)


def test_encoder_decoder_cross_attention_matches_eager(device, gen):
    """BART: the decoder's cross-attention keys are the encoder's tokens (a bidirectional mask, or none): every
    decoder query is kept and the keys are not cut to the decoder's length; logits with and without encoder
    padding, and cached greedy generation, equal eager's."""
    register_hf_attention()
    cfg = transformers.BartConfig(vocab_size=97, d_model=128, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=96,
                                  decoder_ffn_dim=96, dropout=0.0, attention_dropout=0.0, max_position_embeddings=64)
    eager = random_eager(transformers.BartForConditionalGeneration, cfg, device, gen)
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation("triforge")
    enc = torch.randint(3, 97, (2, 12), generator=gen).to(device)
    emask = torch.ones_like(enc)
    emask[1, 9:] = 0
    for dec_len in (5, 16):
        dec = torch.randint(3, 97, (2, dec_len), generator=gen).to(device)
        for kwargs in ({}, {"attention_mask": emask}):
            with torch.no_grad():
                want = eager(input_ids=enc, decoder_input_ids=dec, **kwargs).logits
                got = ours(input_ids=enc, decoder_input_ids=dec, **kwargs).logits
            assert compare(f"bart logits dec {dec_len} {list(kwargs)}", want, got, tol=FP32).ok
    g_want = eager.generate(enc, attention_mask=emask, max_new_tokens=4, do_sample=False, num_beams=1)
    g_got = ours.generate(enc, attention_mask=emask, max_new_tokens=4, do_sample=False, num_beams=1)
    assert torch.equal(g_want, g_got)


def test_registration_names_what_an_old_transformers_lacks(monkeypatch):
    import sys
    import types

    old = types.ModuleType("transformers")  # a transformers from before the attention interfaces
    old.__version__ = "4.45.0"
    monkeypatch.setitem(sys.modules, "transformers", old)
    with pytest.raises(ImportError, match=r"AttentionMaskInterface \(4.53 or later\); found 4.45.0"):
        register_hf_attention()
