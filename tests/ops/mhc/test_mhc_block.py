"""``triforge.nn.MHCLiteBlock``: stacks of blocks around a tiny MLP and a tiny causal attention layer,
backend="triton" against backend="torch" and against a float64 run of the torch backend (outputs and
every parameter gradient), layer_has_residual, torch.compile, a few optimizer steps, bad input.

Losses put a random upstream gradient on the full streams [..., 4, C]. A loss on
``reduce_streams(out)`` would be blind to H_res: its columns sum to 1, so sum_i (H_res x)_i = sum_j x_j
and the true b_res / alpha_res gradients vanish (fp32 then compares rounding noise).

Modules are built on the CPU (seeded from the per-test generator) and moved to the kernels' device
(the ``device`` fixture); inputs are drawn on the CPU from the generator, then moved there too. The
float64 arbiter is a copy of the model on that same device.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import triforge  # noqa: F401  (sets TRITON_INTERPRET before triton kernels are defined)
from triforge.launch import poisoned
from triforge.nn import MHCLiteBlock, expand_streams, reduce_streams
from triforge.testing import TOLERANCES, compare

# C = 40 is not a multiple of the interpreter's 32-wide C blocks, and B * S = 18 tokens span two of
# the project kernel's 16-token blocks
C = 40
B, S = 2, 9


# ----------------------------------------------------------------------------- tiny layers


class TinyMLP(nn.Module):
    def __init__(self, c, residual=False):
        super().__init__()
        self.up = nn.Linear(c, 2 * c)
        self.down = nn.Linear(2 * c, c)
        self.residual = residual

    def forward(self, x):
        y = self.down(F.silu(self.up(x)))
        return x + y if self.residual else y


class TinyCausalAttention(nn.Module):
    def __init__(self, c, heads=2, residual=False):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(c, 3 * c)
        self.out = nn.Linear(c, c)
        self.residual = residual

    def forward(self, x):
        b, s, c = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.out(y.transpose(1, 2).reshape(b, s, c))
        return x + y if self.residual else y


class Stack(nn.Module):
    def __init__(self, c, n_blocks=3, backend="triton", layer_has_residual=False):
        super().__init__()
        layers = [TinyCausalAttention, TinyMLP, TinyCausalAttention][:n_blocks]
        self.blocks = nn.ModuleList(
            MHCLiteBlock(L(c, residual=layer_has_residual), c, backend=backend, layer_has_residual=layer_has_residual)
            for L in layers
        )

    def forward(self, streams):
        for blk in self.blocks:
            streams = blk(streams)
        return streams


class Tiny(nn.Module):
    """expand_streams -> blocks -> reduce_streams -> linear head."""

    def __init__(self, c, n_blocks=2, backend="triton"):
        super().__init__()
        self.stack = Stack(c, n_blocks, backend)
        self.head = nn.Linear(c, c)

    def forward(self, h):
        return self.head(reduce_streams(self.stack(expand_streams(h))))


def _set_backend(model, backend):
    for m in model.modules():
        if isinstance(m, MHCLiteBlock):
            m.backend = backend
    return model


def _randomize_mhc(model, gen):
    """Small random W (not the zero init: its gradient would be compared at a trivial point) and
    random alphas / biases, so every coefficient depends on the input and H_res mixes the streams."""
    with torch.no_grad():  # drawn on the CPU from gen, then moved to wherever the parameters live
        for m in model.modules():
            if isinstance(m, MHCLiteBlock):
                K = m.W.shape[1]
                m.W.copy_((torch.randn(m.W.shape, generator=gen) * 0.5 / K**0.5).to(m.W.device))
                for a in (m.alpha_pre, m.alpha_post, m.alpha_res):
                    a.fill_(float(0.5 + torch.rand((), generator=gen)))
                m.b_pre.add_((0.5 * torch.randn(m.b_pre.shape, generator=gen)).to(m.b_pre.device))
                m.b_post.add_((0.5 * torch.randn(m.b_post.shape, generator=gen)).to(m.b_post.device))
                m.b_res.copy_(torch.randn(m.b_res.shape, generator=gen).to(m.b_res.device))
    return model


def _seed_modules(gen):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))


def _x(shape, gen, dtype=torch.float32, device="cpu"):
    """Drawn on the CPU from ``gen``, then moved to ``device``."""
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


def _assert_ok(*results):
    for r in results:
        assert r.ok, r.line()


def _run(model, streams, g):
    """Output and {param name: grad} of the loss (out * g).sum()."""
    model.zero_grad(set_to_none=True)
    x = streams.detach().clone().requires_grad_(True)
    with poisoned():
        out = model(x)
        (out * g.to(out.dtype)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    grads["<input>"] = x.grad.detach().clone()
    return out.detach(), grads


_REDUCED = ("alpha_pre", "alpha_post", "alpha_res", "b_pre", "b_post", "b_res")


def _run_f64(model, streams, g, monkeypatch):
    """The arbiter: a float64 copy of ``model`` on the torch backend.

    Besides output and gradients it returns, for every alpha and bias (gradients that are sums over
    tokens), the float64 sum over tokens of |summand|, per element. Those sums cancel: d alpha_res =
    sum_{t,k} dlogit[t, k] proj[t, 2n + k] with sum_k dlogit = 0 and random upstream signs ends at
    ~1e-3 of its summands, so an fp32 result of either backend is off by well over 1e-5 of |d alpha|
    while accurate to ~1e-7 of the summands. Those parameters are checked on the summands' scale:
    the textbook error bound of a floating-point sum, with the dtype's own rtol."""
    import triforge.nn.mhc as nn_mhc

    per_term = []
    coefficients = nn_mhc.coefficients

    def spy(proj, alpha_pre, alpha_post, alpha_res, b_pre, b_post, b_res):
        T = proj.shape[0]
        spread = []
        for p, width in zip((alpha_pre, alpha_post, alpha_res, b_pre, b_post, b_res), (4, 4, 24, 4, 4, 24)):
            e = p.expand(T, width).clone()  # same values; its .grad holds every summand
            e.retain_grad()
            spread.append(e)
        per_term.append(spread)
        return coefficients(proj, *spread)

    m64 = _set_backend(copy.deepcopy(model), "torch").double()
    monkeypatch.setattr(nn_mhc, "coefficients", spy)
    out64, grads64 = _run(m64, streams.double(), g.double())
    monkeypatch.setattr(nn_mhc, "coefficients", coefficients)
    blocks = [n.removesuffix("W") for n, _ in m64.named_parameters() if n == "W" or n.endswith(".W")]
    assert len(blocks) == len(per_term)
    mags = {}
    for prefix, spread in zip(blocks, per_term):
        for name, e in zip(_REDUCED, spread):
            key = prefix + name
            summed = e.grad.sum(0) if name.startswith("b_") else e.grad.sum()
            torch.testing.assert_close(summed, grads64[key], rtol=1e-9, atol=1e-12)
            mags[key] = e.grad.abs().sum(0) if name.startswith("b_") else e.grad.abs().sum()
    return out64, grads64, mags


