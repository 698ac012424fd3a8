"""The Gluon attention forward for Hopper (triforge/ops/attention/forward_ws.py) against the float64 reference.

GPU-only (Gluon has no interpreter; the kernel needs sm90): o and lse over odd lengths (1, 17, 63, 1000), Sq != Sk
with flash-attn's bottom-right causal alignment, rows that see no key (o = 0, lse = -inf), GQA/MQA, head dims 64 and
128, fp16 and bf16, large scores, both key-tile sizes and ring depths; o's rounding residual; the public function and
its gradients with the kernel taking the forward (``TRIFORGE_ATTN_GLUON=1``). Outputs start as NaN (``poisoned``).
"""

import pytest
import torch

import triforge  # noqa: F401
from triforge import _runtime
from triforge.launch import poisoned
from triforge.ops import attention
from triforge.ops.attention import attention_ref, flash_attn_func
from triforge.testing import compare

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or _runtime.INTERPRET
                       or torch.cuda.get_device_capability() != (9, 0), reason="needs a compiled sm90 GPU"),
]

F16 = [torch.float16, torch.bfloat16]
F16_IDS = ["fp16", "bf16"]
# (B, Sq, Sk, H, Hkv, D)
SHAPES = [
    (1, 1, 1, 2, 2, 64),
    (2, 17, 17, 4, 2, 128),
    (1, 63, 200, 2, 1, 64),
    (2, 1000, 1000, 2, 2, 128),
    (1, 300, 129, 4, 4, 64),  # causal: the first 171 rows see no key
    (3, 128, 128, 2, 2, 128),
    (1, 384, 1000, 4, 1, 128),
    (2, 257, 255, 6, 3, 64),
]
# EMU: of every 8 exponentials of an unmasked tile, how many the FMA pipes compute (_tl.exp2_emu)
# NUM_WG 3: three consumer warpgroups (192-row tiles), P carried in 16 bits by default there (P16); SCHED: the
# warpgroups take turns issuing their products (a scheduler barrier)
CFGS = [{"BLOCK_N": 128, "num_stages": 2}, {"BLOCK_N": 128, "num_stages": 3}, {"BLOCK_N": 64, "num_stages": 4},
        {"BLOCK_N": 128, "num_stages": 3, "EMU": 3}, {"BLOCK_N": 128, "num_stages": 3, "NUM_WG": 3},
        {"BLOCK_N": 64, "num_stages": 4, "NUM_WG": 3, "P16": 0}, {"BLOCK_N": 128, "num_stages": 2, "P16": 1},
        {"BLOCK_N": 128, "num_stages": 3, "SCHED": 1}, {"BLOCK_N": 128, "num_stages": 2, "NUM_WG": 3, "SCHED": 1},
        {"BLOCK_N": 128, "num_stages": 4, "NUM_WG": 3, "SCHED": 1},
        # PERSIST: the persistent kernel; a few programs (PROGRAMS), so that each walks many work items whose key-tile
        # counts differ (causal), the K/V ring, the two Q buffers and the scheduler's turns running on across them
        {"BLOCK_N": 128, "num_stages": 4, "NUM_WG": 3, "SCHED": 1, "PERSIST": 1, "PROGRAMS": 3},
        # XITEM: an item's first S product issued with the previous one's last P V (dense inputs; causal launches with
        # S_q > S_k walk the items one by one)
        {"BLOCK_N": 128, "num_stages": 4, "NUM_WG": 3, "SCHED": 1, "PERSIST": 1, "PROGRAMS": 3, "XITEM": 1},
        {"BLOCK_N": 128, "num_stages": 2, "PERSIST": 1, "PROGRAMS": 2, "XITEM": 1},
        # XITEM 2: the P V product first, the previous item's output stored under the S product
        {"BLOCK_N": 128, "num_stages": 2, "NUM_WG": 3, "SCHED": 1, "PERSIST": 1, "PROGRAMS": 4, "XITEM": 2},
        {"BLOCK_N": 64, "num_stages": 3, "PERSIST": 1, "PROGRAMS": 3, "XITEM": 2},
        {"BLOCK_N": 128, "num_stages": 2, "PERSIST": 1, "PROGRAMS": 2},
        {"BLOCK_N": 64, "num_stages": 3, "PERSIST": 1, "PROGRAMS": 5, "SCHED": 1}]


