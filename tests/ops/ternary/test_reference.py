"""Reference arithmetic: exact popcount W1.58A8 product, absmax int8 activations."""

import pytest
import torch

from triforge.ops.ternary.reference import (
    absmax_quantize_int8,
    activation_bit_planes,
    matmul_dense_ref,
    matmul_w158a8_ref,
    popcount_matmul_a8,
)
from triforge.ops.ternary.tensor import CHUNK_COLS, TernaryTensor, words_to_bits

from .test_tensor import random_scales, random_trits


@pytest.mark.parametrize("k", [1, 31, 33, 100, 2049])
@pytest.mark.parametrize("sparsity", [0.3, 0.95])
def test_popcount_matmul_a8_exact(k, sparsity, gen):
    m, n = 5, 9
    trits = random_trits(n, k, gen, sparsity=sparsity)
    trits[2] = 0  # an all-zero row
    x = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
    x[0] = -128  # the extremes of int8, against dense rows
    x[1] = 127
    trits[3] = 1  # dense rows: -128 * k and 127 * -k
    trits[4] = -1
    tt = TernaryTensor.from_trits(trits, random_scales(n, gen))
    got = popcount_matmul_a8(x, tt)
    assert got.dtype == torch.int64
    want = x.to(torch.int64) @ trits.to(torch.int64).T
    assert torch.equal(got, want)
    assert got[0, 3].item() == -128 * k and got[1, 4].item() == -127 * k


def test_popcount_matmul_a8_zero_chunks(gen):
    m, n, k = 3, 4, 3 * CHUNK_COLS + 7
    trits = random_trits(n, k, gen, sparsity=0.9)
    trits[:, CHUNK_COLS : 2 * CHUNK_COLS] = 0
    tt = TernaryTensor.from_trits(trits, torch.ones(1))
    x = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
    assert torch.equal(popcount_matmul_a8(x, tt), x.long() @ trits.long().T)
    assert not tt.sparsity_metadata().is_chunk_active(0, 1)


def test_activation_bit_planes_twos_complement(gen):
    x = torch.tensor([[-128, -1, 0, 1, 127, -37]], dtype=torch.int8)
    planes = activation_bit_planes(x)
    bits = torch.stack([words_to_bits(planes[b], 6) for b in range(8)]).long()  # [8, 1, 6]
    w = torch.tensor([1, 2, 4, 8, 16, 32, 64, -128])
    assert torch.equal((bits * w[:, None, None]).sum(0), x.long())


def test_absmax_quantize_int8(gen):
    x = torch.randn(5, 50, generator=gen) * 3
    x[2] = 0
    x[4] *= 1e-38  # max|x| ~1e-37: 127 / max|x| would overflow to inf, and inf * 0 give NaN (dequant is subnormal)
    q, dq = absmax_quantize_int8(x)
    assert q.dtype == torch.int8 and dq.shape == (5, 1) and dq.isfinite().all()
    assert dq[2].item() == 1.0 and bool((q[2] == 0).all())
    for r in (0, 1, 3, 4):
        amax = x[r].abs().max()
        assert int(q[r].abs().max()) == 127
        # (row 4's dequant ~1e-39 is subnormal: its spacing 2^-149 is ~1e-5 of it)
        assert dq[r].item() == pytest.approx(float(amax) / 127, rel=2e-5, abs=0)
        assert torch.equal(q[r], torch.round(x[r] / amax * 127.0).clamp(-128, 127).to(torch.int8))
        err = float((q[r].double() * float(dq[r]) - x[r].double()).abs().max())
        assert err <= float(dq[r]) / 2 * (1 + 1e-5) + 127 * 2.0**-149
    with pytest.raises(TypeError, match="x"):
        absmax_quantize_int8(torch.ones(2, 2, dtype=torch.int32))


def test_w158a8_matches_dense_on_quantized_activations(gen):
    m, n, k = 6, 10, 300
    tt = TernaryTensor.from_float(torch.randn(n, k, generator=gen), method="absmean")
    x = torch.randn(2, 3, k, generator=gen)
    got = matmul_w158a8_ref(x, tt)
    q, dq = absmax_quantize_int8(x.reshape(m, k))
    want = matmul_dense_ref((q.double() * dq.double()), tt).reshape(2, 3, n)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # and it approximates the float product (int8 activations lose ~1% here)
    dense = matmul_dense_ref(x, tt)
    assert float((got - dense).norm() / dense.norm()) < 0.03


def test_popcount_errors_name_the_argument(gen):
    tt = TernaryTensor.from_trits(random_trits(3, 40, gen), torch.ones(3))
    with pytest.raises(TypeError, match="x_int8"):
        popcount_matmul_a8(torch.randn(2, 40, generator=gen), tt)
    with pytest.raises(ValueError, match="x_int8"):
        popcount_matmul_a8(torch.zeros(2, 41, dtype=torch.int8), tt)
    with pytest.raises(ValueError, match="x_int8"):
        popcount_matmul_a8(torch.zeros(40, dtype=torch.int8), tt)
    with pytest.raises(TypeError, match="tt"):
        popcount_matmul_a8(torch.zeros(2, 40, dtype=torch.int8), tt.to_float())