def _check_grads(label, grads64, mags, grads, dtype):
    """Every gradient: alphas and biases within rtol of their summands' magnitude (see _run_f64),
    and in fp32 the biases also pass compare with the summands as scale; all others pass compare at
    ``dtype``."""
    tol = TOLERANCES[dtype]
    assert set(grads) == set(grads64)
    for name in grads64:
        ref, got = grads64[name], grads[name]
        assert ref.abs().max() > 0, f"gradient of {name} is zero: it would be compared trivially"
        if name in mags:
            err = (got.double() - ref).abs()
            bound = tol.rtol * mags[name]
            assert (err <= bound).all(), (
                f"{label}.d{name}: got {got.tolist()}, float64 {ref.tolist()}, |err| {err.tolist()} > "
                f"{tol.rtol:.0e} * sum|summands| {mags[name].tolist()}"
            )
        if name not in mags:
            _assert_ok(compare(f"{label}.d{name}", ref, got, dtype=dtype, verbose=False))
        elif dtype == torch.float32 and name.rsplit(".", 1)[-1].startswith("b_"):
            # a bias gradient is a sum over tokens too: its rel_rms is taken against the summands' scale
            # where they exceed the value (compare's rule for sums that cancel); against |d b| alone an
            # fp32 sum that cancels on some draws measured 1.03e-5 (session 31), a rounding-level miss
            _assert_ok(compare(f"{label}.d{name}", ref, got, dtype=dtype, scale=mags[name], verbose=False))


