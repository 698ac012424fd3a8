"""The warp-specialized Gluon recurrence + output for Hopper (``triforge.ops.deltanet.fused_ws``), which the chunked
forward takes on compiled sm90 launches that keep nothing for a backward (``chunk.gluon_config``).

On the H100 (``gpu``): every config it can run in, against the float64 recurrent reference (awkward lengths, a short
first chunk, packed sequences with empty and one-token sequences, initial states, grouped heads, fp16, without
l2norm), outputs NaN-poisoned; which calls take it. Without a GPU: the kernel as ptxas builds it for sm90a (no spills,
shared memory, wgmma kept asynchronous); the dispatch rule's refusals.
"""

import pytest
import torch

from triforge import _runtime
from triforge.launch import poisoned
from triforge.ops.deltanet import chunk, chunk_gated_delta_rule
from triforge.ops.deltanet.reference import L2NORM_EPS, chunk_ref_stages, recurrent_ref
from triforge.testing import compare

from .test_deltanet import _check_modelled, _f64, _inputs

# (the dispatch's two configs, and the variant with q's row norms taken by the output warpgroups)
CFGS = {
    "bv32-loader-norms": chunk.GLUON_CFGS["bv32"],
    "bv64-slot-norms": chunk.GLUON_CFGS["bv64"],
    "bv32-output-norms": {"BV": 32, "STAGES": 3, "NB": 3, "FTZ": 0, "L2NORM": 2, "OUT_REGS": 168,
                          "LOAD_REGS": 24},
}


def _ws(x, cfg, l2norm=True, cu_seqlens=None, output_final_state=True, save=False):
    """The forward through the intra kernel and fused_ws.fwd_ws with ``cfg`` (``save``: with the residuals)."""
    from triforge.ops.deltanet import fused_ws

    varlen = chunk.prepare_varlen(cu_seqlens)
    intra = chunk.chunk_fwd_intra(x["k"], x["v"], x["g"], x["beta"], l2norm=l2norm, varlen=varlen, store_kn=l2norm)
    res = fused_ws.fwd_ws(x["q"], intra.get("kn", x["k"]), intra["w"], intra["u"], intra["gamma"],
                          x["initial_state"], x["q"].shape[-1] ** -0.5, l2norm=l2norm,
                          cu_seqlens=None if varlen is None else varlen.cu_seqlens,
                          output_final_state=output_final_state, cfg=cfg, save=save,
                          chunk_offsets=None if varlen is None else varlen.chunk_offsets,
                          n_chunks=None if varlen is None else varlen.n_chunks)
    return res


def _sm90():
    return torch.cuda.is_available() and not _runtime.INTERPRET and _runtime.arch() == "sm90"


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", list(CFGS))
@pytest.mark.parametrize("case", ["dense-tail", "short", "packed", "fp16-no-l2norm"])
def test_gpu_ws_forward_matches_float64(case, cfg, gen):
    if not _sm90():
        pytest.skip("the Gluon kernel is built for sm90")
    dtype, l2norm, cu = torch.bfloat16, True, None
    if case == "dense-tail":  # T % 64 != 0, grouped heads, an initial state
        x = _inputs(2, 300, 2, 4, 128, 128, dtype, gen)
    elif case == "short":  # one chunk shorter than 64, no initial state
        x = _inputs(3, 37, 1, 2, 128, 128, dtype, gen, h0=False)
    elif case == "packed":  # an empty and a one-token sequence; chunks cross sequence ends
        lengths = [200, 0, 1, 64, 135, 63]
        x = _inputs(1, sum(lengths), 2, 4, 128, 128, dtype, gen, N=len(lengths))
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    else:  # fp16, k unit-length and no in-kernel normalisation, V = 64
        dtype, l2norm = torch.float16, False
        x = _inputs(2, 130, 2, 2, 128, 64, dtype, gen)
    x = {n: (t.cuda() if t is not None else None) for n, t in x.items()}
    cu = cu.cuda() if cu is not None else None
    o_ref, final_ref = recurrent_ref(**_f64(x), output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                                     cu_seqlens=cu)
    with poisoned():
        o, final = _ws(x, CFGS[cfg], l2norm=l2norm, cu_seqlens=cu)
    _check_modelled({"o": o_ref, "final_state": final_ref}, {"o": o, "final_state": final}, x, dtype, l2norm=l2norm,
                    cu_seqlens=cu)


