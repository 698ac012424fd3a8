"""mHC-lite ops (``triforge.ops.mhc``): K1 fused RMSNorm + projection, K2 coefficients, K3 pre-map and
K4 post-res against the float64 reference, forward and every gradient; the registered ops through
``check_op``; torch.library.opcheck of the custom ops; input validation.

Every kernel call runs under ``poisoned()``: outputs start as NaN, so an element the kernel never
writes fails the comparison. Under the interpreter the project kernel uses 16-wide T/K blocks and the
stream kernels 32-wide C blocks (BLOCK_T 4 for the pre-map backward, 2 for post-res; the pre-map forward
64-element blocks of the flattened output), so T in {1, 17, 63} and
C in {1, 24, 40, 100} hit partial blocks, masks and multi-iteration loops.

Inputs are drawn on the CPU from the per-test generator (reproducible on any machine), then moved to
the kernels' device (the ``device`` fixture); the float64 references run on that same device.
"""

import contextlib
import math

import pytest
import torch

import triforge  # noqa: F401  (sets TRITON_INTERPRET before triton kernels are defined)
import triforge.ops.mhc  # noqa: F401  (registers mhc_project, mhc_pre_map, mhc_post_res)
from triforge import registry
from triforge.check import check_op
from triforge.launch import poisoned
from triforge.ops.mhc import (
    N_PROJ,
    coefficients,
    fused_post_res,
    fused_pre_map,
    fused_rmsnorm_project,
)
from triforge.ops.mhc.reference import permutation_matrices, post_res_ref, pre_map_ref, rmsnorm_project_ref
from triforge.testing import compare

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
TS = [1, 17, 63]
CS = [1, 24, 40, 100]


def _cases():
    """All 12 (T, C) pairs, each in one dtype, such that every dtype sees every T and every C:
    dtype d gets the pairs (TS[i], CS[j]) with (i + j) % 3 == d (a Latin design; the full
    3 x 12 grid would cost ~3x the interpreter time for little extra coverage)."""
    out = []
    for d, dtype in enumerate(DTYPES):
        for i, T in enumerate(TS):
            for j, C in enumerate(CS):
                if (i + j) % 3 == d:
                    out.append(pytest.param(dtype, T, C, id=f"{DTYPE_IDS[d]}-T{T}-C{C}"))
    return out


CASES = _cases()


# ----------------------------------------------------------------------------- helpers


def _x(shape, dtype, gen, scale=1.0, device="cpu"):
    """Drawn on the CPU from ``gen``, then moved to ``device``."""
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype).to(device)


def _W(C, gen, rows=N_PROJ, device="cpu"):
    return (torch.randn(rows, 4 * C, generator=gen, dtype=torch.float64) / (4 * C) ** 0.5).float().to(device)


def _to(t, device):
    """``t`` on ``device`` with its strides kept (bad-input cases are built on the CPU at collection
    time; a non-contiguous one must stay non-contiguous). Non-tensors pass through."""
    if not isinstance(t, torch.Tensor) or t.device.type == torch.device(device).type:
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return out.copy_(t)


def _to64(t):
    return t.detach().to(torch.float64)


def _assert_ok(*results):
    for r in results:
        assert r.ok, r.line()


@contextlib.contextmanager
def _fp32_may_exceed_shared(dtype, device):
    """A tile entry tuned for 16-bit streams (the H200's 512 x 64 forward and 64 x 256 backward tiles, 4 stages) keeps
    its stages of x in shared memory on a GPU: in fp32 they can pass the SM's 227 KB, and Triton refuses the launch
    (OutOfResources); that case skips. 16-bit launches, and the interpreter (no such limit), must run."""
    from triton.runtime.errors import OutOfResources

    try:
        yield
    except OutOfResources as e:
        if dtype != torch.float32 or torch.device(device).type != "cuda":
            raise
        pytest.skip(f"fp32 stages of this 16-bit tile exceed the GPU's shared memory: {e}")


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _grads(outs, leaves, upstream):
    """autograd.grad with unused leaves given zero gradients (compare needs a tensor)."""
    gs = torch.autograd.grad(outs, leaves, upstream, allow_unused=True)
    return [torch.zeros_like(l) if g is None else g for g, l in zip(gs, leaves)]


# ----------------------------------------------------------------------------- K1: RMSNorm + projection


def _check_project(x_flat, W, gen, *, eps=1e-6, use=("proj", "inv")):
    """Forward and (dx, dW) of the project op against float64 autograd through the reference,
    with a random upstream gradient on the outputs named in ``use``."""
    dtype = x_flat.dtype
    T = x_flat.shape[0]
    dev = x_flat.device
    upstream = {"proj": _x((T, N_PROJ), torch.float32, gen, device=dev), "inv": _x((T,), torch.float32, gen, device=dev)}

    x64, W64 = _leaf(_to64(x_flat)), _leaf(_to64(W))
    p64, i64 = rmsnorm_project_ref(x64, W64, eps)
    named64 = {"proj": p64, "inv": i64}
    ref_dx, ref_dW = _grads([named64[k] for k in use], [x64, W64], [_to64(upstream[k]) for k in use])

    xk, Wk = _leaf(x_flat), _leaf(W)
    with poisoned():
        proj, inv = fused_rmsnorm_project(xk, Wk, eps)
        named = {"proj": proj, "inv": inv}
        dx, dW = _grads([named[k] for k in use], [xk, Wk], [upstream[k] for k in use])

    assert proj.shape == (T, N_PROJ) and proj.dtype == torch.float32
    assert inv.shape == (T,) and inv.dtype == torch.float32
    assert dx.shape == x_flat.shape and dx.dtype == dtype
    assert dW.shape == W.shape and dW.dtype == torch.float32
    _assert_ok(
        compare("proj", p64, proj, dtype=dtype, verbose=False),
        compare("inv_rms", i64, inv, dtype=dtype, verbose=False),
        compare("dx", ref_dx, dx, dtype=dtype, verbose=False),
        compare("dW", ref_dW, dW, dtype=dtype, verbose=False),
    )
    return dx, dW


@pytest.mark.parametrize("dtype,T,C", CASES)
def test_project_forward_and_gradients(dtype, T, C, gen, device):
    """Both outputs used downstream (d inv_rms != 0): the inv_rms^3 term of dx is exercised."""
    _check_project(_x((T, 4 * C), dtype, gen, device=device), _W(C, gen, device=device), gen)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("use", [("proj",), ("inv",)], ids=["proj-only", "inv-only"])
