"""Ternary weight kernels against exact integer and float64 dense references.

Inputs and references are built on the CPU; the kernels' operands move to ``device`` (CUDA on the
GPU, the CPU under Triton's interpreter). Integer references stay on the CPU (CUDA has no int64
matmul) and the kernels' integer results come back to it to be compared bit for bit."""

import pytest
import torch

from triforge.launch import poisoned
from triforge.ops.ternary.kernels import activation_bit_planes, chunk_activity, popcount_matmul_a8, ternary_matmul
from triforge.testing import compare


def planes_of(trits: torch.Tensor):
    """Independent plane builder: bit b of word w is column 32w + b (int32, two's complement)."""
    N, K = trits.shape
    kw = (K + 31) // 32
    out = []
    for sign in (1, -1):
        bits = torch.zeros(N, kw * 32, dtype=torch.int64)
        bits[:, :K] = (trits == sign).to(torch.int64)
        words = torch.zeros(N, kw, dtype=torch.int64)
        for b in range(32):
            words |= bits[:, b::32] << b
        out.append(torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))
    return out[0], out[1]


def random_trits(N, K, sparsity=0.5):
    t = torch.randint(-1, 2, (N, K), dtype=torch.int8)
    t[torch.rand(N, K) < sparsity] = 0
    return t


def test_activation_bit_planes_reassemble_the_bytes():
    x = torch.randint(-128, 128, (3, 70), dtype=torch.int8)
    x[0, 0], x[0, 1] = -128, 127
    planes = activation_bit_planes(x)
    assert planes.shape == (8, 3, 3) and planes.dtype == torch.int32
    words = planes.to(torch.int64) & 0xFFFFFFFF
    bits = torch.stack([(words >> b) & 1 for b in range(32)], -1).view(8, 3, 96)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, -128]).view(8, 1, 1)
    assert torch.equal((bits[:, :, :70] * weights).sum(0), x.to(torch.int64))
    assert bits[:, :, 70:].sum() == 0  # padding columns stay zero


@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (1, 33, 31), (4, 17, 33), (7, 40, 100), (2, 9, 2049)])
def test_popcount_a8_is_exact(M, N, K, device):
    t = random_trits(N, K)
    t[0] = 0  # an all-zero row
    plus, minus = planes_of(t)
    x = torch.randint(-128, 128, (M, K), dtype=torch.int8)
    x[0, : min(K, 4)] = torch.tensor([-128, 127, -1, 0][: min(K, 4)], dtype=torch.int8)
    with poisoned():
        got = popcount_matmul_a8(x.to(device), plus.to(device), minus.to(device))
    want = x.to(torch.int64) @ t.to(torch.int64).T
    assert got.dtype == torch.int32
    assert torch.equal(got.cpu().to(torch.int64), want)


def test_popcount_a8_bit31_columns(device):
    # column 31 of each word is the int32 sign bit of the plane word
    K = 96
    t = torch.zeros(3, K, dtype=torch.int8)
    t[0, 31], t[1, 63], t[2, 95] = 1, -1, 1
    t[2, 30] = -1
    plus, minus = planes_of(t)
    assert (plus[0, 0] < 0) and (minus[1, 1] < 0)
    x = torch.randint(-128, 128, (2, K), dtype=torch.int8)
    got = popcount_matmul_a8(x.to(device), plus.to(device), minus.to(device))
    assert torch.equal(got.cpu().to(torch.int64), x.to(torch.int64) @ t.to(torch.int64).T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("M,N,K", [(1, 33, 100), (3, 20, 31), (16, 17, 65), (20, 24, 300)])
def test_ternary_matmul_matches_dense_float64(dtype, M, N, K, device):
    t = random_trits(N, K)
    plus, minus = planes_of(t)
    scales = torch.rand(N) + 0.1
    bias = torch.randn(N)
    x = torch.randn(M, K).to(dtype)
    want = x.double() @ (t.double() * scales.double()[:, None]).T + bias.double()
    with poisoned():
        got = ternary_matmul(x.to(device), plus.to(device), minus.to(device), scales.to(device), bias=bias.to(device))
    assert got.dtype == dtype and got.shape == (M, N)
    assert compare(f"ternary_matmul {dtype}", want, got, dtype=dtype).ok


@pytest.mark.parametrize("M", [1, 20])
def test_plane_skipping_gives_the_same_result(M, device):
    N, K = 24, 3 * 2048 + 5
    t = random_trits(N, K, sparsity=0.95)  # > 90% sparse
    t[:, 2048:4096] = 0  # an all-zero chunk for every row
    t[3] = 0  # an all-zero row
    plus, minus = (p.to(device) for p in planes_of(t))
    active = chunk_activity(plus, minus)
    assert active.shape == (N, 4) and active[:, 1].sum() == 0 and active[3].sum() == 0
    scales = torch.rand(N) + 0.1
    x = torch.randn(M, K, dtype=torch.float16)
    want = x.double() @ (t.double() * scales.double()[:, None]).T
    x, scales = x.to(device), scales.to(device)
    with poisoned():
        dense = ternary_matmul(x, plus, minus, scales)
        skipped = ternary_matmul(x, plus, minus, scales, active=active)
    assert compare("no skipping", want, dense, dtype=torch.float16).ok
    assert compare("plane skipping", want, skipped, dtype=torch.float16).ok
    assert torch.all(skipped[:, 3] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_w158a8_through_the_popcount_kernel_matches_the_reference(dtype, device):
    from triforge.ops.ternary import TernaryTensor, matmul_w158a8
    from triforge.ops.ternary.reference import matmul_w158a8_ref

    tt = TernaryTensor.from_float(torch.randn(37, 101), method="twn", per_row=True).to(device)
    x = torch.randn(2, 5, 101).to(device, dtype)
    bias = torch.randn(37).to(device)
    with poisoned():
        got = matmul_w158a8(x, tt, bias=bias)
    want = matmul_w158a8_ref(x, tt, bias=bias)
    assert got.shape == (2, 5, 37) and got.dtype == dtype
    assert compare("W1.58A8 kernel vs reference", want, got, dtype=dtype).ok


def test_public_matmul_runs_the_kernel_on_the_kernel_device(monkeypatch, device):
    import triforge.ops.ternary.kernels as kernels
    from triforge.ops.ternary import TernaryTensor, matmul

    calls = []
    real = kernels.ternary_matmul
    monkeypatch.setattr(kernels, "ternary_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    tt = TernaryTensor.from_float(torch.randn(20, 64)).to(device)
    x = torch.randn(3, 64).to(device)
    y = matmul(x, tt)
    assert calls, "matmul did not dispatch to the Triton kernel"
    assert compare("dispatched matmul", x.double() @ tt.to_float(torch.float64).T, y, dtype=torch.float32).ok