@pytest.mark.gpu
def test_gpu_ws_without_final_state_returns_empty(gen):
    if not _sm90():
        pytest.skip("the Gluon kernel is built for sm90")
    x = {n: t.cuda() for n, t in _inputs(1, 100, 2, 2, 128, 128, torch.bfloat16, gen).items()}
    o_ref, _ = recurrent_ref(**_f64(x), output_final_state=False, use_qk_l2norm_in_kernel=True)
    with poisoned():
        o, final = _ws(x, CFGS["bv32-loader-norms"], output_final_state=False)
    assert final.numel() == 0
    _check_modelled({"o": o_ref}, {"o": o}, x, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_dispatch_takes_ws_only_without_a_backward(monkeypatch, gen):
    """chunk_gated_delta_rule takes the Gluon kernel for a forward nothing will differentiate (both of the rule's
    configs), not for one that keeps residuals for the backward, and never with TRIFORGE_DELTANET_GLUON=0."""
    if not _sm90():
        pytest.skip("the Gluon kernel is built for sm90")
    from triforge.ops.deltanet import fused_ws

    monkeypatch.delenv(chunk.GLUON_SAVE_ENV, raising=False)  # (the default: a saving forward keeps the Triton kernels)
    calls = []
    real = fused_ws.fwd_ws

    def spy(*a, **kw):
        calls.append(kw["cfg"]["BV"])
        return real(*a, **kw)

    monkeypatch.setattr(fused_ws, "fwd_ws", spy)
    for HV in (2, 8):  # 2 x 2 x 4 = 16 programs at BV 32 (one wave); 16 x 8 x 4 = 512 at BV 32: BV 64
        B = 2 if HV == 2 else 16
        x = {n: t.cuda() for n, t in _inputs(B, 70, 2, HV, 128, 128, torch.bfloat16, gen).items()}
        o_ref, f_ref = recurrent_ref(**_f64(x), output_final_state=True, use_qk_l2norm_in_kernel=True)
        with poisoned():
            o, final = chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
        _check_modelled({"o": o_ref, "final_state": f_ref}, {"o": o, "final_state": final}, x, torch.bfloat16)
    assert calls == [32, 64]
    x = {n: t.cuda() for n, t in _inputs(1, 70, 2, 2, 128, 128, torch.bfloat16, gen).items()}
    x["q"].requires_grad_(True)
    chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert len(calls) == 2  # a differentiable forward keeps the Triton kernels (h, v_new for the backward)
    monkeypatch.setenv(chunk.GLUON_ENV, "0")
    with torch.no_grad():
        chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert len(calls) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", list(CFGS))
@pytest.mark.parametrize("case", ["dense-tail", "packed", "fp16-no-l2norm"])
def test_gpu_ws_saving_forward_keeps_the_residuals(case, cfg, gen):
    """SAVE (the training forward through the Gluon kernel): o, the final state, h and v_new against the float64
    chunked reference's stages, each element held to the registry's error model; P against its float64 value
    (the kernel's q and k normalised in float64; dense cases) within the input dtype's rounding and exactly 0 outside
    each chunk's causal block; every output NaN-poisoned first."""
    if not _sm90():
        pytest.skip("the Gluon kernel is built for sm90")
    from .test_deltanet_bwd import _p_ref

    dtype, l2norm, cu = torch.bfloat16, True, None
    if case == "dense-tail":  # T % 64 != 0, grouped heads, an initial state
        x = _inputs(2, 300, 2, 4, 128, 128, dtype, gen)
    elif case == "packed":  # an empty and a one-token sequence; chunks cross sequence ends
        lengths = [200, 0, 1, 64, 135, 63]
        x = _inputs(1, sum(lengths), 2, 4, 128, 128, dtype, gen, N=len(lengths))
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    else:
        dtype, l2norm = torch.float16, False
        x = _inputs(2, 130, 2, 2, 128, 128, dtype, gen)
    x = {n: (t.cuda() if t is not None else None) for n, t in x.items()}
    cu = cu.cuda() if cu is not None else None
    ref = chunk_ref_stages(**_f64(x), output_final_state=True, use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu)
    with poisoned():
        o, final, kept = _ws(x, chunk.gluon_save_cfg(CFGS[cfg]), l2norm=l2norm, cu_seqlens=cu, save=True)
    n_chunks = chunk.prepare_varlen(cu).n_chunks if cu is not None else -(-x["q"].shape[1] // 64)
    assert kept["h"].shape == (1 if cu is not None else x["q"].shape[0], n_chunks, 4 if case != "fp16-no-l2norm"
                               else 2, 128, 128)
    got = {"o": o, "final_state": final, "h": kept["h"], "v_new": kept["v_new"]}
    _check_modelled({n: ref[n] for n in got}, got, x, dtype, l2norm=l2norm, cu_seqlens=cu)
    q64, k64 = x["q"].double(), x["k"].double()
    if l2norm:
        q64 = q64 * torch.rsqrt(q64.square().sum(-1, keepdim=True) + L2NORM_EPS)
        k64 = k64 * torch.rsqrt(k64.square().sum(-1, keepdim=True) + L2NORM_EPS)
    # (twice the dtype's rounding of P: |P| <= 1 with l2norm, up to a few without, hence the relative term too)
    eps = {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    bounds = [(0, x["q"].shape[1])] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    for b0, b1 in bounds:  # per sequence: its chunks start at its first row, as the kernel's do
        p_want, in_block = _p_ref(q64[:, b0:b1], k64[:, b0:b1], ref["gamma"][:, b0:b1])
        got_p = kept["P"][:, b0:b1]
        torch.testing.assert_close(got_p.double(), p_want, rtol=2 * eps, atol=2 * eps, msg="P")
        assert (got_p[~in_block] == 0).all(), "P is 0 exactly outside each chunk's causal block"


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,HV", [(2, 300, 4), (8, 130, 8)], ids=["bv32", "bv64"])
def test_gpu_training_forward_through_the_gluon_kernel(B, T, HV, monkeypatch, gen):
    """TRIFORGE_DELTANET_GLUON_SAVE=1: a differentiable forward takes the Gluon kernel with SAVE (a spy) and its
    gradients, through the Triton backward reading the saved residuals, match the float64 reference backward at each
    element's modelled scale, as with the Triton saving forward (grouped heads, a tail chunk, an initial state, a
    final-state gradient; 32 programs take BV 32, 256 BV 64)."""
    if not _sm90():
        pytest.skip("the Gluon kernel is built for sm90")
    from triforge.ops.deltanet import fused_ws

    from .test_deltanet_bwd import GRAD_NAMES, _bwd_inputs, _cuda, _ref_and_scales

    calls = []
    real = fused_ws.fwd_ws
    monkeypatch.setattr(fused_ws, "fwd_ws", lambda *a, **kw: calls.append(kw.get("save")) or real(*a, **kw))
    monkeypatch.setenv(chunk.GLUON_SAVE_ENV, "1")
    monkeypatch.setenv("TRIFORGE_DELTANET_BWD", "triton")  # the backward that reads the saved h, v_new and P
    monkeypatch.setenv("TRIFORGE_DELTANET_SAVE", "1")
    x = _cuda(_bwd_inputs(B, T, 2, HV, 128, 128, torch.bfloat16, gen))
    leaves = {n: x[n].clone().requires_grad_(True) for n in GRAD_NAMES}
    o, final = chunk_gated_delta_rule(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True)
    with poisoned():
        got = torch.autograd.grad([o, final], list(leaves.values()), [x["do"], x["dht"]])
    assert calls == [True]
    ref, scales = _ref_and_scales(x, torch.bfloat16, use_qk_l2norm_in_kernel=True)
    for n, gg in zip(GRAD_NAMES, got):
        m = "dh0" if n == "initial_state" else f"d{n}"
        res = compare(n, ref[m], gg, dtype=torch.bfloat16, scale=scales[m])
        assert res.ok, res.line()
    monkeypatch.setenv(chunk.GLUON_SAVE_ENV, "yes")
    with pytest.raises(ValueError, match=chunk.GLUON_SAVE_ENV):
        chunk_gated_delta_rule(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True)


def test_gluon_config_refuses_where_it_cannot_run(monkeypatch):
    q = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16, device=_runtime.default_device())
    if not _sm90():  # the interpreter or another GPU: never
        assert chunk.gluon_config(q, 128, 128, 4) is None
    else:
        assert chunk.gluon_config(q, 128, 128, 4)["BV"] == 32
        assert chunk.gluon_config(q, 64, 128, 4) is None  # K = 128 only
        assert chunk.gluon_config(q, 128, 96, 4) is None  # V a multiple of 64
        assert chunk.gluon_config(q.float(), 128, 128, 4) is None  # 16-bit inputs
        # q is read through a TMA descriptor: contiguous and 16-byte aligned, else the Triton kernels
        assert chunk.gluon_config(q.transpose(1, 2).contiguous().transpose(1, 2), 128, 128, 4) is None
        shifted = torch.empty(q.numel() + 8, dtype=q.dtype, device=q.device)[1:1 + q.numel()].view(q.shape)
        assert shifted.is_contiguous() and shifted.data_ptr() % 16
        assert chunk.gluon_config(shifted, 128, 128, 4) is None
    monkeypatch.setenv(chunk.GLUON_ENV, "yes")
    with pytest.raises(ValueError, match=chunk.GLUON_ENV):
        chunk.gluon_config(q, 128, 128, 4)


_SM90_WS = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
from triton.experimental.gluon import language as gl
from triforge.ops.deltanet import fused_ws as W
from tests.ops.deltanet.gluon_compile import compile_sm90

rows = []
for case in json.loads(sys.argv[1]):
    cfg, dt = case["cfg"], case["dtype"]
    bv = cfg["BV"]
    g = gl.bfloat16 if dt == "bf16" else gl.float16
    lk, lv = gl.NVMMASharedLayout.get_default_for([64, 128], g), gl.NVMMASharedLayout.get_default_for([64, bv], g)
    consts = dict(H=2, HV=4, K=128, V=128, BV=bv, STAGES=cfg["STAGES"], NB=cfg["NB"], L2NORM=cfg["L2NORM"],
                  USE_H0=case["h0"], STORE_FINAL=True, VARLEN=case["varlen"], FTZ=bool(cfg["FTZ"]),
                  OUT_REGS=cfg["OUT_REGS"], LOAD_REGS=cfg["LOAD_REGS"], LOAD_WARPS=4 if cfg["L2NORM"] == 3 else 1,
                  SAVE=bool(case.get("save", False)))
    types = {n: f"tensordesc<{dt}[64, 128],{lk!r}>" for n in ("w_desc", "k_desc", "q_desc")}
    types.update(u_desc=f"tensordesc<{dt}[64, {bv}],{lv!r}>", gamma_ptr="*fp32", h0_ptr="*fp32", ht_ptr="*fp32",
                 o_ptr=f"*{dt}", cu_ptr="*i32", scale="fp32", h_ptr=f"*{dt}", vn_ptr=f"*{dt}", p_ptr=f"*{dt}",
                 coff_ptr="*i32")
    rows.append(dict(case, **compile_sm90(W.gdn_fwd_ws_kernel, types, consts,
                                          ("gamma_ptr", "h0_ptr", "ht_ptr", "o_ptr", "h_ptr", "vn_ptr", "p_ptr"))))
print("RESULT" + json.dumps(rows))
"""


def test_ws_kernel_compiles_for_sm90():
    """The dispatch's two configs as ptxas builds them for sm90a (no GPU here): no spills, within the 227 KB of
    shared memory, the wgmma kept asynchronous (C7515 not raised), dense and packed, with and without h0; the
    training forward's variant (SAVE) at BV 32 too."""
    from tests.ops.attention.test_flash_attn import _sm90_compile

    cases = [dict(cfg=CFGS[c], dtype=dt, varlen=vl, h0=h0)
             for c, dt, vl, h0 in (("bv32-loader-norms", "bf16", False, False), ("bv32-loader-norms", "fp16", True, True),
                                   ("bv64-slot-norms", "bf16", False, True), ("bv64-slot-norms", "bf16", True, False))]
    # the training forward's SAVE variant, with the configs the saving path gives it (chunk.gluon_save_cfg)
    cases += [dict(cfg=chunk.gluon_save_cfg(CFGS[c]), dtype="bf16", varlen=vl, h0=True, save=True)
              for c in ("bv32-loader-norms", "bv64-slot-norms") for vl in (False, True)]
    for r in _sm90_compile(cases, _SM90_WS):
        assert r["spills"] == 0 and r["shared"] <= 227 * 1024 and not r["serialized"], r
        assert r["wgmma"] > 0, r