def _check_against_f64(model32, streams, gen, monkeypatch):
    """Both fp32 backends against the float64 torch backend, output and every gradient."""
    g = _x(streams.shape, gen, device=streams.device)
    out64, grads64, mags = _run_f64(model32, streams, g, monkeypatch)
    results = {}
    for backend in ("triton", "torch"):
        m = _set_backend(copy.deepcopy(model32), backend)
        out, grads = _run(m, streams, g)
        assert out.dtype == torch.float32 and out.shape == streams.shape
        _assert_ok(compare(f"{backend}.out", out64, out, dtype=torch.float32, verbose=False))
        _check_grads(backend, grads64, mags, grads, torch.float32)
        results[backend] = (out, grads)
    return results, (out64, grads64)


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("n_blocks", [2, 3])
def test_stack_triton_matches_torch_and_float64(n_blocks, gen, monkeypatch, device):
    _seed_modules(gen)
    model = _randomize_mhc(Stack(C, n_blocks), gen).to(device)
    streams = _x((B, S, 4, C), gen, device=device)  # four different streams: H_res matters already in block 1
    results, (out64, grads64) = _check_against_f64(model, streams, gen, monkeypatch)
    names = set(grads64)
    for blk in range(n_blocks):
        for p in ("W", "b_pre", "b_post", "b_res", "alpha_pre", "alpha_post", "alpha_res"):
            assert f"blocks.{blk}.{p}" in names
    assert any(".layer." in n for n in names)
    # the two fp32 backends also agree with each other to fp32 rounding
    out_tr, out_to = results["triton"][0], results["torch"][0]
    _assert_ok(compare("triton_vs_torch", out_to.double(), out_tr, dtype=torch.float32, verbose=False))


def test_single_block_bf16_streams(gen, monkeypatch, device):
    """bf16 streams (the production dtype) with W, alphas and biases in fp32: both backends within
    bf16 tolerance of the float64 run, the output and every gradient. (Under the interpreter the
    kernels' fp32 -> bf16 casts truncate instead of rounding: a biased error that the bias/alpha sums
    over tokens accumulate, hence their check on the summands' scale, see _run_f64.)"""
    _seed_modules(gen)
    c = 48
    blk = _randomize_mhc(MHCLiteBlock(TinyMLP(c), c), gen).to(device)
    blk.layer.to(torch.bfloat16).float()  # layer weights on the bf16 grid: the float64 run uses the same ones
    streams = _x((B, S, 4, c), gen, torch.bfloat16, device=device)
    g = _x(streams.shape, gen, torch.bfloat16, device=device)
    out64, grads64, mags = _run_f64(blk, streams, g, monkeypatch)
    for backend in ("triton", "torch"):
        m = _set_backend(copy.deepcopy(blk), backend)
        m.layer.to(torch.bfloat16)  # the layer runs on the streams' dtype; the mHC parameters stay fp32
        out, grads = _run(m, streams, g)
        assert out.dtype == torch.bfloat16 and grads["W"].dtype == torch.float32
        _assert_ok(compare(f"{backend}.out", out64, out, dtype=torch.bfloat16, verbose=False))
        _check_grads(backend, grads64, mags, grads, torch.bfloat16)


def test_layer_has_residual(gen, monkeypatch, device):
    """A wrapped layer that adds its input back, with layer_has_residual=True (H_merged = H_res -
    h_post h_pre^T), gives the same streams and gradients as the plain layer: checked for both
    backends against the float64 torch run of the layer_has_residual=False model."""
    _seed_modules(gen)
    plain = _randomize_mhc(Stack(C, 3), gen).to(device)
    resid = Stack(C, 3, layer_has_residual=True).to(device)
    resid.load_state_dict(plain.state_dict())
    streams = _x((B, S, 4, C), gen, device=device)
    g = _x(streams.shape, gen, device=device)
    out64, grads64, mags = _run_f64(plain, streams, g, monkeypatch)
    for backend in ("triton", "torch"):
        m = _set_backend(copy.deepcopy(resid), backend)
        assert all(b.layer_has_residual and b.layer.residual for b in m.blocks)
        out, grads = _run(m, streams, g)
        _assert_ok(compare(f"{backend}.out", out64, out, dtype=torch.float32, verbose=False))
        _check_grads(backend, grads64, mags, grads, torch.float32)


