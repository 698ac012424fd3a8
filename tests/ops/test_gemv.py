"""Decode GEMV kernels: float64 references (with and without the eager model's rounding points),
odd sizes, both inner-product paths (FMA for M <= 2, tl.dot above), NaN-poisoned outputs, the KV-cache
append, validation, the registry checks, and an sm90 compile of every kernel (no GPU needed)."""

import pytest
import torch
import torch.nn.functional as F

from triforge import _runtime, registry
from triforge.check import check_op
from triforge.launch import poisoned
from triforge.ops import gemv as G
from triforge.testing import compare

DEV = _runtime.default_device()
DTYPES = [torch.float32, torch.bfloat16]
IDS = ["fp32", "bf16"]


def _rand(gen, *shape, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(shape, generator=gen)).to(DEV, dtype)


def _ok(name, ref, got, dtype):
    res = compare(name, ref, got, dtype=dtype)
    assert res.ok, res.line()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("M,N,K", [(1, 77, 63), (2, 300, 200), (3, 33, 130), (17, 65, 96)])
@pytest.mark.parametrize("bias,residual,norm", [(False, False, False), (True, True, False), (False, True, True)],
                         ids=["plain", "bias+residual", "norm+residual"])
def test_gemv_matches_reference(M, N, K, bias, residual, norm, dtype, gen):
    x = _rand(gen, M, K, dtype=dtype)
    w = _rand(gen, N, K, dtype=dtype, scale=K ** -0.5)
    b = _rand(gen, N, dtype=dtype) if bias else None
    r = _rand(gen, M, N, dtype=dtype) if residual else None
    nw = (1 + _rand(gen, K, scale=0.2)).to(dtype) if norm else None
    with poisoned():
        y = G.gemv(x, w, b, r, nw, eps=1e-6)
        stages = G.gemv_stages(x, w, b, r, nw, eps=1e-6)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    # the kernel rounds where the eager model rounds: against that reference it is (almost) exact
    ref = G.gemv_ref(d(x), d(w), d(b), d(r), d(nw), 1e-6, dtype=dtype)
    for name in ref:
        _ok(f"{name} vs rounded ref", ref[name], stages[name], dtype)
    assert torch.equal(y, stages["y"])
    # and within the dtype's tolerance of the exact float64 math
    _ok("y vs float64", G.gemv_ref(d(x), d(w), d(b), d(r), d(nw), 1e-6)["y"], y, dtype)