def _cfg_id(c):
    p16 = c.get("P16", int(c.get("NUM_WG", 2) == 3))
    return (f"w{c.get('NUM_WG', 2)}n{c['BLOCK_N']}s{c['num_stages']}e{c.get('EMU', 0)}p{p16}"
            f"sc{c.get('SCHED', 0)}" + (f"pe{c['PROGRAMS']}" if c.get("PERSIST") else "")
            + (f"x{c['XITEM']}" if c.get("XITEM") else ""))


def _qkv(B, Sq, Sk, H, Hkv, D, dtype, seed, q_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to("cuda", dtype)  # noqa: E731
    return (q_scale * r(B, Sq, H, D)).to(dtype), r(B, Sk, Hkv, D), r(B, Sk, Hkv, D)


def _check(q, k, v, causal, dtype, cfg, residual=False):
    from triforge.ops.attention.forward_ws import attn_fwd_ws

    D = q.shape[-1]
    q_bufs = 2 if cfg.get("PERSIST") else 1
    if cfg["BLOCK_N"] * D * 2 * 2 * cfg["num_stages"] + q_bufs * 64 * cfg.get("NUM_WG", 2) * D * 2 > 227 * 1024:
        pytest.skip("does not fit in shared memory")
    with poisoned():
        o, lse, o_res = attn_fwd_ws(q, k, v, causal, D ** -0.5, cfg, residual)
    ref = attention_ref(q.double(), k.double(), v.double(), causal)
    for name, r, got in (("o", ref["o"], o), ("lse", ref["lse"], lse)):
        res = compare(name, r, got, dtype=dtype, verbose=False)
        assert res.ok, res.line()
    return o, lse, o_res, ref


# each config's cases on one xdist worker under --dist loadgroup (the GPU run's): a worker then compiles that config's
# kernels alone, where spread cases had every worker compile nearly every variant (~10 s each for the persistent ones)
@pytest.mark.parametrize("cfg", [pytest.param(c, marks=pytest.mark.xdist_group(_cfg_id(c))) for c in CFGS],
                         ids=_cfg_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", F16, ids=F16_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Sq{}-Sk{}-H{}-Hkv{}-D{}".format(*s))
def test_forward_matches_reference(shape, dtype, causal, cfg):
    q, k, v = _qkv(*shape, dtype, seed=hash((shape, causal)) % 1000)
    o, lse, _, ref = _check(q, k, v, causal, dtype, cfg)
    B, Sq, Sk = shape[0], shape[1], shape[2]
    assert not o.isnan().any() and not lse.isnan().any()
    if causal and Sq > Sk:  # rows that see no key: o exactly 0, lse -inf (the reference says so too)
        assert (o[:, : Sq - Sk] == 0).all()
        assert torch.isneginf(lse[:, :, : Sq - Sk]).all()
        assert torch.isneginf(ref["lse"][:, :, : Sq - Sk]).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", F16, ids=F16_IDS)
def test_large_scores(dtype, causal):
    q, k, v = _qkv(2, 200, 300, 4, 2, 128, dtype, seed=7, q_scale=100.0)  # |q k^T| * scale ~ 1e3-1e4
    for cfg in (CFGS[1], CFGS[3], dict(CFGS[4], num_stages=2)):  # (D = 128: three warpgroups fit at 2 stages)
        o, lse, _, _ = _check(q, k, v, causal, dtype, cfg)
        assert torch.isfinite(o).all()


# (D, causal, cfg): the last is the H200's D = 64 non-causal entry (a training forward stores the residual there)
RES_FORMS = [(128, True, {"BLOCK_N": 128, "num_stages": 3}),
             (128, True, {"BLOCK_N": 128, "num_stages": 2, "NUM_WG": 3}),
             (64, False, {"BLOCK_N": 128, "num_stages": 4, "NUM_WG": 3, "SCHED": 1}),
             (64, False, {"BLOCK_N": 128, "num_stages": 4, "NUM_WG": 3, "SCHED": 1, "PERSIST": 1, "PROGRAMS": 7}),
             (64, False, {"BLOCK_N": 128, "num_stages": 4, "NUM_WG": 3, "SCHED": 1, "PERSIST": 1, "PROGRAMS": 7,
                          "XITEM": 1})]


@pytest.mark.parametrize("form", RES_FORMS, ids=lambda f: f"D{f[0]}-{'causal' if f[1] else 'full'}-{_cfg_id(f[2])}")
@pytest.mark.parametrize("dtype", F16, ids=F16_IDS)
def test_rounding_residual(dtype, form):
    """o_res is the rounding error of o from the kernel's fp32 result: within half a spacing of o (so o + o_res rounds
    back to o but at ties), mostly nonzero, and o + o_res no farther from the reference than o on average."""
    D, causal, cfg = form
    q, k, v = _qkv(2, 333, 333, 4, 4, D, dtype, seed=3)
    o, _, o_res, ref = _check(q, k, v, causal, dtype, cfg, residual=True)
    assert o_res.shape == o.shape and o_res.dtype == o.dtype
    eps = torch.finfo(dtype).eps
    assert (o_res.float().abs() <= eps * o.float().abs() + 1e-30).all()
    # o + o_res rounds back to o, except where o_res rounded to exactly half the spacing (a tie; round-to-even may
    # then pick the neighbour): there the sum lies exactly midway between o and the value it rounds to
    back = (o.float() + o_res.float()).to(dtype)
    off = back != o
    assert torch.equal((back.float() - o.float()).abs()[off], 2 * o_res.float().abs()[off])
    assert (o_res != 0).float().mean() > 0.5
    err_o = (o.double() - ref["o"]).abs().mean()
    err_sum = (o.double() + o_res.double() - ref["o"]).abs().mean()
    assert err_sum <= err_o, (err_sum, err_o)


def test_dispatch(monkeypatch):
    """flash_attn_func takes the Gluon forward where the sm90 config has GLUON (D = 128; D = 64 non-causal on the H200)
    and the inputs allow it; non-contiguous inputs and TRIFORGE_ATTN_GLUON=0 take the Triton kernel (same results
    within the comparison)."""
    import triforge.ops.attention.forward_ws as fws

    calls = []
    real = fws.attn_fwd_ws
    monkeypatch.setattr(fws, "attn_fwd_ws", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    dtype = torch.bfloat16
    q, k, v = _qkv(1, 130, 130, 2, 2, 128, dtype, seed=5)
    ref = attention_ref(q.double(), k.double(), v.double(), False)["o"]
    for expect, args, env in [
        (1, (q, k, v), None),
        (0, (q.transpose(1, 2).contiguous().transpose(1, 2), k, v), None),  # q not contiguous
        (0, (q, k, v), "0"),
    ]:
        if env is None:
            monkeypatch.delenv("TRIFORGE_ATTN_GLUON", raising=False)
        else:
            monkeypatch.setenv("TRIFORGE_ATTN_GLUON", env)
        calls.clear()
        o = flash_attn_func(*args)
        assert len(calls) == expect, (expect, env)
        res = compare("o", ref, o, dtype=dtype, verbose=False)
        assert res.ok, res.line()
    monkeypatch.delenv("TRIFORGE_ATTN_GLUON", raising=False)
    calls.clear()
    q64, k64, v64 = _qkv(1, 130, 130, 2, 2, 64, dtype, seed=6)
    for causal in (False, True):
        # D = 64: the three-warpgroup Gluon kernel where this device's entry has GLUON (the H200's, non-causal:
        # measured faster there, session 52), else the Triton kernel
        calls.clear()
        o = flash_attn_func(q64, k64, v64, causal=causal)
        assert len(calls) == int("GLUON" in attention._cfg("flash_attn_fwd", 64, causal, dtype)), causal
        res = compare("o", attention_ref(q64.double(), k64.double(), v64.double(), causal)["o"], o, dtype=dtype,
                      verbose=False)
        assert res.ok, res.line()
    calls.clear()
    # packed sequences: the Triton kernel unless forced (the Gluon kernel measured slower on the varlen bench)
    from triforge.ops.attention import flash_attn_varlen_func

    cu = torch.tensor([0, 60, 130], dtype=torch.int32, device="cuda")
    for env, expect in ((None, 0), ("1", 1)):
        if env is None:
            monkeypatch.delenv("TRIFORGE_ATTN_GLUON", raising=False)
        else:
            monkeypatch.setenv("TRIFORGE_ATTN_GLUON", env)
        calls.clear()
        flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 70, 70)
        assert len(calls) == expect, env


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_public_function_and_gradients(causal, monkeypatch):
    """flash_attn_func with the Gluon forward (forced): o, lse and dq/dk/dv (the backward reads its o_res) against
    float64 autograd through the reference."""
    monkeypatch.setenv("TRIFORGE_ATTN_GLUON", "1")
    dtype = torch.bfloat16
    q, k, v = (t.requires_grad_(True) for t in _qkv(2, 190, 190, 4, 2, 128, dtype, seed=11))
    with poisoned():
        o, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = attention_ref(q64, k64, v64, causal)
    rdq, rdk, rdv = torch.autograd.grad(ref["o"], (q64, k64, v64), do.double())
    for name, r, got in (("o", ref["o"], o), ("lse", ref["lse"], lse), ("dq", rdq, dq), ("dk", rdk, dk),
                         ("dv", rdv, dv)):
        res = compare(name, r.detach(), got, dtype=dtype, verbose=False)
        assert res.ok, res.line()


VARLEN_CASES = [([37, 0, 129, 1, 200], [37, 0, 129, 1, 200]), ([300, 17, 64], [129, 250, 64]), ([0, 5], [3, 0])]


@pytest.mark.parametrize("persist", [pytest.param(p, marks=pytest.mark.xdist_group(f"varlen{p}")) for p in (0, 1)],
                         ids=["grid", "persist"])
@pytest.mark.parametrize("n_wg", [2, 3])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
def test_varlen_matches_reference(case, causal, D, n_wg, persist):
    """Packed sequences (empty ones, Sq != Sk per sequence, tiles crossing sequence ends) against the reference run
    per sequence; o and lse (rows that see no key: 0 and -inf). persist: the persistent kernel with two programs
    walking every item, those past a sequence's end (no key tile) among them."""
    from triforge.ops.attention import Varlen, varlen_attention_ref
    from triforge.ops.attention.forward_ws import attn_fwd_ws

    lq, lk = VARLEN_CASES[case]
    cq = torch.tensor([0] + lq, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    ck = torch.tensor([0] + lk, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(case)
    q = torch.randn(sum(lq), 4, D, generator=g).to("cuda", dtype)
    k = torch.randn(sum(lk), 2, D, generator=g).to("cuda", dtype)
    v = torch.randn(sum(lk), 2, D, generator=g).to("cuda", dtype)
    vl = Varlen(cq, ck, max(lq), max(lk))
    with poisoned():
        o, lse, _ = attn_fwd_ws(q[None], k[None], v[None], causal, D ** -0.5,
                                {"BLOCK_N": 128, "num_stages": 2 if n_wg == 3 or (persist and D == 128) else 3,
                                 "NUM_WG": n_wg,
                                 "PERSIST": persist, "PROGRAMS": 2}, False, vl)
    ref = varlen_attention_ref(q.double(), k.double(), v.double(), cq.cpu(), ck.cpu(), causal)
    for name, r, got in (("o", ref["o"], o[0]), ("lse", ref["lse"], lse[0])):
        res = compare(name, r, got, dtype=dtype, verbose=False)
        assert res.ok, res.line()
    assert not o.isnan().any() and not lse.isnan().any()


def test_varlen_public_function_and_gradients(monkeypatch):
    """flash_attn_varlen_func with the Gluon forward (forced) against the per-sequence reference, gradients included."""
    from triforge.ops.attention import flash_attn_varlen_func, varlen_attention_ref

    monkeypatch.setenv("TRIFORGE_ATTN_GLUON", "1")
    lens = [37, 0, 129, 1, 200]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(sum(lens), 4, 128, generator=g).to("cuda", dtype).requires_grad_(True) for _ in range(3))
    with poisoned():
        o = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = varlen_attention_ref(q64, k64, v64, cu.cpu(), cu.cpu(), True)["o"]
    rdq, rdk, rdv = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    for name, r, got in (("o", ref, o), ("dq", rdq, dq), ("dk", rdk, dk), ("dv", rdv, dv)):
        res = compare(name, r.detach(), got, dtype=dtype, verbose=False)
        assert res.ok, res.line()