def test_block_accepts_noncontiguous_and_3d_streams(gen, device):
    """Streams of any leading shape ([T, 4, C] or [B, S, 4, C]) and non-contiguous views."""
    _seed_modules(gen)
    blk = _randomize_mhc(MHCLiteBlock(TinyMLP(C), C), gen).to(device)
    ref = _set_backend(copy.deepcopy(blk), "torch").double()
    base = _x((4, C, 11), gen, device=device)
    streams = base.permute(2, 0, 1)  # [11, 4, C], not contiguous (a view of the tensor on the device)
    assert not streams.is_contiguous()
    with poisoned(), torch.no_grad():
        out = blk(streams)
        out64 = ref(streams.double())
    assert out.shape == streams.shape
    _assert_ok(compare("out", out64, out, dtype=torch.float32, verbose=False))


def test_block_initialised_as_mhc_lite():
    """The issue's initial values: W zero, pre and post biases [1, -1, -1, -1], residual bias -8 except 0 on the
    identity permutation (index 0 of permutation_matrices), every alpha 0.01."""
    from triforge.ops.mhc.reference import permutation_matrices

    blk = MHCLiteBlock(nn.Identity(), C)
    assert blk.W.shape == (32, 4 * C) and not blk.W.detach().any()  # 2n + n! rows
    for b in (blk.b_pre, blk.b_post):
        assert b.detach().tolist() == [1.0, -1.0, -1.0, -1.0]
    assert blk.b_res.shape == (24,) and blk.b_res[0].item() == 0.0 and (blk.b_res[1:] == -8.0).all()
    assert torch.equal(permutation_matrices(4)[0].to(torch.float64), torch.eye(4, dtype=torch.float64))
    for a in (blk.alpha_pre, blk.alpha_post, blk.alpha_res):
        assert a.shape == () and a.item() == pytest.approx(0.01)


def test_block_at_init_is_nearly_identity_mixing(gen, device):
    """Freshly built block (W = 0): H_res ~ I, so with a zero layer the streams pass through almost
    unchanged (each stream keeps > 99% of itself)."""

    class Zero(nn.Module):
        def forward(self, x):
            return torch.zeros_like(x)

    blk = MHCLiteBlock(Zero(), C).to(device)
    streams = _x((3, 4, C), gen, device=device)
    with poisoned(), torch.no_grad():
        out = blk(streams)
    diff = (out - streams).abs().max() / streams.abs().max()
    assert diff < 0.02, diff


# ----------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_stack_matches_eager(backend, gen, monkeypatch, device):
    """torch.compile(fullgraph=True) of a stack: aot_eager runs the same kernels and aten ops in the same order as
    eager (bit-identical); inductor, the default users get, keeps the custom ops as opaque calls and fuses the aten
    ops around them (their rounding differs), so it is held to the float64 model as the eager result is."""
    _seed_modules(gen)
    model = _randomize_mhc(Stack(C, 2), gen).to(device)  # attention + MLP
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    streams = _x((B, S, 4, C), gen, device=device)
    g = _x(streams.shape, gen, device=device)
    out_e, grads_e = _run(model, streams, g)
    out_c, grads_c = _run(compiled, streams, g)
    # the compiled model shares the eager model's parameters: names gain an _orig_mod. prefix
    grads_c = {n.removeprefix("_orig_mod."): v for n, v in grads_c.items()}
    assert set(grads_c) == set(grads_e)
    if backend == "aot_eager":
        torch.testing.assert_close(out_c, out_e, rtol=0, atol=0)
        for name in grads_e:
            torch.testing.assert_close(grads_c[name], grads_e[name], rtol=0, atol=0,
                                       msg=lambda m, name=name: f"d{name}: {m}")
    # and the compiled result is right, not merely equal to eager
    out64, grads64, mags = _run_f64(model, streams, g, monkeypatch)
    _assert_ok(compare("compiled.out", out64, out_c, dtype=torch.float32, verbose=False))
    _check_grads("compiled", grads64, mags, grads_c, torch.float32)
    assert any(".layer.qkv." in n for n in grads_c) and any(".layer.up." in n for n in grads_c)


# ----------------------------------------------------------------------------- training