def test_project_gradients_one_output_used(use, dtype, gen, device):
    """Only proj used (autograd hands the backward d inv_rms = None), or only inv_rms (d proj = None:
    dW must be exactly zero and dx is the pure RMS term)."""
    T, C = 17, 24
    dx, dW = _check_project(_x((T, 4 * C), dtype, gen, device=device), _W(C, gen, device=device), gen, use=use)
    if use == ("inv",):
        assert torch.count_nonzero(dW) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scale,eps", [(1e-3, 1e-6), (30.0, 1e-6), (1.0, 0.5)], ids=["small-x", "large-x", "large-eps"])
def test_project_scales_and_eps(scale, eps, dtype, gen, device):
    """x at 1e-3 (eps is 1/1000 of the mean square: an ignored eps shows in fp32), x at 30 (x^2 summed
    in fp32, the 16-bit split of inv_rms * dproj still in range) and eps comparable to the mean square."""
    T, C = 17, 40
    _check_project(_x((T, 4 * C), dtype, gen, scale, device=device), _W(C, gen, device=device), gen, eps=eps)


@pytest.mark.parametrize("stack", [0, 1], ids=["two-dots", "stack"])
def test_project_w_is_used_in_full_precision(stack, gen, device):
    """With 16-bit streams W is split into hi + lo 16-bit parts: proj keeps ~16 mantissa bits of W,
    far more than a plain cast of W to bf16 (2^-8) would give; with STACK (one dot of x against the parts
    interleaved) too: a lost lo, or another row's, would leave ~2^-9 (a bf16-tolerance check passes that)."""
    from triforge.ops import mhc as M

    T, C = 17, 40
    x = _x((T, 4 * C), torch.bfloat16, gen, device=device)
    W = _W(C, gen, device=device)
    p64, _ = rmsnorm_project_ref(_to64(x), _to64(W))
    cfg = dict(M._cfg("mhc_project_fwd", C, torch.bfloat16), STACK=stack)
    with poisoned():
        proj, _ = M.project_fwd(x, W, 1e-6, cfg)
    rel = float((proj.double() - p64).norm() / p64.norm())
    assert rel < 1e-4, rel


@pytest.mark.parametrize("n_k,n_t,P", [(1, 1, 1), (3, 7, 2), (10, 3, 4), (10, 3, 20), (80, 2048, 396),
                                       (80, 2048, 264), (5, 1, 5), (7, 13, 91), (2, 100, 3)])
