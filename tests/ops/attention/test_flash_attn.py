"""FlashAttention (``triforge.ops.attention.flash_attn_func``): forward o and lse against the float64
reference (and torch SDPA in float64 as a second, independent reference), gradients dq/dk/dv against
float64 autograd through the reference, flash-attn's bottom-right causal alignment with Sq != Sk,
rows that see no key, large scores, GQA/MQA, odd lengths, launch configs, strides, determinism,
torch.compile, opcheck, input validation and the registered ops.

Every kernel call runs under ``poisoned()`` (outputs start as NaN: an element the kernel never writes
fails). Under the interpreter the kernels use 16x16 tiles, so lengths 1, 17, 45 and 63 hit partial
blocks, masked diagonal blocks and multi-block loops; ``test_launch_configs`` also runs unequal
tiles (the GPU uses 128x64 forward tiles).
"""

import math

import pytest
import torch
import torch.nn.functional as F

import triforge  # noqa: F401  (sets TRITON_INTERPRET before triton kernels are defined)
import triforge.ops.attention as attn
from triforge import _runtime, registry, tune
from triforge.check import check_op
from triforge.launch import poisoned
from triforge.ops.attention import attention_ref, causal_mask, flash_attn_func
from triforge.testing import compare

F16 = [torch.float16, torch.bfloat16]
F16_IDS = ["fp16", "bf16"]


# ----------------------------------------------------------------------------- helpers


def _rand(shape, dtype, gen, scale=1.0):
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float32)).to(_runtime.default_device(), dtype)


def _qkv(B, Sq, Sk, H, Hkv, D, dtype, gen, q_scale=1.0):
    return (_rand((B, Sq, H, D), dtype, gen, q_scale), _rand((B, Sk, Hkv, D), dtype, gen), _rand((B, Sk, Hkv, D), dtype, gen))


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _assert_ok(name, ref, got, dtype):
    res = compare(name, ref, got, dtype=dtype, verbose=False)
    assert res.ok, res.line()


def _assert_ok_scaled(name, ref, got, dtype, scale):
    res = compare(name, ref, got, dtype=dtype, scale=scale, verbose=False)
    assert res.ok, res.line()


def _ref(q, k, v, causal, scale=None):
    return attention_ref(q.double(), k.double(), v.double(), causal, scale)


