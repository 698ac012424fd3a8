"""Decode attention fused with the output projection and residual (``flash_decode_oproj``) against the
float64 golden reference: attention over each row's first n_b cached keys (``kvcache_attention_ref``),
o rounded to the input dtype, then ``gemv_ref`` (round(w_o o) + residual, rounded). Outputs are
NaN-poisoned before every call; inputs are fresh random draws.

Covers GQA groups of 1, 2 and 7 (Qwen2-0.5B's 14 / 2 heads), head dims 16..64, output rows that are
not a multiple of the row block, lengths of 1 and of the full cache, an empty row (o = 0, y = the
residual), several batch rows, the optional o output, large scores, lengths past the cache (clamped),
and input validation.
"""

import pytest
import torch

import triforge  # noqa: F401  (sets TRITON_INTERPRET before triton kernels are defined)
from triforge.launch import poisoned
from triforge.ops.attention.decode_oproj import fallback_config, fits, flash_decode_oproj
from triforge.ops.attention.reference import kvcache_attention_ref
from triforge.ops.gemv import gemv_ref
from triforge.testing import compare

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _randn(shape, dtype, gen, scale=1.0):
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)


def _inputs(gen, *, B, H, Hkv, D, S, N, dtype, lengths=None, q_scale=1.0, device="cpu"):
    q = _randn((B, H, D), dtype, gen, q_scale)
    kc = _randn((B, S, Hkv, D), dtype, gen)
    vc = _randn((B, S, Hkv, D), dtype, gen)
    w = _randn((N, H * D), dtype, gen, (H * D) ** -0.5)
    r = _randn((B, N), dtype, gen)
    if lengths is None:
        lengths = [1, S] + torch.randint(1, S + 1, (max(0, B - 2),), generator=gen).tolist()
        lengths = lengths[:B]
    lengths = torch.as_tensor(lengths, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, kc, vc, lengths, w, r))


def _reference(q, kc, vc, lengths, w, r, dtype):
    """float64 stages: o [B, H * D] (rounded to dtype, as the kernel hands it to the projection) and y."""
    d = lambda t: t.detach().cpu().to(torch.float64)  # noqa: E731
    n = lengths.cpu().clamp(0, kc.shape[1])
    st, _, _ = kvcache_attention_ref(d(q)[:, None], d(kc), d(vc), n, causal=False)
    o = st["o"][:, 0].reshape(q.shape[0], -1)
    o = torch.nan_to_num(o, nan=0.0)  # a row with no key: the kernel's convention is 0
    o = o.to(dtype).to(torch.float64)
    y = gemv_ref(o, d(w), residual=d(r), dtype=dtype)["y"]
    return o, y


def _check(gen, device, *, B=1, H=14, Hkv=2, D=32, S=40, N=50, dtype=torch.float32, lengths=None, q_scale=1.0,
           cfg=None):
    q, kc, vc, lens, w, r = _inputs(gen, B=B, H=H, Hkv=Hkv, D=D, S=S, N=N, dtype=dtype, lengths=lengths,
                                    q_scale=q_scale, device=device)
    ref_o, ref_y = _reference(q, kc, vc, lens, w, r, dtype)
    with poisoned():
        y, o = flash_decode_oproj(q, kc, vc, lens, w, r, D ** -0.5, store_o=True, cfg=cfg)
    assert y.shape == (B, N) and y.dtype == dtype and o.shape == (B, H * D) and o.dtype == dtype
    res_o = compare("o", ref_o, o, dtype=dtype, verbose=False)
    assert res_o.ok, res_o.line()
    res_y = compare("y", ref_y, y, dtype=dtype, verbose=False)
    assert res_y.ok, res_y.line()
    return y, o, ref_y


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES.values()))
@pytest.mark.parametrize("H,Hkv,D", [(14, 2, 32), (4, 4, 16), (6, 3, 64)], ids=["g7", "g1", "g2"])
def test_matches_reference(dtype, H, Hkv, D, gen, device):
    _check(gen, device, B=2, H=H, Hkv=Hkv, D=D, S=37, N=45, dtype=dtype)


