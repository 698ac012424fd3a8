"""Softmax: parity with the float64 reference and torch, masked rows, the looped wide-row path,
stages, gradients, layouts, torch.compile, validation."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from triforge import _runtime, registry
from triforge.check import check_op
from triforge.launch import poisoned
from triforge.ops import softmax as softmax_mod
from triforge.ops.softmax import MAX_N, softmax, softmax_dx_scale, softmax_ref, softmax_stages
from triforge.testing import compare, compare_stages

DEV = _runtime.default_device()  # cpu through the interpreter, cuda when compiled
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NEG_INF = float("-inf")


def _randn(shape, dtype, gen, scale=3.0):
    return (scale * torch.randn(shape, generator=gen)).to(DEV, dtype)


def _check(name, ref, got, dtype):
    res = compare(name, ref, got, dtype=dtype)
    assert res.ok, res.line()


def _grad(fn, x, dy):
    x = x.detach().clone().requires_grad_(True)
    fn(x).backward(dy)
    return x.grad


def _check_dx(name, x, dy, dx, dim=-1, ref_fn=None):
    x64, dy64 = x.double(), dy.double()
    ref_fn = ref_fn or (lambda t: softmax_ref(t, dim)["y"])
    res = compare(name, _grad(ref_fn, x64, dy64), dx, dtype=x.dtype, scale=softmax_dx_scale(x64, dy64, dim))
    assert res.ok, res.line()


def _check_fwd_bwd(x, dim, dy, *, against_torch=True):
    """Forward and input gradient of softmax(x, dim) against the reference (and torch) in float64."""
    dtype = x.dtype
    with poisoned():
        y = softmax(x, dim)
        dx = _grad(lambda t: softmax(t, dim), x, dy)
    assert y.shape == x.shape and y.dtype == dtype and dx.dtype == dtype
    assert not y.isnan().any() and not dx.isnan().any()
    x64, dy64 = x.double(), dy.double()
    _check("y vs ref", softmax_ref(x64, dim)["y"], y, dtype)
    _check_dx("dx vs ref", x, dy, dx, dim)
    if against_torch:
        _check("y vs torch", F.softmax(x64, dim), y, dtype)
        _check_dx("dx vs torch", x, dy, dx, dim, ref_fn=lambda t: F.softmax(t, dim))
    return y, dx


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (17,), (5, 63), (3, 1000), (4, 1), (37, 300)])
def test_parity_last_dim(shape, dtype, gen):
    x = _randn(shape, dtype, gen)
    _check_fwd_bwd(x, -1, torch.randn(shape, generator=gen).to(DEV, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2, -3])
def test_parity_any_dim_3d(dim, dtype, gen):
    shape = (6, 17, 33)
    x = _randn(shape, dtype, gen)
    _check_fwd_bwd(x, dim, torch.randn(shape, generator=gen).to(DEV, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_rows(dtype, gen):
    """Partly -inf rows are right; all -inf rows give zeros forward and backward, never NaN."""
    x = _randn((9, 130), dtype, gen)
    x = x.masked_fill(torch.rand(x.shape, generator=gen).to(DEV) < 0.3, NEG_INF)
    x[2] = NEG_INF
    x[5, 1:] = NEG_INF  # one finite entry: y is exactly one there
    x[5, 0] = 4.0
    x[7, :-1] = NEG_INF
    x[7, -1] = -7.0
    dy = torch.randn(x.shape, generator=gen).to(DEV, dtype)
    y, dx = _check_fwd_bwd(x, -1, dy, against_torch=False)
    assert (y[2] == 0).all() and (dx[2] == 0).all()
    assert y[5, 0] == 1 and y[7, -1] == 1
    assert (y[x == NEG_INF] == 0).all() and (dx[x == NEG_INF] == 0).all()
    live = [i for i in range(x.shape[0]) if i != 2]
    _check("y vs torch (live rows)", F.softmax(x[live].double(), -1), y[live], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_rows_along_dim0(dtype, gen):
    x = _randn((40, 3, 5), dtype, gen)
    x[:, 1, 2] = NEG_INF
    x[::3, 0, :] = NEG_INF
    y, dx = _check_fwd_bwd(x, 0, torch.randn(x.shape, generator=gen).to(DEV, dtype), against_torch=False)
    assert (y[:, 1, 2] == 0).all() and (dx[:, 1, 2] == 0).all()


def test_reference_gradient_is_finite_on_masked_rows(gen):
    x = torch.randn(3, 8, generator=gen, dtype=torch.float64)
    x[1] = NEG_INF
    x[2, :4] = NEG_INF
    dx = _grad(lambda t: softmax_ref(t)["y"], x, torch.randn(3, 8, generator=gen, dtype=torch.float64))
    assert torch.isfinite(dx).all() and (dx[1] == 0).all() and (dx[2, :4] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_magnitudes(dtype, gen):
    x = (1e4 * (2 * torch.rand(6, 257, generator=gen) - 1)).to(DEV, dtype)
    x[1, :10] = 1e4  # ties at the max
    y, dx = _check_fwd_bwd(x, -1, torch.randn(x.shape, generator=gen).to(DEV, dtype))
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_wide_rows_looped_path(dtype, gen):
    N = 20000
    assert N > softmax_mod.MAX_FUSED_N
    x = _randn((2, N), dtype, gen)
    x[1, : N // 2] = NEG_INF
    x[1, N - 5:] = NEG_INF
    dy = torch.randn(x.shape, generator=gen).to(DEV, dtype)
    _check_fwd_bwd(x, -1, dy, against_torch=False)
    with poisoned():
        got = softmax_stages(x)
    _, failed = compare_stages(softmax_ref(x.double()), got, dtype=dtype)
    assert failed is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 255, 256, 1000])
def test_looped_kernels_small_blocks(N, dtype, gen):
    """The looped kernels with a block narrower than the row (several blocks, a partial last one,
    whole blocks of -inf, an all -inf row), against the reference stages and the one-row kernels."""
    x = _randn((5, N), dtype, gen)
    x[1] = NEG_INF
    x[2, : min(N - 1, 256)] = NEG_INF
    x[3, ::3] = NEG_INF
    cfg = {"BLOCK_N": 128, "num_warps": 4}
    with poisoned():
        y, row_max, row_sum = softmax_mod.softmax_fwd(x, store_stages=True, cfg=cfg, looped=True)
    got = {"row_max": row_max, "row_sum": row_sum, "y": y}
    _, failed = compare_stages(softmax_ref(x.double()), got, dtype=dtype)
    assert failed is None
    dy = torch.randn(x.shape, generator=gen).to(DEV, dtype)
    with poisoned():
        dx = softmax_mod.softmax_bwd(dy, x, row_max, row_sum, cfg=cfg, looped=True)
        _, rm1, rs1 = softmax_mod.softmax_fwd(x, store_stages=True, looped=False)
        dx_row = softmax_mod.softmax_bwd(dy, x, rm1, rs1, looped=False)
    assert not dx.isnan().any() and (dx[1] == 0).all()
    _check_dx("dx looped", x, dy, dx)
    _check_dx("dx one-row", x, dy, dx_row)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [0, -1])
def test_stages(dim, dtype, gen):
    x = _randn((11, 7, 90), dtype, gen)
    x[3, 2, :] = NEG_INF
    x[:, 4, 5] = NEG_INF
    x = x.masked_fill(torch.rand(x.shape, generator=gen).to(DEV) < 0.1, NEG_INF)
    with poisoned():
        got = softmax_stages(x, dim)
    ref = softmax_ref(x.double(), dim)
    assert list(got) == list(ref) == ["row_max", "row_sum", "y"]
    results, failed = compare_stages(ref, got, dtype=dtype)
    assert failed is None, "\n".join(r.line() for r in results)


def _layouts(gen, dtype):
    base = _randn((48, 70), dtype, gen)
    row = _randn((1, 70), dtype, gen)
    return [
        ("transposed", base.t()),
        ("strided", base[::3, 1:-2]),
        ("expanded rows", row.expand(9, 70)),
        ("expanded columns", _randn((9, 1), dtype, gen).expand(9, 70)),
        ("permuted 3d", _randn((4, 6, 10), dtype, gen).permute(2, 0, 1)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, -1])
def test_noncontiguous_and_expanded(dim, dtype, gen):
    for _, x in _layouts(gen, dtype):
        _check_fwd_bwd(x, dim, torch.randn(x.shape, generator=gen).to(DEV, dtype))


@settings(max_examples=8, deadline=None)
@given(
    shape=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
    dim_seed=st.integers(0, 5),
    scale=st.sampled_from([0.1, 1.0, 2.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_matches_torch(shape, dtype, dim_seed, scale, seed):
    # Logit spreads stay moderate: a tensor whose every gradient is below fp16's normal range
    # (e.g. one 5-wide row of 30*randn, dx ~ 1e-19) cannot be held to relative precision in fp16.
    gen = torch.Generator().manual_seed(seed)
    dim = dim_seed % len(shape) - (len(shape) if dim_seed >= 3 else 0)
    x = (scale * torch.randn(shape, generator=gen)).to(DEV, dtype)
    _check_fwd_bwd(x, dim, torch.randn(shape, generator=gen).to(DEV, dtype))


def test_ill_conditioned_gradient_is_judged_by_its_terms(gen):
    """A near-one-hot column repeated 70 times (the expanded layout that failed CI once): dx cancels
    to ~1e-4 of its terms, so float32 rounding alone puts it ~1e-4 off relative to ||dx||, for torch's
    own kernel as for ours. Judged by its terms both pass; one element moved by 1e-3 of its scale
    fails, alone."""
    col = torch.randn(9, 1, generator=gen)
    col[4] = 12.0
    x = col.expand(9, 70).to(DEV)
    dy = torch.randn(x.shape, generator=gen).to(DEV)
    x64, dy64 = x.double(), dy.double()
    ref = _grad(lambda t: softmax_ref(t, 0)["y"], x64, dy64)
    scale = softmax_dx_scale(x64, dy64, 0)
    torch_dx = _grad(lambda t: F.softmax(t, 0), x, dy)
    assert not compare("torch by ||dx||", ref, torch_dx, dtype=torch.float32, verbose=False).ok
    assert compare("torch by terms", ref, torch_dx, dtype=torch.float32, scale=scale, verbose=False).ok
    with poisoned():
        dx = _grad(lambda t: softmax(t, 0), x, dy)
    assert compare("dx by terms", ref, dx, dtype=torch.float32, scale=scale).ok
    bad = dx.detach().cpu().double()
    bad[2, 33] += 1e-3 * float(scale[2, 33])
    res = compare("moved", ref, bad, dtype=torch.float32, scale=scale, verbose=False)
    assert not res.ok and res.n_over == 1


def test_backward_without_stored_row_stats(gen):
    """The op's forward skips the row stats when no gradient was expected; backward recomputes them."""
    x = _randn((7, 90), torch.float32, gen)
    x[3] = NEG_INF
    dy = torch.randn(x.shape, generator=gen).to(DEV)
    xg = x.clone().requires_grad_(True)
    with poisoned():
        y, row_max, row_sum = torch.ops.triforge.softmax_fwd(xg, False)
        assert row_max.numel() == 0 and row_sum.numel() == 0
        y.backward(dy)
    _check_dx("dx", x, dy, xg.grad)