def test_training_steps_track(gen, device):
    """Four Adam steps (lr 1e-2) of expand -> 2 blocks -> reduce -> head with an MSE loss, triton vs
    torch backend: the losses agree to < 1e-4 relative at every step (and the loss goes down). Adam
    is the harder case: it normalises every gradient, so a wrong small gradient moves its parameter
    by a full lr. (Through reduce_streams the loss does not see H_res, see the module docstring;
    the parity tests above cover its gradients.)"""
    _seed_modules(gen)
    c, s = 32, 7  # smaller than the parity tests: 2 backends x 4 steps through the interpreter
    base = _randomize_mhc(Tiny(c, n_blocks=2), gen).to(device)
    h = _x((B, s, c), gen, device=device)
    target = _x((B, s, c), gen, device=device)
    losses = {}
    for backend in ("triton", "torch"):
        model = _set_backend(copy.deepcopy(base), backend)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses[backend] = []
        for _ in range(4):
            optim.zero_grad()
            with poisoned():
                loss = F.mse_loss(model(h), target)
                loss.backward()
            optim.step()
            losses[backend].append(loss.item())
    for step, (lt, lr) in enumerate(zip(losses["triton"], losses["torch"])):
        assert abs(lt - lr) <= 1e-4 * abs(lr), f"step {step}: triton {lt} vs torch {lr} ({losses})"
    assert losses["triton"][-1] < losses["triton"][0], losses


def test_expand_and_reduce_streams(gen):
    h = _x((B, S, C), gen)
    s = expand_streams(h)
    assert s.shape == (B, S, 4, C) and s.is_contiguous()
    assert all(torch.equal(s[..., i, :], h) for i in range(4))
    s = _x((B, S, 4, C), gen)
    torch.testing.assert_close(reduce_streams(s), s[..., 0, :] + s[..., 1, :] + s[..., 2, :] + s[..., 3, :])


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs,exc,arg",
    [
        (dict(n_streams=3), ValueError, "n_streams"),
        (dict(n_streams=8), ValueError, "n_streams"),
        (dict(backend="cuda"), ValueError, "backend"),
        (dict(backend="Triton"), ValueError, "backend"),
        (dict(hidden_size=0), ValueError, "hidden_size"),
        (dict(hidden_size=32.0), ValueError, "hidden_size"),
    ],
    ids=["n3", "n8", "backend-cuda", "backend-case", "hidden-0", "hidden-float"],
)
def test_block_bad_construction(kwargs, exc, arg):
    kw = dict(layer=nn.Identity(), hidden_size=C)
    kw.update(kwargs)
    with pytest.raises(exc, match=rf"^{arg}\b"):
        MHCLiteBlock(**kw)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    "shape",
    [(B, S, 3, C), (B, S, 4, C + 1), (B, S, C, 4), (S, 4 * C), (4 * C,)],
    ids=["3-streams", "wrong-C", "swapped", "2d", "1d"],
)
def test_block_bad_streams_shape(shape, backend, gen, device):
    blk = MHCLiteBlock(nn.Identity(), C, backend=backend).to(device)
    with pytest.raises(ValueError, match=r"^streams\b"):
        blk(_x(shape, gen, device=device))


def test_block_triton_rejects_fp64_streams(gen, device):
    """The triton backend's kernels take fp32/fp16/bf16 streams; fp64 is refused naming the argument."""
    blk = MHCLiteBlock(nn.Identity(), C).double().to(device)
    with pytest.raises(TypeError, match=r"^x_flat\b"):
        blk(_x((3, 4, C), gen, torch.float64, device=device))


def test_block_cast_to_bf16_runs_on_both_backends(gen, device):
    """After .bfloat16() the parameters are bf16; the triton backend still feeds its kernels fp32 W and coefficients."""
    C = 24
    _seed_modules(gen)
    block = MHCLiteBlock(torch.nn.Linear(C, C), C).bfloat16()
    with torch.no_grad():  # W ~ N(0, 0.02^2), drawn on the CPU from gen
        block.W.copy_(0.02 * torch.randn(block.W.shape, generator=gen))
    block.to(device)
    ref = copy.deepcopy(block)
    ref.backend = "torch"
    x = expand_streams(_x((2, 5, C), gen, device=device)).bfloat16()
    with poisoned():
        got = block(x)
    want = ref(x)
    assert got.dtype == torch.bfloat16
    assert compare("bf16 block triton vs torch", want.double(), got, dtype=torch.bfloat16).ok
