"""2^x on the FMA pipes (triforge.ops._tl.exp2_emu), the attention forward's partial MUFU offload.

On any machine: a float32 model of the PTX sequence (clamp, round by the 1.5 * 2^23 magic, degree-4 polynomial on
[-1/2, 1/2], exponent bits added) against float64 2^x, so a wrong coefficient or step fails here. On a GPU: the PTX
itself, alone (every exponential emulated, and mixed with ex2.approx) and inside the attention forward (Triton kernel
with EMU = 8 and 3 of every 8) against the float64 references.
"""

import numpy as np
import pytest
import torch

import triforge  # noqa: F401
from triforge import _runtime
from triforge.ops._tl import EXP2_POLY, exp2_asm

_GPU = pytest.mark.skipif(not torch.cuda.is_available() or _runtime.INTERPRET, reason="inline PTX: compiled GPU only")


def _model(x):
    """The PTX of one emulated exponential in float32 steps (fma: exact product and sum, one rounding)."""
    x = np.maximum(np.asarray(x, np.float32), np.float32(-125.0))
    magic = np.float32(1.5 * 2**23)
    t = (x + magic).astype(np.float32)
    j = (t - magic).astype(np.float32)
    f = (x - j).astype(np.float32)
    c = [np.float32(v) for v in EXP2_POLY]
    p = np.full_like(f, c[0])
    for ci in c[1:]:
        p = (p.astype(np.float64) * f.astype(np.float64) + np.float64(ci)).astype(np.float32)
    bits = p.view(np.int32) + (t.view(np.int32) << 23)
    return bits.view(np.float32)


def test_model_accuracy():
    rng = np.random.default_rng()
    x = np.concatenate([np.linspace(-125.0, 0.0, 400_001, dtype=np.float32),
                        -rng.exponential(4.0, 100_000).astype(np.float32),  # the bulk of softmax arguments
                        np.arange(-125, 1, dtype=np.float32) + np.float32(0.5),  # the rounding ties
                        np.float32([0.0, -0.0, 1e-7, -1e-30, -124.99])])
    got = _model(x).astype(np.float64)
    ref = np.exp2(x.astype(np.float64))
    assert np.isfinite(got).all()
    rel = np.abs(got / ref - 1)
    assert rel.max() < 3e-6, (rel.max(), x[rel.argmax()])
    # below the clamp: 2^-125 (~2.4e-38), a normal number, never negative or NaN
    lo = _model(np.float32([-125.5, -126.0, -1e4, -3.4e38]))
    assert np.all(lo > 0) and np.all(lo <= np.float32(2.0**-125) * np.float32(1 + 1e-5))


def test_asm_emulates_the_first_n_of_each_pack():
    for n in range(9):
        s = exp2_asm(n)
        assert s.count("ex2.approx.ftz.f32") == 8 - n and s.count("fma.rn.f32") == 4 * n
        assert s.count("$") == 16  # each element's output and input, once each


@pytest.mark.gpu
@_GPU
@pytest.mark.parametrize("emu", [8, 3])
def test_ptx_matches_float64(emu):
    import triton
    import triton.language as tl

    from triforge.ops._tl import exp2_emu

    @triton.jit
    def k(x_ptr, y_ptr, n, EMU: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, exp2_emu(tl.load(x_ptr + offs, mask=offs < n, other=0.0), EMU), mask=offs < n)

    x = torch.cat([torch.linspace(-125.0, 0.0, 1 << 20), -torch.empty(1 << 18).exponential_(0.25),
                   torch.tensor([0.0, -126.0, -1e4, -3e38])]).cuda()
    n = x.numel()
    y = torch.full_like(x, float("nan"))
    k[(triton.cdiv(n, 1024),)](x, y, n, EMU=emu, BLOCK=1024)
    ref = torch.exp2(x.double())
    ok = x >= -125
    rel = (y.double()[ok] / ref[ok] - 1).abs()
    assert torch.isfinite(y).all() and rel.max() < 3e-6, rel.max()
    assert (y[~ok] >= 0).all() and (y[~ok] <= 2.0**-125 * (1 + 1e-5)).all()


@pytest.mark.gpu
@_GPU
@pytest.mark.parametrize("emu", [8, 3])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(2, 1000, 1000, 4, 2, 64), (1, 63, 517, 2, 1, 128), (2, 300, 129, 2, 2, 64)],
                         ids=lambda s: "B{}-Sq{}-Sk{}-H{}-Hkv{}-D{}".format(*s))
def test_triton_forward_with_emulated_exponentials(shape, dtype, causal, emu):
    """The Triton forward with EMU of every 8 exponentials of its unmasked tiles emulated (its tuned tile otherwise)
    against the float64 reference; 300 x 129 causal has rows that see no key (o = 0, lse = -inf)."""
    from triforge.launch import poisoned
    from triforge.ops import attention
    from triforge.ops.attention import attention_ref
    from triforge.testing import compare

    B, Sq, Sk, H, Hkv, D = shape
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype) for _ in range(2))
    cfg = {n: c for n, c in attention._cfg("flash_attn_fwd", D, causal, dtype).items() if n != "GLUON"}
    with poisoned():
        o, lse, _ = attention.attn_fwd(q, k, v, causal, D ** -0.5, dict(cfg, EMU=emu))
    ref = attention_ref(q.double(), k.double(), v.double(), causal)
    for name, r, got in (("o", ref["o"], o), ("lse", ref["lse"], lse)):
        res = compare(name, r, got, dtype=dtype, verbose=False)
        assert res.ok, res.line()
    if causal and Sq > Sk:
        assert (o[:, : Sq - Sk] == 0).all() and torch.isneginf(lse[:, :, : Sq - Sk]).all()


@pytest.mark.gpu
@_GPU
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_forward_large_scores_emulated(causal):
    """|q k^T| * scale ~ 1e3-1e4: arguments far below the clamp (-125) in every tile stay finite and correct."""
    from triforge.ops import attention
    from triforge.ops.attention import attention_ref
    from triforge.testing import compare

    q = 100.0 * torch.randn(2, 200, 4, 64, device="cuda")
    q = q.to(torch.bfloat16)
    k, v = (torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cfg = {n: c for n, c in attention._cfg("flash_attn_fwd", 64, causal, torch.bfloat16).items() if n != "GLUON"}
    o, lse, _ = attention.attn_fwd(q, k, v, causal, 64 ** -0.5, dict(cfg, EMU=8))
    ref = attention_ref(q.double(), k.double(), v.double(), causal)
    assert torch.isfinite(o).all()
    for name, r, got in (("o", ref["o"], o), ("lse", ref["lse"], lse)):
        res = compare(name, r, got, dtype=torch.bfloat16, verbose=False)
        assert res.ok, res.line()