def test_row_blocks_and_key_blocks(gen, device):
    # several programs along N (the last one partial) and key loops of 1..3 blocks with partial ends
    cfg = {"BLOCK_R": 8, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    _check(gen, device, B=3, H=14, Hkv=2, D=32, S=47, N=29, lengths=[47, 16, 17], cfg=cfg)


def test_empty_row_gives_residual(gen, device):
    y, o, _ = _check(gen, device, B=2, H=4, Hkv=2, D=16, S=20, N=12, lengths=[0, 5])
    assert torch.count_nonzero(o[0]) == 0
    assert torch.isfinite(y).all()


def test_lengths_are_clamped_into_the_cache(gen, device):
    _check(gen, device, B=2, H=4, Hkv=2, D=16, S=20, N=12, lengths=[25, -3])


def test_large_scores_stay_finite(gen, device):
    y, _, _ = _check(gen, device, B=1, H=4, Hkv=1, D=32, S=33, N=20, dtype=torch.bfloat16, q_scale=300.0)
    assert torch.isfinite(y).all()


def test_a_planted_wrong_cache_row_fails(gen, device):
    """The check above can fail: the same inputs with one cached value changed are far off."""
    q, kc, vc, lens, w, r = _inputs(gen, B=1, H=4, Hkv=2, D=16, S=20, N=12, dtype=torch.float32, device=device)
    _, ref_y = _reference(q, kc, vc, lens, w, r, torch.float32)
    vc2 = vc.clone()
    vc2[0, int(lens[0]) - 1] += 50.0
    y, _ = flash_decode_oproj(q, kc, vc2, lens, w, r, 16 ** -0.5)
    assert not compare("y", ref_y, y, dtype=torch.float32, verbose=False).ok


def test_fallback_config_and_fits():
    cfg = fallback_config(14, 64, 896)
    assert cfg["BLOCK_R"] >= 1 and cfg["BLOCK_N"] >= 16
    assert fits(1, 512, 14, 64) and fits(2, 2048, 14, 64)
    assert not fits(3, 512, 14, 64) and not fits(1, 4096, 14, 64)


def _bad_cases(device):
    gen = torch.Generator().manual_seed(0)
    q, kc, vc, lens, w, r = _inputs(gen, B=2, H=4, Hkv=2, D=16, S=8, N=6, dtype=torch.float32, device=device)
    return [
        ("q must be", (q[0], kc, vc, lens, w, r)),
        ("k_cache / v_cache", (q, kc[:1], vc, lens, w, r)),
        ("multiple of the cache's kv heads", (q[:, :3], kc, vc, lens, w[:, :48], r)),
        ("w_o must be", (q, kc, vc, lens, w[:, :60], r)),
        ("residual must be", (q, kc, vc, lens, w, r[:1])),
        ("lengths must be int32", (q, kc, vc, lens.long(), w, r)),
        ("w_o must have q's dtype", (q, kc, vc, lens, w.half(), r)),
        ("q must be contiguous", (q.transpose(0, 1).contiguous().transpose(0, 1), kc, vc, lens, w, r)),
    ]


@pytest.mark.parametrize("i", range(8))
def test_bad_input(i, device):
    match, args = _bad_cases(device)[i]
    with pytest.raises(ValueError, match=match):
        flash_decode_oproj(*args, 0.25)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_qwen2_shape_no_spills(dtype):
    """Compiled at the Qwen2-0.5B decode shape (14 / 2 heads, D 64, 896 rows, a 512-row cache): the reference's
    values, both with the fallback config and under PDL, and no register spills."""
    from triforge import launch

    gen = torch.Generator().manual_seed(7)
    for pdl in (False, True):
        q, kc, vc, lens, w, r = _inputs(gen, B=1, H=14, Hkv=2, D=64, S=512, N=896, dtype=dtype, lengths=[300],
                                        device="cuda")
        ref_o, ref_y = _reference(q, kc, vc, lens, w, r, dtype)
        launch._compiled.clear()
        with poisoned():
            y, o = flash_decode_oproj(q, kc, vc, lens, w, r, 0.125, store_o=True, pdl=pdl)
        torch.cuda.synchronize()
        for name, ref, got in (("o", ref_o, o), ("y", ref_y, y)):
            res = compare(name, ref, got, dtype=dtype, verbose=False)
            assert res.ok, res.line()
        res = launch.kernel_resources("flash_decode_oproj")
        assert res["spills"] == 0, res