def test_torch_compile_fullgraph(gen):
    def fn(x):
        return (softmax(x * 2.0, dim=1) * x).sum(1)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    x = _randn((5, 33, 9), torch.float32, gen)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    dy = torch.randn(5, 9, generator=gen).to(DEV)
    eager_out = fn(x1)
    compiled_out = compiled(x2)
    eager_out.backward(dy)
    compiled_out.backward(dy)
    torch.testing.assert_close(compiled_out, eager_out, rtol=0, atol=0)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=0, atol=0)


def test_bad_inputs(gen):
    x = _randn((4, 8), torch.float32, gen)
    with pytest.raises(TypeError, match="x"):
        softmax(x.tolist())
    with pytest.raises(TypeError, match="x"):
        softmax(x.to(torch.int64))
    with pytest.raises(TypeError, match="x"):
        softmax(x.double())
    with pytest.raises(ValueError, match="x"):
        softmax(x[:, :0])
    with pytest.raises(ValueError, match="x"):
        softmax(x.to("meta"))
    with pytest.raises(ValueError, match="x"):
        softmax(torch.tensor(1.0, device=DEV))
    with pytest.raises(ValueError, match="dim"):
        softmax(x, dim=2)
    with pytest.raises(ValueError, match="dim"):
        softmax(x, dim=-3)
    with pytest.raises(TypeError, match="dim"):
        softmax(x, dim=1.0)
    with pytest.raises(TypeError, match="dim"):
        softmax(x, dim=None)
    with pytest.raises(ValueError, match="x"):
        softmax(torch.randn(1, MAX_N + 1, device=DEV))
    with pytest.raises(ValueError, match="x"):
        softmax(torch.randn(MAX_N + 1, 2, device=DEV), dim=0)
    with pytest.raises(ValueError, match="x"):
        softmax_stages(torch.randn(2, MAX_N + 1, device=DEV))


