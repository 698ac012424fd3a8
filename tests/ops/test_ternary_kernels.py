"""Ternary weight kernels against exact integer and float64 dense references.

Inputs and references are built on the CPU; the kernels' operands move to ``device`` (CUDA on the
GPU, the CPU under Triton's interpreter). Integer references stay on the CPU (CUDA has no int64
matmul) and the kernels' integer results come back to it to be compared bit for bit."""

import pytest
import torch

from triforge.launch import poisoned
from triforge.ops.ternary.kernels import (
    activation_bit_planes,
    chunk_activity,
    popcount_matmul_a8,
    ternary_gemv,
    ternary_matmul,
)
from triforge.testing import compare


def planes_of(trits: torch.Tensor):
    """Independent plane builder: bit b of word w is column 32w + b (int32, two's complement)."""
    N, K = trits.shape
    kw = (K + 31) // 32
    out = []
    for sign in (1, -1):
        bits = torch.zeros(N, kw * 32, dtype=torch.int64)
        bits[:, :K] = (trits == sign).to(torch.int64)
        words = torch.zeros(N, kw, dtype=torch.int64)
        for b in range(32):
            words |= bits[:, b::32] << b
        out.append(torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))
    return out[0], out[1]


def random_trits(N, K, sparsity=0.5):
    t = torch.randint(-1, 2, (N, K), dtype=torch.int8)
    t[torch.rand(N, K) < sparsity] = 0
    return t


def test_activation_bit_planes_reassemble_the_bytes():
    x = torch.randint(-128, 128, (3, 70), dtype=torch.int8)
    x[0, 0], x[0, 1] = -128, 127
    planes = activation_bit_planes(x)
    assert planes.shape == (8, 3, 3) and planes.dtype == torch.int32
    words = planes.to(torch.int64) & 0xFFFFFFFF
    bits = torch.stack([(words >> b) & 1 for b in range(32)], -1).view(8, 3, 96)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, -128]).view(8, 1, 1)
    assert torch.equal((bits[:, :, :70] * weights).sum(0), x.to(torch.int64))
    assert bits[:, :, 70:].sum() == 0  # padding columns stay zero


@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (1, 33, 31), (4, 17, 33), (7, 40, 100), (2, 9, 2049)])
def test_popcount_a8_is_exact(M, N, K, device):
    t = random_trits(N, K)
    t[0] = 0  # an all-zero row
    plus, minus = planes_of(t)
    x = torch.randint(-128, 128, (M, K), dtype=torch.int8)
    x[0, : min(K, 4)] = torch.tensor([-128, 127, -1, 0][: min(K, 4)], dtype=torch.int8)
    with poisoned():
        got = popcount_matmul_a8(x.to(device), plus.to(device), minus.to(device))
    want = x.to(torch.int64) @ t.to(torch.int64).T
    assert got.dtype == torch.int32
    assert torch.equal(got.cpu().to(torch.int64), want)