def test_project_bwd_partition_covers_each_unit_once(n_k, n_t, P):
    """K1 backward's persistent partition, in plain Python: the runs [p U // P, (p + 1) U // P) tile the
    U = n_k x n_t units exactly once, a run touches at most J column blocks, and the reduce kernel's
    formula p_of(u) = ((u + 1) P - 1) // U names exactly the programs whose runs touch each block."""
    from triforge.ops.mhc import project_bwd_grid

    U = n_k * n_t
    seen = [0] * U
    touching = {kb: set() for kb in range(n_k)}
    J = triton_cdiv(U, P) // n_t + 2  # project_bwd_grid's bound
    for p in range(P):
        lo, hi = p * U // P, (p + 1) * U // P
        for u in range(lo, hi):
            seen[u] += 1
            touching[u // n_t].add(p)
        if hi > lo:
            assert (hi - 1) // n_t - lo // n_t + 1 <= J
    assert seen == [1] * U
    for kb in range(n_k):
        p_lo = ((kb * n_t + 1) * P - 1) // U
        p_hi = ((kb + 1) * n_t * P - 1) // U
        assert set(range(p_lo, p_hi + 1)) == touching[kb]
    # the launcher's own numbers agree with the model above (T and K chosen to give n_t and n_k)
    from triforge import _runtime

    got = project_bwd_grid(16 * n_t, 16 * n_k, {"BLOCK_T": 16, "BLOCK_K": 16, "programs_per_sm": 1})
    P_launch = max(1, min(U, _runtime.num_sms()))
    assert got == (n_t, U, P_launch, triton_cdiv(U, P_launch) // n_t + 2)


def triton_cdiv(a, b):
    return -(-a // b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", [
    {"BLOCK_T": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_T": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3, "TMA": 1},  # descriptors (GPU)
    {"BLOCK_T": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3, "STACK": 1},  # one dot against [hi | lo]
    {"BLOCK_T": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3, "TMA": 1, "STACK": 1},
], ids=["pointers", "tma", "stack", "stack-tma"])
def test_project_forward_configs(cfg, dtype, gen, device):
    """K1 forward at explicit launch configs: 3 token tiles of 16 (the last partial) and K = 160, 2.5 column
    blocks of 64 (descriptor rows are 16-byte multiples); proj and inv_rms against the float64 reference."""
    from triforge.ops import mhc as M

    x = _x((40, 160), dtype, gen, device=device)
    W = _W(40, gen, device=device)
    p64, i64 = rmsnorm_project_ref(_to64(x), _to64(W), 1e-6)
    with poisoned():
        proj, inv = M.project_fwd(x, W, 1e-6, cfg)
    _assert_ok(compare("proj", p64, proj, dtype=dtype, verbose=False),
               compare("inv_rms", i64, inv, dtype=dtype, verbose=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_project_forward_h200_tile(dtype, gen, device):
    """K1 forward at the H200's tile (512 tokens x 64 columns, 4 stages; its descriptors on a GPU only: the
    interpreter takes the pointer path): T = 1000 (the second tile partial) and K = 200 (the last column block
    partial: 8 of 64 columns); proj and inv_rms against float64."""
    from triforge.ops import mhc as M

    cfg = {"BLOCK_T": 512, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4, "TMA": 1}
    x = _x((1000, 200), dtype, gen, device=device)
    W = _W(50, gen, device=device)
    p64, i64 = rmsnorm_project_ref(_to64(x), _to64(W), 1e-6)
    with poisoned(), _fp32_may_exceed_shared(dtype, device):
        proj, inv = M.project_fwd(x, W, 1e-6, cfg)
    _assert_ok(compare("proj", p64, proj, dtype=dtype, verbose=False),
               compare("inv_rms", i64, inv, dtype=dtype, verbose=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", [
    {"BLOCK_T": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1, "programs_per_sm": 1},   # runs span 3-4 blocks
    {"BLOCK_T": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1, "programs_per_sm": 5},   # 1.5 units per run
    {"BLOCK_T": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1, "programs_per_sm": 16},  # more programs than units
    {"BLOCK_T": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2, "TMA": 1},  # descriptors (GPU)
    {"BLOCK_T": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1, "programs_per_sm": 1, "PREFETCH": 1},  # one tile ahead
    {"BLOCK_T": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2, "TMA": 1, "PREFETCH": 1},
    {"BLOCK_T": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2, "TMA": 2, "PREFETCH": 1},
    {"BLOCK_T": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2, "TMA": 3},  # all descriptors
    # 256-column blocks, 8 warps, 4 stages, one program per SM (the H200 tune's best in isolation, session 50)
    {"BLOCK_T": 64, "BLOCK_K": 256, "num_warps": 8, "num_stages": 4, "programs_per_sm": 1, "TMA": 2, "PREFETCH": 1},
], ids=["span", "split", "capped", "tma", "prefetch", "tma-prefetch", "tma-load-prefetch", "tma-all", "h200"])
def test_project_backward_persistent_runs(cfg, dtype, gen, device):
    """K1 backward at launch configs whose runs start and end inside column blocks (and T, K that are
    not multiples of the tiles): dx and dW against float64 autograd through the reference."""
    from triforge.ops import mhc as M

    # 3 token tiles of 16 (the last partial), K = 148: 10 or 5 column blocks (the last partial); with TMA K = 160
    # (descriptor rows must be 16-byte multiples: the launcher takes the pointer path otherwise); at 64 x 256 tiles
    # T = 150 and K = 280: 3 token tiles and 2 column blocks, the last of each partial
    T, C = (40, 40) if cfg.get("TMA") else (40, 37)
    if cfg["BLOCK_T"] == 64:
        T, C = 150, 70
    x = _x((T, 4 * C), dtype, gen, device=device)
    W = _W(C, gen, device=device)
    dproj = _x((T, N_PROJ), torch.float32, gen, device=device)
    dinv = _x((T,), torch.float32, gen, device=device)
    x64, W64 = _leaf(_to64(x)), _leaf(_to64(W))
    p64, i64 = rmsnorm_project_ref(x64, W64, 1e-6)
    ref_dx, ref_dW = torch.autograd.grad([p64, i64], [x64, W64], [_to64(dproj), _to64(dinv)])
    with poisoned():
        proj, inv = M.project_fwd(x, W, 1e-6)
        with _fp32_may_exceed_shared(dtype, device):  # (only the config under test may be refused)
            dx, dW = M.project_bwd(x, W, proj, inv, dproj, dinv, cfg)
    _assert_ok(compare("dx", ref_dx, dx, dtype=dtype, verbose=False), compare("dW", ref_dW, dW, dtype=dtype, verbose=False))


# ----------------------------------------------------------------------------- K3: pre-map


@pytest.mark.parametrize("dtype,T,C", CASES)
def test_pre_map_forward_and_gradients(dtype, T, C, gen, device):
    x = _x((T, 4, C), dtype, gen, device=device)
    h = _x((T, 4), torch.float32, gen, device=device)  # any real weights (signs included), not only sigmoid outputs
    dy = _x((T, C), dtype, gen, device=device)

    x64, h64 = _leaf(_to64(x)), _leaf(_to64(h))
    y64 = pre_map_ref(x64, h64)
    ref_dx, ref_dh = torch.autograd.grad(y64, [x64, h64], _to64(dy))

    xk, hk = _leaf(x), _leaf(h)
    with poisoned():
        y = fused_pre_map(xk, hk)
        dx, dh = torch.autograd.grad(y, [xk, hk], dy)
    assert y.shape == (T, C) and y.dtype == dtype
    assert dx.shape == x.shape and dx.dtype == dtype
    assert dh.shape == h.shape and dh.dtype == torch.float32
    _assert_ok(
        compare("y", y64, y, dtype=dtype, verbose=False),
        compare("dx", ref_dx, dx, dtype=dtype, verbose=False),
        compare("dh_pre", ref_dh, dh, dtype=dtype, verbose=False),
    )


@pytest.mark.parametrize("even,i64", [(True, False), (False, False), (True, True), (False, True)],
                         ids=["even", "masked", "even-int64", "masked-int64"])
def test_pre_map_forward_kernel_paths(even, i64, gen, device):
    """The flat pre-map forward's four compiled paths (no masks when BLOCK divides T * C; 64-bit offsets,
    which the launcher picks only past 2^31 elements) against the float64 reference, on the NaN-poisoned
    output (a block the unmasked path skipped or overran shows as NaN or a mismatch)."""
    import triton

    from triforge.ops.mhc.forward import mhc_pre_map_fwd_kernel

    T, C, block = (16, 40, 64) if even else (17, 40, 64)
    x = _x((T, 4, C), torch.bfloat16, gen, device=device)
    h = _x((T, 4), torch.float32, gen, device=device)
    assert (T * C % block == 0) == even
    with poisoned():
        y = torch.full((T, C), float("nan"), dtype=x.dtype, device=device)
        mhc_pre_map_fwd_kernel[(triton.cdiv(T * C, block),)](x, h, y, T * C, C=C, BLOCK=block, EVEN=even, I64=i64)
    _assert_ok(compare("y", pre_map_ref(_to64(x), _to64(h)), y, dtype=torch.bfloat16, verbose=False))


# ----------------------------------------------------------------------------- K4: post-res


def _post_res_inputs(T, C, dtype, gen, device):
    x = _x((T, 4, C), dtype, gen, device=device)
    f = _x((T, C), dtype, gen, device=device)
    H = _x((T, 4, 4), torch.float32, gen, device=device)  # a general (non-symmetric) matrix: a transposed H fails
    hp = _x((T, 4), torch.float32, gen, device=device)
    return x, f, H, hp


@pytest.mark.parametrize("dtype,T,C", CASES)
def test_post_res_forward_and_gradients(dtype, T, C, gen, device):
    x, f, H, hp = _post_res_inputs(T, C, dtype, gen, device)
    g = _x((T, 4, C), dtype, gen, device=device)

    leaves64 = [_leaf(_to64(t)) for t in (x, f, H, hp)]
    y64 = post_res_ref(*leaves64)
    ref = torch.autograd.grad(y64, leaves64, _to64(g))

    leaves = [_leaf(t) for t in (x, f, H, hp)]
    with poisoned():
        y = fused_post_res(*leaves)
        got = torch.autograd.grad(y, leaves, g)
    assert y.shape == x.shape and y.dtype == dtype
    for name, t, gt in zip(("dx", "dlayer_output", "dH", "dh_post"), (x, f, H, hp), got):
        assert gt.shape == t.shape and gt.dtype == t.dtype, name
    _assert_ok(compare("y", y64, y, dtype=dtype, verbose=False))
    for name, r, gt in zip(("dx", "dlayer_output", "dH", "dh_post"), ref, got):
        _assert_ok(compare(name, r, gt, dtype=dtype, verbose=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("T,C", [(37, 72), (5, 24), (9, 20)], ids=["T37-C72", "T5-C24", "T9-C20"])
@pytest.mark.parametrize("cfg", [
    {"BLOCK_T": 4, "BLOCK_C": 32, "num_warps": 4},  # registers: the next block loaded before this one's math
    {"BLOCK_T": 4, "BLOCK_C": 32, "num_warps": 4, "TMA": 1, "num_stages": 3},  # descriptors, a 3-stage loop
    {"BLOCK_T": 2, "BLOCK_C": 16, "num_warps": 4, "TMA": 1, "num_stages": 2, "programs_per_sm": 1},
    {"BLOCK_T": 8, "BLOCK_C": 64, "num_warps": 4, "TMA": 1, "num_stages": 4},  # one C block, T < BLOCK_T possible
], ids=["regs", "tma-s3", "tma-s2", "tma-s4"])
def test_post_res_backward_configs(cfg, T, C, dtype, gen, device):
    """K4 backward at explicit launch configs against the float64 gradients: T not a multiple of BLOCK_T, C ending
    mid-block (72 = 2.25 blocks of 32) or inside the first; with TMA, C = 20 in 16 bits (40-byte rows, not 16-byte
    multiples) takes the pointer path instead, and every other case reads g, f and x through descriptors whose
    boxes pass T and C (zero-filled), its persistent programs taking several token tiles each where the machine has
    fewer than T / BLOCK_T program slots (the interpreter counts 4 SMs: programs_per_sm 1 gives 4 programs). The
    kernel each case launched is checked too."""
    from triforge import launch as L
    from triforge.ops import mhc as M

    x, f, H, hp = _post_res_inputs(T, C, dtype, gen, device)
    g = _x((T, 4, C), dtype, gen, device=device)
    leaves64 = [_leaf(_to64(t)) for t in (x, f, H, hp)]
    ref = torch.autograd.grad(post_res_ref(*leaves64), leaves64, _to64(g))
    kernels, real_launch = [], L.launch

    def recording_launch(name, jit_fn, *a, **kw):
        kernels.append(jit_fn.__name__)
        return real_launch(name, jit_fn, *a, **kw)

    with poisoned(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(L, "launch", recording_launch)
        got = M.post_res_bwd(g, x, f, H, hp, cfg)
    want_tma = bool(cfg.get("TMA")) and (C * x.element_size()) % 16 == 0  # (bf16 at C = 20: 40-byte rows)
    assert kernels == ["mhc_post_res_bwd_tma_kernel" if want_tma else "mhc_post_res_bwd_kernel"]
    for name, r, gt in zip(("dx", "dlayer_output", "dH", "dh_post"), ref, got):
        _assert_ok(compare(name, r, gt, dtype=dtype, verbose=False))


def test_post_res_noncontiguous_coefficients_and_layer_output(gen, device):
    """Only x_streams must be contiguous: a transposed layer_output / H_merged / h_post is accepted
    and read correctly (the op makes them contiguous)."""
    T, C = 17, 24
    x, f, H, hp = _post_res_inputs(T, C, torch.float32, gen, device)  # moved, then made non-contiguous
    f_nc = f.t().contiguous().t()
    H_nc = H.transpose(1, 2).contiguous().transpose(1, 2)
    hp_nc = hp.t().contiguous().t()
    assert not (f_nc.is_contiguous() or H_nc.is_contiguous() or hp_nc.is_contiguous())
    with poisoned():
        y = fused_post_res(x, f_nc, H_nc, hp_nc)
    _assert_ok(compare("y", post_res_ref(_to64(x), _to64(f), _to64(H), _to64(hp)), y, verbose=False))


def test_noncontiguous_upstream_gradients(gen, device):
    """Upstream gradients that are expanded / transposed views reach the backward kernels intact."""
    T, C = 17, 24
    x = _x((T, 4, C), torch.float32, gen, device=device)
    h = _x((T, 4), torch.float32, gen, device=device)
    dy = _x((C, T), torch.float32, gen, device=device).t()  # transposed view (of the tensor on the device)
    xk, hk = _leaf(x), _leaf(h)
    with poisoned():
        y = fused_pre_map(xk, hk)
        dx, dh = torch.autograd.grad(y, [xk, hk], dy)
    x64, h64 = _leaf(_to64(x)), _leaf(_to64(h))
    rdx, rdh = torch.autograd.grad(pre_map_ref(x64, h64), [x64, h64], _to64(dy))
    _assert_ok(compare("dx", rdx, dx, verbose=False), compare("dh", rdh, dh, verbose=False))

    x, f, H, hp = _post_res_inputs(T, C, torch.float32, gen, device)
    g = _x((T, C), torch.float32, gen, device=device)[:, None, :].expand(T, 4, C)  # stride 0 over the streams
    leaves = [_leaf(t) for t in (x, f, H, hp)]
    with poisoned():
        got = torch.autograd.grad(fused_post_res(*leaves), leaves, g)
    leaves64 = [_leaf(_to64(t)) for t in (x, f, H, hp)]
    ref = torch.autograd.grad(post_res_ref(*leaves64), leaves64, _to64(g))
    for name, r, gt in zip(("dx", "df", "dH", "dh_post"), ref, got):
        _assert_ok(compare(name, r, gt, verbose=False))


def test_eager_calls_bypass_the_custom_ops_traced_calls_use_them(gen, device):
    """Eager calls of the three ops run their launchers under a plain autograd.Function (launch.eager: the custom
    ops' dispatch and autograd wrappers cost host time the GPU waits for); under a dispatch mode (what AOTAutograd
    and make_fx trace with) the custom ops run. Outputs and every gradient are bit-equal on both paths."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    T, C = 19, 24
    x = _x((T, 4, C), torch.bfloat16, gen, device=device)
    W, h = _W(C, gen, device=device), _x((T, 4), torch.float32, gen, device=device)
    _, f, H, hp = _post_res_inputs(T, C, torch.bfloat16, gen, device)
    up = [_x(s, torch.float32, gen, device=device) for s in ((T, N_PROJ), (T,), (T, C), (T, 4, C))]
    results = {}
    for path in ("eager", "op"):
        leaves = [_leaf(t) for t in (x, W, h, f, H, hp)]
        xl, Wl, hl, fl, Hl, hpl = leaves
        with contextlib.nullcontext() if path == "eager" else Passthrough(), poisoned():
            proj, inv = fused_rmsnorm_project(xl.view(T, 4 * C), Wl)
            y = fused_pre_map(xl, hl)
            z = fused_post_res(xl, fl, Hl, hpl)
        names = {type(t.grad_fn).__name__ for t in (proj, y, z)}
        want = {"_ProjectFunctionBackward", "_PreMapFunctionBackward", "_PostResFunctionBackward"}
        assert (names == want) == (path == "eager"), names
        loss = (proj * up[0]).sum() + (inv * up[1]).sum() + (y.float() * up[2]).sum() + (z.float() * up[3]).sum()
        with poisoned():
            results[path] = [proj, inv, y, z, *torch.autograd.grad(loss, leaves)]
    for e, o in zip(results["eager"], results["op"]):
        assert not e.isnan().any()
        torch.testing.assert_close(o, e, rtol=0, atol=0)


# ----------------------------------------------------------------------------- K2: coefficients


def _random_coeff_params(gen):
    return dict(
        alpha_pre=torch.rand((), generator=gen) * 2,
        alpha_post=torch.rand((), generator=gen) * 2,
        alpha_res=torch.rand((), generator=gen) * 2,
        b_pre=torch.randn(4, generator=gen),
        b_post=torch.randn(4, generator=gen),
        b_res=torch.randn(24, generator=gen) * 3,
    )


def _assert_coefficient_ranges(h_pre, h_post, H, T):
    assert h_pre.shape == (T, 4) and h_post.shape == (T, 4) and H.shape == (T, 4, 4)
    assert ((h_pre > 0) & (h_pre < 1)).all()
    assert ((h_post > 0) & (h_post < 2)).all()
    assert ((H >= 0) & (H <= 1 + 1e-6)).all()  # a sum of 6 softmax weights: 1 + an ulp at most
    ones = torch.ones(T, 4, dtype=H.dtype, device=H.device)
    torch.testing.assert_close(H.sum(-1), ones, rtol=0, atol=1e-5)  # rows
    torch.testing.assert_close(H.sum(-2), ones, rtol=0, atol=1e-5)  # columns


def test_coefficients_ranges_and_doubly_stochastic(gen):
    T = 29
    # logits within ~+-12: fp32 sigmoid is still strictly inside (0, 1) (it rounds to 1 above ~16.6)
    proj = _x((T, N_PROJ), torch.float32, gen, scale=1.5)
    params = _random_coeff_params(gen)
    h_pre, h_post, H = coefficients(proj, **params)
    _assert_coefficient_ranges(h_pre, h_post, H, T)
    # and they are what the definition says, in float64
    p = {k: _to64(v) for k, v in params.items()}
    P = permutation_matrices(dtype=torch.float64)
    a = torch.softmax(p["alpha_res"] * _to64(proj)[:, 8:] + p["b_res"], -1)
    _assert_ok(
        compare("h_pre", torch.sigmoid(p["alpha_pre"] * _to64(proj)[:, :4] + p["b_pre"]), h_pre, verbose=False),
        compare("h_post", 2 * torch.sigmoid(p["alpha_post"] * _to64(proj)[:, 4:8] + p["b_post"]), h_post, verbose=False),
        compare("H_res", torch.einsum("tk,kij->tij", a, P), H, verbose=False),
    )


def test_coefficients_saturated_logits_stay_in_range(gen):
    """Logits of +-60: sigmoid / softmax saturate, and H_res stays a (near-)permutation matrix."""
    T = 9
    proj = 60.0 * torch.sign(_x((T, N_PROJ), torch.float32, gen))
    params = _random_coeff_params(gen)
    params.update(alpha_pre=torch.tensor(1.0), alpha_post=torch.tensor(1.0), alpha_res=torch.tensor(1.0))
    h_pre, h_post, H = coefficients(proj, **params)
    assert ((h_pre >= 0) & (h_pre <= 1)).all() and ((h_post >= 0) & (h_post <= 2)).all()
    assert H.isfinite().all() and ((H >= 0) & (H <= 1 + 1e-6)).all()
    ones = torch.ones(T, 4)
    torch.testing.assert_close(H.sum(-1), ones, rtol=0, atol=1e-5)
    torch.testing.assert_close(H.sum(-2), ones, rtol=0, atol=1e-5)


def test_permutation_matrices():
    P = permutation_matrices()
    assert P.shape == (24, 4, 4)
    torch.testing.assert_close(P[0], torch.eye(4), rtol=0, atol=0)
    assert (P.sum(-1) == 1).all() and (P.sum(-2) == 1).all()
    assert len({tuple(p.flatten().tolist()) for p in P}) == 24  # all distinct


def test_coefficients_at_block_init(gen, device):
    """At MHCLiteBlock's init W = 0, so proj = 0: h_pre = sigmoid(b_pre) = sigmoid([1, -1, -1, -1]),
    h_post = 2 sigmoid([1, -1, -1, -1]) and H_res ~ identity (off-identity permutation logits -8)."""
    from triforge.nn.mhc import MHCLiteBlock

    T, C = 7, 24
    block = MHCLiteBlock(torch.nn.Identity(), C).to(device)
    assert torch.count_nonzero(block.W) == 0
    x = _x((T, 4 * C), torch.float32, gen, device=device)
    with poisoned():
        proj, _ = fused_rmsnorm_project(x, block.W.detach())
    assert torch.count_nonzero(proj) == 0
    with torch.no_grad():
        h_pre, h_post, H = coefficients(proj, block.alpha_pre, block.alpha_post, block.alpha_res,
                                        block.b_pre, block.b_post, block.b_res)
    _assert_coefficient_ranges(h_pre, h_post, H, T)
    b = torch.tensor([1.0, -1.0, -1.0, -1.0], device=device)
    eye = torch.eye(4, device=device)
    torch.testing.assert_close(h_pre, torch.sigmoid(b).expand(T, 4), rtol=0, atol=1e-7)
    torch.testing.assert_close(h_post, (2 * torch.sigmoid(b)).expand(T, 4), rtol=0, atol=1e-7)
    # softmax over 24 logits (0, -8 x 23): the identity weighs a0, every other permutation ak.
    # Each off-diagonal (i, j) is hit by 3! = 6 permutations, each diagonal entry by the identity + 5.
    z = 1 + 23 * math.exp(-8)
    a0, ak = 1 / z, math.exp(-8) / z
    expected = (a0 + 5 * ak) * eye + 6 * ak * (1 - eye)
    torch.testing.assert_close(H, expected.expand(T, 4, 4), rtol=0, atol=1e-6)
    assert (H.diagonal(dim1=-2, dim2=-1) > 0.99).all() and (H - eye).abs().max() < 0.01


# ----------------------------------------------------------------------------- registry / opcheck


def _mhc_cases():
    return [(registry._OPS[name], dt) for name in ("mhc_project", "mhc_pre_map", "mhc_post_res") for dt in DTYPES]


@pytest.mark.parametrize(
    "spec,dtype", _mhc_cases(), ids=[f"{s.name}-{str(d).replace('torch.', '')}" for s, d in _mhc_cases()]
)
def test_registered_mhc_ops_pass_check(spec, dtype, gen):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    result = check_op(spec, dtype, tier="tiny", seed=seed)  # the real tier: tests/test_gpu.py
    assert result.error is None, result.error
    assert result.ok, f"seed {seed}\n" + "\n".join(r.line() for r in result.results)
    names = [r.name for r in result.results]
    fwd = [n.removeprefix("fwd.") for n in names if n.startswith("fwd.")]
    assert set(spec.outputs) <= set(fwd)
    assert names == [f"fwd.{n}" for n in fwd] + [f"bwd.d{k}" for k in spec.grad_inputs]


def test_mhc_ops_registered():
    assert {"mhc_project", "mhc_pre_map", "mhc_post_res"} <= set(registry._OPS)
    assert all(registry._OPS[n].family == "mhc" for n in ("mhc_project", "mhc_pre_map", "mhc_post_res"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_custom_ops_pass_opcheck(dtype, gen, device):
    """torch.library.opcheck: schema, fakes, autograd registration and AOT dispatch of all six ops."""
    T, C = 5, 8
    x = _x((T, 4, C), dtype, gen, device=device)
    W = _W(C, gen, device=device)
    h = _x((T, 4), torch.float32, gen, device=device)
    f = _x((T, C), dtype, gen, device=device)
    H = _x((T, 4, 4), torch.float32, gen, device=device)
    ops = torch.ops.triforge
    torch.library.opcheck(ops.fused_rmsnorm_project.default,
                          (x.view(T, 4 * C).clone().requires_grad_(), W.clone().requires_grad_(), 1e-6))
    torch.library.opcheck(ops.fused_pre_map.default, (x.clone().requires_grad_(), h.clone().requires_grad_()))
    torch.library.opcheck(ops.fused_post_res.default, tuple(t.clone().requires_grad_() for t in (x, f, H, h)))
    proj, inv = ops.fused_rmsnorm_project(x.view(T, 4 * C), W, 1e-6)
    dproj, dinv = _x((T, N_PROJ), torch.float32, gen, device=device), _x((T,), torch.float32, gen, device=device)
    torch.library.opcheck(ops.fused_rmsnorm_project_bwd.default, (x.view(T, 4 * C), W, proj, inv, dproj, dinv))
    torch.library.opcheck(ops.fused_rmsnorm_project_bwd.default, (x.view(T, 4 * C), W, proj, inv, dproj, None))
    torch.library.opcheck(ops.fused_pre_map_bwd.default, (f, x, h))
    torch.library.opcheck(ops.fused_post_res_bwd.default, (_x((T, 4, C), dtype, gen, device=device), x, f, H, h))


def test_torch_compile_ops_fullgraph_dynamic(gen, device):
    """The fakes follow symbolic shapes: one compiled graph of all three ops serves several T."""
    C = 24

    def f(x, W, b):
        T = x.shape[0]
        proj, inv = fused_rmsnorm_project(x.view(T, 4 * C), W)
        h_pre, h_post, H = coefficients(proj, 1.0, 1.0, 1.0, b[:4], b[4:8], b[8:])
        y = fused_pre_map(x, h_pre.contiguous())
        return fused_post_res(x, torch.tanh(y), H.contiguous(), h_post.contiguous()) * inv[:, None, None]

    cf = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    W, b = _W(C, gen, device=device), _x((N_PROJ,), torch.float32, gen, device=device)
    for T in (3, 17, 2):
        x = _x((T, 4, C), torch.float32, gen, device=device)
        leaves = [_leaf(x), _leaf(W), _leaf(b)]
        g = _x((T, 4, C), torch.float32, gen, device=device)
        with poisoned():
            out = cf(*leaves)
            grads = torch.autograd.grad(out, leaves, g)
        leaves64 = [_leaf(_to64(t)) for t in (x, W, b)]
        x64, W64, b64 = leaves64
        p64, i64 = rmsnorm_project_ref(x64.view(T, 4 * C), W64)
        hp, hq, H64 = coefficients(p64, 1.0, 1.0, 1.0, b64[:4], b64[4:8], b64[8:])
        out64 = post_res_ref(x64, torch.tanh(pre_map_ref(x64, hp)), H64, hq) * i64[:, None, None]
        ref = torch.autograd.grad(out64, leaves64, _to64(g))
        _assert_ok(compare("out", out64, out, verbose=False))
        for name, r, gt in zip(("dx", "dW", "db"), ref, grads):
            _assert_ok(compare(name, r, gt, verbose=False))


# ----------------------------------------------------------------------------- bad input


def _bad_cases():
    T, C = 5, 8

    def xs(shape=(T, 4, C), dtype=torch.float32):
        return torch.randn(shape).to(dtype)

    def co(shape, dtype=torch.float32):
        return torch.randn(shape).to(dtype)

    W = lambda shape=(N_PROJ, 4 * C), dtype=torch.float32: torch.randn(shape).to(dtype)  # noqa: E731
    transposed = torch.randn(T, C, 4).transpose(1, 2)  # [T, 4, C], not contiguous
    post = lambda **kw: dict(dict(x_streams=xs(), layer_output=xs((T, C)), H_merged=co((T, 4, 4)), h_post=co((T, 4))), **kw)  # noqa: E731
    pre = lambda **kw: dict(dict(x_streams=xs(), h_pre=co((T, 4))), **kw)  # noqa: E731
    proj = lambda **kw: dict(dict(x_flat=xs((T, 4 * C)), W=W()), **kw)  # noqa: E731
    P, R, K = fused_post_res, fused_pre_map, fused_rmsnorm_project
    return [
        # n != 4
        ("pre-3-streams", R, pre(x_streams=xs((T, 3, C)), h_pre=co((T, 3))), ValueError, "x_streams"),
        ("post-3-streams", P, post(x_streams=xs((T, 3, C))), ValueError, "x_streams"),
        ("pre-2d-streams", R, pre(x_streams=xs((T, 4 * C))), ValueError, "x_streams"),
        ("project-width-not-4C", K, dict(x_flat=xs((T, 10)), W=W((N_PROJ, 10))), ValueError, "x_flat"),
        # mismatched T / C
        ("pre-h_pre-T", R, pre(h_pre=co((T + 1, 4))), ValueError, "h_pre"),
        ("pre-h_pre-n", R, pre(h_pre=co((T, 3))), ValueError, "h_pre"),
        ("pre-h_pre-1d", R, pre(h_pre=co((4,))), ValueError, "h_pre"),
        ("post-layer_output-T", P, post(layer_output=xs((T + 1, C))), ValueError, "layer_output"),
        ("post-layer_output-C", P, post(layer_output=xs((T, C + 1))), ValueError, "layer_output"),
        ("post-layer_output-3d", P, post(layer_output=xs((T, 1, C))), ValueError, "layer_output"),
        ("post-H_merged-T", P, post(H_merged=co((T + 1, 4, 4))), ValueError, "H_merged"),
        ("post-H_merged-n", P, post(H_merged=co((T, 4, 3))), ValueError, "H_merged"),
        ("post-h_post-T", P, post(h_post=co((T - 1, 4))), ValueError, "h_post"),
        ("post-h_post-n", P, post(h_post=co((T, 5))), ValueError, "h_post"),
        # dtypes
        ("pre-fp64-streams", R, pre(x_streams=xs(dtype=torch.float64)), TypeError, "x_streams"),
        ("post-fp64-streams", P, post(x_streams=xs(dtype=torch.float64), layer_output=xs((T, C), torch.float64)), TypeError, "x_streams"),
        ("project-fp64-x", K, proj(x_flat=xs((T, 4 * C), torch.float64)), TypeError, "x_flat"),
        ("pre-int-streams", R, pre(x_streams=torch.ones(T, 4, C, dtype=torch.int32)), TypeError, "x_streams"),
        ("pre-bf16-h_pre", R, pre(h_pre=co((T, 4), torch.bfloat16)), TypeError, "h_pre"),
        ("post-bf16-H_merged", P, post(H_merged=co((T, 4, 4), torch.bfloat16)), TypeError, "H_merged"),
        ("post-bf16-h_post", P, post(h_post=co((T, 4), torch.bfloat16)), TypeError, "h_post"),
        ("post-fp64-h_post", P, post(h_post=co((T, 4), torch.float64)), TypeError, "h_post"),
        ("post-layer_output-dtype", P, post(x_streams=xs(dtype=torch.bfloat16)), TypeError, "layer_output"),
        ("project-fp16-W", K, proj(W=W(dtype=torch.float16)), TypeError, "W"),
        ("project-bf16-W", K, proj(x_flat=xs((T, 4 * C), torch.bfloat16), W=W(dtype=torch.bfloat16)), TypeError, "W"),
        ("pre-list-h_pre", R, pre(h_pre=[[0.5] * 4] * T), TypeError, "h_pre"),
        # non-contiguous streams
        ("pre-transposed-streams", R, pre(x_streams=transposed), ValueError, "x_streams"),
        ("post-transposed-streams", P, post(x_streams=transposed), ValueError, "x_streams"),
        ("project-transposed-x", K, proj(x_flat=torch.randn(4 * C, T).t()), ValueError, "x_flat"),
        # W shape
        ("project-W-cols", K, proj(W=W((N_PROJ, 4 * C + 4))), ValueError, "W"),
        ("project-W-rows-33", K, proj(W=W((N_PROJ + 1, 4 * C))), ValueError, "W"),
        ("project-W-rows-31", K, proj(W=W((N_PROJ - 1, 4 * C))), ValueError, "W"),
        ("project-W-1d", K, proj(W=W((4 * C,))), ValueError, "W"),
        ("project-W-3d", K, proj(W=W((1, N_PROJ, 4 * C))), ValueError, "W"),
        # eps
        ("project-zero-eps", K, proj(eps=0.0), ValueError, "eps"),
        ("project-negative-eps", K, proj(eps=-1e-6), ValueError, "eps"),
        ("project-nan-eps", K, proj(eps=float("nan")), ValueError, "eps"),
        # empty
        ("pre-empty", R, pre(x_streams=xs((0, 4, C)), h_pre=co((0, 4))), ValueError, "x_streams"),
    ]


_BAD = _bad_cases()


@pytest.mark.parametrize("fn,kwargs,exc,arg", [c[1:] for c in _BAD], ids=[c[0] for c in _BAD])
def test_bad_input_names_the_argument(fn, kwargs, exc, arg, device):
    # built on the CPU at collection time: every tensor argument moves to the kernels' device with its
    # strides kept (the transposed cases must stay non-contiguous), so each case fails on what it is
    # about, not on the device check
    kwargs = {name: _to(value, device) for name, value in kwargs.items()}
    with pytest.raises(exc, match=rf"^{arg}\b"):
        fn(**kwargs)


@pytest.mark.parametrize("rows", [16, 64])
def test_project_rejects_w_with_16_or_64_rows(rows, gen, device):
    C = 8
    with pytest.raises(ValueError, match=r"^W\b"):
        fused_rmsnorm_project(_x((5, 4 * C), torch.float32, gen, device=device), _W(C, gen, rows=rows, device=device))


def test_project_str_eps_names_the_argument(gen, device):
    C = 8
    with pytest.raises((TypeError, ValueError), match=r"^eps\b"):
        fused_rmsnorm_project(_x((5, 4 * C), torch.float32, gen, device=device), _W(C, gen, device=device), "1e-6")


def test_project_forward_stack_compiles_to_half_the_wgmmas():
    """K1's forward compiled for sm90a (no GPU: the triton wheel's ptxas / nvdisasm) at the H200's tuned tile (256
    tokens x 128 columns, 8 warps, 3 stages, descriptors): with STACK its token loop issues half the wgmmas of the
    two-dot form (one N = 64 dot of x against [hi | lo] instead of two of N = 32), none serialized by ptxas, and
    neither form spills."""
    from ...sm90 import compile_for_sm90

    def case(stack):
        return {"kernel": "triforge.ops.mhc.forward:mhc_project_fwd_kernel",
                "signature": {"x_ptr": "*bf16", "w_ptr": "*fp32", "proj_ptr": "*fp32", "inv_rms_ptr": "*fp32",
                              "T": "i32", "K": "i32", "eps": "fp32"},
                "constexprs": {"R": 32, "BLOCK_T": 256, "BLOCK_K": 128, "SPLIT_W": True, "UPCAST": False,
                               "RNE": False, "TMA": 1, "STACK": stack},
                "divisible": ["x_ptr", "w_ptr", "proj_ptr", "inv_rms_ptr", "T", "K"],
                "options": {"num_warps": 8, "num_stages": 3}}

    two, one = compile_for_sm90([case(0), case(1)])

    def wgmmas(r):
        return sum(n for op, n in r["loops"][0].items() if op.startswith("HGMMA"))

    print(f"two dots: {wgmmas(two)} wgmmas, {sum(two['loops'][0].values())} instructions per tile; "
          f"stacked: {wgmmas(one)}, {sum(one['loops'][0].values())}")
    assert wgmmas(two) > 0 and wgmmas(one) * 2 == wgmmas(two)
    assert sum(one["loops"][0].values()) < sum(two["loops"][0].values())
    assert not one["serialized"] and not two["serialized"]
    assert one["spill_bytes"] == 0 and two["spill_bytes"] == 0


def test_post_res_backward_tma_kernel_compiles_without_layout_conversions():
    """K4 backward's descriptor kernel compiled for sm90a (no GPU) at the H200's entries (4 tokens x 256 columns, 4
    warps, 3 and 4 stages): no spills, registers for three programs per SM (the entries' programs_per_sm), and no
    loop of it stores to shared memory beyond the five cross-warp reductions of a block (dh_post and dH's four
    columns): its loads feed the math in the layout they arrive in. (The first form, 3-D boxes reshaped inside the
    register kernel, stored 120 values per block for layout conversions and ran 7x slower on the H200; 8 warps or
    2-token tiles bring conversions back: 30 stores.)"""
    from ...sm90 import compile_for_sm90

    def case(stages):
        return {"kernel": "triforge.ops.mhc.backward:mhc_post_res_bwd_tma_kernel",
                "signature": {"g_ptr": "*bf16", "x_ptr": "*bf16", "f_ptr": "*bf16", "H_ptr": "*fp32", "hp_ptr": "*fp32",
                              "dx_ptr": "*bf16", "df_ptr": "*bf16", "dH_ptr": "*fp32", "dhp_ptr": "*fp32",
                              "T": "i32", "C": "i32"},
                "constexprs": {"BLOCK_T": 4, "BLOCK_C": 256, "STAGES": stages},
                "divisible": ["g_ptr", "x_ptr", "f_ptr", "H_ptr", "hp_ptr", "dx_ptr", "df_ptr", "dH_ptr", "dhp_ptr",
                              "T", "C"],
                "options": {"num_warps": 4}}

    for stages, r in zip((3, 4), compile_for_sm90([case(3), case(4)])):
        tma_loops = [lp for lp in r["loops"] if lp.get("UTMALDG.2D")]
        stores = max(sum(n for op, n in lp.items() if op.startswith("STS")) for lp in tma_loops)
        print(f"stages {stages}: {r['regs']} registers, {r['shared']} B shared, {len(tma_loops)} loops with "
              f"descriptor loads, at most {stores} shared stores in one")
        assert r["spill_bytes"] == 0 and r["regs"] <= 65536 // (3 * 128)
        assert tma_loops and stores <= 5


def test_project_forward_h200_entries_compile_without_spills():
    """K1's forward at the H200's stored entries (512 tokens x 64 columns, 8 warps, 3 and 4 stages, descriptors)
    compiled for sm90a: no spills, wgmmas not serialized, and the shared memory within the SM's 227 KB."""
    import json
    from pathlib import Path

    from ...sm90 import compile_for_sm90

    entries = json.loads((Path(__file__).parents[3] / "triforge/configs/sm90.h200.json").read_text())
    cfgs = list(entries["kernels"]["mhc_project_fwd"].values())
    assert cfgs and all(c["BLOCK_T"] == 512 for c in cfgs)
    cases = [{"kernel": "triforge.ops.mhc.forward:mhc_project_fwd_kernel",
              "signature": {"x_ptr": "*bf16", "w_ptr": "*fp32", "proj_ptr": "*fp32", "inv_rms_ptr": "*fp32",
                            "T": "i32", "K": "i32", "eps": "fp32"},
              "constexprs": {"R": 32, "BLOCK_T": c["BLOCK_T"], "BLOCK_K": c["BLOCK_K"], "SPLIT_W": True,
                             "UPCAST": False, "RNE": False, "TMA": c["TMA"], "STACK": c.get("STACK", 0)},
              "divisible": ["x_ptr", "w_ptr", "proj_ptr", "inv_rms_ptr", "T", "K"],
              "options": {"num_warps": c["num_warps"], "num_stages": c["num_stages"]}} for c in cfgs]
    for c, r in zip(cfgs, compile_for_sm90(cases)):
        print(c, r["regs"], r["spill_bytes"], r["shared"])
        assert r["spill_bytes"] == 0 and not r["serialized"] and r["shared"] <= 232448