@pytest.mark.parametrize("dtype", DTYPES)
def test_registered_op_checks(dtype):
    spec = registry.get("softmax")
    assert spec.family == "softmax" and spec.outputs == ("y",) and spec.grad_inputs == ("x",)
    result = check_op(spec, dtype, tier="tiny", seed=int(torch.randint(0, 2**31, ()).item()))
    assert result.ok, (result.error, [r.line() for r in result.results])


def test_registry_inputs_are_masked(gen):
    spec = registry.get("softmax")
    x = spec.make_inputs("tiny", torch.float32, DEV, gen)["x"]
    full = (x == NEG_INF).all(-1)
    assert full.sum() == 1
    assert ((x == NEG_INF).any(-1) & ~full).sum() > 0
    assert spec.bytes({"x": x}, "fwd") == 2 * 4 * x.numel()
    assert spec.bytes({"x": x}, "bwd") == 3 * 4 * x.numel()


def test_registry_judges_dx_by_its_terms(gen):
    """check_op's dx scale is the terms' (softmax_dx_scale), as the tests above judge it; the forward stages keep
    the rms default."""
    spec = registry.get("softmax")
    x64 = spec.make_inputs("tiny", torch.float32, "cpu", gen)["x"].double()
    dy64 = torch.randn(x64.shape, generator=gen, dtype=torch.float64)
    assert spec.magnitudes({"x": x64}, None, torch.float32) == {}
    scale = spec.magnitudes({"x": x64}, [dy64], torch.float32)["dx"]
    assert torch.equal(scale, softmax_dx_scale(x64, dy64))
    assert scale.shape == x64.shape and bool((scale > 0).all())