def _sdpa64(q, k, v, causal, scale=None):
    """torch SDPA (math backend, float64) with an explicit bottom-right mask; GQA by repeating k/v."""
    H, Hkv, Sq, Sk = q.shape[2], k.shape[2], q.shape[1], k.shape[1]
    qt = q.double().transpose(1, 2)
    kt = k.double().repeat_interleave(H // Hkv, 2).transpose(1, 2)
    vt = v.double().repeat_interleave(H // Hkv, 2).transpose(1, 2)
    mask = causal_mask(Sq, Sk, q.device) if causal else None
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale).transpose(1, 2)


def _seen_rows(Sq, Sk, causal):
    """[Sq] bool: query rows that see at least one key."""
    if not causal:
        return torch.ones(Sq, dtype=torch.bool)
    return causal_mask(Sq, Sk).any(-1)


def _check_forward(q, k, v, causal, dtype, scale=None):
    with poisoned():
        o, lse = flash_attn_func(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    B, Sq, H, D = q.shape
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (B, H, Sq) and lse.dtype == torch.float32
    ref = _ref(q, k, v, causal, scale)
    _assert_ok("lse", ref["lse"], lse, dtype)
    _assert_ok("o", ref["o"], o, dtype)
    assert not o.isnan().any() and not lse.isnan().any()
    seen = _seen_rows(Sq, k.shape[1], causal)
    if seen.any():
        _assert_ok("o vs sdpa64", _sdpa64(q, k, v, causal, scale)[:, seen], o[:, seen], dtype)
    # rows that see no key: exactly 0, lse -inf
    assert (o[:, ~seen] == 0).all()
    assert (lse[:, :, ~seen] == float("-inf")).all()
    assert lse[:, :, seen].isfinite().all()
    return o, lse


def _check_backward(q, k, v, causal, dtype, gen, scale=None, with_lse=False):
    ql, kl, vl = _leaf(q), _leaf(k), _leaf(v)
    do = _rand(q.shape, dtype, gen)
    B, Sq, H, _ = q.shape
    dlse = _rand((B, H, Sq), torch.float32, gen) if with_lse else None
    with poisoned():
        o, lse = flash_attn_func(ql, kl, vl, causal=causal, softmax_scale=scale, return_lse=True)
        outs, grads_out = ([o, lse], [do, dlse]) if with_lse else ([o], [do])
        dq, dk, dv = torch.autograd.grad(outs, (ql, kl, vl), grads_out)
    q64, k64, v64 = _leaf(q.double()), _leaf(k.double()), _leaf(v.double())
    ref = attention_ref(q64, k64, v64, causal, scale)
    if with_lse:
        seen = _seen_rows(Sq, k.shape[1], causal)
        # the reference's lse is -inf on unseen rows; they take no gradient there
        loss = (ref["o"] * do.double()).sum() + (ref["lse"][:, :, seen] * dlse.double()[:, :, seen]).sum()
        ref_grads = torch.autograd.grad(loss, (q64, k64, v64))
    else:
        ref_grads = torch.autograd.grad(ref["o"], (q64, k64, v64), do.double())
    # each element within atol of the larger of the tensor's rms and its own terms' rounding scale: in a causal
    # row that sees few keys, or a key seen by few rows, the terms are ~10-100x the rms and an element that
    # cancels keeps an error of a 16-bit ulp of them (length 1000: 0.74 of the rms bound over six runs; the
    # peaked test's near-ties failed it). The rms-relative error of the whole tensor is held to rel_rms as before.
    mags = attn.attention_magnitudes(q.double(), k.double(), v.double(), do.double(), causal, scale, dtype=dtype)
    for name, r, g, x in zip(("dq", "dk", "dv"), ref_grads, (dq, dk, dv), (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert g.isfinite().all(), f"{name} has NaN/Inf"
        whole = compare(f"{name} rel_rms", r, g, dtype=dtype, verbose=False)  # its element bound is not the check
        assert whole.rel_rms <= whole.tol.rel_rms, whole.line()
        rms = float(r.detach().double().square().mean().sqrt())
        _assert_ok_scaled(name, r, g, dtype, mags[name].clamp_min(rms))
    seen = _seen_rows(Sq, k.shape[1], causal)
    assert (dq[:, ~seen] == 0).all()  # rows that saw no key get no gradient
    return dq, dk, dv


# ----------------------------------------------------------------------------- forward parity

# (B, Sq, Sk, H, Hkv, D): one query/key; GQA; MQA at a near-block length; Sq < Sk; Sq > Sk (causal
# rows that see no key); the largest per test is 63 x 63 with 4 heads.
FWD_SHAPES = [
    (1, 1, 1, 2, 1, 32),
    (2, 17, 17, 4, 2, 64),
    (1, 63, 63, 4, 1, 32),
    (1, 17, 45, 2, 2, 64),
    (1, 45, 17, 4, 2, 32),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", F16, ids=F16_IDS)
@pytest.mark.parametrize("shape", FWD_SHAPES, ids=lambda s: "B{}-Sq{}-Sk{}-H{}-Hkv{}-D{}".format(*s))
def test_forward_matches_reference(shape, dtype, causal, gen):
    B, Sq, Sk, H, Hkv, D = shape
    _check_forward(*_qkv(B, Sq, Sk, H, Hkv, D, dtype, gen), causal, dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", F16, ids=F16_IDS)
def test_forward_head_dim_128(dtype, causal, gen):
    _check_forward(*_qkv(1, 19, 33, 2, 1, 128, dtype, gen), causal, dtype)


@pytest.mark.parametrize("dtype", F16, ids=F16_IDS)
def test_forward_head_dim_256(dtype, gen):
    _check_forward(*_qkv(1, 20, 9, 2, 2, 256, dtype, gen), True, dtype)


def test_forward_fp32(gen):
    _check_forward(*_qkv(2, 17, 30, 4, 2, 32, torch.float32, gen), True, torch.float32)


@pytest.mark.parametrize("dtype", F16, ids=F16_IDS)
def test_rows_that_see_no_key(dtype, gen):
    """Sq > Sk, causal: query i sees keys j <= i - (Sq - Sk); the first Sq - Sk rows see none."""
    B, Sq, Sk, H, Hkv, D = 2, 40, 7, 2, 1, 32
    o, lse = _check_forward(*_qkv(B, Sq, Sk, H, Hkv, D, dtype, gen), True, dtype)
    assert (o[:, : Sq - Sk] == 0).all() and (lse[:, :, : Sq - Sk] == float("-inf")).all()
    assert (o[:, Sq - Sk :].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", F16, ids=F16_IDS)
def test_large_scores_forward(dtype, causal, gen):
    """|QK^T| ~ 1e4: the online softmax stays finite and exact (scores in fp32, scale after the dot)."""
    B, Sq, Sk, H, Hkv, D = 1, 33, 40, 2, 1, 32
    q, k, v = _qkv(B, Sq, Sk, H, Hkv, D, dtype, gen, q_scale=1e4 / math.sqrt(D))
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(H // Hkv, 2))
    assert s.abs().max() > 1e4
    o, lse = _check_forward(q, k, v, causal, dtype)
    assert o.isfinite().all()


def test_softmax_scale(gen):
    q, k, v = _qkv(1, 17, 21, 2, 1, 32, torch.float16, gen)
    _check_forward(q, k, v, True, torch.float16, scale=0.37)
    _check_forward(q, k, v, False, torch.float16, scale=2)


@pytest.mark.parametrize("dtype", F16, ids=F16_IDS)
def test_deterministic(dtype, gen):
    """deterministic=True: two runs are bitwise equal, forward and backward (GQA with a split group:
    kv_split > 1). Without it only dq may differ (the GPU configs' atomic fp32 dQ), within rounding."""
    q, k, v = _qkv(1, 33, 29, 4, 1, 32, dtype, gen)
    do = _rand(q.shape, dtype, gen)
    for deterministic in (True, False):
        runs = []
        for _ in range(2):
            leaves = [_leaf(t) for t in (q, k, v)]
            o, lse = flash_attn_func(*leaves, causal=True, return_lse=True, deterministic=deterministic)
            runs.append((o, lse, *torch.autograd.grad(o, leaves, do)))
        for i, (a, b) in enumerate(zip(*runs)):
            if deterministic or i != 2:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


# ----------------------------------------------------------------------------- gradients

BWD_SHAPES = [
    (2, 17, 17, 4, 2, 32),
    (1, 45, 17, 4, 1, 64),  # Sq > Sk: causal rows that see no key; MQA
    (1, 17, 45, 2, 2, 64),  # Sq < Sk
    (1, 1, 1, 2, 1, 32),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", F16, ids=F16_IDS)
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=lambda s: "B{}-Sq{}-Sk{}-H{}-Hkv{}-D{}".format(*s))
def test_gradients_match_reference(shape, dtype, causal, gen):
    B, Sq, Sk, H, Hkv, D = shape
    _check_backward(*_qkv(B, Sq, Sk, H, Hkv, D, dtype, gen), causal, dtype, gen)


@pytest.mark.parametrize("dtype", F16, ids=F16_IDS)
def test_gradients_head_dim_128(dtype, gen):
    _check_backward(*_qkv(1, 23, 19, 2, 1, 128, dtype, gen), True, dtype, gen)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", F16, ids=F16_IDS)
def test_gradients_head_dim_256(dtype, gen):
    _check_backward(*_qkv(1, 20, 18, 2, 1, 256, dtype, gen), True, dtype, gen)


def test_gradients_fp32(gen):
    _check_backward(*_qkv(1, 21, 17, 4, 2, 32, torch.float32, gen), True, torch.float32, gen)


@pytest.mark.parametrize("dtype", F16, ids=F16_IDS)
def test_gradients_through_lse(dtype, gen):
    """return_lse: a loss on lse too (dlse folds into delta: dS = P * (dP - delta + dlse))."""
    _check_backward(*_qkv(1, 30, 17, 2, 1, 32, dtype, gen), True, dtype, gen, with_lse=True)


@pytest.mark.parametrize("dtype", F16, ids=F16_IDS)
def test_gradients_peaked_softmax(dtype, gen):
    """Logits with std ~40: nearly one-hot rows, where dq/dk come from the cancellation dP - delta.

    Each element is judged by the rounding of its terms (attention_magnitudes), not by the tensor's
    rms: a row whose top two keys nearly tie has terms ~10-100x the rms, and an element of it that
    cancels to ~0 keeps an error of about a 16-bit ulp of those terms (measured: at most 0.5% of its
    magnitude over 300 seeds). Against the rms that error failed the element bound in ~1 run in 500
    (CI, dq of such a row, 0.88-1.1x the bound). The scales are floored at fp32's smallest normal:
    probabilities below it (exp of a gap > 87) are not resolved by fp32 arithmetic, and gradients of
    ~1e-41 made of them came back 0. The rms-relative error of the whole tensor is still held to the
    dtype's rel_rms. What this test was first written to catch (delta from the rounded o alone) is
    caught exactly by test_backward_stages."""
    q, k, v = _qkv(1, 33, 40, 2, 1, 64, dtype, gen, q_scale=40.0)
    ql, kl, vl = _leaf(q), _leaf(k), _leaf(v)
    do = _rand(q.shape, dtype, gen)
    with poisoned():
        o = flash_attn_func(ql, kl, vl, causal=True)
        grads = torch.autograd.grad(o, (ql, kl, vl), do)
    q64, k64, v64 = _leaf(q.double()), _leaf(k.double()), _leaf(v.double())
    ref = torch.autograd.grad(attention_ref(q64, k64, v64, True)["o"], (q64, k64, v64), do.double())
    mags = attn.attention_magnitudes(q.double(), k.double(), v.double(), do.double(), True, dtype=dtype)
    for name, r, g in zip(("dq", "dk", "dv"), ref, grads):
        assert g.isfinite().all(), f"{name} has NaN/Inf"
        whole = compare(f"{name} rel_rms", r, g, dtype=dtype, verbose=False)  # its element bound is not the check
        assert whole.rel_rms <= whole.tol.rel_rms, whole.line()
        _assert_ok_scaled(name, r, g, dtype, mags[name])


@pytest.mark.parametrize("dtype", F16, ids=F16_IDS)
def test_gradients_large_scores_finite(dtype, gen):
    """|QK^T| ~ 1e4: every gradient is finite and dv (= P^T dO) is right. The exact dq/dk here are
    ~exp(-gap between the top scores), mostly far below fp32's resolution of dP - delta (any fp32
    kernel returns rounding noise for them), so they are only required to be finite;
    test_gradients_peaked_softmax checks dq/dk where softmax is nearly one-hot but resolvable."""
    q, k, v = _qkv(1, 33, 40, 2, 1, 32, dtype, gen, q_scale=1e4 / math.sqrt(32))
    do = _rand(q.shape, dtype, gen)
    leaves = [_leaf(t) for t in (q, k, v)]
    with poisoned():
        o = flash_attn_func(*leaves, causal=True)
        dq, dk, dv = torch.autograd.grad(o, leaves, do)
    leaves64 = [_leaf(t.double()) for t in (q, k, v)]
    ref = torch.autograd.grad(attention_ref(*leaves64, True)["o"], leaves64, do.double())
    for g in (dq, dk, dv):
        assert g.isfinite().all()
    _assert_ok("dv", ref[2], dv, dtype)


@pytest.mark.parametrize("dtype", F16, ids=F16_IDS)
def test_backward_stages(dtype, gen):
    """The debug stages: o_res is o's rounding error (o + o_res is the kernel's fp32 o to ~16 bits);
    delta = rowsum(dO * O) - dlse, summed from o + o_res: equal to that float64 sum within fp32's
    summation bound (D + 2 roundings of 2^-24 each, relative to the sum of |terms|; measured ~1e-7),
    where a delta from the rounded o alone differs by >= 5.6e-5 (fp16; bf16 >= 4e-4) and fails. In
    nearly one-hot rows that difference is the whole of dq (test_gradients_peaked_softmax)."""
    q, k, v = _qkv(1, 30, 21, 2, 1, 32, dtype, gen)
    do = _rand(q.shape, dtype, gen)
    dlse = _rand((1, 2, 30), torch.float32, gen)
    with poisoned():
        st = attn.flash_attn_bwd_stages(q, k, v, do, causal=True, dlse=dlse)
    assert list(st) == ["lse", "o", "o_res", "delta", "dk", "dv", "dq"]
    ref = _ref(q, k, v, True)
    o_full = st["o"].double() + st["o_res"].double()  # the kernel's fp32 o (to ~16 bits in bf16)
    # o is o_full rounded to bf16: o_res is at most half an ulp of o (<= 2^-8 |o|), and not all zero
    assert (st["o_res"].double().abs() <= st["o"].double().abs() * 2**-8).all() and (st["o_res"] != 0).any()
    assert (o_full - ref["o"]).norm() < (st["o"].double() - ref["o"]).norm()
    delta_ref = (do.double() * ref["o"]).sum(-1).transpose(1, 2) - dlse.double()
    _assert_ok("delta", delta_ref, st["delta"], dtype)
    terms = do.double() * o_full
    own = terms.sum(-1).transpose(1, 2) - dlse.double()
    bound = (q.shape[-1] + 2) * 2.0**-24 * (terms.abs().sum(-1).transpose(1, 2) + dlse.double().abs())
    assert ((st["delta"].double() - own).abs() <= bound).all()
    rounded = (do.double() * st["o"].double()).sum(-1).transpose(1, 2) - dlse.double()
    assert ((rounded - own).abs() > bound).any()  # the bound tells the two apart


# ----------------------------------------------------------------------------- launch configs, GQA split


CONFIGS = [(16, 32), (32, 16), (32, 32), (64, 16)]


@pytest.mark.parametrize("bm,bn", CONFIGS, ids=[f"{m}x{n}" for m, n in CONFIGS])
def test_launch_configs(bm, bn, gen):
    """Unequal tiles for all three kernels (the causal block ranges depend on both), Sq != Sk both ways."""
    dtype = torch.float16
    for Sq, Sk in ((37, 70), (70, 37)):
        q, k, v = _qkv(1, Sq, Sk, 2, 1, 32, dtype, gen)
        do = _rand(q.shape, dtype, gen)
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4, "num_stages": 1}
        scale = 32**-0.5
        leaves64 = [_leaf(t.double()) for t in (q, k, v)]
        ref = attention_ref(*leaves64, True)
        ref_grads = torch.autograd.grad(ref["o"], leaves64, do.double())
        with poisoned():
            o, lse, o_res = attn.attn_fwd(q, k, v, True, scale, cfg, residual=True)
            delta = attn.attn_bwd_preprocess(o, do, o_res)
            dk, dv = attn.attn_bwd_dkdv(q, k, v, do, lse, delta, True, scale, cfg)
            dq = attn.attn_bwd_dq(q, k, v, do, lse, delta, True, scale, cfg)
        _assert_ok("lse", ref["lse"], lse, dtype)
        _assert_ok("o", ref["o"], o, dtype)
        for name, r, g in zip(("dq", "dk", "dv"), ref_grads, (dq, dk, dv)):
            _assert_ok(name, r, g, dtype)


@pytest.mark.parametrize("split", [1, 2, 4])
def test_gqa_kv_split(split, gen):
    """dK/dV of a kv head summed over its 4 query heads by 1, 2 or 4 programs: same result."""
    dtype = torch.bfloat16
    q, k, v = _qkv(2, 21, 26, 4, 1, 32, dtype, gen)
    do = _rand(q.shape, dtype, gen)
    scale = 32**-0.5
    leaves64 = [_leaf(t.double()) for t in (q, k, v)]
    ref = torch.autograd.grad(attention_ref(*leaves64, False)["o"], leaves64, do.double())
    with poisoned():
        o, lse, o_res = attn.attn_fwd(q, k, v, False, scale, residual=True)
        delta = attn.attn_bwd_preprocess(o, do, o_res)
        dk, dv = attn.attn_bwd_dkdv(q, k, v, do, lse, delta, False, scale, kv_split=split)
    _assert_ok("dk", ref[1], dk, dtype)
    _assert_ok("dv", ref[2], dv, dtype)


# the Hopper variants in the interpreter: tensor descriptors (TMA), the warp-specialized forward's
# single key loop (WARP_SPEC, masking every tile), dQ accumulated by the dK/dV kernel (ATOMIC_DQ:
# plain atomic adds here; the TMA reduction is compiled-only)
VARIANTS = [
    ({"TMA": 1}, {"TMA": 1}, {"TMA": 1}),
    ({"TMA": 1, "WARP_SPEC": 1}, {"ATOMIC_DQ": 1}, {}),
    ({}, {"TMA": 1, "ATOMIC_DQ": 2}, {}),
]


@pytest.mark.parametrize("fwd,dkdv,dq", VARIANTS, ids=["tma", "warpspec-atomic", "atomic-tma"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_variants(fwd, dkdv, dq, causal, gen):
    """Each variant against float64: unequal tiles, Sq != Sk both ways (rows that see no key), a
    multiple of the key tile (WARP_SPEC's unmasked loop when not causal), GQA with a split group."""
    dtype = torch.bfloat16
    scale = 32**-0.5
    for Sq, Sk in ((37, 70), (70, 37), (32, 48)):
        q, k, v = _qkv(1, Sq, Sk, 4, 1, 32, dtype, gen)
        do = _rand(q.shape, dtype, gen)
        base = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
        leaves64 = [_leaf(t.double()) for t in (q, k, v)]
        ref = attention_ref(*leaves64, causal)
        ref_grads = torch.autograd.grad(ref["o"], leaves64, do.double())
        assert attn._tma_ok(q, k, v, do)
        with poisoned():
            o, lse, o_res = attn.attn_fwd(q, k, v, causal, scale, {**base, **fwd}, residual=True)
            dq_, dk, dv = attn.attn_bwd(do, q, k, v, o, o_res, lse, None, causal, scale,
                                        cfg_dkdv={**base, "BLOCK_M": 16, "BLOCK_N": 32, **dkdv}, cfg_dq={**base, **dq})
        _assert_ok("lse", ref["lse"], lse, dtype)
        _assert_ok("o", ref["o"], o, dtype)
        for name, r, g in zip(("dq", "dk", "dv"), ref_grads, (dq_, dk, dv)):
            _assert_ok(name, r, g, dtype)
        seen = _seen_rows(Sq, Sk, causal)
        assert (o[:, ~seen] == 0).all() and (dq_[:, ~seen] == 0).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_guarded_key_loops_change_nothing(causal, gen):
    """GUARD (each key loop inside ``if lo < hi``, against ptxas's wgmma serialization) only skips loops that run
    no trip: o, lse and dq bit-equal with it off, where whole-tile, boundary-only and empty key ranges occur
    (Sk a multiple of the tile, Sq > Sk with causal rows that see no key, Sk < one tile)."""
    for Sq, Sk in ((32, 32), (40, 17), (5, 48)):
        q, k, v = _qkv(1, Sq, Sk, 2, 1, 32, torch.float16, gen)
        do = torch.randn(q.shape, generator=gen, dtype=torch.float32).to(q.device, q.dtype)
        outs = []
        for guard in (1, 0):
            cfg = dict(attn._cfg("flash_attn_fwd", 32, causal, q.dtype), GUARD=guard)
            o, lse, o_res = attn.attn_fwd(q, k, v, causal, 32**-0.5, cfg, residual=True)
            delta = attn.attn_bwd_preprocess(o, do, o_res)
            cfg_dq = dict(attn._cfg("flash_attn_bwd_dq", 32, causal, q.dtype), GUARD=guard)
            outs.append((o, lse, attn.attn_bwd_dq(q, k, v, do, lse, delta, causal, 32**-0.5, cfg_dq)))
        for name, a, b in zip(("o", "lse", "dq"), *outs):
            assert name == "lse" or torch.isfinite(a).all(), name  # lse is -inf on rows that see no key
            assert torch.equal(a, b), (name, Sq, Sk)


def test_tma_falls_back_on_misaligned_inputs(gen):
    """q starting 2 bytes past a 16-byte boundary: no tensor descriptors, the plain loads, same result."""
    dtype = torch.float16
    q, k, v = _qkv(1, 21, 19, 2, 1, 32, dtype, gen)
    q_off = torch.empty(q.numel() + 1, dtype=dtype, device=q.device)[1:].view(q.shape)
    q_off.copy_(q)
    assert not attn._tma_ok(q_off, k, v) and attn._tma_ok(q, k, v)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "TMA": 1, "WARP_SPEC": 1}
    flags = {"TMA": False, "WARP_SPEC": False, "EVEN_N": False, "GUARD": True, "EMU": 0}
    assert attn._fwd_variant(cfg, q_off, k, v, None, 19) == (flags, 8)
    assert attn._fwd_variant(cfg, q, k, v, None, 32)[1] == 4  # one consumer warpgroup's warps
    with pytest.raises(ValueError, match="WARP_SPEC needs TMA"):
        attn._fwd_variant({**cfg, "TMA": 0}, q, k, v, None, 19)
    with poisoned():
        got = attn.attn_fwd(q_off, k, v, True, 0.2, cfg)[0]
        want = attn.attn_fwd(q, k, v, True, 0.2, {**cfg, "TMA": 0, "WARP_SPEC": 0})[0]
    assert torch.equal(got, want)


def test_deterministic_flag_selects_the_dq_kernel(gen, monkeypatch):
    """With an ATOMIC_DQ config, flash_attn_func's backward converts the dK/dV kernel's dQ sums, unless
    deterministic=True (then the dQ kernel runs); both are right."""
    dtype = torch.bfloat16
    q, k, v = _qkv(1, 23, 31, 4, 2, 32, dtype, gen)
    do = _rand(q.shape, dtype, gen)
    cfg = attn._cfg

    def atomic_cfg(kernel, D, causal, dt, varlen=False):
        return {**cfg(kernel, D, causal, dt, varlen), **({"ATOMIC_DQ": 1} if kernel == "flash_attn_bwd_dkdv" else {})}

    calls = []
    convert = attn.attn_bwd_dq_convert
    monkeypatch.setattr(attn, "_cfg", atomic_cfg)
    monkeypatch.setattr(attn, "attn_bwd_dq_convert", lambda *a: calls.append(1) or convert(*a))
    leaves64 = [_leaf(t.double()) for t in (q, k, v)]
    ref = torch.autograd.grad(attention_ref(*leaves64, True)["o"], leaves64, do.double())
    for deterministic, n_calls in ((False, 1), (True, 1)):
        leaves = [_leaf(t) for t in (q, k, v)]
        with poisoned():
            o = flash_attn_func(*leaves, causal=True, deterministic=deterministic)
            grads = torch.autograd.grad(o, leaves, do)
        assert len(calls) == n_calls
        for name, r, g in zip(("dq", "dk", "dv"), ref, grads):
            _assert_ok(name, r, g, dtype)


def test_kv_split_heuristic():
    sms = _runtime.num_sms()
    assert attn.kv_split_for(2 * sms, 1, 1, 8) == 1  # the kv heads alone give two programs per SM
    assert attn.kv_split_for(1, 1, 1, 8) == 8  # one key block: split the whole group
    assert attn.kv_split_for(1, 1, 1, 6) in (1, 2, 3, 6)
    assert attn.kv_split_for(1, 1, 1, 1) == 1


def test_varlen_launches_take_their_own_config_entry(tmp_path, monkeypatch):
    """A packed launch compiles a different kernel: an entry under the varlen=1 key wins for it, the dense
    entry (then the fallback) otherwise; dense launches never read the varlen entry. The sm90 file has both
    for the dK/dV kernel at D = 128 (the dense tile spills in the varlen kernel)."""
    import json

    from triforge import launch

    monkeypatch.setattr(launch, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(_runtime, "arch", lambda: "sm_test_varlen")
    monkeypatch.setattr(_runtime, "config_scope", lambda: ("sm_test_varlen", "test-device"))
    monkeypatch.setattr(_runtime, "INTERPRET", False)
    dense = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "TMA": 1}
    packed = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "TMA": 1}
    key = attn.config_key(128, True, torch.bfloat16)
    vkey = attn.config_key(128, True, torch.bfloat16, varlen=True)
    assert vkey != key and "varlen=1" in vkey and "varlen" not in key
    table = {"flash_attn_bwd_dkdv": {key: dense, vkey: packed}, "flash_attn_bwd_dq": {key: dense}}
    (tmp_path / "sm_test_varlen.json").write_text(json.dumps({"kernels": table}))
    launch.reload()
    try:
        assert attn._cfg("flash_attn_bwd_dkdv", 128, True, torch.bfloat16) == dense
        assert attn._cfg("flash_attn_bwd_dkdv", 128, True, torch.bfloat16, varlen=True) == packed
        assert attn._cfg("flash_attn_bwd_dq", 128, True, torch.bfloat16, varlen=True) == dense  # no varlen entry
        fb = attn.fallback_config("flash_attn_fwd", 128, torch.bfloat16, True)
        assert attn._cfg("flash_attn_fwd", 128, True, torch.bfloat16, varlen=True) == fb  # no entry at all
    finally:
        launch.reload()


def test_sm90_attention_entries():
    """The H100 entries of benchmarks/attention_bwd_sweep.py: every (D, causal, dtype) key of the three kernels
    at D = 64 and 128 has one, with every tile key (TMA explicit: a missing key would come from the fallback)."""
    import json

    from triforge import launch

    table = json.loads((launch.CONFIG_DIR / "sm90.json").read_text())
    for kernel in ("flash_attn_fwd", "flash_attn_bwd_dkdv", "flash_attn_bwd_dq"):
        for D in (64, 128):
            for causal in (False, True):
                for dtype in (torch.bfloat16, torch.float16):
                    cfg = table["kernels"][kernel][attn.config_key(D, causal, dtype)]
                    keys = {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "TMA"}
                    assert keys <= set(cfg) <= keys | {"GUARD", "GLUON"}, (kernel, D, causal)

                    # the Gluon forward (forward_ws.py) where it measured faster: D = 128
                    assert ("GLUON" in cfg) == (kernel == "flash_attn_fwd" and D == 128), (kernel, D, causal)
                    if "GLUON" in cfg:
                        assert set(cfg["GLUON"]) == {"BLOCK_N", "num_stages"}
                    assert table["provenance"][f"{kernel}[{attn.config_key(D, causal, dtype)}]"]["device"].startswith(
                        "NVIDIA H100")
    for causal in (False, True):
        assert table["kernels"]["flash_attn_bwd_dkdv"][attn.config_key(128, causal, torch.bfloat16, varlen=True)][
            "BLOCK_M"] == 32


def test_interpreter_and_fallback_configs():
    for kernel in ("flash_attn_fwd", "flash_attn_bwd_dkdv", "flash_attn_bwd_dq"):
        for D in attn.HEAD_DIMS:
            cfg = attn._cfg(kernel, D, True, torch.bfloat16)
            assert set(cfg) >= {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}
            if _runtime.INTERPRET:
                assert cfg["BLOCK_M"] == cfg["BLOCK_N"] == 16
    bf16 = torch.bfloat16
    # the measured H100 configs: at D = 128 the TMA loads where they were faster (non-causal forward,
    # both backward kernels), the portable path elsewhere
    assert attn.fallback_config("flash_attn_fwd", 128, bf16, causal=True) == {
        "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    assert attn.fallback_config("flash_attn_fwd", 128, bf16, causal=False) == {
        "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "TMA": 1}
    assert attn.fallback_config("flash_attn_fwd", 64, bf16, causal=False) == {
        "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    assert attn.fallback_config("flash_attn_bwd_dkdv", 128, torch.float16)["TMA"] == 1
    assert attn.fallback_config("flash_attn_bwd_dq", 128, bf16)["TMA"] == 1
    for kernel in ("flash_attn_fwd", "flash_attn_bwd_dkdv", "flash_attn_bwd_dq"):
        for D in attn.HEAD_DIMS:
            for dtype in (torch.float16, bf16, torch.float32):
                for causal in (False, True):
                    cfg = attn.fallback_config(kernel, D, dtype, causal)
                    assert cfg["BLOCK_M"] >= 16 and cfg["BLOCK_N"] >= 16
                    # warp specialization miscompiles on Triton 3.6; atomic dQ is not deterministic
                    assert not (cfg.get("WARP_SPEC") or cfg.get("ATOMIC_DQ")), (kernel, D, dtype, causal)
                    if dtype == torch.float32 or D != 128:  # the portable path only
                        assert not cfg.get("TMA"), (kernel, D, dtype, causal)
    assert {"flash_attn_fwd", "flash_attn_bwd_dkdv", "flash_attn_bwd_dq"} <= set(tune.all_tunables())
    for kernel, space in attn.TUNE_SPACES.items():
        assert tune.get(kernel).space == space and len(tune.grid(space)) <= 24


# ----------------------------------------------------------------------------- layouts, compile, opcheck


def test_non_contiguous_inputs(gen):
    """[B, H, S, D] tensors seen as [B, S, H, D] (strided heads, the kernels read them in place) and a
    strided last dim (copied), forward and backward."""
    dtype = torch.float16
    B, S, H, Hkv, D = 1, 19, 4, 2, 32
    q_bh = _rand((B, H, S, D), dtype, gen)
    k_bh = _rand((B, Hkv, S, D), dtype, gen)
    v_wide = _rand((B, S, Hkv, 2 * D), dtype, gen)
    q, k, v = q_bh.transpose(1, 2), k_bh.transpose(1, 2), v_wide[..., ::2]
    assert not q.is_contiguous() and v.stride(-1) == 2
    with poisoned():
        got = flash_attn_func(q, k, v, causal=True)
        want = flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(got, want)
    _assert_ok("o", _ref(q, k, v, True)["o"], got, dtype)
    # gradients through the views
    leaves = [_leaf(q_bh), _leaf(k_bh), _leaf(v_wide)]
    do = _rand((B, S, H, D), dtype, gen)
    with poisoned():
        o = flash_attn_func(leaves[0].transpose(1, 2), leaves[1].transpose(1, 2), leaves[2][..., ::2], causal=True)
        grads = torch.autograd.grad(o, leaves, do)
    leaves64 = [_leaf(t.double()) for t in (q_bh, k_bh, v_wide)]
    o64 = attention_ref(leaves64[0].transpose(1, 2), leaves64[1].transpose(1, 2), leaves64[2][..., ::2], True)["o"]
    for name, r, g in zip(("dq", "dk", "dv"), torch.autograd.grad(o64, leaves64, do.double()), grads):
        _assert_ok(name, r, g, dtype)


def test_expanded_upstream_gradient(gen):
    """o.sum(): dO is an expanded (stride-0) tensor."""
    q, k, v = _qkv(1, 17, 17, 2, 1, 32, torch.float16, gen)
    leaves = [_leaf(t) for t in (q, k, v)]
    with poisoned():
        grads = torch.autograd.grad(flash_attn_func(*leaves, causal=True).float().sum(), leaves)
    leaves64 = [_leaf(t.double()) for t in (q, k, v)]
    ref = torch.autograd.grad(attention_ref(*leaves64, True)["o"].sum(), leaves64)
    for name, r, g in zip(("dq", "dk", "dv"), ref, grads):
        _assert_ok(name, r, g, torch.float16)


def test_eager_calls_without_autograd_skip_the_custom_op(gen, monkeypatch):
    """flash_attn_func with no input requiring grad (or under no_grad) calls the launcher directly, skipping the custom
    op's dispatch (host time), with the op's result bit for bit; with autograd it goes through the op."""
    q, k, v = _qkv(2, 37, 50, 4, 2, 32, torch.bfloat16, gen)
    via_op = []
    real = torch.ops.triforge.flash_attn_fwd
    monkeypatch.setattr(torch.ops.triforge, "flash_attn_fwd", lambda *a: (via_op.append(1), real(*a))[1])
    with poisoned():
        o, lse = attn.flash_attn_func(q, k, v, causal=True, return_lse=True)
        o_op, lse_op, _ = real(q, k, v, True, 32**-0.5, False, False)
    assert not via_op
    assert torch.equal(o, o_op) and torch.equal(lse, lse_op)
    qg = q.clone().requires_grad_()
    attn.flash_attn_func(qg, k, v, causal=True).float().sum().backward()
    assert via_op == [1] and qg.grad is not None and torch.isfinite(qg.grad).all()
    with torch.no_grad():
        attn.flash_attn_func(qg, k, v, causal=True)
    assert via_op == [1]


def test_torch_compile_fullgraph(gen):
    dtype = torch.bfloat16

    def f(q, k, v):
        o, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        o2 = flash_attn_func(q * 0.5, k, v, softmax_scale=0.2)
        return (o.float() * o2.float()).sum() + lse[:, :, 4:].sum()  # rows 0-3 see no key: lse -inf

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    base = _qkv(1, 21, 17, 4, 2, 32, dtype, gen)
    eager_in, comp_in = [_leaf(t) for t in base], [_leaf(t) for t in base]
    with poisoned():
        loss_e = f(*eager_in)
        loss_c = compiled(*comp_in)
        grads_e = torch.autograd.grad(loss_e, eager_in)
        grads_c = torch.autograd.grad(loss_c, comp_in)
    torch.testing.assert_close(loss_c, loss_e, rtol=0, atol=0)
    for ge, gc in zip(grads_e, grads_c):
        torch.testing.assert_close(gc, ge, rtol=0, atol=0)
    # and the compiled gradients are right
    leaves64 = [_leaf(t.double()) for t in base]
    q64, k64, v64 = leaves64
    r1 = attention_ref(q64, k64, v64, True)
    r2 = attention_ref(q64 * 0.5, k64, v64, False, 0.2)
    seen = _seen_rows(21, 17, True)
    assert seen.tolist() == [False] * 4 + [True] * 17
    loss64 = (r1["o"] * r2["o"]).sum() + r1["lse"][:, :, 4:].sum()
    for name, r, g in zip(("dq", "dk", "dv"), torch.autograd.grad(loss64, leaves64), grads_c):
        _assert_ok(name, r, g, dtype)


def test_custom_ops_pass_opcheck(gen):
    """torch.library.opcheck: schema, fakes, autograd registration and AOT dispatch."""
    q, k, v = _qkv(1, 5, 7, 2, 1, 32, torch.float16, gen)
    ops = torch.ops.triforge
    torch.library.opcheck(ops.flash_attn_fwd.default, (_leaf(q), _leaf(k), _leaf(v), True, 0.3, True))
    torch.library.opcheck(ops.flash_attn_fwd.default, (q, k, v, False, 0.3, False))
    o, lse, o_res = ops.flash_attn_fwd(q, k, v, True, 0.3, True)
    do = _rand(q.shape, torch.float16, gen)
    dlse = _rand(lse.shape, torch.float32, gen)
    torch.library.opcheck(ops.flash_attn_bwd.default, (do, q, k, v, o, o_res, lse, dlse, True, 0.3))
    torch.library.opcheck(ops.flash_attn_bwd.default, (do, q, k, v, o, None, lse, None, False, 0.3))
    torch.library.opcheck(ops.flash_attn_fwd.default, (_leaf(q), _leaf(k), _leaf(v), False, 0.3, True, True))
    torch.library.opcheck(ops.flash_attn_bwd.default, (do, q, k, v, o, o_res, lse, dlse, True, 0.3, True))


# ----------------------------------------------------------------------------- validation


def _bad_cases():
    d = _runtime.default_device()
    q = torch.randn(2, 5, 4, 32, device=d, dtype=torch.float16)
    k = torch.randn(2, 7, 2, 32, device=d, dtype=torch.float16)
    f = flash_attn_func
    return [
        ("q-not-tensor", lambda: f(q.tolist(), k, k), TypeError, r"q must be a torch.Tensor"),
        ("q-3d", lambda: f(q[0], k, k), ValueError, r"q must have 4 dimensions"),
        ("q-int", lambda: f(q.long(), k, k), TypeError, r"q must have dtype"),
        ("q-fp64", lambda: f(q.double(), k.double(), k.double()), TypeError, r"q must have dtype"),
        ("q-empty", lambda: f(q[:, :0], k, k), ValueError, r"q must not be empty"),
        ("k-empty", lambda: f(q, k[:, :0], k[:, :0]), ValueError, r"k must not be empty"),
        ("k-3d", lambda: f(q, k[0], k), ValueError, r"k must have 4 dimensions"),
        ("v-dtype", lambda: f(q, k, k.bfloat16()), TypeError, r"v must have the same dtype as q"),
        ("k-dtype", lambda: f(q, k.float(), k), TypeError, r"k must have the same dtype as q"),
        ("head-dim-16", lambda: f(q[..., :16], k[..., :16], k[..., :16]), ValueError, r"q has head_dim"),
        ("head-dim-96", lambda: f(torch.randn(1, 3, 2, 96, device=d, dtype=torch.float16),
                                   torch.randn(1, 3, 2, 96, device=d, dtype=torch.float16),
                                   torch.randn(1, 3, 2, 96, device=d, dtype=torch.float16)), ValueError, r"q has head_dim"),
        ("k-batch", lambda: f(q, k[:1], k[:1]), ValueError, r"k must be \[B, Sk, Hkv, D\]"),
        ("k-head-dim", lambda: f(q, torch.randn(2, 7, 2, 64, device=d, dtype=torch.float16),
                                 torch.randn(2, 7, 2, 64, device=d, dtype=torch.float16)), ValueError, r"k must be"),
        ("v-shape", lambda: f(q, k, k[:, :6]), ValueError, r"v must have the same shape as k"),
        ("kv-heads", lambda: f(q, torch.randn(2, 7, 3, 32, device=d, dtype=torch.float16),
                               torch.randn(2, 7, 3, 32, device=d, dtype=torch.float16)), ValueError, r"k has 3 heads"),
        ("v-device", lambda: f(q, k, k.to("meta")), ValueError, r"v must be a (CPU|CUDA) tensor"),
        ("scale-zero", lambda: f(q, k, k, softmax_scale=0.0), ValueError, r"softmax_scale must be a positive"),
        ("scale-negative", lambda: f(q, k, k, softmax_scale=-1.0), ValueError, r"softmax_scale must be a positive"),
        ("scale-nan", lambda: f(q, k, k, softmax_scale=float("nan")), ValueError, r"softmax_scale must be a positive"),
        ("scale-str", lambda: f(q, k, k, softmax_scale="0.1"), TypeError, r"softmax_scale must be"),
        ("scale-tensor", lambda: f(q, k, k, softmax_scale=torch.tensor(0.1)), TypeError, r"softmax_scale must be"),
        ("causal-str", lambda: f(q, k, k, causal="yes"), TypeError, r"causal must be a bool"),
        ("deterministic-int", lambda: f(q, k, k, deterministic=1), TypeError, r"deterministic must be a bool"),
        # flash-attn's fourth positional argument is dropout_p
        ("causal-float", lambda: f(q, k, k, 0.0), TypeError, r"causal must be a bool, got float \(flash-attn"),
        ("dropout", lambda: f(q, k, k, dropout_p=0.1), NotImplementedError, r"dropout_p=0.1"),
        ("window", lambda: f(q, k, k, window_size=(8, 0)), NotImplementedError, r"window_size"),
        ("softcap", lambda: f(q, k, k, softcap=30.0), NotImplementedError, r"softcap"),
        ("alibi", lambda: f(q, k, k, alibi_slopes=torch.ones(4)), NotImplementedError, r"alibi_slopes"),
        ("attn-probs", lambda: f(q, k, k, return_attn_probs=True), NotImplementedError, r"return_attn_probs"),
    ]


def test_flash_attn_keywords_at_plain_values(gen):
    """A flash-attn style call, every argument by keyword (dropout_p 0, no window, no softcap, no ALiBi): the same
    output as the plain call, bit for bit."""
    q, k, v = _qkv(1, 9, 11, 2, 1, 32, torch.float16, gen)
    plain = flash_attn_func(q, k, v, causal=True, softmax_scale=0.2)
    fa = flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=0.2, causal=True, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, deterministic=False, return_attn_probs=False)
    assert torch.equal(plain, fa)


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input(case):
    _, call, exc, match = case
    with pytest.raises(exc, match=match):
        call()


# ----------------------------------------------------------------------------- reference + registry


def test_chunked_reference_equals_reference(gen):
    """The registry's reference (head slices, checkpointed under autograd) is attention_ref."""
    q, k, v = (t.double() for t in _qkv(2, 9, 11, 4, 2, 32, torch.float32, gen))
    do = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(q.device)
    for causal in (False, True):
        a = [_leaf(t) for t in (q, k, v)]
        b = [_leaf(t) for t in (q, k, v)]
        ra = attention_ref(*a, causal)
        rb = attn.attention_ref_chunked(*b, causal, max_scores=1)
        for name in ("lse", "o"):
            torch.testing.assert_close(rb[name], ra[name], rtol=1e-12, atol=1e-12)
        ga = torch.autograd.grad(ra["o"], a, do)
        gb = torch.autograd.grad(rb["o"], b, do)
        for x, y in zip(ga, gb):
            torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["flash_attn", "flash_attn_causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_registered_op_passes_check(name, dtype, gen):
    spec = registry.get(name)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    result = check_op(spec, dtype, tier="tiny", seed=seed)  # the real tier: tests/test_gpu.py
    assert result.error is None, result.error
    assert result.ok, f"seed {seed}\n" + "\n".join(r.line() for r in result.results)
    assert [r.name for r in result.results] == ["fwd.lse", "fwd.o", "bwd.dq", "bwd.dk", "bwd.dv"]


def test_registry_entries(gen):
    device = _runtime.default_device()
    spec, spec_c = registry.get("flash_attn"), registry.get("flash_attn_causal")
    for s in (spec, spec_c):
        assert s.family == "attention" and s.outputs == ("o",) and s.grad_inputs == ("q", "k", "v")
        assert set(s.peers) == {"sdpa_flash", "sdpa_cudnn"}
    tiny = spec_c.make_inputs("tiny", torch.bfloat16, device, gen)
    assert tiny["q"].shape == (2, 37, 4, 64) and tiny["k"].shape == (2, 37, 2, 64) and tiny["causal"] is True
    assert spec.make_inputs("tiny", torch.bfloat16, device, gen)["causal"] is False
    # the bench's dict tier: triforge bench attention --B 16 --H 16 --S 2048 --D 64 (small here)
    shape = {"B": 2, "H": 3, "S": 5, "D": 64}
    i0, i1 = spec.make_inputs(shape, torch.float16, device, gen), spec_c.make_inputs(shape, torch.float16, device, gen)
    assert i0["q"].shape == i0["k"].shape == (2, 5, 3, 64)
    assert i0["causal"] is False and i1["causal"] is True
    assert spec.make_inputs({**shape, "causal": 1}, torch.float16, device, gen)["causal"] is True
    B, S, H, D = 2, 5, 3, 64
    assert spec.flops(i0, "fwd") == 4 * B * H * S * S * D
    assert spec.flops(i1, "fwd") == 2 * B * H * S * S * D
    assert spec.flops(i0, "bwd") == 2.5 * spec.flops(i0, "fwd")
    n = B * S * H * D * 2
    assert spec.bytes(i0, "fwd") == 4 * n + 4 * B * H * S
    assert spec.bytes(i0, "bwd") == 8 * n + 4 * B * H * S
    assert "B=2 H=3 S=5 D=64" in spec.describe(i0) and "causal" in spec_c.describe(i1)
    if not torch.cuda.is_available():
        assert all(build(i0) is None for build in spec.peers.values())


@pytest.mark.gpu
def test_peers_match_reference(gen):
    """The SDPA peers compute the same thing (GPU only)."""
    device = _runtime.default_device()
    for name in ("flash_attn", "flash_attn_causal"):
        spec = registry.get(name)
        inputs = spec.make_inputs({"B": 2, "H": 4, "S": 300, "D": 64}, torch.bfloat16, device, gen)
        ref = spec.reference(**{k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()})
        for peer, build in spec.peers.items():
            fn = build(inputs)
            if fn is None:
                continue
            try:
                (o,) = fn(**inputs)
            except RuntimeError as e:  # a backend this GPU/torch build lacks
                pytest.skip(f"{peer}: {e}")
            _assert_ok(f"{peer}.o", ref["o"], o, torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_longer_sequence_forward_and_backward(causal, gen):
    """Several dozen key blocks per program: S = 200, D = 64, GQA."""
    dtype = torch.bfloat16
    q, k, v = _qkv(1, 200, 200, 2, 1, 64, dtype, gen)
    _check_forward(q, k, v, causal, dtype)
    _check_backward(q, k, v, causal, dtype, gen)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_length_1000_forward_and_backward(causal, gen, monkeypatch):
    """The issue's odd length 1000 on the Triton kernels (not a multiple of any block; 16 key blocks of 64 with a
    partial last one of 40): o, lse and dq / dk / dv against the float64 reference. In the interpreter the tiles are
    64 x 64 here, as on the GPU (its default 16 x 16 makes 63 x 63 tiles a pass; the small odd cases above cover
    those)."""
    if _runtime.INTERPRET:
        monkeypatch.setattr(attn, "_INTERPRET_CFG", {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1})
    dtype = torch.bfloat16
    q, k, v = _qkv(1, 1000, 1000, 1, 1, 64, dtype, gen)
    _check_forward(q, k, v, causal, dtype)
    _check_backward(q, k, v, causal, dtype, gen)


# ----------------------------------------------------------------------------- compiled for sm90 (no GPU needed)

_SM90_COMPILE = r"""
import json, os, re, subprocess, sys, tempfile
os.environ["TRITON_INTERPRET"] = "0"  # real @triton.jit kernels, compiled for sm90 without a device
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
import triforge.ops.attention as attn
from triforge.ops.attention import backward as bw, forward as fw
from tests.sm90 import C7515

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_(fn, ptrs, floats, consts, opts):
    names = fn.arg_names
    # constexpr parameters left out take their defaults (not a runtime i32, which would compile every branch)
    consts = dict({p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts)
    sig = {n: ("constexpr" if n in consts else ptrs.get(n, "fp32" if n in floats else "i32")) for n in names}
    # as a launch specialises them: pointers and strides divisible by 16
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in ptrs or n.startswith("stride")}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=opts)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    out = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                         text=True, check=True)
    os.unlink(f.name)
    txt = out.stdout + out.stderr
    ptx = k.asm["ptx"]
    return {"regs": int(re.search(r"Used (\d+) registers", txt).group(1)),
            "spills": int(re.search(r"(\d+) bytes spill stores", txt).group(1)),
            "wgmma": ptx.count("wgmma.mma_async"), "cp_async": ptx.count("cp.async."),
            "tma_loads": ptx.count("cp.async.bulk.tensor"), "tma_reduce": ptx.count("cp.reduce.async.bulk.tensor"),
            "setmaxnreg": ptx.count("setmaxnreg"), "warps": k.metadata.num_warps, "shared": k.metadata.shared,
            "serialized": " ".join(re.findall(C7515, txt))}  # tests/sm90.py: wgmma serialized by ptxas


rows = []
for kernel, dt, D, causal, *extra in json.loads(sys.argv[1]):
    varlen = bool(extra and extra[0])
    override = extra[1] if len(extra) > 1 else {}
    dtype = getattr(torch, dt)
    t = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[dt]
    flags = dict(UPCAST=False, IEEE=dtype == torch.float32)
    if kernel == "pre":
        ptrs = {n: "*" + t for n in ("o_ptr", "do_ptr", "ores_ptr")}
        ptrs.update(dlse_ptr="*fp32", delta_ptr="*fp32")
        consts = dict(HEAD_DIM=D, BLOCK_M=max(16, min(128, 8192 // D)), HAS_RES=True, HAS_DLSE=True)
        r = compile_(bw.flash_attn_bwd_preprocess_kernel, ptrs, (), consts, {"num_warps": 4, "num_stages": 1})
        rows.append(dict(r, kernel=kernel, dtype=t, D=D, causal=causal))
        continue
    if kernel == "convert":
        ptrs = {"acc_ptr": "*fp32", "dq_ptr": "*" + t}
        r = compile_(bw.flash_attn_bwd_dq_convert_kernel, ptrs, ("sm_scale",), dict(BLOCK=1024, UPCAST=False),
                     {"num_warps": 4, "num_stages": 1})
        rows.append(dict(r, kernel=kernel, dtype=t, D=D, causal=causal))
        continue
    cfg = dict(attn.fallback_config(kernel, D, dtype, causal), **override)
    # as the launchers decide: varlen launches use neither warp specialization nor atomic dQ
    tma = bool(cfg.get("TMA", 0))
    ws = bool(cfg.get("WARP_SPEC", 0)) and tma and not varlen
    atomic = 0 if varlen else cfg.get("ATOMIC_DQ", 0)
    opts = {"num_warps": cfg["num_warps"] // 2 if ws else cfg["num_warps"], "num_stages": cfg["num_stages"]}
    consts = dict(HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal, VARLEN=varlen, **flags)
    guard = attn._guard(cfg, dtype)  # as the launchers: forward and dQ key loops guarded for 16-bit inputs
    # VARLEN: int32 prefix sums; otherwise the launchers pass None, which compiles away
    cu = {n: "*i32" for n in ("cu_seqlens_q_ptr", "cu_seqlens_k_ptr")} if varlen else {}
    if not varlen:
        consts.update(cu_seqlens_q_ptr=None, cu_seqlens_k_ptr=None)
    if kernel == "flash_attn_fwd":
        ptrs = {n: "*" + t for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "ores_ptr")}
        ptrs.update(lse_ptr="*fp32", **cu)
        consts.update(STORE_RES=dtype != torch.float32, TMA=tma, WARP_SPEC=ws, EVEN_N=False, GUARD=guard,
                      EMU=attn._emu(cfg, dtype))
        r = compile_(fw.flash_attn_fwd_kernel, ptrs, ("qk_scale",), consts, opts)
    elif kernel == "flash_attn_bwd_dkdv":
        ptrs = {n: "*" + t for n in ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dk_ptr", "dv_ptr")}
        ptrs.update(lse_ptr="*fp32", delta_ptr="*fp32", **cu)
        consts.update(TMA=tma, ATOMIC_DQ=atomic)
        if atomic:
            ptrs["dq_ptr"] = "*fp32"
        else:
            consts["dq_ptr"] = None
        r = compile_(bw.flash_attn_bwd_dkdv_kernel, ptrs, ("qk_scale", "sm_scale"), consts, opts)
    else:
        ptrs = {n: "*" + t for n in ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dq_ptr")}
        ptrs.update(lse_ptr="*fp32", delta_ptr="*fp32", **cu)
        consts.update(TMA=tma, GUARD=guard)
        r = compile_(bw.flash_attn_bwd_dq_kernel, ptrs, ("qk_scale", "sm_scale"), consts, opts)
    rows.append(dict(r, kernel=kernel, dtype=t, D=D, causal=causal, varlen=varlen, cfg=cfg, tma=tma, ws=ws,
                     atomic=atomic))
print("RESULT" + json.dumps(rows))
"""

_KERNELS = ("flash_attn_fwd", "flash_attn_bwd_dkdv", "flash_attn_bwd_dq")


def _sm90_compile(cases, script=None):
    """Run ``script`` (default: _SM90_COMPILE) on ``cases`` in a TRITON_INTERPRET=0 subprocess; its RESULT rows."""
    import json
    import os
    import subprocess
    import sys

    import triton

    from triforge import _runtime

    if _runtime.HAS_CUDA and not _runtime.INTERPRET:
        # on the GPU machine ptxas for sm_90a exited 255 in this route (H100, 2026-11-22); there
        # tests/test_gpu.py reads registers and spills from the compiled kernels' own metadata
        pytest.skip("compile-only check for machines without a GPU")

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("triton's bundled ptxas is not installed")
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", script or _SM90_COMPILE, json.dumps(cases)], capture_output=True,
                         text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULT", 1)[1])


def _check_sm90_rows(rows):
    for r in rows:
        assert r["spills"] == 0, r
        assert r["shared"] <= 227 * 1024, r
        if r["kernel"] not in ("pre", "convert") and r["dtype"] != "fp32":
            assert r["cp_async"] > 0, r  # K/V (or Q/dO) loads are asynchronous copies
            if r["D"] <= 128:
                assert r["wgmma"] > 0, r  # Hopper tensor cores
        if (r.get("cfg") or {}).get("GUARD", 1):  # GUARD 0 (a tune point, to time it) may be serialized
            assert r["serialized"] == "", r  # ptxas keeps the wgmma pipeline asynchronous
        if r.get("tma"):
            assert r["tma_loads"] > 0, r  # bulk tensor copies
        if r.get("ws"):  # producer + two consumer warpgroups, registers moved to the consumers
            assert r["warps"] == 12 and r["setmaxnreg"] > 0, r
        if r.get("atomic") == 2:
            assert r["tma_reduce"] > 0, r


def test_kernels_compile_for_sm90():
    """The kernels as the H100 builds them (TRITON_INTERPRET=0, sm90 target, the fallback configs,
    ptxas from the triton wheel): they compile (the interpreter never does), spill no registers, fit
    in shared memory, use wgmma and pipelined loads, and ptxas does not serialize the wgmma (C7515: it
    did in the non-causal D = 64 forward and dQ kernels until their key loops were guarded). bf16 at every head dim, causal and not, and
    the VARLEN variants (flash_attn_varlen_func) of the same."""
    cases = [[k, "bfloat16", D, c] for k in _KERNELS for D in (64, 128) for c in (False, True)]
    cases += [[k, "bfloat16", D, True] for k in _KERNELS for D in (32, 256)]
    varlen = [c + [True] for c in cases]
    rows = _sm90_compile(cases + varlen + [["pre", "bfloat16", D, False] for D in (64, 128)])
    assert sum(r.get("varlen", False) for r in rows) == len(varlen)
    _check_sm90_rows(rows)


def test_tuned_configs_compile_for_sm90():
    """The sm90 entries of the configs file (what the H100 runs, bf16), each compiled as its launcher builds
    it: no wgmma serialization (ptxas C7515 makes every tensor-core op wait for the one before: the non-causal
    D = 64 forward ran so until 2026-11-24), shared memory within the H100's. Spills are the H100's ptxas'
    to judge (tests/test_gpu.py): this wheel's ptxas reports some for the D = 128 dK/dV tiles that it does not."""
    import json

    from triforge import launch

    entries = json.loads(launch.CONFIG_DIR.joinpath("sm90.json").read_text())["kernels"]
    cases = []
    for kernel in _KERNELS:
        for key, cfg in entries.get(kernel, {}).items():
            kv = dict(x.split("=") for x in key.split(","))
            if kv["dtype"] == "bf16":
                cases.append([kernel, "bfloat16", int(kv["d"]), kv.get("causal") == "1", kv.get("varlen") == "1", cfg])
    assert len(cases) >= 12, cases
    for r in _sm90_compile(cases):
        assert r["serialized"] == "" and r["shared"] <= 227 * 1024, r
        assert r["wgmma"] > 0, r


@pytest.mark.slow
def test_kernels_compile_for_sm90_fp16_fp32():
    cases = [[k, "float16", D, c] for k in _KERNELS for D in (64, 128) for c in (False, True)]
    cases += [[k, "float32", D, True] for k in _KERNELS for D in (32, 64, 128, 256)]
    cases += [c + [True] for c in cases]
    cases += [["pre", dt, 256, False] for dt in ("float16", "float32")]
    _check_sm90_rows(_sm90_compile(cases))


def test_variants_and_tune_spaces_compile_for_sm90():
    """Every point of the tune grids (at their tune shape: bf16, D = 128, not causal) and the other
    variants benchmarks/attention_variants.py times compile for sm90 without spills: the
    warp-specialized forward (12 warps, setmaxnreg), TMA loads, TMA reductions of dQ, and the dQ
    conversion. No grid has WARP_SPEC (it gives wrong results on Triton 3.6, found on the H100); the
    variants script still times it, with 2 stages at 128 x 128 tiles and D = 128 (3 need more shared
    memory than an H100 has)."""
    from triforge import tune

    cases = []
    for kernel, space in attn.TUNE_SPACES.items():
        assert "WARP_SPEC" not in space, kernel
        for cfg in tune.grid(space):
            cases.append([kernel, "bfloat16", 128, False, False, cfg])
    ws = {"BLOCK_M": 128, "num_warps": 8, "TMA": 1, "WARP_SPEC": 1}
    for D, c in ((64, False), (64, True), (128, False), (128, True)):
        cases.append(["flash_attn_fwd", "bfloat16", D, c, False, {**ws, "BLOCK_N": 64, "num_stages": 3}])
        stages = 3 if D == 64 else 2
        cases.append(["flash_attn_fwd", "bfloat16", D, c, False, {**ws, "BLOCK_N": 128, "num_stages": stages}])
    atomic = {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 8, "num_stages": 1, "TMA": 1}
    cases.append(["flash_attn_bwd_dkdv", "bfloat16", 128, True, False, {**atomic, "ATOMIC_DQ": 1}])
    cases.append(["flash_attn_bwd_dkdv", "bfloat16", 64, True, False, {**atomic, "BLOCK_M": 64, "ATOMIC_DQ": 2}])
    cases.append(["convert", "bfloat16", 128, False])
    rows = _sm90_compile(cases)
    too_big = [r for r in rows if r["shared"] > 227 * 1024]
    assert [(r["D"], r["cfg"]["BLOCK_N"], r["cfg"]["num_stages"], r["ws"]) for r in too_big] == []
    _check_sm90_rows([r for r in rows if r not in too_big])
    assert sum(r.get("ws", False) for r in rows) >= 8 and sum(r.get("atomic") == 2 for r in rows) >= 3


# ----------------------------------------------------------------------------- error scales (magnitudes)


def _magnitudes_by_loops(q, k, v, do, causal, floor=0.0):
    """attention_magnitudes written element by element (float64, tiny shapes): the rss of each
    output's terms, dS's terms counted as P (max(|dO . v_j|, rss) + max(|delta|, rss)): each dot's
    value or, where it cancels, the rss of its own terms; each seen key's P and dS at least ``floor``."""
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g, sc = H // Hkv, D**-0.5
    o_m, dq_m = torch.zeros_like(q), torch.zeros_like(q)
    dk_m, dv_m = torch.zeros_like(k), torch.zeros_like(v)
    for b in range(B):
        for h in range(H):
            hk = h // g
            for i in range(Sq):
                seen = [j for j in range(Sk) if not causal or j <= i + Sk - Sq]
                if not seen:
                    continue
                s = torch.stack([sc * q[b, i, h] @ k[b, j, hk] for j in seen])
                p = torch.softmax(s, 0)
                o = sum(pj * v[b, j, hk] for pj, j in zip(p, seen))
                delta = do[b, i, h] @ o
                delta_m = max(delta.abs(), ((do[b, i, h] * o) ** 2).sum().sqrt())
                for pj, j in zip(p, seen):
                    dp = do[b, i, h] @ v[b, j, hk]
                    ds = pj * (max(dp.abs(), ((do[b, i, h] * v[b, j, hk]) ** 2).sum().sqrt()) + delta_m)
                    ds, pj = max(ds, floor), max(pj, floor)
                    o_m[b, i, h] += (pj * v[b, j, hk]) ** 2
                    dq_m[b, i, h] += (sc * ds * k[b, j, hk]) ** 2
                    dk_m[b, j, hk] += (sc * ds * q[b, i, h]) ** 2
                    dv_m[b, j, hk] += (pj * do[b, i, h]) ** 2
    return {"o": o_m.sqrt(), "dq": dq_m.sqrt(), "dk": dk_m.sqrt(), "dv": dv_m.sqrt()}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_magnitudes_equal_the_elementwise_definition(causal, gen):
    """GQA, Sq > Sk (causal rows that see no key get 0) and Sq < Sk."""
    for Sq, Sk in ((6, 4), (3, 7)):
        # float64 references only (no kernel): on the CPU, whatever device the kernels use
        q, k, v = (t.double().cpu() for t in _qkv(2, Sq, Sk, 4, 2, 8, torch.float32, gen))
        do = torch.randn(q.shape, generator=gen, dtype=torch.float64)
        got = attn.attention_magnitudes(q, k, v, do, causal)
        want = _magnitudes_by_loops(q, k, v, do, causal)
        for name in ("o", "dq", "dk", "dv"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-14, msg=name)


def test_magnitudes_floor_a_dtype_s_unresolved_terms(gen):
    """With the storage dtype, each seen key's P and dS count at least max(its smallest normal, fp32's
    smallest normal / u): fp16 2^-14 (P ~ 1e-9 is stored to 3e-8, not to u P), bf16 2^-118; masked
    keys and rows that see no key still count 0."""
    assert attn.reference._magnitude_floor(torch.float16) == 2.0**-14
    assert attn.reference._magnitude_floor(torch.bfloat16) == 2.0**-118
    for causal in (False, True):
        # peaked rows (scores ~ 30): most keys' P far below 2^-14
        q, k, v = (t.double().cpu() for t in _qkv(2, 6, 4, 4, 2, 8, torch.float32, gen, q_scale=30.0))
        do = torch.randn(q.shape, generator=gen, dtype=torch.float64)
        got = attn.attention_magnitudes(q, k, v, do, causal, dtype=torch.float16)
        want = _magnitudes_by_loops(q, k, v, do, causal, floor=2.0**-14)
        plain = attn.attention_magnitudes(q, k, v, do, causal)
        for name in ("o", "dq", "dk", "dv"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-14, msg=name)
        for name in ("o", "dq", "dk", "dv"):  # the floor acted (there are keys with P < 2^-14)
            assert (got[name] > plain[name]).any(), name
        if causal:  # Sq > Sk: the first rows see no key
            assert (got["o"][:, :2] == 0).all() and (got["dq"][:, :2] == 0).all()


def test_magnitudes_of_a_row_whose_dots_cancel_scale_with_their_terms(device, gen):
    """Causal row 0 sees one key: P = 1, o = v_0, dP = delta = dO . v_0 and dq = 0 exactly; with dO
    orthogonal to v_0 both dots also cancel to ~0. Their fp32 sums still round (in different orders),
    so dq's error scale is scale (rss(dO v_0) + rss(dO o)) |k_0| (the H100 real tier failed 1 run in 3
    on such rows while the scale counted the dots' values). The kernel's fp32 gradients pass under it."""
    q, k, v = (t.cpu() for t in _qkv(1, 5, 5, 2, 1, 64, torch.float32, gen))  # float64 side on the CPU
    do = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    v0 = v[0, 0, 0].double()
    do[0, 0] -= (do[0, 0] @ v0)[:, None] * v0 / (v0 @ v0)  # both heads' dO orthogonal to v_0
    do = do.float().double()
    mags = attn.attention_magnitudes(q.double(), k.double(), v.double(), do, True)
    rss = (do[0, 0] * v0).square().sum(-1).sqrt()  # [H]
    want = 64**-0.5 * 2 * rss[:, None] * k[0, 0, 0].double().abs()
    torch.testing.assert_close(mags["dq"][0, 0], want, rtol=1e-6, atol=0)
    assert (do[0, 0] @ v0).abs().max() < 1e-4 * rss.min()  # the value alone would ask for ~exact zeros
    leaves = [_leaf(t.to(device)) for t in (q, k, v)]
    with poisoned():
        o = flash_attn_func(*leaves, causal=True)
        grads = torch.autograd.grad(o, leaves, do.float().to(device))
    r64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = torch.autograd.grad(attention_ref(*r64, causal=True)["o"], r64, do)
    for name, r, g in zip(("dq", "dk", "dv"), ref, grads):
        res = compare(name, r, g, dtype=torch.float32, scale=mags[name], verbose=False)
        assert res.ok, res.line()


def test_magnitudes_chunked_equal_whole(gen):
    # float64 references only (no kernel). The slices' products may sum in another order than the batched
    # ones (MKL picks its kernels by shape and CPU: 4 float64 ulps apart on an AVX-512 machine), so equal to
    # float64 rounding; a slice given the wrong head, batch or kv head moves an element by O(1)
    q, k, v = (t.double().cpu() for t in _qkv(2, 9, 11, 4, 2, 32, torch.float32, gen))
    do = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    whole = attn.attention_magnitudes(q, k, v, do, True)
    sliced = attn.attention_magnitudes_chunked(q, k, v, do, True, max_scores=1)
    for name in whole:
        torch.testing.assert_close(sliced[name], whole[name], rtol=1e-13, atol=0, msg=name)


def test_gradient_check_under_magnitudes_passes_the_kernel_and_catches_an_error(device, gen):
    """The kernel's bf16 gradients pass against their error scales; one dq element moved by a fifth
    of its own scale (plus its value) fails, and is located."""
    q, k, v = _qkv(2, 37, 37, 4, 2, 64, torch.bfloat16, gen)
    do64 = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(device)
    leaves = [_leaf(t.to(device)) for t in (q, k, v)]
    o = flash_attn_func(*leaves, causal=True)
    dq, dk, dv = torch.autograd.grad(o, leaves, do64.to(device, torch.bfloat16))
    r64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = torch.autograd.grad(attention_ref(*r64, causal=True)["o"], r64, do64.to(torch.bfloat16).double())
    mags = attn.attention_magnitudes(*(t.double() for t in (q, k, v)), do64.to(torch.bfloat16).double(), True)
    for name, r, g in zip(("dq", "dk", "dv"), ref, (dq, dk, dv)):
        assert compare(name, r, g, dtype=torch.bfloat16, scale=mags[name], verbose=False).ok, name
    bad = dq.detach().cpu().double()
    idx = (1, 20, 3, 11)
    bad[idx] += 0.2 * float(mags["dq"][idx]) + 0.2 * abs(float(ref[0][idx]))
    res = compare("dq", ref[0], bad, dtype=torch.bfloat16, scale=mags["dq"], verbose=False)
    assert not res.ok and res.max_abs_at == idx


_SM90_GLUON = r"""
import collections, json, os, re, subprocess, sys, tempfile
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triforge.ops.attention import forward_ws as W

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
INSTR = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
rows = []
for case in json.loads(sys.argv[1]):
    D, bn, st, dt = case["D"], case["BLOCK_N"], case["num_stages"], case["dtype"]
    g = gl.bfloat16 if dt == "bf16" else gl.float16
    ql, kl = gl.NVMMASharedLayout.get_default_for([64, D], g), gl.NVMMASharedLayout.get_default_for([bn, D], g)
    fn = W.flash_attn_fwd_ws_persist_kernel if case.get("PERSIST") else W.flash_attn_fwd_ws_kernel
    n_wg = case.get("NUM_WG", 2)
    consts = dict(BM=64 * n_wg, BN=bn, D=D, STAGES=st, CAUSAL=case["causal"], STORE_RES=case["res"],
                  VARLEN=case.get("varlen", False), CONS_REGS=240 if n_wg == 2 else 160, LOADER_REGS=24,
                  EMU=case.get("EMU", 0), NUM_WG=n_wg, P16=n_wg == 3, SCHED=bool(case.get("SCHED", 0)))
    if case.get("PERSIST"):
        consts["XITEM"] = int(case.get("XITEM", 0))
    types = {"q_desc": f"tensordesc<{dt}[64, {D}],{ql!r}>", "k_desc": f"tensordesc<{dt}[{bn}, {D}],{kl!r}>",
             "v_desc": f"tensordesc<{dt}[{bn}, {D}],{kl!r}>", "o_ptr": f"*{dt}", "res_ptr": f"*{dt}",
             "lse_ptr": "*fp32", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32", "qk_scale": "fp32"}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("o_ptr", "res_ptr", "lse_ptr")}
    k = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4})
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(k.asm["ptx"])
        open(os.path.join(d, "k.cubin"), "wb").write(k.asm["cubin"])
        v = subprocess.run([os.path.join(BIN, "ptxas"), "-v", "-arch=sm_90a", os.path.join(d, "k.ptx"), "-o",
                            os.path.join(d, "o.cubin")], capture_output=True, text=True).stderr
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", os.path.join(d, "k.cubin")], capture_output=True,
                              text=True).stdout.splitlines()
    loops = []  # backward branches that repeat 16 HGMMAs: the key loops (unmasked ones have no FSEL)
    for i, line in enumerate(sass):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m:
            t = [j for j, l2 in enumerate(sass) if l2.startswith(m.group(1) + ":")]
            if t and t[0] < i - 2:
                c = collections.Counter(mm.group(2) for mm in map(INSTR.match, sass[t[0]:i + 1]) if mm)
                # S = Q K^T and P V: 8 + 8 wgmma of k = 16 at BN = D = 128, 4 + 8 at D = 64
                if c.get("HGMMA.64", 0) == (16 if D == 128 else 12):
                    loops.append(dict(c))
    spill = re.search(r"(\d+) bytes spill stores", v)
    n_instr = sum(1 for line in sass if INSTR.match(line))
    rows.append(dict(case, loops=loops, shared=k.metadata.shared, n_instr=n_instr, serialized="C7515" in v or "C7512" in v,
                     spill_stores=int(spill.group(1)) if spill else -1))
print("RESULT" + json.dumps(rows))
"""


def test_gluon_forward_compiles_for_sm90():
    """forward_ws.py's kernel as the H100 builds it (Gluon, sm90a, the wheel's ptxas; no GPU here): it fits in shared
    memory, ptxas keeps the wgmma pipeline asynchronous, and each unmasked key loop (the hot loop) holds its 16 wgmma
    with no local-memory traffic and no PRMT (a 16-bit P carried across the two key loops cost 32-64 per tile); with
    EMU, that many of every 8 of its exponentials leave the MUFU unit (_tl.exp2_emu)."""
    cases = [dict(D=128, BLOCK_N=128, num_stages=3, dtype=dt, causal=c, res=r, varlen=vl, EMU=e)
             for dt, c, r, vl, e in (("bf16", False, False, False, 0), ("bf16", True, True, False, 0),
                                     ("fp16", False, True, False, 0), ("bf16", True, True, True, 0),
                                     ("bf16", False, False, False, 2), ("fp16", False, True, False, 3))]
    for r in _sm90_compile(cases, _SM90_GLUON):
        assert r["shared"] <= 227 * 1024 and not r["serialized"], r
        hot = [lp for lp in r["loops"] if "FSEL" not in lp]
        assert len(hot) == 2, r  # one unmasked key loop per consumer warpgroup
        for lp in hot:
            assert not any(op.startswith(("LDL", "STL", "PRMT")) for op in lp), lp
            # the 64 x 128 tile's exponentials (64 per thread) and alpha's, less EMU of every 8 on the FMA pipes
            assert lp["MUFU.EX2"] == 64 - 8 * r["EMU"] + 2, lp


def test_gluon_forward_three_warpgroups_compiles_for_sm90():
    """The D = 64 form with three consumer warpgroups (192-row tiles, 128-key tiles, NUM_WG 3, P carried as the 16-bit
    operand; the worker consumer warpgroups at 160 registers, the default partition's at the launch's rest, 168) as the
    H100 builds it, with and without the scheduler barrier (the H200's entry: 4 slots, SCHED): no spill, the wgmma
    pipeline asynchronous, one unmasked key loop per warpgroup with its 12 wgmma and the tile's 64 exponentials
    (+ alpha's); the 16-bit carry costs at most one PRMT per P register pair (32); with P in fp32 the tile does not fit
    (session 37 ran 64-key tiles there; session 52 measured both)."""
    cases = [dict(D=64, BLOCK_N=128, num_stages=st, dtype=dt, causal=c, res=r, NUM_WG=3, SCHED=sc)
             for dt, c, r, st, sc in (("bf16", False, False, 4, 1), ("fp16", True, True, 4, 1),
                                      ("bf16", False, True, 3, 0))]
    # the persistent form (the H200's entry since session 53): a few spilled bytes outside the key loops (the work
    # item's loop), none inside them
    cases.append(dict(D=64, BLOCK_N=128, num_stages=4, dtype="bf16", causal=False, res=True, NUM_WG=3, SCHED=1,
                      PERSIST=1))
    for r in _sm90_compile(cases, _SM90_GLUON):
        assert r["shared"] <= 227 * 1024 and not r["serialized"], r
        assert r["spill_stores"] == 0 or (r.get("PERSIST") and r["spill_stores"] <= 64), r
        hot = [lp for lp in r["loops"] if "FSEL" not in lp]
        assert len(hot) == 3, r
        for lp in hot:
            assert not any(op.startswith(("LDL", "STL")) for op in lp), lp
            assert lp.get("PRMT", 0) <= 32 and lp["MUFU.EX2"] == 66, lp


def test_gluon_forward_overlapped_walk_compiles_for_sm90():
    """The persistent forward's overlapped walk (XITEM 1 and 2, two warpgroups, causal and not; not yet in an entry)
    as the H100 builds it: fits, the wgmma pipeline asynchronous, and each consumer warpgroup's unmasked key loop,
    compiled twice (the first item's and the walk's), with its 12 wgmma and no local-memory traffic."""
    cases = [dict(D=64, BLOCK_N=128, num_stages=4, dtype="bf16", causal=c, res=r, PERSIST=1, XITEM=x)
             for c, r, x in ((False, False, 1), (True, True, 1), (False, True, 2), (True, False, 2))]
    for r in _sm90_compile(cases, _SM90_GLUON):
        assert r["shared"] <= 227 * 1024 and not r["serialized"], r
        hot = [lp for lp in r["loops"] if "FSEL" not in lp]
        assert len(hot) == 4, r
        for lp in hot:
            assert not any(op.startswith(("LDL", "STL")) for op in lp), lp


@pytest.mark.parametrize("bad, key", [({"num_stages": 1}, "num_stages"), ({"num_stages": 2.0}, "num_stages"),
                                      ({"BLOCK_N": 32}, "BLOCK_N"), ({"NUM_WG": 4}, "NUM_WG"),
                                      ({"XITEM": 1}, "XITEM"), ({"PERSIST": 1, "XITEM": 3}, "XITEM"),
                                      ({"PERSIST": 1, "PROGRAMS": 0}, "PROGRAMS")])
def test_gluon_forward_rejects_bad_configs(bad, key):
    """attn_fwd_ws refuses a config its kernels cannot run, naming the key, before any launch (a one-slot ring would
    hang the GPU: each key step waits for tile j's K before releasing tile j - 1's slot; session 53's varlen test with
    one slot did)."""
    from triforge.ops.attention.forward_ws import attn_fwd_ws

    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=key):
        attn_fwd_ws(q, q, q, False, 0.125, dict({"BLOCK_N": 128, "num_stages": 3}, **bad))
