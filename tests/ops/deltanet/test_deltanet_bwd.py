"""Gated DeltaNet chunked backward (``triforge.ops.deltanet.chunk_bwd``, the default; the tests
set ``TRIFORGE_DELTANET_BWD=triton`` where they go through autograd): the float64 reference backward (``chunk_bwd_ref_stages``)
against autograd through ``chunk_ref_stages``; every Triton stage against the reference's (whole
pipeline, and each kernel fed the reference's inputs); odd lengths, grouped value heads, initial
state and final-state gradient on and off, l2norm on and off, packed sequences, extreme decays and
beta near 0 and 1; the switch, the custom op (opcheck, torch.compile); the kernels compiled for
sm90 (no spills, wgmma); GPU tests at K = V = 128 for the session that flips the default.

Kernel calls run under ``poisoned()``; inputs are fresh random draws every run (the ``gen``
fixture). Interpreter shapes stay at K = V in {32, 64} and T <= 150 (about a minute in all).
fp32 results are judged at the default fp32 tolerance; 16-bit ones at their dtype's default
tolerance with per-element error scales from the reference run with the kernels' 16-bit stores
(``stored_error_scales``).
"""

import contextlib
import dataclasses
from collections import OrderedDict

import pytest
import torch

from triforge import _runtime
from triforge.launch import poisoned
from triforge.ops.deltanet import chunk as chunk_fwd_module
from triforge.ops.deltanet import (
    backward_impl,
    chunk_bwd,
    chunk_bwd_torch,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_bwd_stages,
    recurrent_ref,
)
from triforge.ops.deltanet.reference import (
    chunk_bwd_ref_stages,
    chunk_ref_stages,
    l2norm,
    l2norm_bwd,
    SOLVE_BLOCK,
    Rounding,
    rounding_samples,
    solve_unit_lower_blocks,
    stored_error_scales,
    tf32_round,
)
from triforge.testing import Tolerance, compare, compare_stages, tolerance_for

from .test_deltanet import DEV, DIRECT_D, DTYPE_IDS, _f64, _inputs

# fp32 gamma near -1900 (g to -30 a token) is off by ~1e-4 (ulp 1.2e-4): exp(gamma_i - gamma_j) ~1e-4 relative
EXTREME = Tolerance(rel_rms=1e-3, atol=1e-3, rtol=1e-3)
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _bwd_inputs(B, T, H, HV, K, V, dtype, gen, *, h0=True, dht=True, l2norm=True, N=None, g_scale=1.0):
    x = _inputs(B, T, H, HV, K, V, dtype, gen, h0=h0, normalized_k=not l2norm, N=N, g_scale=g_scale)
    x["do"] = torch.randn(x["v"].shape, generator=gen).to(DEV, dtype)
    x["dht"] = torch.randn(N or B, HV, K, V, generator=gen).to(DEV) if dht else None
    return x


class _Scales(dict):
    """Per-element error scales (``stored_error_scales``) and, in ``rel``, each stage's relative RMS
    change under the kernels' roundings to nearest (the model's own error, ``rounding_samples[0]``)."""

    rel: dict


# a stage's relative RMS error may reach this multiple of what its roundings alone make (the
# rounding model's nearest instance); the dtype's default (1e-2) where that is larger. Measured on
# the interpreter with extreme decays (bf16, beta = 0.9999): dbeta at 1.0-1.3x the model's 1e-3..8e-3
REL_OF_MODEL = 2.0


