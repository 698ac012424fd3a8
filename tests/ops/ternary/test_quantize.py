"""TWN and BitNet b1.58 absmean quantizers: formulas, per-row vs per-tensor, zero rows, bad input."""

import pytest
import torch

from triforge.ops.ternary.quantize import quantize_absmean, quantize_twn
from triforge.ops.ternary.tensor import TernaryTensor


def _twn_row(w):
    a = w.double().abs()
    delta = 0.7 * a.mean()
    keep = a > delta
    alpha = a[keep].mean()
    return torch.where(keep, torch.sign(w), torch.zeros_like(w)).to(torch.int8), alpha


@pytest.mark.parametrize("k", [1, 33, 100, 2049])
def test_twn_per_row_formula(k, gen):
    n = 6
    w = torch.randn(n, k, generator=gen) * (0.1 + torch.rand(n, 1, generator=gen))
    trits, scales = quantize_twn(w, per_row=True)
    assert trits.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (n,)
    for r in range(n):
        t, alpha = _twn_row(w[r])
        assert torch.equal(trits[r], t)
        assert scales[r].item() == pytest.approx(float(alpha), rel=1e-6)
        # every kept weight exceeds the threshold and every dropped one does not
        delta = 0.7 * w[r].double().abs().mean()
        assert bool((w[r].double().abs()[t != 0] > delta).all()) and bool((w[r].double().abs()[t == 0] <= delta).all())


def test_twn_per_tensor_formula(gen):
    w = torch.randn(5, 77, generator=gen)
    trits, scales = quantize_twn(w, per_row=False)
    t, alpha = _twn_row(w.reshape(-1))
    assert scales.shape == (1,)
    assert torch.equal(trits.reshape(-1), t)
    assert scales.item() == pytest.approx(float(alpha), rel=1e-6)


@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "per_tensor"])
def test_absmean_roundclip(per_row, gen):
    n, k = 7, 129
    w = torch.randn(n, k, generator=gen) * (0.01 + torch.rand(n, 1, generator=gen))
    trits, scales = quantize_absmean(w, per_row=per_row)
    w64 = w.double()
    gamma = (w64.abs().mean(1, keepdim=True) if per_row else w64.abs().mean().reshape(1, 1)) + 1e-8
    expect = torch.round(w64 / gamma).clamp(-1, 1).to(torch.int8)
    assert torch.equal(trits, expect)
    assert scales.shape == ((n,) if per_row else (1,))
    torch.testing.assert_close(scales.double(), gamma.reshape(-1), rtol=1e-6, atol=0)
    assert set(trits.unique().tolist()) <= {-1, 0, 1}
    # RoundClip: |w| / gamma < 0.5 -> 0, >= 1.5 -> sign
    r = w64 / gamma
    assert bool((trits[r.abs() < 0.49] == 0).all())
    assert bool((trits[r.abs() > 0.51] == torch.sign(r[r.abs() > 0.51]).to(torch.int8)).all())


def test_per_row_differs_from_per_tensor_on_row_scaled_weights(gen):
    w = torch.randn(4, 256, generator=gen) * torch.tensor([[0.01], [0.1], [1.0], [10.0]])
    for q in (quantize_twn, quantize_absmean):
        t_row, s_row = q(w, per_row=True)
        t_ten, s_ten = q(w, per_row=False)
        err_row = (TernaryTensor.from_trits(t_row, s_row).to_float(torch.float64) - w.double()).norm()
        err_ten = (TernaryTensor.from_trits(t_ten, s_ten).to_float(torch.float64) - w.double()).norm()
        assert err_row < err_ten
        # the small-magnitude rows vanish under a per-tensor scale
        assert int((t_ten[0] != 0).sum()) == 0 and int((t_row[0] != 0).sum()) > 0


@pytest.mark.parametrize("method", ["twn", "absmean"])
@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "per_tensor"])
def test_all_zero_rows_give_zero_scale_no_nan(method, per_row, gen):
    w = torch.randn(5, 40, generator=gen)
    w[1] = 0
    w[3] = 0
    tt = TernaryTensor.from_float(w, method=method, per_row=per_row)
    assert bool(torch.isfinite(tt.scales).all())
    dense = tt.to_float(torch.float64)
    assert bool(torch.isfinite(dense).all()) and bool((dense[1] == 0).all()) and bool((dense[3] == 0).all())
    if per_row:
        assert tt.scales[1].item() == 0 and tt.scales[3].item() == 0 and bool((tt.scales[[0, 2, 4]] > 0).all())
    zero = TernaryTensor.from_float(torch.zeros(3, 10), method=method, per_row=per_row)
    assert bool((zero.scales == 0).all()) and zero.sparsity() == 1.0
    assert bool((zero.to_float() == 0).all())


def test_quantizers_reject_bad_input(gen):
    for q in (quantize_twn, quantize_absmean):
        with pytest.raises(ValueError, match="w"):
            q(torch.randn(3, generator=gen))
        with pytest.raises(TypeError, match="w"):
            q(torch.randint(0, 3, (3, 3), generator=gen))
        with pytest.raises(TypeError, match="w"):
            q([[1.0]])
        bad = torch.randn(2, 3, generator=gen)
        bad[0, 1] = float("nan")
        with pytest.raises(ValueError, match="w"):
            q(bad)
