"""triforge.ternary.matmul and the ternary attention scores against float64 dense expansion."""

import pytest
import torch

from triforge.launch import poisoned
from triforge.ops.ternary.reference import attention_scores_ref, matmul_dense_ref
from triforge.ops.ternary.tensor import CHUNK_COLS
from triforge.ternary import TernaryTensor, hybrid_attention_scores, matmul, ternary_attention_scores
from triforge.testing import compare

from .test_tensor import random_scales, random_trits

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]


def _x(shape, dtype, device, gen):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("k", [1, 31, 33, 100, 2049])
def test_matmul_vs_dense_f64(k, dtype, device, gen):
    n = 24
    tt = TernaryTensor.from_trits(random_trits(n, k, gen), random_scales(n, gen)).to(device)
    x = _x((3, 5, k), dtype, device, gen)
    bias = _x((n,), dtype, device, gen)
    with poisoned():
        y = matmul(x, tt, bias)
    assert y.dtype == dtype and y.shape == (3, 5, n)
    # reference from the same (rounded) operands: scales * trits rounded to dtype, as the dense path expands
    ref = x.double() @ tt.to_float(dtype).double().T + bias.double()
    assert compare(f"ternary matmul k={k}", ref, y, dtype=dtype).ok
    if dtype == torch.float32:
        assert compare(f"ternary matmul vs f64 k={k}", matmul_dense_ref(x, tt, bias), y, dtype=dtype).ok


@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_matmul_sparse_zero_rows_and_chunks(m, device, gen):
    n, k = 40, 3 * CHUNK_COLS + 77
    trits = random_trits(n, k, gen, sparsity=0.95)
    trits[5] = 0
    trits[17] = 0
    trits[:, CHUNK_COLS : 2 * CHUNK_COLS] = 0
    trits[:20, 2 * CHUNK_COLS :] = 0
    tt = TernaryTensor.from_trits(trits, random_scales(n, gen)).to(device)
    assert tt.sparsity() > 0.9
    md = tt.sparsity_metadata()
    assert not md.is_chunk_active(0, 1) and not md.is_chunk_active(3, 2)
    x = _x((m, k), torch.float32, device, gen)
    y = matmul(x, tt)
    assert compare(f"sparse ternary matmul m={m}", matmul_dense_ref(x, tt), y, dtype=torch.float32).ok
    assert bool((y[:, 5] == 0).all()) and bool((y[:, 17] == 0).all())


@pytest.mark.parametrize("method", ["twn", "absmean"])
@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "per_tensor"])
def test_matmul_quantized_weights(method, per_row, device, gen):
    w = torch.randn(33, 257, generator=gen)
    w[4] = 0
    tt = TernaryTensor.from_float(w, method=method, per_row=per_row).to(device)
    x = _x((7, 257), torch.bfloat16, device, gen)
    y = matmul(x, tt)
    assert compare("quantized ternary matmul", x.double() @ tt.to_float(torch.bfloat16).double().T, y,
                   dtype=torch.bfloat16).ok


def test_matmul_bad_input(device, gen):
    tt = TernaryTensor.from_trits(random_trits(8, 40, gen), torch.ones(8)).to(device)
    x = _x((2, 40), torch.float32, device, gen)
    with pytest.raises(ValueError, match="x"):
        matmul(_x((2, 41), torch.float32, device, gen), tt)
    with pytest.raises(TypeError, match="x"):
        matmul(x.double(), tt)
    with pytest.raises(TypeError, match="x"):
        matmul(x.to(torch.int32), tt)
    with pytest.raises(TypeError, match="x"):
        matmul(x.tolist(), tt)
    with pytest.raises(TypeError, match="tt"):
        matmul(x, tt.to_float())
    with pytest.raises(ValueError, match="bias"):
        matmul(x, tt, torch.ones(7, device=device))
    with pytest.raises(TypeError, match="bias"):
        matmul(x, tt, torch.ones(8, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="x"):
        matmul(x.to("meta"), tt)
    assert matmul(x[:0], tt).shape == (0, 8)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [1, 33, 64, 128])