def _ref_and_scales(x, dtype, **kw):
    """(float64 reference stages, their error scales: a ``_Scales`` for 16-bit inputs, else None, the
    default rms)."""
    ref = chunk_bwd_ref_stages(**_f64(x), **kw)
    if dtype not in (torch.float16, torch.bfloat16):
        return ref, None
    samples = rounding_samples(lambda **r: chunk_bwd_ref_stages(**_f64(x), **kw, **r), dtype)
    scales = _Scales(stored_error_scales(ref, samples, tolerance_for(dtype).atol))
    scales.rel = {n: float((samples[0][n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-300)) for n in scales}
    return ref, scales


def _bwd_stages(x, l2norm, cu=None, scale=None):
    """(float64 reference stages, Triton stages, error scales or None) of the same inputs."""
    ref, scales = _ref_and_scales(x, x["q"].dtype, scale=scale, use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu)
    with poisoned():
        got = chunk_gated_delta_rule_bwd_stages(**x, scale=scale, use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu)
    return ref, got, scales


def _assert_stages(ref, got, dtype, scales=None, tol=None):
    """Every stage within its dtype's default tolerance (``tol`` where given), at ``scales``; with a
    rounding model (16-bit), a stage's relative RMS bound is at least REL_OF_MODEL times the model's."""
    assert list(got) == list(ref)
    tols = {n: tol for n in ref} if tol else None
    if tol is None and isinstance(scales, _Scales):
        base = tolerance_for(dtype)
        tols = {n: dataclasses.replace(base, rel_rms=max(base.rel_rms, REL_OF_MODEL * scales.rel.get(n, 0.0)))
                for n in ref}
    results, failed = compare_stages(ref, got, dtype=dtype, tols=tols, scales=scales)
    assert failed is None, results[-1].line()


# ----------------------------------------------------------------------------- the float64 reference

_REF_CASES = [
    # B, T, H, HV, K, V, h0, dht, l2norm, cu_seqlens, g_scale
    (2, 130, 2, 4, 16, 8, True, True, True, None, 1.0),
    (2, 17, 1, 3, 16, 16, False, False, False, None, 1.0),
    (1, 64, 2, 2, 8, 16, True, False, True, None, 1.0),
    (1, 1, 1, 2, 16, 8, False, True, True, None, 1.0),
    (1, 150, 1, 2, 16, 8, True, True, True, [0, 30, 31, 31, 150], 1.0),
    (2, 100, 1, 2, 16, 16, True, True, True, None, 30.0),
]


@pytest.mark.parametrize("case", _REF_CASES, ids=[f"T{c[1]}-G{c[3] // c[2]}-h0{int(c[6])}-dht{int(c[7])}-l2{int(c[8])}"
                                                  f"{'-varlen' if c[9] else ''}{'-extreme' if c[10] > 1 else ''}"
                                                  for c in _REF_CASES])
def test_reference_backward_equals_autograd_float64(case, gen):
    """Every input gradient of the explicit backward stages equals autograd through chunk_ref_stages."""
    B, T, H, HV, K, V, h0, dht, l2, cu, g_scale = case
    cu = torch.tensor(cu, device=DEV) if cu is not None else None
    N = len(cu) - 1 if cu is not None else None
    x = _f64(_bwd_inputs(B, T, H, HV, K, V, torch.float64, gen, h0=h0, dht=dht, l2norm=l2, N=N, g_scale=g_scale))
    leaves = {n: x[n].clone().requires_grad_(True) for n in GRAD_NAMES if x[n] is not None}
    st = chunk_ref_stages(**{n: leaves.get(n, x[n]) for n in GRAD_NAMES}, scale=0.3, output_final_state=True,
                          use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
    outs, grads = [st["o"]], [x["do"]]
    if dht:
        outs.append(st["final_state"])
        grads.append(x["dht"])
    want = dict(zip(leaves, torch.autograd.grad(outs, list(leaves.values()), grads)))
    got = chunk_bwd_ref_stages(**x, scale=0.3, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
    assert ("dh0" in got) == h0
    for n, w in want.items():
        d = got["dh0" if n == "initial_state" else f"d{n}"]
        assert (d - w).abs().max() <= 1e-10 * w.abs().max(), n


def test_reference_state_gradient_by_suffix(gen):
    """dh of chunk n (the gradient of the state leaving it) equals autograd's gradient of the initial
    state of the same problem started at chunk n + 1 from that state."""
    x = _f64(_bwd_inputs(2, 170, 1, 2, 16, 8, torch.float64, gen))
    ref = chunk_bwd_ref_stages(**x, use_qk_l2norm_in_kernel=True)
    fwd = chunk_ref_stages(**{n: x[n] for n in GRAD_NAMES}, use_qk_l2norm_in_kernel=True)
    for n in (0, 1):
        s = 64 * (n + 1)
        h = fwd["h"][:, n + 1].clone().requires_grad_(True)
        st = chunk_ref_stages(*(x[m][:, s:] for m in ("q", "k", "v", "g", "beta")), initial_state=h,
                              output_final_state=True, use_qk_l2norm_in_kernel=True)
        (dh,) = torch.autograd.grad([st["o"], st["final_state"]], [h], [x["do"][:, s:], x["dht"]])
        assert (ref["dh"][:, n] - dh).abs().max() <= 1e-10 * dh.abs().max()


def test_l2norm_backward_equals_autograd(gen):
    x = torch.randn(5, 3, 32, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(5, 3, 32, generator=gen, dtype=torch.float64)
    (want,) = torch.autograd.grad(l2norm(x), [x], [dy])
    torch.testing.assert_close(l2norm_bwd(x.detach(), dy), want, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- Triton stages

# (B, T, H, HV, K, dtype, h0, dht, l2norm): every T, every dtype, both head dims, groups of 1-3
_STAGE_CASES = [
    (2, 1, 1, 2, 32, torch.float32, True, True, True),
    (2, 17, 2, 2, 32, torch.float16, False, True, False),
    (1, 64, 1, 3, 64, torch.bfloat16, True, False, True),
    (2, 100, 2, 4, 32, torch.float32, True, True, True),
    (1, 100, 1, 1, 64, torch.float32, False, False, False),
    (1, 130, 1, 2, 32, torch.bfloat16, True, True, True),
    (1, 130, 2, 2, 32, torch.float16, True, False, True),
]


_STAGE_IDS = [f"T{c[1]}-K{c[4]}-G{c[3] // c[2]}-{DTYPE_IDS[c[5]]}-h0{int(c[6])}-dht{int(c[7])}-l2{int(c[8])}"
              for c in _STAGE_CASES]


@pytest.mark.parametrize("B,T,H,HV,K,dtype,h0,dht,l2", _STAGE_CASES, ids=_STAGE_IDS)
def test_kernel_stages_match_reference(B, T, H, HV, K, dtype, h0, dht, l2, gen):
    """dh, dv_new, dq_hv, dk_local, dw, dgamma_local, dT, dA, dv, dbeta, dk_hv, dgamma, dg, dq, dk, dh0
    in order (stops at the first failing stage)."""
    x = _bwd_inputs(B, T, H, HV, K, K, dtype, gen, h0=h0, dht=dht, l2norm=l2)
    ref, got, scales = _bwd_stages(x, l2, scale=0.3 if K == 64 else None)
    for n in ("dq", "dk", "dv"):
        assert got[n].dtype == dtype
    assert got["dg"].dtype == x["g"].dtype and got["dbeta"].dtype == dtype
    _assert_stages(ref, got, dtype, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_kernel_stages_varlen(dtype, gen):
    """Packed sequences with an empty and a one-token sequence; per-sequence states and dht."""
    lengths = [37, 1, 0, 70]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    x = _bwd_inputs(1, sum(lengths), 1, 2, 32, 32, dtype, gen, N=len(lengths))
    ref, got, scales = _bwd_stages(x, True, cu=cu)
    _assert_stages(ref, got, dtype, scales)
    assert torch.equal(got["dh0"][2], x["dht"][2])  # an empty sequence passes its final state's gradient on


def test_stored_error_scales_catch_a_planted_error(gen):
    """The Triton bf16 dq and dk pass under ``stored_error_scales``; one element at a
    well-conditioned place (scale within 2x the rms, |ref| <= rms / 2: bound <= 0.125 rms) moved
    by a quarter of the tensor's rms fails, and is located: it is the one element over its bound."""
    dtype = torch.bfloat16
    x = _bwd_inputs(1, 130, 1, 2, 32, 32, dtype, gen)
    ref, got, scales = _bwd_stages(x, True)
    tol = tolerance_for(dtype)
    for name in ("dq", "dk"):
        r, g, s = ref[name], got[name].double(), scales[name]
        clean = compare(name, r, g, dtype=dtype, scale=s)
        assert clean.ok, clean.line()
        rms = float(r.square().mean().sqrt())
        well = (s <= 2.0 * rms) & (r.abs() <= 0.5 * rms)
        assert well.float().mean() > 0.2, name  # most elements are well conditioned
        slack = torch.where(well, tol.atol * s + tol.rtol * r.abs() - (g - r).abs(), torch.inf)
        idx = tuple(int(i) for i in torch.unravel_index(slack.argmin(), slack.shape))
        bad = g.clone()
        bad[idx] += 0.25 * rms * (1.0 if g[idx] >= r[idx] else -1.0)
        res = compare(name, r, bad, dtype=dtype, scale=s, verbose=False)
        assert not res.ok and res.n_over == 1, res.line()
        assert not compare(name, r[idx], bad[idx], dtype=dtype, scale=s[idx], verbose=False).ok, (name, idx)


def test_reference_store_dtype_rounds_the_stored_tensors(gen):
    """store_dtype rounds w, u, h, v_new (forward recompute), dh, dv_new, dw: those stages are
    exact in bf16, the exact reference's are not; the gradients move by about bf16's rounding."""
    x = _f64(_bwd_inputs(1, 100, 1, 2, 16, 16, torch.float64, gen))
    names = {n: x[n] for n in GRAD_NAMES}
    exact, stored = chunk_bwd_ref_stages(**x, use_qk_l2norm_in_kernel=True), chunk_bwd_ref_stages(
        **x, use_qk_l2norm_in_kernel=True, store_dtype=torch.bfloat16)
    fe, fs = (chunk_ref_stages(**names, use_qk_l2norm_in_kernel=True, store_dtype=d) for d in (None, torch.bfloat16))
    for n, e, st in [(n, fe[n], fs[n]) for n in ("w", "u", "h", "v_new")] + [
            (n, exact[n], stored[n]) for n in ("dh", "dv_new", "dw")]:
        assert torch.equal(st, st.to(torch.bfloat16).double()), n
        assert not torch.equal(e, e.to(torch.bfloat16).double()), n
    for n in ("dq", "dk", "dv", "dg", "dbeta", "dh0"):
        rel = float((stored[n] - exact[n]).norm() / exact[n].norm())
        assert 1e-5 < rel < 2e-2, (n, rel)


def test_rounding_instances_are_roundings_of_the_same_size(gen):
    """``Rounding``: to nearest equals the dtype cast; a dithered instance is representable, within half
    a unit of the dither's mantissa plus half a unit in the last place of x (16-bit: one unit; fp32:
    the 3xTF32 products' 21-bit mantissa), differs from nearest at a sizeable share of elements, and is
    reproducible from its seed."""
    x = torch.randn(4096, generator=gen, dtype=torch.float64) * torch.logspace(-6, 6, 4096, dtype=torch.float64)
    for dtype, mant, dither, share in ((torch.bfloat16, 7, 7, (0.1, 0.5)), (torch.float16, 10, 10, (0.1, 0.5)),
                                       (torch.float32, 23, 21, (0.6, 0.95))):
        x_d = x.clamp(-6e4, 6e4) if dtype == torch.float16 else x
        near = Rounding(dtype)(x_d)
        assert torch.equal(near, x_d.float().to(dtype).double()), dtype
        a, b = Rounding(dtype, seed=7)(x_d), Rounding(dtype, seed=7)(x_d)
        assert torch.equal(a, b) and torch.equal(a, a.to(dtype).double()), dtype
        _, e = torch.frexp(x_d)
        e = (e - 1).clamp(min=-14 if dtype == torch.float16 else -126)
        one = torch.ones_like(x_d)
        bound = 0.5 * torch.ldexp(one, e - dither) + 0.5 * torch.ldexp(one, e - mant)
        assert ((a - x_d).abs() <= bound * (1 + 1e-12)).all(), dtype
        assert share[0] < float((a != near).double().mean()) < share[1], dtype


# the compiled kernels' fp32-operand products (input_precision "tf32", bf16/fp16 inputs) drop each operand's
# low 13 bits: benchmarks/deltanet_rounding_probe.py on the H100 (7b72ea2) put the model with "rz" at 0.000-0.002
# of dq_hv's error, "rna" at 0.26-0.36 and no tf32 at 0.26-0.35; the interpreter multiplies in full fp32
TF32 = None if _runtime.INTERPRET else "rz"


def test_rounding_model_is_where_the_kernels_round(gen):
    """The float64 reference with the kernels' roundings to nearest (stores and tensor-core
    operands; compiled, also the forward's tf32 products) reproduces the Triton backward's fp32 stages
    (dh, dq_hv, dk_local, dgamma_local) to a quarter of their error against the exact reference: the
    model rounds where the kernels do."""
    x = _bwd_inputs(1, 150, 1, 2, 32, 32, torch.bfloat16, gen)
    ref, got, _ = _bwd_stages(x, True)
    model = chunk_bwd_ref_stages(**_f64(x), use_qk_l2norm_in_kernel=True,
                                 store_dtype=Rounding(torch.bfloat16, tf32=TF32))
    for n in ("dh", "dq_hv", "dk_local", "dgamma_local"):
        g = got[n].double()
        assert float((g - model[n]).norm()) < 0.25 * float((g - ref[n]).norm()), n


def test_tf32_round_keeps_ten_mantissa_bits():
    """rz drops the low 13 bits of the fp32 value; rna adds half of them first (ties away from zero);
    both results have 10 explicit mantissa bits and lie within one (rz) or half (rna) a tf32 unit."""
    one = 2.0**-10
    x = torch.tensor([1.0, 1 + one / 2, 1 + one, 1 + 1.5 * one, -(1 + one / 2), -1.7, 3e-40, 0.0], dtype=torch.float64)
    rz = tf32_round(x, "rz")
    assert rz[[0, 1, 2, 3, 4, 5, 7]].tolist() == [1.0, 1.0, 1 + one, 1 + one, -1.0, -1.69921875, 0.0]
    sub = x[6].float().double()  # an fp32 subnormal: its low 13 bits dropped, at most 2^13 subnormal units
    assert 0 < rz[6] <= sub and sub - rz[6] < 2.0**-149 * 2**13
    assert tf32_round(x, "rna").tolist()[:6] == [1.0, 1 + one, 1 + one, 1 + 2 * one, -(1 + one), -1.7001953125]
    assert torch.equal(tf32_round(x, None), x)
    y = torch.randn(4096, dtype=torch.float64) * torch.logspace(-20, 20, 4096, dtype=torch.float64)
    for mode, units in (("rz", 1.0), ("rna", 0.5)):
        r = tf32_round(y, mode)
        assert torch.equal(r.float().view(torch.int32) & 0x1FFF, torch.zeros(4096, dtype=torch.int32)), mode
        _, e = torch.frexp(y.float().double())
        assert ((r - y.float().double()).abs() <= units * torch.ldexp(torch.ones_like(y), e - 11)).all(), mode
    with pytest.raises(ValueError, match="tf32"):
        Rounding(torch.bfloat16, tf32="rne")


@pytest.mark.parametrize("n", [64, 22, 9, 1])
@pytest.mark.parametrize("diag", ["product", "substitute"])
def test_block_solve_model_without_rounding_is_the_inverse(n, diag, gen):
    """solve_unit_lower_blocks (the forward kernel's block-Neumann solve, chunk.BC blocks; the diagonal blocks by
    products, the kernel's default, or by substitution) without operand rounding equals the triangular inverse;
    with tf32 operands it moves T by tf32-sized amounts (relative ~1e-4, not 0): across blocks in both forms, and
    inside one block (n <= 16) in the product form only."""
    assert SOLVE_BLOCK == chunk_fwd_module.BC
    A = (0.1 * torch.randn(2, n, n, generator=gen, dtype=torch.float64)).tril(-1)
    eye = torch.eye(n, dtype=torch.float64)
    exact = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    torch.testing.assert_close(solve_unit_lower_blocks(A, SOLVE_BLOCK, None, diag), exact, rtol=1e-12, atol=1e-12)
    rel = float((solve_unit_lower_blocks(A, SOLVE_BLOCK, "rz", diag) - exact).norm() / exact.norm())
    if n > SOLVE_BLOCK or (diag == "product" and n > 2):
        assert 1e-6 < rel < 2e-3, rel
    else:  # one block solved exactly (substitution) or a 1 x 1 / 2 x 2 block (no tf32-rounded product is nonzero)
        assert rel < 1e-12, rel
    with pytest.raises(ValueError, match="diag"):
        solve_unit_lower_blocks(A, SOLVE_BLOCK, None, "lu")


def test_each_kernel_from_reference_inputs(gen):
    """Each launcher fed the reference's own upstream stages (fp32), so a failure names one kernel
    whatever the stages before it did: kernel 1 (dh, dv_new, dh0), 2 (dq_hv, dk_local, dw,
    dgamma_local), 3 (dv, dbeta, dk_hv, dg, dT, dA, dgamma), 4 (dq, dk)."""
    x = _bwd_inputs(2, 100, 1, 2, DIRECT_D, DIRECT_D, torch.float32, gen)
    x64 = _f64(x)
    ref = chunk_bwd_ref_stages(**x64, use_qk_l2norm_in_kernel=True)
    fwd = chunk_ref_stages(**{n: x64[n] for n in GRAD_NAMES}, use_qk_l2norm_in_kernel=True)
    f32 = {n: t.float().contiguous() for n, t in {**fwd, **ref}.items()}
    scale = DIRECT_D**-0.5
    qn, kn = (l2norm(x64[n]).float() for n in ("q", "k"))
    with poisoned():
        qn2, kn2 = chunk_bwd.chunk_bwd_l2norm(x["q"], x["k"])
        dh, dv_new, dh0 = chunk_bwd.chunk_bwd_dh(qn, kn, f32["w"], f32["gamma"], x["do"], x["dht"], scale)
        local = chunk_bwd.chunk_bwd_dqkw(qn, kn, f32["v_new"], f32["h"], f32["dh"], x["do"], f32["dv_new"],
                                         f32["gamma"], scale)
        dgl = f32["dgamma_local"][None]
        wy = chunk_bwd.chunk_bwd_wy(kn, x["v"], x["beta"], torch.float32, f32["gamma"], f32["T"], f32["dw"],
                                    f32["dv_new"], f32["dk_local"].clone(), dgl, stages=True)
        dq, dk = chunk_bwd.chunk_bwd_qk(x["q"], x["k"], f32["dq_hv"], f32["dk_hv"], scale, l2norm=True)
    got = OrderedDict(qn=qn2, kn=kn2, dh=dh, dv_new=dv_new, dh0=dh0, dq_hv=local["dq_hv"], dk_local=local["dk_local"],
                      dw=local["dw"], dgamma_local=local["dgamma_local"].sum(0), dT=wy["dT"], dA=wy["dA"], dv=wy["dv"],
                      dbeta=wy["dbeta"], dk_hv=wy["dk_hv"], dgamma=wy["dgamma"], dg=wy["dg"], dq=dq, dk=dk)
    want = {**ref, "qn": l2norm(x64["q"]), "kn": l2norm(x64["k"])}
    for n, t in got.items():
        res = compare(n, want[n], t, dtype=torch.float32)
        assert res.ok, res.line()


@pytest.mark.parametrize("dtype,beta_value", [(torch.float32, 1e-4), (torch.float32, 0.9999),
                                              (torch.bfloat16, 0.9999), (torch.float16, 1e-4)],
                         ids=["fp32-beta0", "fp32-beta1", "bf16-beta1", "fp16-beta0"])
def test_extreme_decay_and_beta_stay_finite(dtype, beta_value, gen):
    """g down to -30 per token (gamma to about -1900 in a chunk), some tokens at g = 0, beta near 0
    or 1: every stage finite. fp32 and bf16 (fp32's range) match the reference; fp16 gradients such
    as dh0 shrink to ~1e-9 there, below fp16's normal range (w and u underflow), so only finite."""
    x = _bwd_inputs(1, 130, 1, 2, 32, 32, dtype, gen)
    x["g"] = -30.0 * torch.rand(x["g"].shape, generator=gen).to(DEV)
    x["g"][:, ::7] = 0.0
    x["beta"] = torch.full_like(x["beta"], beta_value)
    ref, got, scales = _bwd_stages(x, True)
    for n, t in got.items():
        assert t.isfinite().all(), n
    if dtype != torch.float16:
        _assert_stages(ref, got, dtype, scales, EXTREME if dtype == torch.float32 else None)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_gradients_with_a_huge_negative_decay(impl, gen, monkeypatch):
    """g = -1e4 and -inf at a few tokens (beyond the kernels' floor, chunk.G_FLOOR), through the Triton backward and
    the PyTorch one: every gradient, dg included, finite and equal to float64 autograd through the recurrence (which
    needs no cumsum of g) at -1e4, fp32; at -inf (a full reset) finite. Each element is judged at the registry's fp32
    error scale (``deltanet._chunk_magnitudes``, of the inputs with g at the floor, as the kernels read them: e^-80
    and e^-1e4 differ by nothing fp32 holds): by the rms of each gradient, 2 of 40 seeds failed (session 48) at dk's
    last rows (95-97 of 100), where the final state's gradient makes dk cancel, and at dg's rel. RMS (1.009e-5)."""
    from triforge.ops import deltanet as dn
    from triforge.ops.deltanet.reference import recurrent_ref

    monkeypatch.setenv("TRIFORGE_DELTANET_BWD", impl)
    x = _inputs(1, 100, 1, 2, 32, 32, torch.float32, gen, normalized_k=False)
    leaves = {n: x[n].clone().requires_grad_(True) for n in GRAD_NAMES}
    leaves["g"].data[0, 40] = float("-inf")
    o, _ = chunk_gated_delta_rule(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for n, d in zip(GRAD_NAMES, torch.autograd.grad(o.sum(), [leaves[n] for n in GRAD_NAMES])):
        assert d.isfinite().all(), f"d{n} at g = -inf"
    x["g"][0, 5] = -1e4
    x["g"][0, 70, 1] = -1e4
    x["g"][0, 63, 0] = -1e4  # a chunk's last row
    do = torch.randn(x["v"].shape, generator=gen).to(DEV)
    dht = torch.randn(x["initial_state"].shape, generator=gen).to(DEV)  # the final state's gradient too
    leaves = {n: x[n].clone().requires_grad_(True) for n in GRAD_NAMES}
    o, fin = chunk_gated_delta_rule(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True)
    got = dict(zip(GRAD_NAMES, torch.autograd.grad((o, fin), [leaves[n] for n in GRAD_NAMES], (do, dht))))
    ref_leaves = {n: t.detach().double().cpu().requires_grad_(True) for n, t in x.items()}
    o_ref, fin_ref = recurrent_ref(**ref_leaves, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want = dict(zip(GRAD_NAMES, torch.autograd.grad((o_ref, fin_ref), [ref_leaves[n] for n in GRAD_NAMES],
                                                    (do.double().cpu(), dht.double().cpu()))))
    x64 = {n: t.detach().double().cpu() for n, t in x.items()}
    x64["g"] = x64["g"].clamp(min=chunk_fwd_module.G_FLOOR_VALUE)
    scales = dn._chunk_magnitudes({**x64, "use_qk_l2norm_in_kernel": True}, [do.double().cpu(), dht.double().cpu()],
                                  torch.float32)
    for n in GRAD_NAMES:
        assert got[n].isfinite().all(), n
        res = compare(f"d{n}", want[n], got[n].cpu(), dtype=torch.float32, scale=scales[f"d{n}"], verbose=False)
        assert res.ok, res.line()


# ----------------------------------------------------------------------------- switch, autograd, custom op


def test_switch_defaults_to_triton(monkeypatch, gen):
    monkeypatch.delenv("TRIFORGE_DELTANET_BWD", raising=False)
    assert backward_impl() == "triton"
    x = _inputs(1, 20, 1, 2, 32, 32, torch.float32, gen)
    leaves = {n: x[n].clone().requires_grad_(True) for n in GRAD_NAMES}
    calls = []
    real = chunk_bwd.chunk_bwd

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(chunk_bwd, "chunk_bwd", spy)
    o, _ = chunk_gated_delta_rule(**leaves)
    o.sum().backward()
    assert calls, "the default backward did not run the Triton kernels"

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton backward ran though torch was asked for")

    monkeypatch.setattr(chunk_bwd, "chunk_bwd", refuse)
    monkeypatch.setenv("TRIFORGE_DELTANET_BWD", "torch")
    o, _ = chunk_gated_delta_rule(**leaves)
    o.sum().backward()
    monkeypatch.setenv("TRIFORGE_DELTANET_BWD", "cuda")
    o, _ = chunk_gated_delta_rule(**leaves)
    with pytest.raises(ValueError, match="TRIFORGE_DELTANET_BWD"):
        o.sum().backward()


_GRAD_CASES = [
    # T, dtype, h0, use the final state, l2norm, cu_seqlens
    (70, torch.float32, True, True, True, None),
    (40, torch.bfloat16, False, False, True, [0, 13, 40]),
    (130, torch.float16, True, True, False, None),
]


@pytest.mark.parametrize("save", ["1", "0"], ids=["saved", "recomputed"])
@pytest.mark.parametrize("T,dtype,h0,use_final,l2,cu", _GRAD_CASES,
                         ids=["fp32-h0-final", "bf16-varlen", "fp16-noL2"])
def test_triton_backward_gradients_through_autograd(T, dtype, h0, use_final, l2, cu, save, monkeypatch, gen):
    """The public function's gradients with TRIFORGE_DELTANET_BWD=triton against float64 autograd
    through the recurrent reference (an independent formulation of the forward), with the forward's
    intermediates kept for the backward (TRIFORGE_DELTANET_SAVE=1; with varlen h holds the chunks of every sequence)
    or recomputed there."""
    monkeypatch.setenv("TRIFORGE_DELTANET_BWD", "triton")
    monkeypatch.setenv("TRIFORGE_DELTANET_SAVE", save)
    cu = torch.tensor(cu, device=DEV) if cu is not None else None
    N = len(cu) - 1 if cu is not None else None
    x = _inputs(1 if cu is not None else 2, T, 1, 2, 32, 32, dtype, gen, h0=h0, normalized_k=not l2, N=N)
    names = [n for n in GRAD_NAMES if x[n] is not None]
    leaves = {n: x[n].clone().requires_grad_(True) for n in names}
    leaves64 = {n: x[n].double().requires_grad_(True) for n in names}
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
    o, final = chunk_gated_delta_rule(**leaves, **kw)
    o64, final64 = recurrent_ref(**leaves64, **kw)
    do = torch.randn(o.shape, generator=gen).to(DEV, dtype)
    dht = torch.randn(final.shape, generator=gen).to(DEV)
    outs, outs64, grads = ([o, final], [o64, final64], [do, dht]) if use_final else ([o], [o64], [do])
    with poisoned():
        got = torch.autograd.grad(outs, list(leaves.values()), grads)
    want = torch.autograd.grad(outs64, list(leaves64.values()), [t.double() for t in grads])
    _, scales = _ref_and_scales({**x, "do": do, "dht": dht if use_final else None}, dtype, use_qk_l2norm_in_kernel=l2,
                                cu_seqlens=cu)
    for n, w, gg in zip(names, want, got):
        assert gg.dtype == leaves[n].dtype
        scale = scales["dh0" if n == "initial_state" else f"d{n}"] if scales else None
        res = compare(f"d{n}", w, gg, dtype=dtype, scale=scale)
        assert res.ok, res.line()


def _both_backwards_match_reference(x, scale, l2norm):
    """The Triton and the PyTorch backward (fp32) each against the float64 reference backward at
    the default fp32 tolerance, each element at the registry check's fp32 error scale
    (``deltanet._chunk_magnitudes``: the fp32 store roundings, the stage algorithm evaluated in fp32, and
    the per-head changes carried through the group sum and the l2norm's backward, where dk cancels at a
    sequence's last rows under a final-state gradient; with the store roundings alone the PyTorch
    backward failed one dk element at row 998 of 1000 on the H100, session 25)."""
    from triforge.ops import deltanet as dn

    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], l2norm, None)
    want = chunk_bwd_torch(x["do"], x["dht"], *args)
    with poisoned():
        got = torch.ops.triforge.chunk_gated_delta_rule_bwd(x["do"], x["dht"], *args)
    kw = dict(scale=scale, use_qk_l2norm_in_kernel=l2norm)
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    x64 = _f64(x)
    ref = {n: t for n, t in chunk_bwd_ref_stages(**x64, **kw).items() if n in names}
    inputs = {**{n: x64[n] for n in GRAD_NAMES}, **kw}
    scales = dn._chunk_magnitudes(inputs, [x64["do"], x64["dht"]], torch.float32)
    scales["dh0"] = scales.pop("dinitial_state")
    for n, w, gg in zip(names, want, got):
        for impl, t in (("torch", w), ("triton", gg)):
            res = compare(f"{n} {impl}", ref[n], t, dtype=torch.float32, scale=scales[n])
            assert res.ok, res.line()


def test_fp32_check_scales_hold_the_fp32_evaluation(gen):
    """The registry's fp32 error scales (forward stages and input gradients) cover, besides the fp32
    store roundings, the stage algorithm evaluated in fp32: its arithmetic error (at the last rows of a
    sequence with a final-state gradient it matches the store roundings' change, 8x at single elements).
    Each element's scale is at least the rms plus STORE_C / atol times that evaluation's error."""
    from triforge.ops import deltanet as dn
    from triforge.ops.deltanet.reference import STORE_C

    x = _bwd_inputs(1, 130, 2, 4, 32, 32, torch.float32, gen)
    inputs = {**{n: x[n].double() for n in GRAD_NAMES}, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    grads = [x["do"].double(), x["dht"].double()]
    args32 = {n: x[n] for n in GRAD_NAMES}
    atol = tolerance_for(torch.float32).atol
    fwd_kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    bwd_kw = dict(do=x["do"], dht=x["dht"], use_qk_l2norm_in_kernel=True)
    names = {"dq": "dq", "dk": "dk", "dv": "dv", "dg": "dg", "dbeta": "dbeta", "dh0": "dinitial_state"}
    cases = (
        (dn._chunk_magnitudes(inputs, None, torch.float32), chunk_ref_stages(**_f64(args32), **fwd_kw),
         chunk_ref_stages(**args32, **fwd_kw, dtype=torch.float32), {}),
        (dn._chunk_magnitudes(inputs, grads, torch.float32), chunk_bwd_ref_stages(**_f64({**args32, **bwd_kw})),
         chunk_bwd_ref_stages(**args32, **bwd_kw, dtype=torch.float32), names),
    )
    for scales, exact, f32, rename in cases:
        checked = 0
        for n, e in exact.items():
            key = rename.get(n, n) if rename else n
            if key not in scales or (rename and n not in rename):
                continue
            rms = float(e.square().mean().sqrt())
            floor = (rms if rms > 0 else 1.0) + (STORE_C / atol) * (f32[n].double() - e).abs()
            assert torch.all(scales[key] >= floor * (1 - 1e-12)), n
            checked += 1
        assert checked >= (6 if rename else 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grad_scales_carry_per_head_changes_through_the_group_sum_and_l2norm(dtype, gen, monkeypatch):
    """fp32: dq and dk are sums of per-value-head terms followed by the l2norm's projection, both of which
    cancel. Their error scales take at least the instances' per-head changes (dq_hv, dk_hv) carried through
    those steps in absolute value (abs_l2norm_bwd), where the fp32 evaluation's own dq/dk change may cancel
    by chance. The floor must hold elementwise, must bite somewhere (else it is not what moves the fp32 real
    tier), and must not loosen typical elements: the median scale grows by at most a quarter. 16-bit scales
    are left as they were (several instances of their dominant roundings; they pass)."""
    from triforge.ops import deltanet as dn
    from triforge.ops.deltanet.reference import STORE_C, abs_l2norm_bwd, error_changes, rounding_samples

    x = _bwd_inputs(1, 200, 2, 4, 32, 32, torch.float32, gen)
    inputs = {**{n: x[n].double() for n in GRAD_NAMES}, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    grads = [x["do"].double(), x["dht"].double()]
    atol = tolerance_for(dtype).atol
    scales = dn._chunk_magnitudes(inputs, grads, dtype)
    args = {n: inputs[n] for n in GRAD_NAMES}
    kw = dict(do=grads[0], dht=grads[1], use_qk_l2norm_in_kernel=True)
    exact = chunk_bwd_ref_stages(**args, **kw)
    samples = rounding_samples(lambda **r: chunk_bwd_ref_stages(**args, **kw, **r), dtype, lazy=True)
    if dtype == torch.float32:
        samples = list(samples) + list(dn._fp32_instance(chunk_bwd_ref_stages, args, kw))
    change = error_changes({n: exact[n] for n in ("dq_hv", "dk_hv", "dq", "dk")}, samples)
    monkeypatch.setattr(dn, "abs_l2norm_bwd", lambda x, d: torch.zeros_like(d))
    without = dn._chunk_magnitudes(inputs, grads, dtype)
    if dtype != torch.float32:
        assert all(torch.equal(scales[n], without[n]) for n in scales)
        return
    bit = 0
    for hv, name, xin, mult in (("dq_hv", "dq", inputs["q"], 32 ** -0.5), ("dk_hv", "dk", inputs["k"], 1.0)):
        rms = float(exact[name].square().mean().sqrt())
        floor = rms + (STORE_C / atol) * abs_l2norm_bwd(xin, mult * change[hv].view(1, 200, 2, 2, 32).sum(3))
        assert torch.all(scales[name] >= floor * (1 - 1e-12)), name
        assert torch.all(scales[name] >= without[name] * (1 - 1e-12)), name
        ratio = scales[name] / without[name]
        bit += int((ratio > 1.01).sum())
        assert float(ratio.median()) <= 1.25, (name, float(ratio.median()))
    assert bit > 0


def test_triton_backward_matches_torch_backward(gen):
    """The two implementations side by side (fp32, grouped heads, no l2norm, scale given)."""
    _both_backwards_match_reference(_bwd_inputs(1, 90, 2, 4, 32, 32, torch.float32, gen, l2norm=False), 0.25, False)


def _grads_with_save(monkeypatch, x, save, scale):
    """The input gradients of o and the final state (l2norm in the kernel, upstream do and dht) with
    TRIFORGE_DELTANET_SAVE set to ``save``: the saved ("1") or the recomputing ("0") backward."""
    monkeypatch.setenv("TRIFORGE_DELTANET_SAVE", save)
    leaves = {n: x[n].clone().requires_grad_(True) for n in GRAD_NAMES}
    o, fin = chunk_gated_delta_rule(**leaves, scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=True)
    with poisoned():
        return torch.autograd.grad([o, fin], list(leaves.values()), [x["do"], x["dht"]])


def _p_ref(qn, kn, gamma):
    """(P [B, T, HV, 64] in float64, the mask of its kept entries): row t holds (q_t . k_j) exp(gamma_t - gamma_j)
    for the keys j <= t of its chunk (column j - chunk start), 0 elsewhere; value head v reads q/k head
    v // (HV / H)."""
    B, T, H, _ = qn.shape
    HV = gamma.shape[2]
    q = qn.double().repeat_interleave(HV // H, dim=2)
    k = kn.double().repeat_interleave(HV // H, dim=2)
    g = gamma.double()
    out = torch.zeros(B, T, HV, 64, dtype=torch.float64, device=qn.device)
    kept = torch.zeros(B, T, HV, 64, dtype=torch.bool, device=qn.device)
    for c0 in range(0, T, 64):
        c1 = min(c0 + 64, T)
        s = torch.einsum("bthk,bjhk->bthj", q[:, c0:c1], k[:, c0:c1])
        d = g[:, c0:c1, :, None] - g[:, c0:c1].transpose(1, 2)[:, None, :, :]  # [B, t, HV, j]
        n = c1 - c0
        causal = torch.ones(n, n, dtype=torch.bool, device=qn.device).tril()[None, :, None, :]
        out[:, c0:c1, :, :n] = torch.where(causal, s * torch.exp(torch.where(causal, d, 0.0)), 0.0)
        kept[:, c0:c1, :, :n] = causal
    return out, kept


@pytest.mark.parametrize("K,V,dtype,padded", [(32, 32, torch.float32, False), (64, 32, torch.bfloat16, False),
                                              (32, 32, torch.float16, True)], ids=["fp32", "bf16-K64", "fp16-padded"])
def test_saved_residuals_are_the_recompute(K, V, dtype, padded, monkeypatch, gen):
    """The training forward's residuals (gamma, w, T, h, v_new) are what the backward's recompute makes (the
    same kernels on the same inputs), the saved and the recomputed backward give the same gradients (also with the
    final state alone differentiated: o's gradient arrives as None), and a forward that is not differentiated
    (no_grad, or inputs without requires_grad) keeps nothing; a varlen one keeps them too. T = 100: a partial last
    chunk; padded: the head dims padded to 64 as compiled kernels run 32 (the residuals stay padded)."""
    if padded:  # (compiled kernels pad dims below 64 anyway)
        monkeypatch.setattr(chunk_fwd_module, "PAD_SMALL_DIMS", True)
    x = _bwd_inputs(1, 100, 1, 2, K, V, dtype, gen)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3, x["initial_state"])
    o_s, fin_s, *res = torch.ops.triforge.chunk_gated_delta_rule_fwd_save(*args, True, True, None)
    o, fin = torch.ops.triforge.chunk_gated_delta_rule_fwd(*args, True, True, None)
    assert torch.equal(o_s, o) and torch.equal(fin_s, fin)
    Kp, Vp = chunk_fwd_module.padded_dims(K, V)
    pad = lambda t, n: torch.nn.functional.pad(t, (0, n - t.shape[-1]))  # noqa: E731
    intra = chunk_fwd_module.chunk_fwd_intra(pad(x["k"], Kp), pad(x["v"], Vp), x["g"], x["beta"], l2norm=True,
                                             store_t=True)
    h0 = torch.nn.functional.pad(x["initial_state"], (0, Vp - V, 0, Kp - K))
    h, v_new, _ = chunk_fwd_module.chunk_fwd_h(pad(x["k"], Kp), intra["w"], intra["u"], intra["gamma"], h0, l2norm=True,
                                               output_final_state=False)
    qn, kn = chunk_bwd.chunk_bwd_l2norm(pad(x["q"], Kp), pad(x["k"], Kp))
    want = {"gamma": intra["gamma"], "w": intra["w"], "T": intra["T"], "h": h, "v_new": v_new, "qn": qn, "kn": kn,
            "P": _p_ref(qn, kn, intra["gamma"])[0].to(dtype)}
    assert len(res) == len(chunk_fwd_module.SAVED_NAMES) == len(want)
    for name, got in zip(chunk_fwd_module.SAVED_NAMES, res):
        assert got.shape == want[name].shape and got.dtype == want[name].dtype, name
        if name in ("gamma", "w", "T", "qn", "kn"):  # (qn, kn: the output and intra kernels' rounding is kernel 0's)
            assert torch.equal(got, want[name]), name
        elif name == "P":  # (unit q, k rows and decays <= 1: |P| <= 1; the rounding to the input dtype is the error)
            atol = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-10}[dtype]
            p_want, kept = _p_ref(qn, kn, intra["gamma"])
            torch.testing.assert_close(got.double(), p_want, rtol=0, atol=atol, msg=name)
            assert (got[~kept] == 0).all(), "P is 0 exactly outside each chunk's causal block"
        else:  # (a saving forward runs the unfused recurrence, as the recompute does: equal up to block order)
            torch.testing.assert_close(got.float(), want[name].float(), rtol=1e-5, atol=1e-5, msg=name)
    grads_of = {}
    for save in ("1", "0"):
        grads_of[save] = _grads_with_save(monkeypatch, x, save, 0.3)
        # the final state alone differentiated (o's gradient is None in the backward)
        leaves = {n: x[n].clone().requires_grad_(True) for n in GRAD_NAMES}
        _, fin = chunk_gated_delta_rule(**leaves, scale=0.3, output_final_state=True, use_qk_l2norm_in_kernel=True)
        grads_of["final" + save] = torch.autograd.grad(fin, list(leaves.values()), x["dht"])
    for n, a, b, c, d in zip(GRAD_NAMES, grads_of["1"], grads_of["0"], grads_of["final1"], grads_of["final0"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"d{n}")
        torch.testing.assert_close(c, d, rtol=1e-4, atol=1e-4, msg=f"d{n} (final state only)")
    monkeypatch.setenv("TRIFORGE_DELTANET_SAVE", "1")
    calls = []
    real = chunk_fwd_module.chunk_fwd
    # (the save flag of each public call: the padded forward calls itself again at the padded dims)
    monkeypatch.setattr(chunk_fwd_module, "chunk_fwd",
                        lambda *a, **kw: (a[0].shape[-1] == K and a[2].shape[-1] == V
                                          and calls.append(kw.get("save", False))) or real(*a, **kw))
    with torch.no_grad():
        chunk_gated_delta_rule(*args[:5], initial_state=x["initial_state"].requires_grad_(True))
    chunk_gated_delta_rule(*args[:5], initial_state=x["initial_state"].detach())
    leaf = x["q"].clone().requires_grad_(True)
    chunk_gated_delta_rule(leaf, *args[1:5], cu_seqlens=torch.tensor([0, 40, 100], device=DEV))
    chunk_gated_delta_rule(leaf, *args[1:5])
    assert calls == [False, False, True, True], calls


@pytest.mark.parametrize("padded", [False, True], ids=["K64", "K32-padded"])
def test_saved_normalised_qk_replace_the_backwards_l2norm(padded, monkeypatch, gen):
    """With the l2norm the training forward keeps qn (stored by the output kernel, one writer per q head: HV = 2 H
    here) and kn (the intra kernel's), equal to kernel 0's; the saved backward then runs no kernel 0, and the
    recompute runs it on q alone (kn from its intra kernel) and gives the same gradients as the saved one.
    Without the l2norm qn and kn are empty. Kernel 0 on q alone equals its q half on both."""
    if padded:
        monkeypatch.setattr(chunk_fwd_module, "PAD_SMALL_DIMS", True)
    K = 32 if padded else 64
    x = _bwd_inputs(1, 90, 2, 4, K, 32, torch.bfloat16, gen)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.25, x["initial_state"], True)
    res = dict(zip(chunk_fwd_module.SAVED_NAMES, torch.ops.triforge.chunk_gated_delta_rule_fwd_save(*args, True, None)[2:]))
    Kp = chunk_fwd_module.padded_dims(K, 32)[0]
    pad = lambda t: torch.nn.functional.pad(t, (0, Kp - K))  # noqa: E731
    qn, kn = chunk_bwd.chunk_bwd_l2norm(pad(x["q"]), pad(x["k"]))
    assert torch.equal(res["qn"], qn) and torch.equal(res["kn"], kn)
    assert not res["qn"].isnan().any()
    q_alone, none = chunk_bwd.chunk_bwd_l2norm(pad(x["q"]))
    assert none is None and torch.equal(q_alone, qn)
    plain = dict(zip(chunk_fwd_module.SAVED_NAMES, torch.ops.triforge.chunk_gated_delta_rule_fwd_save(*args, False,
                                                                                                     None)[2:]))
    assert plain["qn"].numel() == plain["kn"].numel() == 0 and plain["P"].shape == res["P"].shape

    calls = []
    real = chunk_bwd.chunk_bwd_l2norm
    monkeypatch.setattr(chunk_bwd, "chunk_bwd_l2norm", lambda q, k=None, **kw: calls.append(k is None) or real(q, k, **kw))
    grads = {}
    for save in ("1", "0"):
        grads[save] = _grads_with_save(monkeypatch, x, save, 0.25)
        assert calls == ([] if save == "1" else [True]), (save, calls)
    for n, a, b in zip(GRAD_NAMES, grads["1"], grads["0"]):
        assert not a.isnan().any(), n
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"d{n}")
    # saved q / k of the wrong shape are refused by name
    bad = dict(res, qn=res["qn"][:, :-1].contiguous())
    with pytest.raises(ValueError, match="saved qn / kn"):
        chunk_bwd.chunk_bwd(x["do"], x["dht"], pad(x["q"]), pad(x["k"]), x["v"], x["g"], x["beta"], 0.25,
                            torch.nn.functional.pad(x["initial_state"], (0, 0, 0, Kp - K)), l2norm=True, saved=bad)


def test_save_switch_rejects_other_values(monkeypatch, gen):
    monkeypatch.setenv("TRIFORGE_DELTANET_SAVE", "yes")
    x = _inputs(1, 20, 1, 2, 32, 32, torch.float32, gen)
    with pytest.raises(ValueError, match="TRIFORGE_DELTANET_SAVE"):
        chunk_gated_delta_rule(x["q"].requires_grad_(True), x["k"], x["v"], x["g"], x["beta"])


def test_bwd_op_opcheck(gen):
    x = _inputs(1, 20, 1, 2, 32, 32, torch.float32, gen)
    do = torch.randn(x["v"].shape, generator=gen).to(DEV)
    dht = torch.randn(x["initial_state"].shape, generator=gen).to(DEV)
    op = torch.ops.triforge.chunk_gated_delta_rule_bwd.default
    base = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.2)
    for args in ((do, dht, *base, x["initial_state"], True, None),
                 (do, None, *base, None, False, torch.tensor([0, 7, 20], device=DEV))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    fwd_save = torch.ops.triforge.chunk_gated_delta_rule_fwd_save.default
    cu = torch.tensor([0, 7, 20], device=DEV)
    for h0, final, l2, cs in ((x["initial_state"], True, True, None), (None, False, False, None),
                              (None, True, True, cu)):
        torch.library.opcheck(fwd_save, (*base, h0, final, l2, cs), test_utils=("test_schema", "test_faketensor"))
        res = fwd_save(*base, h0, final, l2, cs)[2:]
        d_final = (dht if cs is None else dht.expand(2, *dht.shape[1:]).contiguous()) if final else None
        torch.library.opcheck(torch.ops.triforge.chunk_gated_delta_rule_bwd_saved.default,
                              (do, d_final, *base, h0, l2, cs, *res), test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_traces_the_triton_backward(monkeypatch, gen):
    monkeypatch.setenv("TRIFORGE_DELTANET_BWD", "triton")
    x = _inputs(1, 20, 1, 2, 32, 32, torch.float32, gen)
    do = torch.randn(x["v"].shape, generator=gen).to(DEV)

    def loss(q, k, v, g, beta, initial_state):
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
        return (o * do).sum() + s.square().sum()

    def grads(fn):
        leaves = [x[n].clone().requires_grad_(True) for n in GRAD_NAMES]
        return torch.autograd.grad(fn(*leaves), leaves)

    calls = []
    real = chunk_bwd.chunk_bwd
    monkeypatch.setattr(chunk_bwd, "chunk_bwd", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = grads(torch.compile(loss, fullgraph=True))
    assert calls, "the compiled backward did not run the Triton kernels"
    for a, b in zip(got, grads(loss)):
        torch.testing.assert_close(a, b)


def test_torch_compile_varlen_saving_forward(monkeypatch, gen):
    """torch.compile(fullgraph=True) through the saving forward with cu_seqlens, where h's chunk count is a size that
    depends on the values of cu_seqlens (an unbacked size in the fake): the same gradients as eager."""
    monkeypatch.setenv("TRIFORGE_DELTANET_SAVE", "1")
    x = _inputs(1, 40, 1, 2, 32, 32, torch.float32, gen, h0=False)
    cu = torch.tensor([0, 13, 40], device=DEV)
    do = torch.randn(x["v"].shape, generator=gen).to(DEV)

    def loss(q, k, v, g, beta):
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        return (o * do).sum()

    def grads(fn):
        leaves = [x[n].clone().requires_grad_(True) for n in GRAD_NAMES[:5]]
        return torch.autograd.grad(fn(*leaves), leaves)

    for a, b in zip(grads(torch.compile(loss, fullgraph=True)), grads(loss)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("save", ["1", "0"])
def test_eager_calls_bypass_the_custom_ops_traced_calls_use_them(monkeypatch, gen, save):
    """Eager calls run the forward under a plain autograd.Function and the backward's body directly (launch.eager:
    torch.library's dispatch costs host time the GPU waits for at ~1 ms backwards); under a dispatch mode (what
    AOTAutograd and make_fx trace with) the custom ops run. Both give the same output, final state and gradients, with
    the saving forward and with the recompute."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    monkeypatch.setenv("TRIFORGE_DELTANET_SAVE", save)
    x = _inputs(1, 70, 1, 2, 32, 32, torch.float32, gen)
    do = torch.randn(x["v"].shape, generator=gen).to(DEV)
    dht = torch.randn(x["initial_state"].shape, generator=gen).to(DEV)
    results = {}
    for path in ("eager", "op"):
        leaves = [x[n].clone().requires_grad_(True) for n in GRAD_NAMES]
        with poisoned(), Passthrough() if path == "op" else contextlib.nullcontext():
            o, s = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
            name = type(o.grad_fn).__name__
            assert name.startswith("_ChunkFwd") == (path == "eager"), (path, name)
            results[path] = [o, s, *torch.autograd.grad((o, s), leaves, (do, dht))]
    for name, e, o in zip(("o", "final_state") + GRAD_NAMES, results["eager"], results["op"]):
        assert e.isfinite().all(), name
        torch.testing.assert_close(o, e, rtol=0, atol=0, msg=name)


def test_double_backward_raises_on_the_eager_path_too(gen):
    """create_graph=True: the eager backward goes through the backward op (launch.eager_backward), so its gradients
    carry a graph and a second backward raises, as through the op (no double backward is registered), instead of
    silently dropping the term."""
    x = _inputs(1, 20, 1, 2, 32, 32, torch.float32, gen)
    leaves = [x[n].clone().requires_grad_(True) for n in GRAD_NAMES[:5]]
    o, _ = chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)
    dq = torch.autograd.grad(o.square().sum(), leaves[0], create_graph=True)[0]
    assert dq.requires_grad and dq.grad_fn is not None
    with pytest.raises(RuntimeError, match="autograd"):
        torch.autograd.grad(dq.sum(), leaves[1])


def test_bwd_bad_inputs_name_the_argument(gen):
    x = _inputs(1, 8, 1, 2, 32, 32, torch.float32, gen)
    op = torch.ops.triforge.chunk_gated_delta_rule_bwd
    base = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.2, x["initial_state"], False, None)
    with pytest.raises(ValueError, match="do"):
        op(torch.randn(1, 8, 2, 16, device=DEV), None, *base)
    with pytest.raises(ValueError, match="dht"):
        op(torch.randn(1, 8, 2, 32, device=DEV), torch.randn(2, 2, 32, 32, device=DEV), *base)


# ----------------------------------------------------------------------------- compiled for sm90 (no GPU needed)

# Appended to test_flash_attn's compile prelude (its ``compile_``: triton.compile for sm90, ptxas -v);
# cases: [kernel, dtype, K, V, varlen, l2norm]; the launchers' fallback configs as the H100 takes them.
_SM90_DRIVER = r'''
import triforge.ops.deltanet.chunk as fwd
import triforge.ops.deltanet.chunk_bwd as bwd

rows = []
for case in json.loads(sys.argv[1]):  # kernel, dtype, K, V, varlen, l2norm[, config override]
    kernel, dt, K, V, varlen, l2 = case[:6]
    dtype = getattr(torch, dt)
    t = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[dt]
    flags = dict(PREC="tf32x3" if dtype == torch.float32 else "tf32", UPCAST=False, RNE=False)
    shape = dict(H=2, HV=4, K=K, V=V, BT=fwd.BT, L2NORM=l2, IS_VARLEN=varlen, **flags)
    if kernel in ("fwd_intra", "fwd_h", "fwd_h_o"):
        cfg = fwd.fwd_config("gated_delta_rule_" + kernel, K, V, dtype, 4096)
    else:
        cfg = bwd.bwd_config("gated_delta_rule_bwd_" + kernel, K, V, dtype, 4096)
    cfg = dict(cfg, **(case[6] if len(case) > 6 else {}))
    if kernel == "fwd_intra":  # as the backward recomputes it: T stored
        fn = fwd.chunk_gated_delta_rule_fwd_kernel_intra
        ptrs = {n: "*" + t for n in ("k_ptr", "v_ptr", "w_ptr", "u_ptr", "beta_ptr", "kn_ptr")}
        ptrs.update({n: "*fp32" for n in ("g_ptr", "gamma_ptr", "t_ptr", "decay_ptr", "a_ptr")})
        consts = dict(shape, BC=fwd.BC, STORE_T=True, STAGES=False, V_LATE=bool(cfg.get("V_LATE", 0)))
    elif kernel == "fwd_h":  # unfused, h and v_new stored
        fn = fwd.chunk_gated_delta_rule_fwd_kernel_h
        ptrs = {n: "*" + t for n in ("q_ptr", "k_ptr", "w_ptr", "u_ptr", "h_ptr", "v_new_ptr", "o_ptr")}
        ptrs.update({n: "*fp32" for n in ("gamma_ptr", "h0_ptr", "ht_ptr")})
        consts = dict(shape, BV=cfg["BV"], USE_H0=True, STORE_FINAL=False, FUSE_O=False, STORE_H=True,
                      STORE_V_NEW=True)
    elif kernel == "fwd_h_o":  # the forward's fused recurrence + output, as chunk_fwd runs it
        fn = fwd.chunk_gated_delta_rule_fwd_kernel_h
        ptrs = {n: "*" + t for n in ("q_ptr", "k_ptr", "w_ptr", "u_ptr", "h_ptr", "v_new_ptr", "o_ptr")}
        ptrs.update({n: "*fp32" for n in ("gamma_ptr", "h0_ptr", "ht_ptr")})
        consts = dict(shape, BV=cfg["BV"], USE_H0=True, STORE_FINAL=True, FUSE_O=True, STORE_H=False,
                      STORE_V_NEW=False)
    elif kernel == "l2norm":
        fn = bwd.chunk_gated_delta_rule_bwd_kernel_l2norm
        ptrs = {n: "*" + t for n in ("q_ptr", "k_ptr", "qn_ptr", "kn_ptr")}
        consts = dict(K=K, BR=cfg["BR"], RNE=False)
    elif kernel == "dh":
        fn = bwd.chunk_gated_delta_rule_bwd_kernel_dh
        ptrs = {n: "*" + t for n in ("q_ptr", "k_ptr", "w_ptr", "do_ptr", "dh_ptr", "dv_new_ptr", "p_ptr")}
        ptrs.update({n: "*fp32" for n in ("gamma_ptr", "dht_ptr", "dh0_ptr")})
        consts = dict(shape, BV=cfg["BV"], USE_DHT=True, STORE_DH0=True, LOAD_P=bool(cfg.get("LOAD_P", 0)))
    elif kernel == "dqkw":
        fn = bwd.chunk_gated_delta_rule_bwd_kernel_dqkw
        ptrs = {n: "*" + t for n in ("q_ptr", "k_ptr", "v_new_ptr", "h_ptr", "dh_ptr", "do_ptr", "dv_new_ptr",
                                     "dw_ptr")}
        ptrs.update({n: "*fp32" for n in ("gamma_ptr", "dq_ptr", "dk_ptr", "dgamma_ptr")})
        consts = dict(shape, BK=cfg["BK"], BV=cfg["BV"])
    elif kernel == "wy":
        fn = bwd.chunk_gated_delta_rule_bwd_kernel_wy
        ptrs = {n: "*" + t for n in ("k_ptr", "v_ptr", "beta_ptr", "dw_ptr", "dv_new_ptr", "dv_ptr", "dbeta_ptr")}
        ptrs.update({n: "*fp32" for n in ("gamma_ptr", "t_ptr", "dk_local_ptr", "dgamma_local_ptr", "dk_ptr",
                                          "dg_ptr", "dgamma_ptr", "dt_ptr", "da_ptr")})
        consts = dict(shape, BK=cfg["BK"], BV=cfg["BV"], NP=K // cfg["BK"], STAGES=False)
    else:
        fn = bwd.chunk_gated_delta_rule_bwd_kernel_qk
        ptrs = {n: "*" + t for n in ("q_ptr", "k_ptr", "dq_ptr", "dk_ptr")}
        ptrs.update({n: "*fp32" for n in ("dq_hv_ptr", "dk_hv_ptr")})
        consts = dict(H=2, HV=4, K=K, BR=cfg["BR"], L2NORM=l2)
    ptrs.update({n: "*i32" for n in ("cu_seqlens_ptr", "chunk_indices_ptr", "chunk_offsets_ptr") if n in fn.arg_names})
    consts = {n: c for n, c in consts.items() if n in fn.arg_names}
    r = compile_(fn, ptrs, ("scale",), consts, {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    rows.append(dict(r, kernel=kernel, dtype=t, K=K, V=V, varlen=varlen, cfg=cfg))
print("RESULT" + json.dumps(rows))
'''

_DOT_KERNELS = ("fwd_intra", "fwd_h", "dh", "dqkw", "wy")


def _sm90_compile(monkeypatch, cases):
    """test_flash_attn's compile machinery (subprocess, TRITON_INTERPRET=0, sm90a, ptxas from the
    triton wheel) with this family's driver in place of attention's."""
    from tests.ops.attention import test_flash_attn as fa

    assert "\nrows = []" in fa._SM90_COMPILE, "test_flash_attn's compile script changed shape"
    prelude = fa._SM90_COMPILE.split("\nrows = []", 1)[0]
    monkeypatch.setattr(fa, "_SM90_COMPILE", prelude + "\n" + _SM90_DRIVER)
    return fa._sm90_compile(cases)


# The WY kernel runs unpipelined (1 stage: pipelined it miscompiles on sm90, chunk_bwd._FALLBACK) at 4
# warps for K >= 128, at 255 registers: dense K = V = 128 does not spill, packed sequences spill 16 bytes
# (at K = V = 64 4 warps spilled 92, and miscompile there: 8 warps, no spills). At 2 warps (a tunable choice) there is no wgmma and its [64, 64] fp32 tiles (T, dT, K K^T, dA)
# over 64 threads spill 1604 bytes at K = V = 128, 2504 the most over the other head dims. Bounded so
# that neither can grow unnoticed.
_WY_MAX_SPILLS = {4: 128, 2: 3072}


def _check_sm90_rows(rows):
    for r in rows:
        assert r["shared"] <= 227 * 1024, r
        if r["kernel"] == "wy" and r["cfg"]["num_warps"] in _WY_MAX_SPILLS:
            assert r["spills"] <= _WY_MAX_SPILLS[r["cfg"]["num_warps"]], r
            if r["cfg"]["num_warps"] == 2:
                continue  # no warpgroup, no wgmma
        else:
            assert r["spills"] == 0, r
        if r["kernel"] in _DOT_KERNELS:
            assert r["wgmma"] > 0, r  # Hopper tensor cores
            assert r["serialized"] == "", r  # ptxas keeps them asynchronous (C7515 not raised)


def test_backward_kernels_compile_for_sm90(monkeypatch):
    """The backward's kernels as the H100 builds them (no device needed): compiled for sm90a with
    their fallback configs, no register spills, shared memory within 227 KiB, wgmma in every kernel
    with matrix products. bf16 at K = V = 128 (dense and packed), fp16 there, bf16 at K = V = 64,
    and the forward kernels the backward recomputes with (intra storing T, the unfused recurrence).
    The interpreter never compiles them."""
    cases = [[k, "bfloat16", 128, 128, False, True] for k in ("l2norm", "dh", "dqkw", "wy", "qk", "fwd_h")]
    cases += [["wy", "bfloat16", 128, 128, False, True, {"num_warps": 2}]]
    cases += [[k, "bfloat16", 128, 128, True, False] for k in ("dh", "dqkw", "wy")]
    cases += [[k, "float16", 128, 128, False, True] for k in ("dh", "dqkw", "wy")]
    cases += [[k, "bfloat16", 64, 64, False, True] for k in ("dh", "dqkw", "wy", "fwd_intra")]
    # the dh kernel as the training backward runs it (P from the forward), at the sm90 entries' shapes of config
    cases += [["dh", "bfloat16", 128, 128, False, True, {"LOAD_P": 1, "BV": bv, "num_warps": 4, "num_stages": 3}]
              for bv in (32, 64)]
    _check_sm90_rows(_sm90_compile(monkeypatch, cases))


@pytest.mark.slow
def test_backward_kernels_compile_for_sm90_other_head_dims(monkeypatch):
    """V = 256, K = 32 and unequal head dims (the recurrence takes V-blocks of 32 at K = 32). Compiled launches never
    see a head dim below chunk.PAD_MIN (64: chunk_fwd / chunk_bwd pad them), so these cases only guard the kernels'
    register budgets; the dh kernel at K = V = 32 is left out since it computes P as the forward's output kernel does
    (the same bits, for the saved P) and spills 8 bytes there."""
    cases = [[k, "bfloat16", K, V, False, True] for k in ("dh", "dqkw", "wy") for K, V in ((128, 256), (32, 128),
                                                                                           (128, 32), (32, 32))
             if not (k == "dh" and K == V == 32)]
    _check_sm90_rows(_sm90_compile(monkeypatch, cases))


# ----------------------------------------------------------------------------- GPU (compiled kernels)


def _cuda(x):
    return {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
def test_gpu_bwd_stages_head_dim_128(dtype, gen):
    x = _cuda(_bwd_inputs(2, 300, 4, 8, 128, 128, dtype, gen))
    ref, got, scales = _bwd_stages(x, True)
    _assert_stages(ref, got, dtype, scales)


@pytest.mark.gpu
@pytest.mark.parametrize("K,V", [(64, 64), (128, 256), (32, 128), (128, 32)])
def test_gpu_bwd_stages_head_dims_varlen(K, V, gen):
    lengths = [200, 1, 64, 135]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda")
    x = _cuda(_bwd_inputs(1, sum(lengths), 2, 4, K, V, torch.bfloat16, gen, N=len(lengths)))
    ref, got, scales = _bwd_stages(x, True, cu=cu)
    _assert_stages(ref, got, torch.bfloat16, scales)


@pytest.mark.gpu
def test_gpu_bwd_stages_extreme_decay(gen):
    x = _cuda(_bwd_inputs(1, 1000, 2, 4, 128, 128, torch.bfloat16, gen))
    x["g"] = -30.0 * torch.rand(x["g"].shape, device="cuda")
    x["g"][:, ::7] = 0.0
    x["beta"] = torch.full_like(x["beta"], 0.9999)
    ref, got, scales = _bwd_stages(x, True)
    for n, t in got.items():
        assert t.isfinite().all(), n
    _assert_stages(ref, got, torch.bfloat16, scales)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 64, 65])
def test_gpu_each_specialisation_of_t(T, monkeypatch, gen):
    """The forward's chunked kernels and the backward's dqkw and wy specialise T (session 32): T = 1 compiles as the
    constant 1, a multiple of 16 as divisible, any other T as neither. Each class through autograd (Triton backward)
    against the float64 reference: output, final state and every gradient."""
    monkeypatch.setenv("TRIFORGE_DELTANET_BWD", "triton")
    x = _cuda(_bwd_inputs(2, T, 2, 4, 128, 128, torch.bfloat16, gen))
    leaves = {n: x[n].clone().requires_grad_(True) for n in GRAD_NAMES}
    o, final = chunk_gated_delta_rule(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True)
    with poisoned():
        got = torch.autograd.grad([o, final], list(leaves.values()), [x["do"], x["dht"]])
    ref, scales = _ref_and_scales(x, torch.bfloat16, use_qk_l2norm_in_kernel=True)
    o64, f64 = recurrent_ref(**_f64({n: x[n] for n in GRAD_NAMES}), output_final_state=True,
                             use_qk_l2norm_in_kernel=True)
    assert compare("o", o64, o, dtype=torch.bfloat16).ok
    assert compare("final_state", f64, final, dtype=torch.bfloat16).ok
    for n, gg in zip(GRAD_NAMES, got):
        m = "dh0" if n == "initial_state" else f"d{n}"
        res = compare(n, ref[m], gg, dtype=torch.bfloat16, scale=scales[m])
        assert res.ok, res.line()


@pytest.mark.gpu
def test_gpu_bwd_gradients_at_a_bench_shape(monkeypatch, gen):
    """Half of the bench's (8, 4096, 16, 32) shape through autograd with TRIFORGE_DELTANET_BWD=triton,
    against the float64 reference backward."""
    monkeypatch.setenv("TRIFORGE_DELTANET_BWD", "triton")
    x = _cuda(_bwd_inputs(4, 4096, 16, 32, 128, 128, torch.bfloat16, gen))
    leaves = {n: x[n].clone().requires_grad_(True) for n in GRAD_NAMES}
    o, final = chunk_gated_delta_rule(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True)
    with poisoned():
        got = torch.autograd.grad([o, final], list(leaves.values()), [x["do"], x["dht"]])
    ref, scales = _ref_and_scales(x, torch.bfloat16, use_qk_l2norm_in_kernel=True)
    for n, gg in zip(GRAD_NAMES, got):
        m = "dh0" if n == "initial_state" else f"d{n}"
        res = compare(n, ref[m], gg, dtype=torch.bfloat16, scale=scales[m])
        assert res.ok, res.line()


@pytest.mark.gpu
def test_gpu_triton_backward_matches_torch_backward(gen):
    _both_backwards_match_reference(_cuda(_bwd_inputs(2, 1000, 4, 8, 128, 128, torch.float32, gen)), 128**-0.5, True)



def test_tunables_run_every_kernel_at_a_small_shape():
    """The backward's tunables (``triforge tune gated_delta_rule_bwd``) build their inputs and launch
    one config each."""
    from triforge import tune

    shape = {"B": 1, "T": 70, "H": 1, "HV": 2, "K": DIRECT_D, "V": DIRECT_D}
    for kernel in ("gated_delta_rule_bwd_dh", "gated_delta_rule_bwd_dqkw", "gated_delta_rule_bwd_wy"):
        t = tune.get(kernel)
        run, key = t.setup(shape, torch.float32, DEV)
        cfg = tune.grid(t.space)[0]
        run({**cfg, "BK": 16, "BV": 16})
        assert f"k={DIRECT_D}" in key and f"v={DIRECT_D}" in key
