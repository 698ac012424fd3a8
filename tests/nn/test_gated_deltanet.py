"""triforge.nn.GatedDeltaNet against Hugging Face's Qwen3NextGatedDeltaNet (its PyTorch path).

Prefill, cached decode, gradients, input validation, and the drop-in into a whole Qwen3Next model.
"""

import contextlib
import copy

import pytest
import torch

from triforge import _runtime
from triforge.launch import poisoned
from triforge.nn import GatedDeltaNet
from triforge.nn.deltanet import GatedDeltaNetCache, HFGatedDeltaNet, RMSNormGated, patch_hf_gated_deltanet
from triforge.ops.deltanet.reference import STORE_C, stored_error_scales
from triforge.testing import Tolerance, compare

from .hf_models import assert_cached_decoding_matches, use_hf_torch_gated_delta

transformers = pytest.importorskip("transformers")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
from transformers import Qwen3NextConfig  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

BACKENDS = ["torch", "triton"]
# HF's chunked torch path against a token-by-token or Triton recurrence: fp32 rounding of different orders
FP32 = Tolerance(rel_rms=2e-5, atol=5e-5, rtol=5e-5)
# weight gradients sum over B * T tokens
FP32_GRAD = Tolerance(rel_rms=5e-5, atol=2e-4, rtol=2e-4)
# Triton's CPU interpreter rounds fp32 -> bf16 by truncation: up to one ulp from round-to-nearest
BF16_INTERPRETER = Tolerance(rel_rms=2e-2, atol=1e-1, rtol=1e-1)
# a bf16 layer against the fp32 one: bf16 rounding of every projection and of the state's inputs;
# two bf16 layers (HF's upcasts the recurrence to fp32, the kernels feed bf16 to their dots) differ by
# about the sum of their errors
BF16_VS_FP32 = Tolerance(rel_rms=3e-2, atol=2e-1, rtol=2e-1)
# the same judged per element by bf16_error_scale: the default bound halved, plus STORE_C x the change bf16
# rounding makes to the element (seed sweep, 80 x 2 backends: worst element 0.58 of this bound for ours
# and for HF's bf16 run; under BF16_VS_FP32 alone 0.65-0.96, one run in ~50 over)
BF16_DITHERED = Tolerance(rel_rms=3e-2, atol=1e-1, rtol=1e-1)
BF16_U = 2.0 ** -8  # round to nearest in bf16 moves a value by at most this relative amount


@pytest.fixture(autouse=True)
def hf_torch_path(monkeypatch):
    """Hugging Face's layer on its plain PyTorch functions, even where fla / causal-conv1d are installed."""
    use_hf_torch_gated_delta(monkeypatch, qwen3_next)


def _config(layer_types=("linear_attention",)) -> Qwen3NextConfig:
    return Qwen3NextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=len(layer_types),
        layer_types=list(layer_types), num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=0,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
    )


def _randomize(layer, gen: torch.Generator) -> None:
    """Fresh random weights everywhere; decays moderate so the state carries across chunks."""
    with torch.no_grad():
        for p in (layer.in_proj_qkvz.weight, layer.in_proj_ba.weight, layer.out_proj.weight):
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
        layer.conv1d.weight.copy_(torch.randn(layer.conv1d.weight.shape, generator=gen) * 0.5)
        nv = layer.A_log.shape[0]
        layer.A_log.copy_(torch.empty(nv).uniform_(0.02, 0.5, generator=gen).log())
        layer.dt_bias.copy_(0.5 * torch.randn(nv, generator=gen))
        layer.norm.weight.copy_(1 + 0.2 * torch.randn(layer.norm.weight.shape, generator=gen))