def test_ternary_attention_scores_vs_dense(d, causal, gen):
    t = 19
    q_t = TernaryTensor.from_trits(random_trits(t, d, gen, sparsity=0.6), random_scales(t, gen))
    k_t = TernaryTensor.from_trits(random_trits(t, d, gen, sparsity=0.6), random_scales(t, gen))
    s = ternary_attention_scores(q_t, k_t, causal=causal)
    assert s.dtype == torch.float32 and s.shape == (t, t)
    assert compare(f"ternary scores d={d} causal={causal}", attention_scores_ref(q_t, k_t, causal), s,
                   dtype=torch.float32).ok
    # the integer part is exact
    ints = q_t.trits().long() @ k_t.trits().long().T
    if causal:
        ints = torch.tril(ints)
        assert bool((s.triu(1) == 0).all())
    unit_q = TernaryTensor(q_t.plus, q_t.minus, torch.ones(1), q_t.shape)
    unit_k = TernaryTensor(k_t.plus, k_t.minus, torch.ones(1), k_t.shape)
    assert torch.equal(ternary_attention_scores(unit_q, unit_k, causal=causal).long(), ints)


def test_ternary_attention_rectangular_and_errors(gen):
    q_t = TernaryTensor.from_float(torch.randn(5, 64, generator=gen))
    k_t = TernaryTensor.from_float(torch.randn(9, 64, generator=gen))
    s = ternary_attention_scores(q_t, k_t)
    assert compare("ternary scores 5x9", attention_scores_ref(q_t, k_t), s, dtype=torch.float32).ok
    with pytest.raises(ValueError, match="causal"):
        ternary_attention_scores(q_t, k_t, causal=True)
    with pytest.raises(ValueError, match="k_t"):
        ternary_attention_scores(q_t, TernaryTensor.from_float(torch.randn(5, 32, generator=gen)))
    with pytest.raises(TypeError, match="q_t"):
        ternary_attention_scores(torch.randn(5, 64), k_t)


def test_hybrid_attention_paths(gen):
    q = torch.randn(12, 64, generator=gen)
    k = torch.randn(12, 64, generator=gen)
    s, path = hybrid_attention_scores(q, k, threshold=1.0, return_path=True)
    assert path == "float"
    assert compare("hybrid float path", q.double() @ k.double().T, s, dtype=torch.float32).ok
    s, path = hybrid_attention_scores(q, k, threshold=0.0, causal=True, return_path=True)
    assert path == "ternary"
    q_t, k_t = TernaryTensor.from_float(q), TernaryTensor.from_float(k)
    assert compare("hybrid ternary path", attention_scores_ref(q_t, k_t, causal=True), s, dtype=torch.float32).ok
    # sparse (mostly tiny) rows take the ternary path at the default threshold
    qs = torch.randn(12, 64, generator=gen) * (torch.rand(12, 64, generator=gen) < 0.1)
    ks = torch.randn(12, 64, generator=gen) * (torch.rand(12, 64, generator=gen) < 0.1)
    s, path = hybrid_attention_scores(qs.half(), ks.half(), return_path=True)
    assert path == "ternary" and s.dtype == torch.float16
    with pytest.raises(ValueError, match="k"):
        hybrid_attention_scores(q, k[:, :32])
    with pytest.raises(TypeError, match="q"):
        hybrid_attention_scores(q.double(), k)
    with pytest.raises(ValueError, match="threshold"):
        hybrid_attention_scores(q, k, threshold=2.0)
    with pytest.raises(ValueError, match="method"):
        hybrid_attention_scores(q, k, method="sign")


