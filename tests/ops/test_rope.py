"""Rotary embedding: parity with the float64 reference and with Hugging Face's apply_rotary_pos_emb,
odd shapes, GQA, gradients (q, k, cos, sin), launch configs, strided inputs, torch.compile, validation."""

import pytest
import torch

import triforge  # noqa: F401  (sets TRITON_INTERPRET without CUDA)
import triforge.ops.rope as rope
from triforge import _runtime, registry, tune
from triforge.check import check_op
from triforge.launch import poisoned
from triforge.testing import compare

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _randn(shape, gen, device, dtype=torch.float32):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def _cos_sin(B, T, D, gen, device, *, batched, dtype=torch.float32):
    """General cos/sin (the two halves differ, unlike HF's), [B, T, D] or [T, D]."""
    shape = (B, T, D) if batched else (T, D)
    return _randn(shape, gen, device, dtype), _randn(shape, gen, device, dtype)


def _ref(x, cos, sin):
    return rope._rope_ref_one(x.double(), cos.double(), sin.double())


def _assert_ok(name, ref, got, dtype):
    res = compare(name, ref, got, dtype=dtype)
    assert res.ok, res.line()


def _leaf(t, requires_grad=True):
    return t.detach().clone().requires_grad_(requires_grad)


# ----------------------------------------------------------------------------- forward parity


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_matches_reference_and_hugging_face(dtype, gen, device):
    hf = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")
    B, T, HQ, HK, D = 2, 19, 6, 2, 64
    q, k = _randn((B, T, HQ, D), gen, device, dtype), _randn((B, T, HK, D), gen, device, dtype)
    positions = torch.randint(0, 4096, (B, 1), generator=gen) + torch.arange(T)
    cos, sin = rope.hf_cos_sin(T, D, positions=positions, dtype=dtype, device=device)  # [B, T, D] as HF has them
    with poisoned():
        q_out, k_out = rope.apply_rotary_qk(q, k, cos, sin)
    assert q_out.dtype == dtype and k_out.dtype == dtype
    ref = rope.rope_ref(q.double(), k.double(), cos.double(), sin.double())
    _assert_ok("q_out", ref["q_out"], q_out, dtype)
    _assert_ok("k_out", ref["k_out"], k_out, dtype)
    # Hugging Face takes [B, H, T, D] and cos/sin [B, T, D] with unsqueeze_dim=1
    hq64, hk64 = hf.apply_rotary_pos_emb(
        q.double().transpose(1, 2), k.double().transpose(1, 2), cos.double(), sin.double(), unsqueeze_dim=1
    )
    torch.testing.assert_close(hq64.transpose(1, 2), ref["q_out"], rtol=0, atol=0)
    _assert_ok("q_out vs hf64", hq64.transpose(1, 2), q_out, dtype)
    _assert_ok("k_out vs hf64", hk64.transpose(1, 2), k_out, dtype)
    # and the eager model's own arithmetic in the op's dtype (what a drop-in replacement is compared with)
    hq, hk = hf.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=1)
    _assert_ok("q_out vs hf", hq.transpose(1, 2).double(), q_out, dtype)
    _assert_ok("k_out vs hf", hk.transpose(1, 2).double(), k_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cs_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_apply_rotary_general_cos_sin(dtype, cs_dtype, gen, device):
    B, T, H, D = 2, 13, 3, 32
    x = _randn((B, T, H, D), gen, device, dtype)
    cos, sin = _cos_sin(B, T, D, gen, device, batched=False, dtype=cs_dtype)
    with poisoned():
        out = rope.apply_rotary(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape
    _assert_ok("out", _ref(x, cos, sin), out, dtype)


ODD_SHAPES = [  # B, T, HQ, HK, D, cos/sin batched
    (1, 1, 1, 1, 2, False),
    (2, 17, 3, 1, 6, True),
    (1, 63, 5, 5, 64, False),
    (2, 17, 1, 3, 128, True),
    (1, 1, 5, 1, 80, True),
    (3, 17, 3, 5, 6, False),
    (1, 63, 1, 1, 2, True),
    (2, 1, 3, 3, 128, False),
    (1, 17, 5, 2, 80, False),
]


@pytest.mark.parametrize("B,T,HQ,HK,D,batched", ODD_SHAPES)
def test_odd_shapes(B, T, HQ, HK, D, batched, gen, device):
    dtype = DTYPES[(B + T + HQ + D) % 3]
    q, k = _randn((B, T, HQ, D), gen, device, dtype), _randn((B, T, HK, D), gen, device, dtype)
    cos, sin = _cos_sin(B, T, D, gen, device, batched=batched)
    with poisoned():
        q_out, k_out = rope.apply_rotary_qk(q, k, cos, sin)
        k_single = rope.apply_rotary(k, cos, sin)
    _assert_ok("q_out", _ref(q, cos, sin), q_out, dtype)
    _assert_ok("k_out", _ref(k, cos, sin), k_out, dtype)
    torch.testing.assert_close(k_single, k_out, rtol=0, atol=0)


def test_cos_sin_with_batch_of_one(gen, device):
    B, T, H, D = 3, 9, 2, 16
    x = _randn((B, T, H, D), gen, device)
    cos, sin = _cos_sin(1, T, D, gen, device, batched=True)  # [1, T, D], as HF builds for shared positions
    with poisoned():
        out = rope.apply_rotary(x, cos, sin)
    _assert_ok("out", _ref(x, cos[0], sin[0]), out, torch.float32)


@pytest.mark.parametrize("block", [8, 16, 64])
def test_blocks_split_positions_and_heads(block, gen, device):
    """Blocks of the flattened tensor smaller than a position or a head, not dividing q's or k's
    element count: a block's elements find their partner, position and cos/sin row on their own,
    and the last q block, the first k block and the ragged end are each right."""
    B, T, HQ, HK, D = 2, 5, 5, 3, 16  # q 800 elements, k 480: neither a multiple of 64
    q, k = _randn((B, T, HQ, D), gen, device), _randn((B, T, HK, D), gen, device)
    cos, sin = _cos_sin(B, T, D, gen, device, batched=True)
    cfg = {"BLOCK": block, "num_warps": 4}
    with poisoned():
        q_out, k_out = rope.rope_launch(q, k, cos, sin, cfg=cfg)
        dq, dk = rope.rope_launch(q_out, k_out, cos, sin, backward=True, cfg=cfg)
    _assert_ok("q_out", _ref(q, cos, sin), q_out, torch.float32)
    _assert_ok("k_out", _ref(k, cos, sin), k_out, torch.float32)
    q64, k64 = _leaf(q.double()), _leaf(k.double())
    gq, gk = torch.autograd.grad((_ref(q64, cos, sin), _ref(k64, cos, sin)), (q64, k64), (q_out.double(), k_out.double()))
    _assert_ok("dq", gq, dq, torch.float32)
    _assert_ok("dk", gk, dk, torch.float32)


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_every_launch_config(kind, gen, device):
    """Every point of the tuning space (block sizes, warps), with a ragged last program."""
    t = tune.get(f"rope_{kind}")
    configs = tune.grid(t.space)
    if _runtime.INTERPRET:  # num_warps means nothing to the interpreter
        configs = [{"num_warps": 4, "BLOCK": b} for b in t.space["BLOCK"]]
    B, T, HQ, HK, D = 1, 11, 3, 2, 12
    q, k = _randn((B, T, HQ, D), gen, device), _randn((B, T, HK, D), gen, device)
    cos, sin = _cos_sin(B, T, D, gen, device, batched=False)
    q64, k64 = _leaf(q.double()), _leaf(k.double())
    ref_q, ref_k = _ref(q64, cos, sin), _ref(k64, cos, sin)
    if kind == "bwd":
        ref_q, ref_k = torch.autograd.grad((ref_q, ref_k), (q64, k64), (q.double(), k.double()))
    for cfg in configs:
        with poisoned():
            got_q, got_k = rope.rope_launch(q, k, cos, sin, backward=kind == "bwd", cfg=cfg)
        _assert_ok(f"q {cfg}", ref_q, got_q, torch.float32)
        _assert_ok(f"k {cfg}", ref_k, got_k, torch.float32)


# ----------------------------------------------------------------------------- gradients


def _ref_grads(q, k, cos, sin, gq, gk, wrt):
    leaves = {n: _leaf(t.double(), n in wrt) for n, t in dict(q=q, k=k, cos=cos, sin=sin).items()}
    outs = rope.rope_ref(**leaves)
    return torch.autograd.grad((outs["q_out"], outs["k_out"]), [leaves[n] for n in wrt], (gq.double(), gk.double()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("cs_grad", [False, True])
def test_gradients(dtype, batched, cs_grad, gen, device):
    B, T, HQ, HK, D = 2, 9, 3, 2, 20
    q, k = _randn((B, T, HQ, D), gen, device, dtype), _randn((B, T, HK, D), gen, device, dtype)
    cos, sin = _cos_sin(B, T, D, gen, device, batched=batched)
    gq, gk = _randn(q.shape, gen, device, dtype), _randn(k.shape, gen, device, dtype)
    wrt = ["q", "k"] + (["cos", "sin"] if cs_grad else [])
    leaves = {n: _leaf(t, n in wrt) for n, t in dict(q=q, k=k, cos=cos, sin=sin).items()}
    with poisoned():
        q_out, k_out = rope.apply_rotary_qk(**leaves)
        got = torch.autograd.grad((q_out, k_out), [leaves[n] for n in wrt], (gq, gk))
    ref = _ref_grads(q, k, cos, sin, gq, gk, wrt)
    for n, r, g in zip(wrt, ref, got):
        assert g.shape == leaves[n].shape and g.dtype == leaves[n].dtype
        _assert_ok(f"d{n}", r, g, dtype)
    if not cs_grad:
        assert cos.grad is None and sin.grad is None


def test_gradient_with_one_output_unused(gen, device):
    B, T, HQ, HK, D = 2, 7, 3, 1, 10
    q, k = _leaf(_randn((B, T, HQ, D), gen, device)), _leaf(_randn((B, T, HK, D), gen, device))
    cos, sin = (_leaf(t) for t in _cos_sin(B, T, D, gen, device, batched=False))
    gq = _randn(q.shape, gen, device)
    with poisoned():
        q_out, _ = rope.apply_rotary_qk(q, k, cos, sin)
        dq, dk, dcos, dsin = torch.autograd.grad(q_out, (q, k, cos, sin), gq)
    assert torch.count_nonzero(dk) == 0
    ref = _ref_grads(q, k, cos, sin, gq, torch.zeros_like(k), ["q", "cos", "sin"])
    for n, r, g in zip(("q", "cos", "sin"), ref, (dq, dcos, dsin)):
        _assert_ok(f"d{n}", r, g, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rotary_gradients(dtype, gen, device):
    B, T, H, D = 2, 6, 4, 14
    x = _leaf(_randn((B, T, H, D), gen, device, dtype))
    cos, sin = (_leaf(t) for t in _cos_sin(B, T, D, gen, device, batched=True))
    gy = _randn(x.shape, gen, device, dtype)
    with poisoned():
        got = torch.autograd.grad(rope.apply_rotary(x, cos, sin), (x, cos, sin), gy)
    x64, c64, s64 = (_leaf(t.double()) for t in (x, cos, sin))
    ref = torch.autograd.grad(rope._rope_ref_one(x64, c64, s64), (x64, c64, s64), gy.double())
    for n, r, g in zip(("x", "cos", "sin"), ref, got):
        _assert_ok(f"d{n}", r, g, dtype)


# ----------------------------------------------------------------------------- property test

try:
    from hypothesis import given
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:

    @given(
        B=st.integers(1, 3), T=st.integers(1, 24), HQ=st.integers(1, 6), HK=st.integers(1, 6),
        half=st.integers(1, 40), dtype=st.sampled_from(DTYPES), batched=st.booleans(),
    )
    def test_property_forward_and_backward(B, T, HQ, HK, half, dtype, batched):
        device = _runtime.default_device()
        D = 2 * half
        q = torch.randn(B, T, HQ, D).to(device=device, dtype=dtype)
        k = torch.randn(B, T, HK, D).to(device=device, dtype=dtype)
        cos, sin = (torch.randn((B, T, D) if batched else (T, D), device=device) for _ in range(2))
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        ql, kl = _leaf(q), _leaf(k)
        with poisoned():
            q_out, k_out = rope.apply_rotary_qk(ql, kl, cos, sin)
            dq, dk = torch.autograd.grad((q_out, k_out), (ql, kl), (gq, gk))
        _assert_ok("q_out", _ref(q, cos, sin), q_out, dtype)
        _assert_ok("k_out", _ref(k, cos, sin), k_out, dtype)
        ref_dq, ref_dk = _ref_grads(q, k, cos, sin, gq, gk, ["q", "k"])
        _assert_ok("dq", ref_dq, dq, dtype)
        _assert_ok("dk", ref_dk, dk, dtype)


# ----------------------------------------------------------------------------- layouts, compile


def test_non_contiguous_inputs(gen, device):
    B, T, HQ, HK, D = 2, 8, 3, 2, 16
    q_bhtd = _randn((B, HQ, T, D), gen, device)
    k_bhtd = _randn((B, HK, T, D), gen, device)
    q, k = q_bhtd.transpose(1, 2), k_bhtd.transpose(1, 2)  # [B, T, H, D] views, as after attention projections
    assert not q.is_contiguous()
    cos_wide, sin_wide = _randn((T, 2 * D), gen, device), _randn((T, 2 * D), gen, device)
    cos, sin = cos_wide[:, ::2], sin_wide[:, 1::2]  # strided last dim
    cos_b, sin_b = cos.expand(B, T, D), sin.expand(B, T, D)  # stride-0 batch
    with poisoned():
        want_q, want_k = rope.apply_rotary_qk(q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous())
        got_q, got_k = rope.apply_rotary_qk(q, k, cos, sin)
        got_qb, got_kb = rope.apply_rotary_qk(q, k, cos_b, sin_b)
        got_x = rope.apply_rotary(q, cos_b, sin_b)
    for got in (got_q, got_qb, got_x):
        torch.testing.assert_close(got, want_q, rtol=0, atol=0)
    for got in (got_k, got_kb):
        torch.testing.assert_close(got, want_k, rtol=0, atol=0)
    _assert_ok("q_out", _ref(q, cos, sin), got_q, torch.float32)
    # gradients through the strided views
    ql, kl = _leaf(q_bhtd), _leaf(k_bhtd)
    gq, gk = _randn((B, T, HQ, D), gen, device), _randn((B, T, HK, D), gen, device)
    with poisoned():
        outs = rope.apply_rotary_qk(ql.transpose(1, 2), kl.transpose(1, 2), cos, sin)
        dq, dk = torch.autograd.grad(outs, (ql, kl), (gq, gk))
    ref_dq, ref_dk = _ref_grads(q, k, cos, sin, gq, gk, ["q", "k"])
    _assert_ok("dq", ref_dq.transpose(1, 2), dq, torch.float32)
    _assert_ok("dk", ref_dk.transpose(1, 2), dk, torch.float32)


def test_torch_compile_fullgraph(gen, device):
    B, T, HQ, HK, D = 2, 6, 4, 2, 16

    def f(q, k, cos, sin):
        q_out, k_out = rope.apply_rotary_qk(q, k, cos, sin)
        x_out = rope.apply_rotary(q.transpose(1, 2).transpose(1, 2), cos, sin)  # strided view into the op
        return (q_out * x_out).sum() + (k_out * k_out).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    base = [_randn((B, T, HQ, D), gen, device), _randn((B, T, HK, D), gen, device)]
    base += list(_cos_sin(B, T, D, gen, device, batched=False))
    eager_in, comp_in = [_leaf(t) for t in base], [_leaf(t) for t in base]
    loss_e = f(*eager_in)
    loss_c = compiled(*comp_in)
    torch.testing.assert_close(loss_c, loss_e, rtol=0, atol=0)
    grads_e = torch.autograd.grad(loss_e, eager_in)
    grads_c = torch.autograd.grad(loss_c, comp_in)
    for ge, gc in zip(grads_e, grads_c):
        torch.testing.assert_close(gc, ge, rtol=0, atol=0)
    # and the compiled gradients are right
    leaves64 = [_leaf(t.double()) for t in base]
    q64, k64, c64, s64 = leaves64
    loss64 = (rope._rope_ref_one(q64, c64, s64) ** 2).sum() + (rope._rope_ref_one(k64, c64, s64) ** 2).sum()
    for n, r, g in zip(("q", "k", "cos", "sin"), torch.autograd.grad(loss64, leaves64), grads_c):
        _assert_ok(f"d{n}", r, g, torch.float32)


def test_eager_calls_bypass_the_custom_op_traced_calls_use_it(gen, device):
    """Eager calls run the launchers under a plain autograd.Function (launch.eager: the custom op's
    dispatch and autograd wrappers cost more host time than the launch); under a dispatch mode (what
    AOTAutograd and make_fx trace with) the custom op runs. Both give the same outputs and gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    B, T, HQ, HK, D = 2, 5, 3, 1, 8
    base = [_randn((B, T, HQ, D), gen, device), _randn((B, T, HK, D), gen, device)]
    base += list(_cos_sin(B, T, D, gen, device, batched=False))
    results = {}
    for path in ("eager", "op"):
        leaves = [_leaf(t) for t in base]
        if path == "eager":
            q_out, k_out = rope.apply_rotary_qk(*leaves)
            x_out = rope.apply_rotary(leaves[0], leaves[2], leaves[3])
        else:
            with Passthrough():
                q_out, k_out = rope.apply_rotary_qk(*leaves)
                x_out = rope.apply_rotary(leaves[0], leaves[2], leaves[3])
        names = {type(t.grad_fn).__name__ for t in (q_out, k_out, x_out)}
        assert (names <= {"_RopeQKFunctionBackward", "_RopeFunctionBackward"}) == (path == "eager"), names
        loss = (q_out * x_out).sum() + (k_out * k_out).sum()
        results[path] = [q_out, k_out, x_out] + list(torch.autograd.grad(loss, leaves))
    for e, o in zip(results["eager"], results["op"]):
        torch.testing.assert_close(o, e, rtol=0, atol=0)


def test_launch_eager_sees_tracers_and_subclasses(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from triforge import launch

    t = torch.ones(3, device=device)
    assert launch.eager(t, None, t)
    with FakeTensorMode() as mode:
        assert not launch.eager(mode.from_tensor(t))
    assert launch.eager(torch.nn.Parameter(t.clone()))  # Parameter disables __torch_function__

    class Sub(torch.Tensor):  # a subclass with its own __torch_function__: the op path
        pass

    assert not launch.eager(t.as_subclass(Sub))


# ----------------------------------------------------------------------------- validation


def _bad_cases():
    d = _runtime.default_device()
    x = torch.randn(2, 5, 3, 8, device=d)
    cs = torch.randn(5, 8, device=d)
    k = torch.randn(2, 5, 1, 8, device=d)
    return [
        ("x-3d", lambda: rope.apply_rotary(x[0], cs, cs), ValueError, r"x must have 4 dimensions"),
        ("x-not-tensor", lambda: rope.apply_rotary(x.tolist(), cs, cs), TypeError, r"x must be a torch.Tensor"),
        ("x-int", lambda: rope.apply_rotary(x.long(), cs, cs), TypeError, r"x must have dtype"),
        ("x-empty", lambda: rope.apply_rotary(x[:, :0], cs[:0], cs[:0]), ValueError, r"x must not be empty"),
        ("x-odd-d", lambda: rope.apply_rotary(x[..., :7], cs[:, :7], cs[:, :7]), ValueError, r"x must have an even head dimension"),
        ("x-too-wide", lambda: rope.apply_rotary(torch.randn(1, 1, 1, rope.MAX_HEAD_DIM + 2, device=d),
                                                 torch.randn(1, rope.MAX_HEAD_DIM + 2, device=d),
                                                 torch.randn(1, rope.MAX_HEAD_DIM + 2, device=d)),
         ValueError, r"x has a last dimension"),
        ("cos-1d", lambda: rope.apply_rotary(x, cs[0], cs[0]), ValueError, r"cos must have \(2, 3\) dimensions"),
        ("cos-int", lambda: rope.apply_rotary(x, cs.long(), cs), TypeError, r"cos must have dtype"),
        ("cos-wrong-T", lambda: rope.apply_rotary(x, cs[:4], cs[:4]), ValueError, r"cos and sin must have shape"),
        ("cos-wrong-D", lambda: rope.apply_rotary(x, cs[:, :6], cs[:, :6]), ValueError, r"cos and sin must have shape"),
        ("cos-wrong-B", lambda: rope.apply_rotary(x, cs.expand(3, 5, 8), cs.expand(3, 5, 8)), ValueError,
         r"cos and sin must have shape"),
        ("sin-shape", lambda: rope.apply_rotary(x, cs, cs.expand(2, 5, 8)), ValueError, r"sin must have the same shape as cos"),
        ("sin-empty", lambda: rope.apply_rotary(x, cs, cs[:0]), ValueError, r"sin must not be empty"),
        ("sin-device", lambda: rope.apply_rotary(x, cs, cs.to("meta")), ValueError, r"sin must be a (CPU|CUDA) tensor"),
        ("q-3d", lambda: rope.apply_rotary_qk(x[0], k, cs, cs), ValueError, r"q must have 4 dimensions"),
        ("k-3d", lambda: rope.apply_rotary_qk(x, k[0], cs, cs), ValueError, r"k must have 4 dimensions"),
        ("k-empty", lambda: rope.apply_rotary_qk(x, k[:, :, :0], cs, cs), ValueError, r"k must not be empty"),
        ("k-wrong-T", lambda: rope.apply_rotary_qk(x, k[:, :4], cs, cs), ValueError, r"k must have the same batch"),
        ("k-wrong-B", lambda: rope.apply_rotary_qk(x, k[:1], cs, cs), ValueError, r"k must have the same batch"),
        ("k-wrong-D", lambda: rope.apply_rotary_qk(x, k[..., :6], cs, cs), ValueError, r"k must have the same batch"),
        ("k-dtype", lambda: rope.apply_rotary_qk(x, k.half(), cs, cs), TypeError, r"k must have the same dtype as q"),
        ("qk-cos-shape", lambda: rope.apply_rotary_qk(x, k, cs[:3], cs[:3]), ValueError, r"cos and sin must have shape"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input(case):
    _, call, exc, match = case
    with pytest.raises(exc, match=match):
        call()


# ----------------------------------------------------------------------------- registry


@pytest.mark.parametrize("dtype", DTYPES)
def test_registered_op_passes_check(dtype):
    spec = registry.get("rope")
    result = check_op(spec, dtype, tier="tiny", seed=int(torch.randint(0, 2**31 - 1, ())), verbose=True)
    assert result.ok, (result.error, result.failed_stage, [r.line() for r in result.results])
    assert [r.name for r in result.results] == ["fwd.q_out", "fwd.k_out", "bwd.dq", "bwd.dk"]


def test_registry_entries(gen, device):
    spec = registry.get("rope")
    assert spec.outputs == ("q_out", "k_out") and spec.grad_inputs == ("q", "k")
    assert set(spec.peers) == {"liger", "torch.compile"}
    assert {"rope_fwd", "rope_bwd"} <= set(tune.all_tunables())
    inputs = spec.make_inputs("tiny", torch.bfloat16, device, gen)
    q, k = inputs["q"], inputs["k"]
    assert q.shape == (2, 37, 6, 64) and k.shape == (2, 37, 2, 64)
    n = q.numel() + k.numel()
    cs = 2 * inputs["cos"].numel() * inputs["cos"].element_size()
    assert spec.bytes(inputs, "fwd") == spec.bytes(inputs, "bwd") == 2 * 2 * n + cs
    assert spec.flops(inputs, "fwd") == 3 * n
    assert "2x37x6x64" in spec.describe(inputs)
    liger = spec.peers["liger"](inputs)
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        assert liger is None


@pytest.mark.gpu
def test_peers_match_reference(gen, device):
    """The peers compute the same thing (GPU only: inductor and liger need one)."""
    spec = registry.get("rope")
    inputs = spec.make_inputs("tiny", torch.float32, device, gen)
    ref = spec.reference(**{k: v.double() for k, v in inputs.items()})
    for name, build in spec.peers.items():
        fn = build({k: v.clone() for k, v in inputs.items()})
        if fn is None:
            continue
        outs = fn(**{k: v.clone() for k, v in inputs.items()})
        for out_name, got in zip(spec.outputs, outs):
            _assert_ok(f"{name}.{out_name}", ref[out_name], got, torch.float32)