@contextlib.contextmanager
def _bf16_dither(layer, gen):
    """Run the fp32 ``layer`` with each point a bf16 run rounds scaled by (1 + u 2^-8), u uniform in [-1, 1]
    per element: the input, both projections, the conv output, the recurrence's q, k, v and output (chunked
    and token by token), the gated norm's output."""
    def d(t):
        u = torch.rand(t.shape, generator=gen, dtype=torch.float64) * 2 - 1
        return t * (1 + BF16_U * u).to(t.device, t.dtype)

    hooks = [layer.register_forward_pre_hook(lambda m, args: (d(args[0]), *args[1:]))]
    hooks += [mod.register_forward_hook(lambda m, args, out: d(out))
              for mod in (layer.in_proj_qkvz, layer.in_proj_ba, layer.norm)]
    saved = {n: getattr(qwen3_next, n) for n in ("causal_conv1d_fn", "causal_conv1d_update",
                                                 "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")}

    def conv(fn):
        return lambda *args, **kw: d(fn(*args, **kw))

    def rule(fn):
        def run(query, key, value, **kw):
            o, state = fn(d(query), d(key), d(value), **kw)
            return d(o), state
        return run

    for n, fn in saved.items():
        setattr(qwen3_next, n, conv(fn) if n.startswith("causal") else rule(fn))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for n, fn in saved.items():
            setattr(qwen3_next, n, fn)


def bf16_error_scale(run, layer, exact, gen, draws=3):
    """Per-element error scale of a bf16 run of ``run(layer)`` (``compare``'s ``scale``), from the fp32 layer:
    rms(exact) + (STORE_C / atol) x the largest change over ``draws`` dithered runs (_bf16_dither), by the
    kernels' own stored_error_scales. Where an output cancels or a head's norm input is small against its terms (the gated RMSNorm divides by it), bf16
    rounding moves the element by far more than its own size: HF's bf16 run and ours both miss the default
    bound there now and then (the same elements); the change is of that size, so the bound follows it."""
    def dithered():  # each run's hooks and patches are gone before its output is handed on
        for _ in range(draws):
            with torch.no_grad(), _bf16_dither(layer, gen):
                y = run(layer).double()
            yield {"y": y}

    return stored_error_scales({"y": exact.double()}, dithered(), BF16_DITHERED.atol, STORE_C)["y"]


def _rel(ref, got):
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def _assert_bf16_like_hf(name, exact, want, got, scale):
    """ours (got) and HF's bf16 run (want) against the fp32 layer (exact) under bf16_error_scale; HF's run
    passing checks the model itself. ours is about as accurate as HF's run overall, and the bound is no
    blanket: an error of 2x the bound at the best-conditioned element fails."""
    assert compare(f"{name}: ours vs HF bf16", want, got, tol=BF16_DITHERED, scale=scale).ok
    assert compare(f"{name}: HF bf16 vs fp32", exact, want, tol=BF16_DITHERED, scale=scale).ok
    assert compare(f"{name}: ours vs fp32", exact, got, tol=BF16_DITHERED, scale=scale).ok
    assert _rel(exact, got) <= 1.5 * _rel(exact, want) + 1e-3
    bound = BF16_DITHERED.atol * scale + BF16_DITHERED.rtol * exact.double().abs()
    i = int(scale.argmin())
    planted = got.clone().flatten()
    planted[i] = exact.flatten()[i] + 2 * bound.flatten()[i].to(exact.dtype)
    assert not compare(f"{name}: planted error", exact, planted.view_as(got), tol=BF16_DITHERED, scale=scale,
                       verbose=False).ok


def _pair(backend, device, dtype, gen):
    """(HF layer, our layer) with the same random weights, ours loaded from HF's state_dict."""
    cfg = _config()
    hf = qwen3_next.Qwen3NextGatedDeltaNet(cfg, layer_idx=0)
    _randomize(hf, gen)
    hf = hf.to(device=device, dtype=dtype)
    ours = GatedDeltaNet.from_config(cfg, backend=backend, device=device, dtype=dtype)
    ours.load_state_dict(hf.state_dict())
    return cfg, hf, ours