def test_skip_flag_follows_modify_dim(device, gen):
    """The cached "any inactive chunk" flag (read once, not per matmul) is reset by modify_dim, so the
    kernels start or stop skipping as chunks empty or fill."""
    trits = random_trits(3, CHUNK_COLS + 5, gen, sparsity=0.0)
    trits[1, CHUNK_COLS:] = 0
    trits[1, CHUNK_COLS + 3] = 1
    tt = TernaryTensor.from_trits(trits, random_scales(3, gen)).to(device)
    md = tt.sparsity_metadata()
    assert not md.has_inactive_chunks()
    x = _x((2, CHUNK_COLS + 5), torch.float32, device, gen)
    assert compare("all chunks active", matmul_dense_ref(x, tt), matmul(x, tt), dtype=torch.float32).ok
    assert tt.kernel_operands()[1] is None  # nothing to skip: the kernels get no activity map
    tt.modify_dim(1, CHUNK_COLS + 3, 0)  # row 1, chunk 1 is now empty
    assert md.has_inactive_chunks() and not md.is_chunk_active(1, 1)
    assert compare("an empty chunk, skipped", matmul_dense_ref(x, tt), matmul(x, tt), dtype=torch.float32).ok
    assert tt.kernel_operands()[1] is md.active  # the cached operands followed the edit
    tt.modify_dim(1, CHUNK_COLS, -1)
    assert not md.has_inactive_chunks()
    assert compare("refilled", matmul_dense_ref(x, tt), matmul(x, tt), dtype=torch.float32).ok
    assert tt.kernel_operands()[1] is None


def test_bench_peer_builds_each_weight_set_once(gen):
    """The bench's peers (cuBLAS fp16, gemlite) prepare their weights per TernaryTensor they are handed: each set
    once, the right set's form for each call (a peer that kept the first set would read one weight set, from L2 at
    the small shapes, while the bench rotates sets past it)."""
    from triforge.ops.ternary import _per_weight_set

    sets = [TernaryTensor.from_trits(random_trits(6, 40, gen), random_scales(6, gen)) for _ in range(3)]
    made = []

    def make(tt):
        made.append(tt)
        w = tt.to_float(torch.float64)
        return lambda x: (x @ w.T,)

    peer = _per_weight_set(make)
    x = torch.randn(2, 40, generator=gen, dtype=torch.float64)
    for rnd in range(2):
        for tt in sets:
            (y,) = peer(x, tt)
            torch.testing.assert_close(y, matmul_dense_ref(x, tt), rtol=1e-12, atol=1e-12)
    assert len(made) == 3 and all(a is b for a, b in zip(made, sets))


@pytest.mark.parametrize("kernel", ["gemv", "gemm"])
@pytest.mark.parametrize("m", [1, 5])
def test_plane_kernels_skip_the_chunks_marked_inactive(kernel, m, device, gen):
    """The plane kernels read the activity map, not only the planes: with the middle 2048-column chunk marked
    inactive for every row although it holds non-zero weights, the result is the product with that chunk zeroed (a
    K step is skipped when no row of a program's block is active there), and with the true map the full product."""
    from triforge.ops.ternary import kernels as K

    n, k = 12, 2 * CHUNK_COLS + 300
    trits = random_trits(n, k, gen, sparsity=0.3)
    tt = TernaryTensor.from_trits(trits, random_scales(n, gen)).to(device)
    active = K.chunk_activity(tt.plus, tt.minus)
    assert bool(active.all())
    lie = active.clone()
    lie[:, 1] = 0
    cut = trits.clone()
    cut[:, CHUNK_COLS:2 * CHUNK_COLS] = 0
    x = _x((m, k), torch.float32, device, gen)
    run = K.ternary_gemv if kernel == "gemv" else K.ternary_matmul
    dense = lambda t: x.double() @ (tt.scales.double().cpu()[:, None] * t.double()).T.to(device)  # noqa: E731
    with poisoned():
        y_true = run(x, tt.plus, tt.minus, tt.scales, active=active)
        y_lie = run(x, tt.plus, tt.minus, tt.scales, active=lie)
    assert compare("all chunks", dense(trits), y_true, dtype=torch.float32, verbose=False).ok
    assert compare("middle chunk skipped", dense(cut), y_lie, dtype=torch.float32, verbose=False).ok
    assert not torch.allclose(y_true, y_lie)