def test_check_op_compares_dx_with_the_terms_scale(monkeypatch):
    """check_op hands compare() the registry's dx scale (softmax_dx_scale of its float64 input and upstream
    gradient), not the rms default; the forward stages get none."""
    import triforge.check as check_mod

    seen = {}
    real = check_mod.compare

    def spy(name, ref, got, **kw):
        seen[name] = kw.get("scale")
        return real(name, ref, got, **kw)

    monkeypatch.setattr(check_mod, "compare", spy)
    seen_stages = {}
    real_stages = check_mod.compare_stages

    def spy_stages(ref_stages, got_stages, **kw):
        seen_stages.update(kw.get("scales") or {})
        return real_stages(ref_stages, got_stages, **kw)

    monkeypatch.setattr(check_mod, "compare_stages", spy_stages)
    spec = registry.get("softmax")
    res = check_op(spec, torch.float32, tier="tiny", seed=3, verbose=False)
    assert res.ok, res.failed_stage
    assert seen_stages == {}
    x64 = spec.make_inputs("tiny", torch.float32, "cpu", torch.Generator().manual_seed(3))["x"].double()
    # check_op's upstream gradient: drawn in float64 from seed + 1, rounded to the output's dtype
    dy64 = torch.randn(x64.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64).float().double()
    assert torch.equal(seen["bwd.dx"].cpu(), softmax_dx_scale(x64, dy64))