def test_popcount_a8_bit31_columns(device):
    # column 31 of each word is the int32 sign bit of the plane word
    K = 96
    t = torch.zeros(3, K, dtype=torch.int8)
    t[0, 31], t[1, 63], t[2, 95] = 1, -1, 1
    t[2, 30] = -1
    plus, minus = planes_of(t)
    assert (plus[0, 0] < 0) and (minus[1, 1] < 0)
    x = torch.randint(-128, 128, (2, K), dtype=torch.int8)
    got = popcount_matmul_a8(x.to(device), plus.to(device), minus.to(device))
    assert torch.equal(got.cpu().to(torch.int64), x.to(torch.int64) @ t.to(torch.int64).T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("M,N,K", [(1, 33, 100), (3, 20, 31), (16, 17, 65), (20, 24, 300)])
def test_ternary_matmul_matches_dense_float64(dtype, M, N, K, device):
    t = random_trits(N, K)
    plus, minus = planes_of(t)
    scales = torch.rand(N) + 0.1
    bias = torch.randn(N)
    x = torch.randn(M, K).to(dtype)
    want = x.double() @ (t.double() * scales.double()[:, None]).T + bias.double()
    with poisoned():
        got = ternary_matmul(x.to(device), plus.to(device), minus.to(device), scales.to(device), bias=bias.to(device))
    assert got.dtype == dtype and got.shape == (M, N)
    assert compare(f"ternary_matmul {dtype}", want, got, dtype=dtype).ok


@pytest.mark.parametrize("M", [1, 20])
def test_plane_skipping_gives_the_same_result(M, device):
    N, K = 24, 3 * 2048 + 5
    t = random_trits(N, K, sparsity=0.95)  # > 90% sparse
    t[:, 2048:4096] = 0  # an all-zero chunk for every row
    t[3] = 0  # an all-zero row
    plus, minus = (p.to(device) for p in planes_of(t))
    active = chunk_activity(plus, minus)
    assert active.shape == (N, 4) and active[:, 1].sum() == 0 and active[3].sum() == 0
    scales = torch.rand(N) + 0.1
    x = torch.randn(M, K, dtype=torch.float16)
    want = x.double() @ (t.double() * scales.double()[:, None]).T
    x, scales = x.to(device), scales.to(device)
    with poisoned():
        dense = ternary_matmul(x, plus, minus, scales)
        skipped = ternary_matmul(x, plus, minus, scales, active=active)
    assert compare("no skipping", want, dense, dtype=torch.float16).ok
    assert compare("plane skipping", want, skipped, dtype=torch.float16).ok
    assert torch.all(skipped[:, 3] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_w158a8_through_the_popcount_kernel_matches_the_reference(dtype, device):
    from triforge.ops.ternary import TernaryTensor, matmul_w158a8
    from triforge.ops.ternary.reference import matmul_w158a8_ref

    tt = TernaryTensor.from_float(torch.randn(37, 101), method="twn", per_row=True).to(device)
    x = torch.randn(2, 5, 101).to(device, dtype)
    bias = torch.randn(37).to(device)
    with poisoned():
        got = matmul_w158a8(x, tt, bias=bias)
    want = matmul_w158a8_ref(x, tt, bias=bias)
    assert got.shape == (2, 5, 37) and got.dtype == dtype
    assert compare("W1.58A8 kernel vs reference", want, got, dtype=dtype).ok


@pytest.mark.parametrize("M", [1, 4, 5, 16])
def test_public_matmul_dispatches_decode_gemv_up_to_4_rows(M, monkeypatch, device, gen):
    import triforge.ops.ternary.kernels as kernels
    from triforge.ops.ternary import TernaryTensor, matmul

    calls = []
    for name in ("ternary_gemv", "ternary_matmul"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    tt = TernaryTensor.from_float(torch.randn(20, 64, generator=gen)).to(device)
    x = torch.randn(M, 64, generator=gen).to(device)
    y = matmul(x, tt)
    assert kernels.GEMV_DISPATCH_M == 4 <= kernels.DECODE_MAX_M
    assert calls == ["ternary_gemv" if M <= 4 else "ternary_matmul"]
    assert compare("dispatched matmul", x.double() @ tt.to_float(torch.float64).T, y, dtype=torch.float32).ok


# ----------------------------------------------------------------------------- decode GEMV (M <= 16)


def _gemv_case(M, N, K, dtype, gen, sparsity=0.5):
    """Fresh trits, per-row scales, bias and x, and the float64 result of exactly those operands."""
    u = torch.rand(N, K, generator=gen)
    t = torch.where(torch.rand(N, K, generator=gen) < 0.5, -1, 1).to(torch.int8)
    t[u < sparsity] = 0
    scales = torch.rand(N, generator=gen) + 0.1
    bias = torch.randn(N, generator=gen)
    x = torch.randn(M, K, generator=gen).to(dtype)
    return t, scales, bias, x


def _gemv_ref(t, scales, x, bias=None):
    y = x.double() @ (t.double() * scales.double()[:, None]).T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("M,N,K", [(1, 33, 31), (2, 40, 100), (5, 17, 2049), (16, 9, 4097), (1, 70, 4097)])
def test_ternary_gemv_matches_dense_float64(M, N, K, dtype, device, gen):
    """Odd K (padding bits, a partial last word and step), N not a multiple of the row block, M padded
    to a power of two, bit 31 of the words (column 32 w + 31 is in every word), bias in x's dtype."""
    t, scales, bias, x = _gemv_case(M, N, K, dtype, gen)
    bias = bias.to(dtype)
    plus, minus = planes_of(t)
    with poisoned():
        got = ternary_gemv(x.to(device), plus.to(device), minus.to(device), scales.to(device), bias=bias.to(device))
    assert got.dtype == dtype and got.shape == (M, N)
    assert compare(f"ternary_gemv M={M} K={K}", _gemv_ref(t, scales, x, bias), got, dtype=dtype).ok


@pytest.mark.parametrize("M", [1, 5])
def test_ternary_gemv_split_k_sparse_zero_rows_and_chunks(M, device, gen):
    """> 90%-sparse weights, all-zero rows, a chunk that is zero for every row and one zero for a whole
    row block; split-K (fixed-order reduction) with and without plane skipping, and a per-tensor scale
    (a stride-0 [N] view)."""
    N, K = 40, 3 * 2048 + 70
    t, scales, bias, x = _gemv_case(M, N, K, torch.bfloat16, gen, sparsity=0.95)
    t[:, 2048:4096] = 0  # chunk 1: inactive everywhere
    t[:16, 4096:] = 0  # chunks 2, 3: inactive for the first row block (16 rows)
    t[3] = 0
    t[37] = 0
    assert (t == 0).double().mean() > 0.9
    plus, minus = (p.to(device) for p in planes_of(t))
    active = chunk_activity(plus, minus)
    assert active[:, 1].sum() == 0 and active[:16, 2:].sum() == 0 and active[3].sum() == 0
    scale = torch.rand(1, generator=gen) + 0.5
    cfg = dict(BLOCK_N=16, BLOCK_W=16, BIT_UNROLL=4, num_warps=4, programs_per_sm=1 << 10)  # 3 x 13 programs
    xd, sd, bd = x.to(device), scale.to(device).expand(N), bias.to(device)
    with poisoned():
        dense = ternary_gemv(xd, plus, minus, sd, bias=bd, cfg=cfg)
        skipped = ternary_gemv(xd, plus, minus, sd, bias=bd, active=active, cfg=cfg)
        again = ternary_gemv(xd, plus, minus, sd, bias=bd, active=active, cfg=cfg)
        whole = ternary_gemv(xd, plus, minus, sd, active=active)
    want = _gemv_ref(t, scale.expand(N), x, bias)
    assert compare("split-K", want, dense, dtype=torch.bfloat16).ok
    assert compare("split-K, plane skipping", want, skipped, dtype=torch.bfloat16).ok
    assert compare("plane skipping", want - bias.double(), whole, dtype=torch.bfloat16).ok
    assert torch.equal(skipped, again)  # deterministic
    for row in (3, 37):
        assert torch.equal(skipped[:, row].cpu(), bias[row].to(torch.bfloat16).expand(M))
        assert bool((whole[:, row] == 0).all())


def test_ternary_gemv_rejects_bad_configs_and_rows(device):
    plus = torch.zeros(8, 4, dtype=torch.int32, device=device)
    x = torch.zeros(2, 100, device=device)
    s = torch.ones(8, device=device)
    with pytest.raises(ValueError, match="rows"):
        ternary_gemv(torch.zeros(17, 100, device=device), plus, plus, s)
    cfg = dict(BLOCK_N=16, BLOCK_W=48, BIT_UNROLL=4, num_warps=4, programs_per_sm=4)
    with pytest.raises(ValueError, match="BLOCK_W"):
        ternary_gemv(x, plus, plus, s, cfg=cfg)
    with pytest.raises(ValueError, match="BIT_UNROLL"):
        ternary_gemv(x, plus, plus, s, cfg=dict(cfg, BLOCK_W=32, BIT_UNROLL=3))


def test_gemv_splits_fill_the_sms(monkeypatch):
    from triforge import _runtime
    from triforge.ops.ternary.kernels import gemv_splits

    monkeypatch.setattr(_runtime, "num_sms", lambda: 132)
    steps = lambda K: -(-K // 32 // 32)  # noqa: E731  (32-word steps)
    assert gemv_splits(8192 // 16, steps(8192), 4) == 1  # 512 row blocks already fill 132 SMs x 4
    assert gemv_splits(896 // 16, steps(4864), 4) == 5  # 56 blocks: K split 9 ways would do, 5 steps allow 5
    assert gemv_splits(896 // 16, steps(4864), 2) == 4


# ----------------------------------------------------------------------------- compiled for sm90 (no GPU needed)


def _gemv_sm90_cases():
    """The decode kernels as the H100 builds them at N = K = 8192 with the fallback configs, and the plane GEMM."""
    from triforge.ops.ternary import kernels as TK

    mod = "triforge.ops.ternary.kernels"
    ptrs = {"xt_ptr": "*fp32", "plus_ptr": "*i32", "minus_ptr": "*i32", "active_ptr": "*i32", "scale_ptr": "*fp32",
            "bias_ptr": "*bf16"}
    cases = []
    for bm, skip in [(1, False), (2, False), (4, False), (8, False), (16, False), (1, True), (16, True)]:
        cfg = TK.gemv_fallback_config(bm, 8192, 8192, interpreter=False)
        final = not skip  # the skipping cases also build the split-K variant (fp32 partials)
        cases.append({
            "kernel": f"{mod}:ternary_gemv_kernel",
            "signature": dict(ptrs, out_ptr="*bf16" if final else "*fp32"),
            "constexprs": dict(BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"], BLOCK_W=cfg["BLOCK_W"],
                               BIT_UNROLL=cfg["BIT_UNROLL"], SKIP=skip, FINAL=final, HAS_BIAS=True, RNE=False),
            "divisible": [*ptrs, "out_ptr", "magic", "N", "KW"],
            "options": {"num_warps": cfg["num_warps"], "num_stages": 1},
        })
    for bm in (1, 16):
        bw = TK.gemv_fallback_config(bm, 8192, 8192, interpreter=False)["BLOCK_W"]
        cases.append({"kernel": f"{mod}:ternary_gemv_bitmajor_kernel",
                      "signature": {"x_ptr": "*bf16", "xt_ptr": "*fp32"}, "constexprs": {"BLOCK_M": bm, "BLOCK_W": bw},
                      "divisible": ["x_ptr", "xt_ptr", "K"], "options": {"num_warps": 4}})
    # the plane GEMM as matmul() builds it: bf16 x at BLOCK_W 8; fp32 x as three bf16 parts (SPLIT3) at BLOCK_W 2 (the
    # fp32 FMA dot, DOT_F32, spilled 0.4-8.6 KB at every tile tried: BLOCK_M 16-64, BLOCK_W 1-8, 4-8 warps)
    for skip, x_ty, bm in [(False, "*bf16", 64), (True, "*bf16", 64), (False, "*fp32", 64), (True, "*fp32", 16)]:
        split3 = x_ty == "*fp32"
        cases.append({"kernel": f"{mod}:ternary_matmul_kernel",
                      "signature": {"x_ptr": x_ty, "plus_ptr": "*i32", "minus_ptr": "*i32", "active_ptr": "*i32",
                                    "part_ptr": "*fp32"},
                      "constexprs": {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_W": 2 if split3 else 8, "SKIP": skip,
                                     "DOT_F32": False, "SPLIT3": split3},
                      "divisible": ["x_ptr", "plus_ptr", "minus_ptr", "active_ptr", "part_ptr", "K", "KW"],
                      "options": {"num_warps": 4}})
    cases.append({"kernel": f"{mod}:ternary_gemv_reduce_kernel",
                  "signature": {"part_ptr": "*fp32", "scale_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16"},
                  "constexprs": {"BLOCK": 1024, "HAS_BIAS": True, "RNE": False},
                  "divisible": ["part_ptr", "scale_ptr", "bias_ptr", "y_ptr", "N"], "options": {"num_warps": 4}})
    return cases


def test_gemv_kernels_compile_for_sm90():
    """Compiled for sm90a (TRITON_INTERPRET=0, the fallback configs, the triton wheel's ptxas/nvdisasm):
    every decode kernel compiles without spilling, and the GEMV's K loop is the instruction mix of its
    cost model: per weight 2 LOP3 (the and-or making P and Q, one instruction each) and 1 FADD (P - Q)
    shared by the M rows, M FFMAs; no int-to-float conversion, no shared or local memory, 16-byte loads."""
    from ..sm90 import compile_for_sm90

    cases = _gemv_sm90_cases()
    rows = compile_for_sm90(cases)
    for case, r in zip(cases, rows):
        name = case["kernel"].split(":")[1]
        c = case["constexprs"]
        print(f"{name} {c} regs={r['regs']} spill_bytes={r['spill_bytes']} shared={r['shared']}")
        assert r["spill_bytes"] == 0 and not any(op.startswith(("LDL", "STL")) for op in r["sass"]), (name, c, r)
        if name != "ternary_gemv_kernel":
            continue
        loop = r["loops"][0]  # the K loop (bit loops nested in it)
        print(f"  K loop: {sorted(loop.items(), key=lambda kv: -kv[1])[:8]}")
        fadd = loop["FADD"]
        words = c["BLOCK_N"] * c["BLOCK_W"] // (32 * case["options"]["num_warps"])  # per thread per step
        assert fadd == words * 2 * (16 if c["BIT_UNROLL"] == 16 else c["BIT_UNROLL"]), loop  # static code
        assert loop["FFMA"] == c["BLOCK_M"] * fadd, loop
        assert 2 * fadd <= loop["LOP3.LUT"] <= 2 * fadd + 16, loop  # + the loop's own predicates
        assert loop.get("LDG.E.128", 0) >= 2, loop
        assert not any(op.startswith("I2F") for op in loop), loop
        # shared memory and barriers only for the skipping test's block-wide max over the rows' active flags
        shared_ops = sum(n for op, n in loop.items() if op.startswith(("LDS", "STS", "BAR")))
        assert shared_ops <= (8 if c["SKIP"] else 0), loop


def test_gemv_tunable_runs_and_covers_the_fallback(device):
    from triforge import tune
    from triforge.ops.ternary.kernels import gemv_fallback_config

    t = tune.get("ternary_gemv")
    assert t.default_shape == {"M": 1, "N": 8192, "K": 8192}
    assert set(t.space) == set(gemv_fallback_config(1, 8192, 8192, interpreter=False))
    run, key = t.setup({"M": 2, "N": 24, "K": 200}, torch.bfloat16, device)
    assert key == "k=200,m=2,n=24"
    run({"BLOCK_N": 8, "BLOCK_W": 32, "BIT_UNROLL": 4, "num_warps": 4, "programs_per_sm": 8})
