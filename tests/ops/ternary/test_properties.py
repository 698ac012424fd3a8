"""Property tests (hypothesis): storage round trips and the exact A8 popcount product on random shapes."""

import pytest
import torch

from triforge.ops.ternary.reference import popcount_matmul_a8
from triforge.ops.ternary.tensor import SparsityMetadata, TernaryTensor, padding_mask

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@given(n=st.integers(1, 6), k=st.integers(1, 2200), sparsity=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1))
def test_storage_round_trips(n, k, sparsity, seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, k, generator=g)
    trits = torch.where(u < sparsity, 0, torch.where(torch.rand(n, k, generator=g) < 0.5, -1, 1)).to(torch.int8)
    tt = TernaryTensor.from_trits(trits, torch.rand(n, generator=g) + 0.5)
    assert torch.equal(tt.trits(), trits)
    assert not bool(((tt.plus & tt.minus) != 0).any())
    assert not bool((((tt.plus[:, -1] | tt.minus[:, -1]) & padding_mask(k)) != 0).any())
    assert torch.equal(TernaryTensor.unpack_base3(tt.pack_base3(), (n, k), tt.scales).trits(), trits)
    md = SparsityMetadata.from_ternary(tt)
    chunks = torch.nn.functional.pad(trits != 0, (0, md.n_chunks * 2048 - k)).view(n, md.n_chunks, 2048).any(-1)
    assert torch.equal(md.active.bool(), chunks)
    x = torch.randint(-128, 128, (3, k), generator=g, dtype=torch.int8)
    assert torch.equal(popcount_matmul_a8(x, tt), x.long() @ trits.long().T)