def test_gemv_fp32_matches_torch_linear(gen):
    x, w, b = _rand(gen, 5, 257), _rand(gen, 1000, 257, scale=0.05), _rand(gen, 1000)
    with poisoned():
        y = G.gemv(x, w, b)
    _ok("gemv vs F.linear", F.linear(x.double(), w.double(), b.double()), y, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("M,B", [(1, 1), (2, 3), (5, 5)])
def test_qkv_rope_matches_reference(M, B, dtype, gen):
    C, Hq, Hkv, D, S = 72, 4, 2, 64, 19
    nqkv = (Hq + 2 * Hkv) * D
    x, nw = _rand(gen, M, C, dtype=dtype), (1 + _rand(gen, C, scale=0.2)).to(dtype)
    w, b = _rand(gen, nqkv, C, dtype=dtype, scale=C ** -0.5), _rand(gen, nqkv, dtype=dtype, scale=0.5)
    cos, sin = G.rope_tables(D, S + 5, 1e6, DEV)  # more table rows than cache rows is fine
    pos = torch.randperm(S, generator=gen)[:M].to(torch.int32).to(DEV)  # a different position per row
    kc, vc = _rand(gen, B, S, Hkv, D, dtype=dtype), _rand(gen, B, S, Hkv, D, dtype=dtype)
    d = lambda t: t.double()  # noqa: E731
    ref = G.gemv_qkv_rope_ref(d(x), d(w), d(b), d(cos), d(sin), pos, d(kc), d(vc), Hq, Hkv, d(nw), 1e-6, dtype=dtype)
    kc0, vc0 = kc.clone(), vc.clone()
    with poisoned():
        got = G.gemv_qkv_rope_stages(x, w, b, cos, sin, pos, kc, vc, Hq, Hkv, nw)
    for name in ref:
        _ok(name, ref[name], got[name], dtype)
    # only row m's slot at positions[m] changed
    changed = (kc != kc0).any(-1).any(-1)
    want = torch.zeros_like(changed)
    want[torch.arange(M), pos.long()] = True
    assert torch.equal(changed, want)
    assert torch.equal((vc != vc0).any(-1).any(-1), want)
    # the public function returns the same q and writes the same caches
    kc2, vc2 = kc0.clone(), vc0.clone()
    q = G.gemv_qkv_rope(x, w, b, cos, sin, pos, kc2, vc2, Hq, Hkv, norm_weight=nw)
    assert torch.equal(q, got["q"]) and torch.equal(kc2, kc) and torch.equal(vc2, vc)


def test_qkv_rope_matches_hf_rotary(gen):
    """The RoPE tables and the rotation are Hugging Face's (default rope, rotate_half)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    C, Hq, Hkv, D, S = 64, 2, 1, 64, 50
    nqkv = (Hq + 2 * Hkv) * D
    x, w, b = _rand(gen, 1, C), _rand(gen, nqkv, C, scale=C ** -0.5), _rand(gen, nqkv)
    cos, sin = G.rope_tables(D, S, 1e6, DEV)
    cfg = transformers.Qwen2Config(hidden_size=C, num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=D,
                                   rope_theta=1e6, max_position_embeddings=S)
    rot = transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding(cfg)  # on the CPU, as rope_tables computes
    pos = torch.tensor([37], dtype=torch.int32, device=DEV)
    hf_cos, hf_sin = rot(x.cpu(), pos[None].long().cpu())  # the module, x and the positions all on the CPU
    assert torch.equal(hf_cos[0].to(DEV), cos[37:38]) and torch.equal(hf_sin[0].to(DEV), sin[37:38])
    kc = torch.zeros(1, S, Hkv, D, device=DEV)
    vc = torch.zeros_like(kc)
    q = G.gemv_qkv_rope(x, w, b, cos, sin, pos, kc, vc, Hq, Hkv)
    qkv = F.linear(x, w, b)
    q_ref, k_ref = apply_rotary_pos_emb(qkv[:, : Hq * D].view(1, 1, Hq, D), qkv[:, Hq * D: (Hq + Hkv) * D].view(1, 1, Hkv, D),
                                        hf_cos.to(DEV), hf_sin.to(DEV), unsqueeze_dim=2)
    _ok("q vs HF apply_rotary_pos_emb", q_ref[0], q, torch.float32)
    _ok("k vs HF apply_rotary_pos_emb", k_ref[0, 0], kc[0, 37], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("M,I,C", [(1, 100, 63), (2, 333, 128), (9, 48, 200)])
@pytest.mark.parametrize("norm", [False, True], ids=["", "norm"])
def test_gate_up_swiglu_matches_reference(M, I, C, norm, dtype, gen):
    x = _rand(gen, M, C, dtype=dtype)
    w = _rand(gen, 2 * I, C, dtype=dtype, scale=2 * C ** -0.5)
    nw = (1 + _rand(gen, C, scale=0.2)).to(dtype) if norm else None
    with poisoned():
        stages = G.gemv_gate_up_stages(x, w, nw)
        y = G.gemv_gate_up_swiglu(x, w, nw)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    ref = G.gemv_gate_up_ref(d(x), d(w), d(nw), 1e-6, dtype=dtype)
    for name in ref:
        _ok(name, ref[name], stages[name], dtype)
    assert torch.equal(y, stages["y"])
    xn = G.rms_norm_ref(d(x), d(nw), 1e-6) if norm else d(x)
    gate, up = (xn @ d(w).T).chunk(2, dim=-1)
    _ok("y vs float64 silu(gate) * up", F.silu(gate) * up, y, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("M", [1, 3], ids=["fma", "dot"])
@pytest.mark.parametrize("bk,one", [(256, 1), (256, 0), (32, 1)], ids=["one-step", "one-step-off", "multi-step"])
def test_norm_prologue_step_paths(bk, one, M, dtype, gen):
    """The RMSNorm-prologue kernels with K in one step (weights loaded first, x read once) and in
    several (the norm's own pass over x, then the K loop), against the rounded float64 references."""
    C, I, Hq, Hkv, D, S = 200, 40, 2, 1, 64, 7
    cfg = {"BLOCK_N": 16, "BLOCK_K": bk, "num_warps": 4, "num_stages": 1, "ONE": one}
    d = lambda t: t.double()  # noqa: E731
    x, nw = _rand(gen, M, C, dtype=dtype), (1 + _rand(gen, C, scale=0.2)).to(dtype)
    w = _rand(gen, 2 * I, C, dtype=dtype, scale=2 * C ** -0.5)
    with poisoned():
        y, xn = G.gemv_gate_up_launch(x, w, nw, 1e-6, store_xn=True, cfg=cfg)
    ref = G.gemv_gate_up_ref(d(x), d(w), d(nw), 1e-6, dtype=dtype)
    _ok("gate_up y", ref["y"], y, dtype)
    _ok("gate_up xn", G.rms_norm_ref(d(x), d(nw), 1e-6, dtype=dtype), xn, dtype)
    wp, b = _rand(gen, 3 * I, C, dtype=dtype, scale=C ** -0.5), _rand(gen, 3 * I, dtype=dtype)
    r = _rand(gen, M, 3 * I, dtype=dtype)
    with poisoned():
        y, _ = G.gemv_launch(x, wp, b, r, nw, 1e-6, cfg=cfg)
    _ok("gemv y", G.gemv_ref(d(x), d(wp), d(b), d(r), d(nw), 1e-6, dtype=dtype)["y"], y, dtype)
    nqkv = (Hq + 2 * Hkv) * D
    wq, bq = _rand(gen, nqkv, C, dtype=dtype, scale=C ** -0.5), _rand(gen, nqkv, dtype=dtype, scale=0.5)
    cos, sin = G.rope_tables(D, S, 1e6, DEV)
    pos = torch.arange(M, dtype=torch.int32, device=DEV) + 2
    kc, vc = _rand(gen, M, S, Hkv, D, dtype=dtype), _rand(gen, M, S, Hkv, D, dtype=dtype)
    ref = G.gemv_qkv_rope_ref(d(x), d(wq), d(bq), d(cos), d(sin), pos, d(kc), d(vc), Hq, Hkv, d(nw), 1e-6,
                              dtype=dtype)
    with poisoned():
        q, _, _ = G.gemv_qkv_rope_launch(x, wq, bq, cos, sin, pos, kc, vc, Hq, Hkv, nw, 1e-6, cfg=cfg)
    _ok("qkv q", ref["q"], q, dtype)
    _ok("qkv k_cache", ref["k_cache"], kc, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("bn,bk,pps", [(4, 32, 2), (1, 256, 64), (2, 256, 1), (8, 64, 3)],
                         ids=["multi-step-uneven", "one-step-one-unit-each", "one-step-uneven", "multi-step-partial"])
def test_stream_kernel(bn, bk, pps, M, dtype, gen):
    """The persistent streaming kernel (cfg PPS): programs walk balanced ranges of row blocks with the next
    tiles prefetched. Ranges of unequal length (units not a multiple of the grid), units that end past N,
    K in one step and in several with a partial last step, the norm prologue with xn written by program 0,
    and bias + residual or the SwiGLU epilogue: against the rounded float64 references, and (interpreter)
    bit for bit equal to the one-shot kernels with the same tiles."""
    N, K, inter, C = 77, 200, 45, 200
    cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 4, "num_stages": 1, "PPS": pps}
    assert G._stream(cfg, G._flags(dtype, M))
    d = lambda t: t.double()  # noqa: E731
    x, nw = _rand(gen, M, K, dtype=dtype), (1 + _rand(gen, K, scale=0.2)).to(dtype)
    w, b, r = _rand(gen, N, K, dtype=dtype, scale=K ** -0.5), _rand(gen, N, dtype=dtype), _rand(gen, M, N, dtype=dtype)
    with poisoned():
        y, xn = G.gemv_launch(x, w, b, r, nw, 1e-6, store_xn=True, cfg=cfg)
        y_one, _ = G.gemv_launch(x, w, b, r, nw, 1e-6, cfg=dict(cfg, PPS=0))
    ref = G.gemv_ref(d(x), d(w), d(b), d(r), d(nw), 1e-6, dtype=dtype)
    _ok("stream gemv xn", ref["xn"], xn, dtype)
    _ok("stream gemv y", ref["y"], y, dtype)
    _ok("stream gemv y vs float64", G.gemv_ref(d(x), d(w), d(b), d(r), d(nw), 1e-6)["y"], y, dtype)
    with poisoned():
        y_plain, _ = G.gemv_launch(x, w, residual=r, cfg=cfg)
    _ok("stream gemv (residual only)", G.gemv_ref(d(x), d(w), residual=d(r), dtype=dtype)["y"], y_plain, dtype)
    x = _rand(gen, M, C, dtype=dtype)
    wg = _rand(gen, 2 * inter, C, dtype=dtype, scale=2 * C ** -0.5)
    with poisoned():
        g, gxn = G.gemv_gate_up_launch(x, wg, nw, 1e-6, store_xn=True, cfg=cfg)
        g_one, _ = G.gemv_gate_up_launch(x, wg, nw, 1e-6, cfg=dict(cfg, PPS=0))
        g_nonorm, _ = G.gemv_gate_up_launch(x, wg, cfg=cfg)
    ref = G.gemv_gate_up_ref(d(x), d(wg), d(nw), 1e-6, dtype=dtype)
    _ok("stream gate_up xn", ref["xn"], gxn, dtype)
    _ok("stream gate_up y", ref["y"], g, dtype)
    _ok("stream gate_up (no norm)", G.gemv_gate_up_ref(d(x), d(wg), dtype=dtype)["y"], g_nonorm, dtype)
    if _runtime.INTERPRET:
        assert torch.equal(y, y_one) and torch.equal(g, g_one)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("bn_gu,bn_d,bk_d,pps", [(2, 1, 32, 2), (1, 4, 256, 64), (4, 2, 64, 3)],
                         ids=["multi-step-uneven", "one-step-more-programs-than-units", "partial-step"])
def test_mlp_kernel_phases(bn_gu, bn_d, bk_d, pps, M, dtype, gen):
    """The fused MLP kernel's two phases (here two launches: the interpreter runs programs one after another,
    so no grid barrier can hold): gate/up + SwiGLU with the norm prologue into act, then down_proj + the
    residual x, against the chained rounded float64 references; grids with more programs than one phase's
    units; and (interpreter) bit for bit equal to the two streaming kernels it replaces."""
    C, inter = 63, 150
    cfg = {"BN_GU": bn_gu, "BK_GU": 64, "BN_D": bn_d, "BK_D": bk_d, "PPS": pps, "num_warps": 4}
    d = lambda t: t.double()  # noqa: E731
    x, nw = _rand(gen, M, C, dtype=dtype), (1 + _rand(gen, C, scale=0.2)).to(dtype)
    wgu = _rand(gen, 2 * inter, C, dtype=dtype, scale=2 * C ** -0.5)
    wd = _rand(gen, C, inter, dtype=dtype, scale=inter ** -0.5)
    sync = torch.zeros(3, dtype=torch.int32, device=DEV)
    with poisoned():
        y, act, xn = G.gemv_mlp_launch(x, wgu, nw, wd, sync, 1e-6, store_xn=True, cfg=cfg)
    ref = G.gemv_gate_up_ref(d(x), d(wgu), d(nw), 1e-6, dtype=dtype)
    _ok("mlp xn", ref["xn"], xn, dtype)
    _ok("mlp act", ref["y"], act, dtype)
    _ok("mlp y", G.gemv_ref(ref["y"], d(wd), residual=d(x), dtype=dtype)["y"], y, dtype)
    xn64 = G.rms_norm_ref(d(x), d(nw), 1e-6)
    gate, up = (xn64 @ d(wgu).T).chunk(2, dim=-1)
    _ok("mlp y vs float64", d(x) + (F.silu(gate) * up) @ d(wd).T, y, dtype)
    assert torch.equal(sync, torch.zeros_like(sync))
    if _runtime.INTERPRET:
        a2, _ = G.gemv_gate_up_launch(x, wgu, nw, 1e-6, cfg={"BLOCK_N": bn_gu, "BLOCK_K": 64, "num_warps": 4,
                                                             "num_stages": 1, "PPS": pps})
        y2, _ = G.gemv_launch(act, wd, residual=x, cfg={"BLOCK_N": bn_d, "BLOCK_K": bk_d, "num_warps": 4,
                                                        "num_stages": 1, "PPS": pps})
        assert torch.equal(act, a2) and torch.equal(y, y2)


def test_mlp_launch_rejects_what_it_cannot_run(gen):
    x, nw = _rand(gen, 3, 64), 1 + _rand(gen, 64, scale=0.2)
    wgu, wd = _rand(gen, 40, 64), _rand(gen, 64, 20)
    sync = torch.zeros(3, dtype=torch.int32, device=DEV)
    cfg = {"BN_GU": 1, "BK_GU": 64, "BN_D": 1, "BK_D": 32, "PPS": 1, "num_warps": 4}
    with pytest.raises(ValueError, match="at most 2 rows"):
        G.gemv_mlp_launch(x, wgu, nw, wd, sync, cfg=cfg)
    with pytest.raises(ValueError, match="BK_GU"):
        G.gemv_mlp_launch(x[:1], wgu, nw, wd, sync, cfg=dict(cfg, BK_GU=32))
    assert G.mlp_config(3, 64, 20, torch.float32) is None
    sync[2] = 1
    with pytest.raises(RuntimeError, match="timed out"):
        G.check_mlp_sync(sync)


def test_stream_partition_covers_every_unit_once():
    """The grid's balanced ranges [p U / P, (p + 1) U / P) tile [0, U) with lengths differing by at most one,
    for every grid size the launcher can pick (P <= U)."""
    for units in (1, 2, 7, 77, 2432):
        for n_prog in sorted({min(units, p) for p in (1, 2, 3, 132, 528)} | {units}):
            bounds = [(p * units // n_prog, (p + 1) * units // n_prog) for p in range(n_prog)]
            assert bounds[0][0] == 0 and bounds[-1][1] == units
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            lens = [b - a for a, b in bounds]
            assert min(lens) >= 1 and max(lens) - min(lens) <= 1


def test_stream_config_is_ignored_on_the_dot_path(gen):
    """PPS applies to the FMA path only (M <= 2); M = 3 takes the tensor-core kernel and is still right."""
    cfg = {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "PPS": 2}
    assert not G._stream(cfg, G._flags(torch.float32, 3))
    x, w, r = _rand(gen, 3, 100), _rand(gen, 40, 100, scale=0.1), _rand(gen, 3, 40)
    with poisoned():
        y, _ = G.gemv_launch(x, w, residual=r, cfg=cfg)
    _ok("dot path with PPS", G.gemv_ref(x.double(), w.double(), residual=r.double())["y"], y, torch.float32)


def test_lm_head_argmax(gen):
    x, w, nw = _rand(gen, 3, 96), _rand(gen, 5000, 96, scale=0.1), 1 + _rand(gen, 96, scale=0.2)
    with poisoned():
        logits, ids = G.lm_head_argmax(x, w, nw)
    ref = G.gemv_ref(x.double(), w.double(), norm_weight=nw.double(), eps=1e-6)["y"]
    _ok("logits", ref, logits, torch.float32)
    assert torch.equal(ids, ref.argmax(-1).to(ids.device))


def test_registered_ops_pass_check():
    for name in ("gemv_residual", "gemv_qkv_rope", "gemv_gate_up_swiglu"):
        for dtype in (torch.float32, torch.bfloat16):
            res = check_op(registry.get(name), dtype, tier="tiny", seed=3)
            assert res.ok, (name, dtype, res.error, [r.line() for r in res.results])


def test_bad_input_raises(gen):
    x, w = _rand(gen, 2, 16), _rand(gen, 8, 16)
    with pytest.raises(ValueError, match="weight must be"):
        G.gemv(x, _rand(gen, 8, 15))
    with pytest.raises(TypeError, match="weight must have x's dtype"):
        G.gemv(x, w.bfloat16())
    with pytest.raises(ValueError, match="residual must have shape"):
        G.gemv(x, w, residual=_rand(gen, 2, 9))
    with pytest.raises(ValueError, match="bias must have shape"):
        G.gemv(x, w, bias=_rand(gen, 9))
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        G.gemv(x, w, norm_weight=_rand(gen, 15))
    with pytest.raises(ValueError, match="odd row count"):
        G.gemv_gate_up_swiglu(x, _rand(gen, 7, 16))
    Hq, Hkv, D, S = 2, 1, 64, 8
    wq, bq = _rand(gen, (Hq + 2 * Hkv) * D, 16), _rand(gen, (Hq + 2 * Hkv) * D)
    cos, sin = G.rope_tables(D, S, 1e4, DEV)
    kc = torch.zeros(2, S, Hkv, D, device=DEV)
    pos = torch.zeros(2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="P >= S_max"):
        G.gemv_qkv_rope(x, wq, bq, cos[:4], sin[:4], pos, kc, kc.clone(), Hq, Hkv)
    with pytest.raises(TypeError, match="positions must have dtype"):
        G.gemv_qkv_rope(x, wq, bq, cos, sin, pos.long(), kc, kc.clone(), Hq, Hkv)
    with pytest.raises(ValueError, match="kv heads"):
        G.gemv_qkv_rope(x, wq, bq, cos, sin, pos, kc, kc.clone(), Hq, 2)
    with pytest.raises(ValueError, match="fewer than x's"):
        G.gemv_qkv_rope(x, wq, bq, cos, sin, pos, kc[:1], kc[:1].clone(), Hq, Hkv)


# ----------------------------------------------------------------------------- compiled for sm90 (no GPU needed)

_SM90_COMPILE = r'''
import json, os, re, subprocess, sys, tempfile
os.environ["TRITON_INTERPRET"] = "0"  # real @triton.jit kernels, compiled for sm90 without a device
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from triforge import _runtime
_runtime.num_sms = lambda: 132  # an H100's SM count, as the launch heuristics see it there
from triforge.ops import gemv as G

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def compile_(fn, ptrs, consts, cfg):
    names = fn.arg_names
    sig = {n: ("constexpr" if n in consts else ptrs.get(n, "fp32" if n == "eps" else "i32")) for n in names}
    # as a launch specialises them: pointers, strides and the model's widths divisible by 16
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n in ptrs or n.startswith("stride") or n in ("N", "K", "C", "I")}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=cfg)
    ptx = k.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                         text=True, check=True)
    txt = out.stdout + out.stderr
    return {"regs": int(re.search(r"Used (\d+) registers", txt).group(1)),
            "spills": int(re.search(r"(\d+) bytes spill stores", txt).group(1)),
            "v4_loads": len(re.findall(r"ld\.global(\.\w+)*\.v4", ptx)), "mma": ptx.count("mma.")}


C, I, Hq, Hkv, D, V = 896, 4864, 14, 2, 64, 151936  # Qwen2.5-0.5B
rows = []
for dtype in (torch.bfloat16, torch.float32):
    t = TYPES[dtype]
    for M in (1, 2, 8, 32):
        fl = G._flags(dtype, M)
        for N, K in ((C, I), (V, C)):
            cfg = G._config("plain", M, N, K, dtype)
            ptrs = {n: "*" + t for n in ("x_ptr", "w_ptr", "b_ptr", "r_ptr", "nw_ptr", "y_ptr", "xn_ptr")}
            consts = dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], HAS_BIAS=False, HAS_RESIDUAL=N == C,
                          NORM=N == V, STORE_XN=False, ONE=G._one(cfg, K), PDL=M == 1, PRE=G._pre(cfg), **fl)
            r = compile_(G.gemv_kernel, ptrs, consts, {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
            rows.append(dict(r, kernel=f"gemv N={N} K={K}", dtype=t, M=M, **fl))
        cfg = G._config("gate_up", M, 2 * I, C, dtype)
        ptrs = {n: "*" + t for n in ("x_ptr", "w_ptr", "nw_ptr", "y_ptr", "xn_ptr")}
        consts = dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], NORM=True, STORE_XN=False, ONE=G._one(cfg, C), PDL=M == 1, PRE=G._pre(cfg), **fl)
        r = compile_(G.gemv_gate_up_kernel, ptrs, consts, {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
        rows.append(dict(r, kernel="gate_up", dtype=t, M=M, **fl))
        cfg = G._config("qkv", M, (Hq + 2 * Hkv) * D, C, dtype)
        ptrs = {n: "*" + t for n in ("x_ptr", "w_ptr", "b_ptr", "nw_ptr", "q_ptr", "kc_ptr", "vc_ptr", "qkv_ptr", "xn_ptr")}
        ptrs.update({"cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i32"})
        consts = dict(HQ=Hq, HKV=Hkv, D=D, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], NORM=True, STORE_PRE=False,
                      STORE_XN=False, ONE=G._one(cfg, C), PDL=M == 1, PRE=G._pre(cfg), **fl)
        r = compile_(G.gemv_qkv_rope_kernel, ptrs, consts, {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
        rows.append(dict(r, kernel="qkv_rope", dtype=t, M=M, **fl))
# the trace variants (debug stores of the normalised input and the pre-RoPE projections)
for M in (1, 8):
    fl = G._flags(torch.bfloat16, M)
    cfg = G._config("plain", M, V, C, torch.bfloat16)
    ptrs = {n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "r_ptr", "nw_ptr", "y_ptr", "xn_ptr")}
    consts = dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], HAS_BIAS=True, HAS_RESIDUAL=True, NORM=True,
                  STORE_XN=True, ONE=G._one(cfg, C), PDL=M == 1, PRE=G._pre(cfg), **fl)
    rows.append(dict(compile_(G.gemv_kernel, ptrs, consts, {"num_warps": 4, "num_stages": 2}), kernel="gemv store",
                     dtype="bf16", M=M, **fl))
    cfg = G._config("gate_up", M, 2 * I, C, torch.bfloat16)
    ptrs = {n: "*bf16" for n in ("x_ptr", "w_ptr", "nw_ptr", "y_ptr", "xn_ptr")}
    consts = dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], NORM=True, STORE_XN=True, ONE=G._one(cfg, C), PDL=M == 1, PRE=G._pre(cfg), **fl)
    rows.append(dict(compile_(G.gemv_gate_up_kernel, ptrs, consts, {"num_warps": 4, "num_stages": 2}),
                     kernel="gate_up store", dtype="bf16", M=M, **fl))
    cfg = G._config("qkv", M, (Hq + 2 * Hkv) * D, C, torch.bfloat16)
    ptrs = {n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "nw_ptr", "q_ptr", "kc_ptr", "vc_ptr", "qkv_ptr", "xn_ptr")}
    ptrs.update({"cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i32"})
    consts = dict(HQ=Hq, HKV=Hkv, D=D, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], NORM=True, STORE_PRE=True,
                  STORE_XN=True, ONE=G._one(cfg, C), PDL=M == 1, PRE=G._pre(cfg), **fl)
    rows.append(dict(compile_(G.gemv_qkv_rope_kernel, ptrs, consts, {"num_warps": 4, "num_stages": 2}),
                     kernel="qkv_rope store", dtype="bf16", M=M, **fl))
# the persistent streaming kernel at the decode shapes (M <= 2), as decode_tune's candidates build it
for M in (1, 2):
    fl = G._flags(torch.bfloat16, M)
    ptrs = {n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "r_ptr", "nw_ptr", "y_ptr", "xn_ptr")}
    for name, gate_up, bn, bk, warps, store in (("down stream", False, 2, 2048, 8, False),
                                                ("gate_up stream", True, 2, 1024, 4, False),
                                                ("gate_up stream store", True, 4, 1024, 4, True)):
        consts = dict(BLOCK_M=fl["BLOCK_M"], BLOCK_N=bn, BLOCK_K=bk, GATE_UP=gate_up, HAS_BIAS=False,
                      HAS_RESIDUAL=not gate_up, NORM=gate_up, STORE_XN=store, RNE=False, ONE=gate_up, PDL=True)
        rows.append(dict(compile_(G.gemv_stream_kernel, ptrs, consts, {"num_warps": warps, "num_stages": 1}),
                         kernel=name, dtype="bf16", M=M, **fl))
    consts = dict(BLOCK_M=fl["BLOCK_M"], BN_GU=2, BK_GU=1024, BN_D=2, BK_D=2048, STORE_XN=False, RNE=False,
                  PHASE=0, PDL=True)
    ptrs = {n: "*bf16" for n in ("x_ptr", "wgu_ptr", "nw_ptr", "wd_ptr", "act_ptr", "y_ptr", "xn_ptr")}
    ptrs["sync_ptr"] = "*i32"
    rows.append(dict(compile_(G.gemv_mlp_kernel, ptrs, consts, {"num_warps": 4, "num_stages": 1}),
                     kernel="mlp fused", dtype="bf16", M=M, **fl))
print("RESULT" + json.dumps(rows))
'''


def test_kernels_compile_for_sm90():
    """Every kernel at Qwen2.5-0.5B's decode shapes as the H100 would build it (TRITON_INTERPRET=0,
    sm90 target, the fallback launch configs, ptxas from the triton wheel): it compiles, spills no
    register; the FMA path streams weights with 16-byte vector loads, the bf16 dot path uses mma."""
    import json
    import os
    import subprocess
    import sys

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton's bundled ptxas is not installed")
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _SM90_COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.split("RESULT", 1)[1])
    assert len(rows) == 2 * 4 * 4 + 2 * 3 + 2 * 4
    for r in rows:
        assert r["spills"] == 0, r
        if not r["USE_DOT"]:
            assert r["v4_loads"] > 0, r
        elif r["dtype"] == "bf16":
            assert r["mma"] > 0, r


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS)
@pytest.mark.parametrize("M", [1, 2, 8, 32])
def test_gpu_model_shapes(M, dtype, gen):
    """Compiled kernels at Qwen2.5-0.5B's shapes with the heuristic configs, against the references."""
    C, I, Hq, Hkv, D, S = 896, 4864, 14, 2, 64, 512
    x = _rand(gen, M, I, dtype=dtype)
    w = _rand(gen, C, I, dtype=dtype, scale=I ** -0.5)
    r = _rand(gen, M, C, dtype=dtype)
    with poisoned():
        y = G.gemv(x, w, residual=r)
    _ok("down_proj + residual", G.gemv_ref(x.double(), w.double(), residual=r.double(), dtype=dtype)["y"], y, dtype)
    x = _rand(gen, M, C, dtype=dtype)
    nw = (1 + _rand(gen, C, scale=0.2)).to(dtype)
    w = _rand(gen, 2 * I, C, dtype=dtype, scale=C ** -0.5)
    with poisoned():
        y = G.gemv_gate_up_swiglu(x, w, nw)
    _ok("gate_up", G.gemv_gate_up_ref(x.double(), w.double(), nw.double(), dtype=dtype)["y"], y, dtype)
    nqkv = (Hq + 2 * Hkv) * D
    w, b = _rand(gen, nqkv, C, dtype=dtype, scale=C ** -0.5), _rand(gen, nqkv, dtype=dtype, scale=0.5)
    cos, sin = G.rope_tables(D, S, 1e6, DEV)
    pos = torch.randint(0, S, (M,), generator=gen, dtype=torch.int32).to(DEV)
    kc, vc = _rand(gen, M, S, Hkv, D, dtype=dtype), _rand(gen, M, S, Hkv, D, dtype=dtype)
    d = lambda t: t.double()  # noqa: E731
    ref = G.gemv_qkv_rope_ref(d(x), d(w), d(b), d(cos), d(sin), pos, d(kc), d(vc), Hq, Hkv, d(nw), 1e-6, dtype=dtype)
    with poisoned():
        got = G.gemv_qkv_rope_stages(x, w, b, cos, sin, pos, kc, vc, Hq, Hkv, nw)
    for name in ref:
        _ok(name, ref[name], got[name], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("pre", [1, 0], ids=["pre", "no_pre"])
def test_gpu_pdl_multi_step_first_weights_before_wait(pre, gen):
    """down_proj's shape (K = 4864 in 2048-wide steps) launched as a programmatic dependent, with the
    first K step's weights loaded before griddepcontrol.wait (PRE) and without: both against the
    float64 reference, and equal to each other bit for bit (the same products in the same order)."""
    C, I, dtype = 896, 4864, torch.bfloat16
    x = _rand(gen, 1, I, dtype=dtype)
    w = _rand(gen, C, I, dtype=dtype, scale=I ** -0.5)
    r = _rand(gen, 1, C, dtype=dtype)
    cfg = {"BLOCK_N": 2, "BLOCK_K": 2048, "num_warps": 8, "num_stages": 2}
    with poisoned():
        y, _ = G.gemv_launch(x, w, residual=r, cfg=dict(cfg, PRE=pre), pdl=True)
        y_plain, _ = G.gemv_launch(x, w, residual=r, cfg=cfg, pdl=False)
    _ok("down_proj (PDL)", G.gemv_ref(x.double(), w.double(), residual=r.double(), dtype=dtype)["y"], y, dtype)
    assert torch.equal(y, y_plain)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no_pdl"])
def test_gpu_stream_model_shapes(pdl, M, gen):
    """The persistent streaming kernel at down_proj's (K = 4864 in 2048-wide steps, residual) and gate_up's
    (one K step, norm prologue, xn stored) shapes, grids smaller than the unit count, as a programmatic
    dependent and not: against the rounded float64 references."""
    C, I, dtype = 896, 4864, torch.bfloat16
    d = lambda t: t.double()  # noqa: E731
    x, w, r = _rand(gen, M, I, dtype=dtype), _rand(gen, C, I, dtype=dtype, scale=I ** -0.5), _rand(gen, M, C, dtype=dtype)
    for cfg in ({"BLOCK_N": 2, "BLOCK_K": 2048, "num_warps": 8, "num_stages": 1, "PPS": 2},
                {"BLOCK_N": 1, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1, "PPS": 4}):
        with poisoned():
            y, _ = G.gemv_launch(x, w, residual=r, cfg=cfg, pdl=pdl)
        _ok(f"down_proj stream {cfg}", G.gemv_ref(d(x), d(w), residual=d(r), dtype=dtype)["y"], y, dtype)
    x, nw = _rand(gen, M, C, dtype=dtype), (1 + _rand(gen, C, scale=0.2)).to(dtype)
    w = _rand(gen, 2 * I, C, dtype=dtype, scale=C ** -0.5)
    ref = G.gemv_gate_up_ref(d(x), d(w), d(nw), 1e-6, dtype=dtype)
    for cfg in ({"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1, "PPS": 4},
                {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 2, "num_stages": 1, "PPS": 8}):
        with poisoned():
            y, xn = G.gemv_gate_up_launch(x, w, nw, 1e-6, store_xn=True, cfg=cfg, pdl=pdl)
        _ok(f"gate_up stream {cfg}", ref["y"], y, dtype)
        _ok(f"gate_up stream xn {cfg}", ref["xn"], xn, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no_pdl"])
def test_gpu_mlp_fused_barrier(pdl, M, gen):
    """The fused MLP kernel in one launch (grid barrier between gate/up and down) at Qwen2.5-0.5B's MLP shape:
    against the chained rounded float64 references, bit for bit equal to its two-launch form, the barrier
    re-armed after every launch (counters back to zero, no timeout) over repeated launches, eager and inside
    a CUDA graph replayed several times."""
    C, I, dtype = 896, 4864, torch.bfloat16
    d = lambda t: t.double()  # noqa: E731
    x, nw = _rand(gen, M, C, dtype=dtype), (1 + _rand(gen, C, scale=0.2)).to(dtype)
    wgu = _rand(gen, 2 * I, C, dtype=dtype, scale=C ** -0.5)
    wd = _rand(gen, C, I, dtype=dtype, scale=I ** -0.5)
    sync = torch.zeros(3, dtype=torch.int32, device=DEV)
    ref = G.gemv_gate_up_ref(d(x), d(wgu), d(nw), 1e-6, dtype=dtype)
    y_ref = G.gemv_ref(ref["y"], d(wd), residual=d(x), dtype=dtype)["y"]
    for cfg in ({"BN_GU": 2, "BK_GU": 1024, "BN_D": 2, "BK_D": 2048, "PPS": 8, "num_warps": 2},
                {"BN_GU": 1, "BK_GU": 1024, "BN_D": 1, "BK_D": 1024, "PPS": 16, "num_warps": 4}):
        with poisoned():
            y, act, xn = G.gemv_mlp_launch(x, wgu, nw, wd, sync, 1e-6, store_xn=True, cfg=cfg, pdl=pdl)
            y2, act2, _ = G.gemv_mlp_launch(x, wgu, nw, wd, sync, 1e-6, cfg=dict(cfg, SPLIT=1), pdl=pdl)
        _ok(f"mlp act {cfg}", ref["y"], act, dtype)
        _ok(f"mlp y {cfg}", y_ref, y, dtype)
        _ok(f"mlp xn {cfg}", ref["xn"], xn, dtype)
        assert torch.equal(act, act2) and torch.equal(y, y2)
        for _ in range(20):
            y3, _, _ = G.gemv_mlp_launch(x, wgu, nw, wd, sync, 1e-6, cfg=cfg, pdl=pdl)
        assert torch.equal(y3, y)
        assert sync.tolist() == [0, 0, 0]
        G.gemv_mlp_launch(x, wgu, nw, wd, sync, 1e-6, cfg=cfg, pdl=pdl)  # compiled before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [G.gemv_mlp_launch(x, wgu, nw, wd, sync, 1e-6, cfg=cfg, pdl=pdl)[0] for _ in range(3)]
        for o in outs:
            o.fill_(float("nan"))
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, y) for o in outs)
        assert sync.tolist() == [0, 0, 0]
        G.check_mlp_sync(sync)