def _x(B, T, device, dtype, gen):
    return torch.randn(B, T, 64, generator=gen).to(device=device, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_gated_matches_hf(backend, dtype, device, gen):
    hf = qwen3_next.Qwen3NextRMSNormGated(32, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.2 * torch.randn(32, generator=gen))
    hf = hf.to(device=device, dtype=dtype)
    ours = RMSNormGated(32, eps=1e-6, backend=backend, device=device, dtype=dtype)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 7, 4, 32, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    z = torch.randn(2, 7, 4, 32, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    tol = BF16_INTERPRETER if backend == "triton" and dtype == torch.bfloat16 and _runtime.INTERPRET else None
    got, want = ours(x, z), hf(x, z)
    assert got.dtype == dtype and compare(f"gated norm {backend}", want, got, dtype=dtype, tol=tol).ok
    dy = torch.randn_like(got)
    grads = torch.autograd.grad(got, [x, z, ours.weight], dy)
    hf_grads = torch.autograd.grad(want, [x, z, hf.weight], dy)
    for name, w, g in zip(["dx", "dz", "dweight"], hf_grads, grads):
        assert compare(f"gated norm {name} {backend}", w, g, dtype=dtype, tol=tol).ok


def test_state_dict_is_hf_state_dict(gen):
    cfg = _config()
    hf = qwen3_next.Qwen3NextGatedDeltaNet(cfg, layer_idx=0)
    ours = GatedDeltaNet.from_config(cfg, backend="torch")
    want = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == want
    _randomize(ours, gen)
    hf.load_state_dict(ours.state_dict())  # and the other way round
    assert all(torch.equal(hf.state_dict()[k], v) for k, v in ours.state_dict().items())
    shared = GatedDeltaNet.from_hf(hf, backend="torch")
    assert dict(shared.named_parameters()).keys() == dict(hf.named_parameters()).keys()
    assert all(p is dict(hf.named_parameters())[n] for n, p in shared.named_parameters())
    assert "num_v_heads=4" in repr(shared) and shared.norm.variance_epsilon == hf.norm.variance_epsilon


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [1, 37, 77])
def test_prefill_matches_hf_fp32(backend, T, device, gen):
    _, hf, ours = _pair(backend, device, torch.float32, gen)
    x = _x(2, T, device, torch.float32, gen)
    with torch.no_grad(), poisoned():  # kernel outputs start as NaN
        want = hf(x)
        got, cache = ours(x)
    assert cache is None
    assert compare(f"prefill T={T} {backend}", want, got, tol=FP32).ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_matches_hf_bf16(backend, device, gen):
    _, hf, ours = _pair(backend, device, torch.float32, gen)
    x = _x(2, 70, device, torch.float32, gen)
    with torch.no_grad():
        exact = hf(x)
        scale = bf16_error_scale(lambda layer: layer(x), hf, exact, gen)
        hf_bf16, ours_bf16 = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
        want = hf_bf16(x.bfloat16())
        got, _ = ours_bf16(x.bfloat16())
    assert got.dtype == torch.bfloat16
    _assert_bf16_like_hf("bf16 prefill", exact, want, got, scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_matches_hf_cache_and_full_prefill(backend, device, gen):
    cfg, hf, ours = _pair(backend, device, torch.float32, gen)
    P, steps, chunk = 66, 3, 5  # prefill past one chunk, single tokens, then a multi-token continuation
    x = _x(2, P + steps + chunk, device, torch.float32, gen)
    hf_cache = DynamicCache(config=cfg)
    with torch.no_grad(), poisoned():
        full, _ = ours(x)
        # the cache goes positionally: Hugging Face names it cache_params before 5.24, cache from 5.24
        want = [hf(x[:, :P], hf_cache)]
        got0, cache = ours(x[:, :P], use_cache=True)
        got = [got0]
        assert cache.conv_state.shape == (2, ours.conv_dim, 3) and cache.conv_state.dtype == torch.float32
        assert cache.recurrent_state.shape == (2, 4, 32, 32) and cache.recurrent_state.dtype == torch.float32
        for t in range(P, P + steps):
            want.append(hf(x[:, t:t + 1], hf_cache))
            before = cache.recurrent_state.clone()
            out, new = ours(x[:, t:t + 1], cache=cache)
            assert torch.equal(cache.recurrent_state, before)  # the given cache is not modified
            cache = new
            got.append(out)
        want.append(hf(x[:, P + steps:], hf_cache))
        out, cache = ours(x[:, P + steps:], cache=cache)
        got.append(out)
    want, got = torch.cat(want, 1), torch.cat(got, 1)
    assert compare(f"decode vs HF cached {backend}", want, got, tol=FP32).ok
    assert compare(f"decode vs full prefill {backend}", full, got, tol=FP32).ok
    with torch.no_grad():
        _, whole = ours(x, use_cache=True)
    assert compare("final recurrent state", whole.recurrent_state, cache.recurrent_state, tol=FP32).ok
    # the conv state holds projections: token-by-token matmuls round differently on a GPU
    assert compare("final conv state", whole.conv_state, cache.conv_state, tol=FP32).ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_bf16_matches_prefill(backend, device, gen):
    _, _, ours = _pair(backend, device, torch.bfloat16, gen)
    x = _x(2, 24, device, torch.bfloat16, gen)
    with torch.no_grad():
        full, _ = ours(x)
        out, cache = ours(x[:, :20], use_cache=True)
        got = [out]
        for t in range(20, 24):
            out, cache = ours(x[:, t:t + 1], cache=cache)
            got.append(out)
    assert cache.conv_state.dtype == torch.bfloat16 and cache.recurrent_state.dtype == torch.float32
    assert compare(f"bf16 decode vs prefill {backend}", full, torch.cat(got, 1), tol=BF16_VS_FP32).ok


def test_triton_backend_calls_the_kernels(monkeypatch, device, gen):
    import triforge.ops.deltanet as ops

    calls = []
    for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
        def spy(*args, _fn=getattr(ops, name), _name=name, **kwargs):
            calls.append(_name)
            return _fn(*args, **kwargs)
        monkeypatch.setattr(ops, name, spy)
    _, _, ours = _pair("triton", device, torch.float32, gen)
    x = _x(2, 6, device, torch.float32, gen)
    with torch.no_grad():
        _, cache = ours(x[:, :5], use_cache=True)
        ours(x[:, 5:], cache=cache)
    ours(x[:, 5:], cache=cache)[0].sum().backward()  # one token needing gradients: the chunked op
    assert calls == ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_gated_delta_rule"]
    assert ours.in_proj_qkvz.weight.grad is not None


def test_empty_cache_is_no_cache(device, gen):
    _, _, ours = _pair("torch", device, torch.float32, gen)
    x = _x(2, 9, device, torch.float32, gen)
    with torch.no_grad():
        a, ca = ours(x, use_cache=True)
        b, cb = ours(x, cache=ours.empty_cache(2))
    assert torch.equal(a, b) and torch.equal(ca.conv_state, cb.conv_state)
    assert torch.equal(ca.recurrent_state, cb.recurrent_state)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [1, 70])
def test_gradients_match_hf(backend, T, device, gen):
    _, hf, ours = _pair(backend, device, torch.float32, gen)
    x = _x(2, T, device, torch.float32, gen).requires_grad_()
    dy = torch.randn(2, T, 64, generator=gen).to(device)
    names = [n for n, _ in ours.named_parameters()]
    got = torch.autograd.grad(ours(x)[0], [x, *ours.parameters()], dy)
    hf_params = dict(hf.named_parameters())
    want = torch.autograd.grad(hf(x), [x, *(hf_params[n] for n in names)], dy)
    for name, w, g in zip(["x", *names], want, got):
        assert compare(f"d{name} {backend}", w, g, tol=FP32_GRAD).ok


def test_attention_mask_matches_hf(device, gen):
    _, hf, ours = _pair("torch", device, torch.float32, gen)
    x = _x(2, 12, device, torch.float32, gen)
    mask = torch.ones(2, 12, dtype=torch.long, device=device)
    mask[0, :4] = 0  # left padding
    with torch.no_grad():
        want = hf(x, attention_mask=mask)
        got, _ = ours(x, attention_mask=mask)
    assert compare("left-padded prefill", want, got, tol=FP32).ok


PACKED_LENGTHS = (5, 1, 0, 70, 2)  # a one-token sequence, an empty one, one past a chunk, two shorter than W - 1


def _packed(lengths, device):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_sequences_equal_separate_calls(backend, device, gen):
    """cu_seqlens: each packed sequence's convolution starts from zeros and its delta rule from a zero
    state, so the output and every gradient equal those of one call per sequence (the convolution of a
    sequence shorter than W - 1, a one-token sequence and an empty one included). The check would fail
    if the conv or the state leaked: a leak moves a sequence's first tokens by O(1)."""
    _, _, ours = _pair(backend, device, torch.float32, gen)
    T = sum(PACKED_LENGTHS)
    x = _x(1, T, device, torch.float32, gen).requires_grad_()
    dy = torch.randn(1, T, 64, generator=gen).to(device)
    params = list(ours.parameters())
    with poisoned():
        y, cache = ours(x, cu_seqlens=_packed(PACKED_LENGTHS, device))
        got = torch.autograd.grad(y, [x, *params], dy)
    assert cache is None
    ys, xs, grads, start = [], [], None, 0
    for n in PACKED_LENGTHS:
        if n:
            xi = x.detach()[:, start : start + n].clone().requires_grad_()
            yi = ours(xi)[0]
            gi = torch.autograd.grad(yi, [xi, *params], dy[:, start : start + n])
            ys.append(yi.detach())
            xs.append(gi[0])
            grads = list(gi[1:]) if grads is None else [a + b for a, b in zip(grads, gi[1:])]
        start += n
    assert compare(f"packed y {backend}", torch.cat(ys, 1), y, tol=FP32).ok
    names = [n for n, _ in ours.named_parameters()]
    for name, want, g in zip(["x", *names], [torch.cat(xs, 1), *grads], got):
        assert compare(f"packed d{name} {backend}", want, g, tol=FP32_GRAD).ok
    # the same tokens unpacked (one sequence) differ: the check can tell a leak from a reset
    with torch.no_grad():
        leaked = ours(x.detach())[0]
    assert not compare("unpacked", torch.cat(ys, 1), leaked, tol=FP32, verbose=False).ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_caches_hold_one_row_per_sequence(backend, device, gen):
    """A packed prefill with use_cache returns one cache row per sequence, equal to each sequence's own
    cache (an empty sequence's row stays zero); from it, one decode step of all sequences as a batch and
    a second packed call continue each sequence as separate calls do."""
    _, _, ours = _pair(backend, device, torch.float32, gen)
    first, second = (5, 0, 2, 70), (3, 4, 1, 0)
    x1 = _x(1, sum(first), device, torch.float32, gen)
    x2 = _x(1, sum(second), device, torch.float32, gen)
    step = _x(len(first), 1, device, torch.float32, gen)
    cu1, cu2 = _packed(first, device), _packed(second, device)
    with torch.no_grad(), poisoned():
        _, packed_cache = ours(x1, cu_seqlens=cu1, use_cache=True)
        y2, cache2 = ours(x2, cu_seqlens=cu2, cache=packed_cache)
        y_step, _ = ours(step, cache=packed_cache)
        rows, y2_want, y_step_want = [], [], []
        for i, (n1, n2) in enumerate(zip(first, second)):
            a, b = int(cu1[i]), int(cu2[i])
            if n1:
                _, c = ours(x1[:, a : a + n1], use_cache=True)
            else:  # no tokens yet: the zero state
                c = GatedDeltaNetCache(packed_cache.conv_state[i : i + 1] * 0, packed_cache.recurrent_state[i : i + 1] * 0)
            rows.append(c)
            if n2:
                y2_want.append(ours(x2[:, b : b + n2], cache=c)[0])
            y_step_want.append(ours(step[i : i + 1], cache=c)[0])
    for name in ("conv_state", "recurrent_state"):
        want = torch.cat([getattr(c, name) for c in rows])
        assert compare(f"packed cache {name}", want, getattr(packed_cache, name), tol=FP32).ok
    assert (packed_cache.conv_state[1] == 0).all() and (packed_cache.recurrent_state[1] == 0).all()
    assert cache2.conv_state.shape[0] == cache2.recurrent_state.shape[0] == len(second)
    assert compare("packed continuation", torch.cat(y2_want, 1), y2, tol=FP32).ok
    assert compare("batched step from a packed cache", torch.cat(y_step_want), y_step, tol=FP32).ok


def test_packed_layer_under_torch_compile_fullgraph(device, gen):
    """The packed path traces whole (no host read of cu_seqlens while compiling: the chunked op checks
    the offsets itself) and gives eager's output and input gradient (~25 s, most of it compiling)."""
    _, _, ours = _pair("triton", device, torch.float32, gen)
    x = _x(1, 30, device, torch.float32, gen).requires_grad_()
    cu = _packed((9, 1, 20), device)
    dy = torch.randn(1, 30, 64, generator=gen).to(device)
    compiled = torch.compile(lambda x, cu: ours(x, cu_seqlens=cu)[0], fullgraph=True)
    y = compiled(x, cu)
    (dx,) = torch.autograd.grad(y, x, dy)
    y0 = ours(x, cu_seqlens=cu)[0]
    (dx0,) = torch.autograd.grad(y0, x, dy)
    assert compare("compiled packed y", y0, y, tol=FP32).ok
    assert compare("compiled packed dx", dx0, dx, tol=FP32_GRAD).ok


def test_patched_layer_takes_packed_sequences_from_hf_kwargs(device, gen):
    """Hugging Face's packed-sequence keyword (cu_seq_lens_q, as DataCollatorWithFlattening passes it):
    the patched layer runs each sequence on its own; with a cache it refuses by name."""
    cfg, hf, _ = _pair("triton", device, torch.float32, gen)
    layer = HFGatedDeltaNet.from_hf(hf)
    lengths = (9, 3, 20)
    x = _x(1, sum(lengths), device, torch.float32, gen)
    cu = _packed(lengths, device)
    with torch.no_grad():
        got = layer(x, attention_mask=None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=20, max_length_k=20)
        want = torch.cat([layer(x[:, int(a) : int(b)]) for a, b in zip(cu[:-1], cu[1:])], 1)
    assert compare("HF packed", want, got, tol=FP32).ok
    # Hugging Face's models make an empty cache whenever use_cache is on (the default, in training too): the
    # packed call runs and writes nothing, and the cache then refuses to be continued from
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        assert compare("HF packed, empty cache", want, layer(x, cache=cache, cu_seq_lens_q=cu), tol=FP32).ok
    assert not cache.has_previous_state(layer.layer_idx)
    with pytest.raises(NotImplementedError, match="went through a packed call"):
        layer(x[:, :1], cache=cache)
    used = DynamicCache(config=cfg)
    with torch.no_grad():
        layer(x[:, :5], cache=used)
    with pytest.raises(NotImplementedError, match="after earlier tokens in the cache"):
        layer(x, cache=used, cu_seq_lens_q=cu)


def test_packed_bad_inputs_name_the_argument(device, gen):
    _, _, ours = _pair("torch", device, torch.float32, gen)
    x = _x(1, 8, device, torch.float32, gen)
    cu = _packed((3, 5), device)
    with pytest.raises(ValueError, match="batch size must be 1"):
        ours(_x(2, 8, device, torch.float32, gen), cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D int32 or int64"):
        ours(x, cu_seqlens=cu.float())
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D"):
        ours(x, cu_seqlens=cu[:1])
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        ours(x, cu_seqlens=[0, 3, 8])
    with pytest.raises(ValueError, match="must end at the packed length T = 8"):
        ours(x, cu_seqlens=_packed((3, 4), device))
    with pytest.raises(ValueError, match="non-decreasing"):
        ours(x, cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="cannot be combined with attention_mask"):
        ours(x, cu_seqlens=cu, attention_mask=torch.ones(1, 8, device=device))
    _, cache = ours(_x(3, 4, device, torch.float32, gen), use_cache=True)  # 3 rows for 2 sequences
    with pytest.raises(ValueError, match=r"cache.conv_state must have shape .* for 2 packed sequences"):
        ours(x, cu_seqlens=cu, cache=cache)


def test_bad_inputs_name_the_argument(device, gen):
    _, _, ours = _pair("torch", device, torch.float32, gen)
    x = _x(2, 5, device, torch.float32, gen)
    with pytest.raises(ValueError, match="hidden_states.*hidden_size=64"):
        ours(torch.randn(2, 5, 48, device=device))
    with pytest.raises(ValueError, match="hidden_states"):
        ours(x[0])
    with pytest.raises(ValueError, match="hidden_states must not be empty"):
        ours(x[:, :0])
    with pytest.raises(TypeError, match="hidden_states.*dtype"):
        ours(x.bfloat16())
    with pytest.raises(TypeError, match="hidden_states must be a torch.Tensor"):
        ours(x.tolist())
    with pytest.raises(TypeError, match="use_cache"):
        ours(x, use_cache=1)
    with pytest.raises(ValueError, match="attention_mask"):
        ours(x, attention_mask=torch.ones(2, 4, device=device))
    _, cache = ours(x, use_cache=True)
    with pytest.raises(TypeError, match="cache must be a GatedDeltaNetCache"):
        ours(x, cache=tuple(cache))
    with pytest.raises(ValueError, match="cache.conv_state.*batch 1"):
        ours(x[:1], cache=cache)
    with pytest.raises(TypeError, match="cache.recurrent_state.*dtype"):
        ours(x, cache=GatedDeltaNetCache(cache.conv_state, cache.recurrent_state.double()))
    with pytest.raises(ValueError, match="cache.conv_state.*shape"):
        ours(x, cache=GatedDeltaNetCache(cache.conv_state[..., 1:], cache.recurrent_state))
    with pytest.raises(ValueError, match="backend"):
        GatedDeltaNet(64, 2, 4, 32, 32, backend="cuda")
    with pytest.raises(ValueError, match="num_v_heads"):
        GatedDeltaNet(64, 2, 3, 32, 32)
    with pytest.raises(ValueError, match="head_k_dim"):
        GatedDeltaNet(64, 2, 4, 0, 32)
    # the kernels' head dims at construction (the torch backend takes any)
    with pytest.raises(ValueError, match="head_k_dim must be one of"):
        GatedDeltaNet(64, 2, 4, 48, 32)
    with pytest.raises(ValueError, match="head_v_dim must be one of"):
        GatedDeltaNet(64, 2, 4, 32, 24)
    assert GatedDeltaNet(64, 2, 4, 48, 24, backend="torch").head_k_dim == 48
    with pytest.raises(TypeError, match="module"):
        GatedDeltaNet.from_hf(torch.nn.Linear(4, 4))


def _tiny_model(gen):
    cfg = _config(("linear_attention", "full_attention", "linear_attention"))
    model = transformers.Qwen3NextForCausalLM(cfg).eval()
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            _randomize(layer.linear_attn, gen)
    return model


@pytest.mark.parametrize("backend", BACKENDS)
def test_patch_hf_model_keeps_logits_and_generation(backend, device, gen):
    model = _tiny_model(gen).to(device)
    patched = copy.deepcopy(model)
    assert patch_hf_gated_deltanet(patched, backend=backend) == 2
    assert sum(isinstance(m, HFGatedDeltaNet) for m in patched.modules()) == 2
    assert [m.layer_idx for m in patched.modules() if isinstance(m, HFGatedDeltaNet)] == [0, 2]
    ids = torch.randint(0, 97, (2, 11), generator=gen).to(device)
    assert_cached_decoding_matches(model, patched, ids, FP32, steps=3)
    with torch.no_grad():
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        assert compare("padded logits", model(ids, attention_mask=mask).logits,
                       patched(ids, attention_mask=mask).logits, tol=FP32).ok


def test_patched_model_packed_forward_equals_separate_sequences(device, gen):
    """A whole hybrid Qwen3-Next (a linear- and a full-attention layer; the latter on triforge's attention, the
    Hugging Face attention implementation that honours packing) fed packed sequences with their position ids
    and cu_seq_lens_q, as Hugging Face's flattening collator does, use_cache at its default (an empty cache
    reaches the layers, in training too): its logits equal one call per sequence, and a training step's loss
    runs. Hugging Face's own PyTorch path ignores cu_seq_lens_q (convolution and state carry across
    sequences), so it is no reference here."""
    from triforge.nn import register_hf_attention

    register_hf_attention()
    cfg = _config(("linear_attention", "full_attention"))
    model = transformers.Qwen3NextForCausalLM(cfg).eval()
    _randomize(model.model.layers[0].linear_attn, gen)
    model = model.to(device)
    model.set_attn_implementation("triforge")
    assert patch_hf_gated_deltanet(model) == 1
    lengths = (7, 2, 30)
    ids = torch.randint(0, 97, (1, sum(lengths)), generator=gen).to(device)
    cu = _packed(lengths, device)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    packed = {"position_ids": pos, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths),
              "max_length_k": max(lengths)}
    with torch.no_grad():
        got = model(ids, **packed).logits
        want = torch.cat([model(ids[:, int(a) : int(b)]).logits for a, b in zip(cu[:-1], cu[1:])], 1)
    assert compare("packed model logits", want, got, tol=FP32).ok
    model.train()
    loss = model(ids, labels=ids, **packed).loss
    loss.backward()
    assert loss.isfinite() and model.model.layers[0].linear_attn.in_proj_qkvz.weight.grad.isfinite().all()


@pytest.mark.gpu
@pytest.mark.big
def test_real_size_layer_bf16_matches_hf(gen):
    """Qwen3-Next-80B-A3B's layer dimensions, a 1000-token prefill and a few decode steps, on the GPU."""
    cfg = Qwen3NextConfig(hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32,
                          linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                          num_hidden_layers=1, layer_types=["linear_attention"], num_experts=0)
    hf = qwen3_next.Qwen3NextGatedDeltaNet(cfg, layer_idx=0)
    _randomize(hf, gen)
    hf = hf.cuda()
    ours = GatedDeltaNet.from_config(cfg, backend="triton", device="cuda", dtype=torch.bfloat16)
    ours.load_state_dict(hf.state_dict())
    P, steps = 1000, 4
    x = torch.randn(2, P + steps, 2048, generator=gen).cuda()

    def prefill_and_decode(layer, dtype=torch.float32):
        cache = DynamicCache(config=cfg)
        out = [layer(x[:, :P].to(dtype), cache)]
        out += [layer(x[:, t:t + 1].to(dtype), cache) for t in range(P, P + steps)]
        return torch.cat(out, 1)

    with torch.no_grad():
        exact = prefill_and_decode(hf)
        scale = bf16_error_scale(prefill_and_decode, hf, exact, gen)
        want = prefill_and_decode(hf.to(torch.bfloat16), torch.bfloat16)
        out, cache = ours(x[:, :P].bfloat16(), use_cache=True)
        got = [out]
        for t in range(P, P + steps):
            out, cache = ours(x[:, t:t + 1].bfloat16(), cache=cache)
            got.append(out)
    _assert_bf16_like_hf("real size", exact, want, torch.cat(got, 1), scale)


@pytest.mark.parametrize("keyword", ["cache", "cache_params"])
def test_patched_layer_reads_hf_cache_under_either_name(keyword, device, gen):
    """transformers 5.24 renamed the layer's ``cache_params`` to ``cache`` (its decoder layer passes ``cache=``;
    the patched layer once took only the old name, ignored the cache and decoded from an empty state): both names
    are read. HF's own layer, prefill then single tokens then a chunk on its cache, is the reference."""
    cfg, hf, _ = _pair("torch", device, torch.float32, gen)
    ours = HFGatedDeltaNet.from_hf(hf, backend="torch")
    P, steps, chunk = 9, 3, 4
    x = _x(2, P + steps + chunk, device, torch.float32, gen)
    parts = [x[:, :P], *(x[:, t:t + 1] for t in range(P, P + steps)), x[:, P + steps:]]
    hf_cache, our_cache = DynamicCache(config=cfg), DynamicCache(config=cfg)
    with torch.no_grad(), poisoned():
        want = torch.cat([hf(p, hf_cache) for p in parts], 1)
        got = torch.cat([ours(p, **{keyword: our_cache}) for p in parts], 1)
        uncached = ours(x)
    assert compare(f"HF cache as {keyword}", want, got, tol=FP32).ok
    assert compare("cached vs whole sequence", uncached, got, tol=FP32).ok
    assert compare("recurrent state in HF's cache", hf_cache.layers[0].recurrent_states[0],
                   our_cache.layers[0].recurrent_states[0], tol=FP32).ok
    with pytest.raises(ValueError, match="`cache` or `cache_params`"):
        ours(x[:, :1], cache=our_cache, cache_params=DynamicCache(config=cfg))
