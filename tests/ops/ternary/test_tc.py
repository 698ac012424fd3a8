"""The tensor-core ternary prototype (triforge/ops/ternary/tc.py): the tc code layout, numerics against
float64 (interpreter: the plain decode), the inline-asm decode's constants emulated bit for bit, and
the kernel compiled for sm90a (registers, spills, the K loop's instruction mix)."""

import pytest
import torch

from triforge.launch import poisoned
from triforge.ops.ternary import tc
from triforge.ops.ternary.reference import matmul_dense_ref
from triforge.ternary import TernaryTensor
from triforge.testing import compare

from .test_tensor import random_scales, random_trits

DTYPES = [torch.float16, torch.bfloat16]
IDS = ["fp16", "bf16"]


@pytest.mark.parametrize("k", [1, 31, 128, 129, 1000])
def test_pack_tc_round_trip(k, gen):
    n = 7
    trits = random_trits(n, k, gen)
    trits[:, -1] = -1
    tt = TernaryTensor.from_trits(trits, random_scales(n, gen))
    codes = tc.pack_tc(tt.plus, tt.minus, k)
    # 2 bits per weight; rows padded to whole 16-row tiles
    assert codes.dtype == torch.int32 and codes.shape == (16, 8 * -(-k // 128))
    assert torch.equal(tc.unpack_tc(codes, k)[:n], trits)
    # padding columns and padding rows hold code 1 (trit 0)
    padded = tc.unpack_tc(codes, codes.shape[1] * 16)
    assert bool((padded[:, k:] == 0).all()) and bool((padded[n:] == 0).all())
    # column k = 128 b + 64 u + 16 (i // 2) + 8 (i % 2) + 2 t + e of row r is field i of half e of word 8 b + 2 t + u
    # of the row, stored at (r // 16) 16 KC + 128 b + 8 (r % 16) + 2 t + u (tiles of 16 rows x 8 words)
    rows, cols = 300, 384
    b, u, i, t, e, r = 1, 1, 5, 3, 1, 200
    one = torch.zeros(rows, cols, dtype=torch.int8)
    one[r, 128 * b + 64 * u + 16 * (i // 2) + 8 * (i % 2) + 2 * t + e] = 1
    tt1 = TernaryTensor.from_trits(one, torch.ones(1))
    flat = tc.pack_tc(tt1.plus, tt1.minus, cols).view(-1).tolist()
    assert len(flat) == 304 * 24  # 19 tile rows of 16 rows x 24 words
    word = (r // 16) * 16 * 24 + 128 * b + 8 * (r % 16) + 2 * t + u
    ones_code = 0x55555555  # every field code 1 (trit 0)
    assert all(v == ones_code for j, v in enumerate(flat) if j != word)
    assert (flat[word] & 0xFFFFFFFF) == (0x55555555 ^ (3 << (16 * e + 2 * i)))  # code 2 there


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("m,n,k", [(1, 63, 1000), (5, 63, 1000), (16, 63, 1000), (33, 40, 300)])
def test_tc_matmul_vs_f64(m, n, k, dtype, device, gen):
    trits = random_trits(n, k, gen)
    trits[3] = 0  # an all-zero row
    tt = TernaryTensor.from_trits(trits, random_scales(n, gen)).to(device)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    bias = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
    with poisoned():
        y = tc.ternary_matmul_tc(x, tt, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    assert compare(f"tc matmul m={m} n={n} k={k}", matmul_dense_ref(x, tt, bias), y, dtype=dtype).ok
    assert bool((y[:, 3] == bias[3]).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_tc_matmul_split_and_whole_k(dtype, device, gen):
    """Split K (fp32 partials + the fixed-order reduction) and one program per tile, x through a tensor
    descriptor (TMA; rows past M and columns past K zero-filled), per-tensor scale, no bias, pre-packed codes."""
    m, n, k = 7, 70, 700
    tt = TernaryTensor.from_trits(random_trits(n, k, gen, sparsity=0.6), torch.tensor([0.7])).to(device)
    codes = tc.pack_tc(tt.plus, tt.minus, k)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    ref = matmul_dense_ref(x, tt)
    for pps, tma in [(0, False), (8, False), (0, True)]:  # pps 0: splits = 1 (the kernel writes y), 8: K split
        with poisoned():
            y = tc.ternary_matmul_tc(x, tt, codes=codes, cfg={"programs_per_sm": pps, "TMA": tma})
        assert compare(f"tc matmul pps={pps} tma={tma}", ref, y, dtype=dtype).ok


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("k", [1100, 300, 1000], ids=["5splits", "3splits", "8splits"])
def test_tc_split_fixup_equals_reduce_launch(dtype, k, device, gen):
    """Split K summed by the tiles' last-arriving programs (FIXUP 1, the eager default; partials read four at a
    time, FIX4, or one at a time) against the separate reduce launch (FIXUP 0, the default under CUDA-graph
    capture: every partial loaded at once, 256 elements per program; and the former loop over the partials, 1024
    per program): the same order of the same fp32 partials, so the same bits, with split counts below, above and
    at multiples of four; right against float64 over several calls (each launch re-arms the arrival counters:
    they are zero after it), with a bias, at 2 x tiles."""
    m, n = 20, 70  # BLOCK_M 32: 1 x tile; 2 weight tiles of 64 rows; 8 words per 128 columns: one step each
    tt = TernaryTensor.from_trits(random_trits(n, k, gen), random_scales(n, gen)).to(device)
    codes = tc.pack_tc(tt.plus, tt.minus, k)
    base = {"programs_per_sm": 64, "BLOCKS_K": 1}
    assert tc._fixup_in_kernel(torch.zeros(1, device=device))  # eager: one launch
    for call in range(3):
        x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
        bias = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
        with poisoned():
            y_fix = tc.ternary_matmul_tc(x, tt, bias, codes=codes, cfg=dict(base, FIX4=1))
            y_fix1 = tc.ternary_matmul_tc(x, tt, bias, codes=codes, cfg=dict(base, FIX4=0, FIXUP=1))
            y_red = tc.ternary_matmul_tc(x, tt, bias, codes=codes, cfg=dict(base, FIXUP=0))
            y_red_loop = tc.ternary_matmul_tc(x, tt, bias, codes=codes, cfg=dict(base, FIXUP=0, RED=(1024, False, False)))
        assert compare(f"tc matmul split fixup call {call}", matmul_dense_ref(x, tt, bias), y_fix, dtype=dtype).ok
        assert torch.equal(y_fix, y_red), (y_fix - y_red).abs().max()
        assert torch.equal(y_fix1, y_red), (y_fix1 - y_red).abs().max()
        assert torch.equal(y_red_loop, y_red), (y_red_loop - y_red).abs().max()
        cnt = tc.split_counters(torch.device(device), 1)
        assert int(cnt.abs().sum()) == 0


@pytest.mark.gpu
def test_graph_capture_sums_splits_in_a_second_launch(gen):
    """Under CUDA-graph capture a split-K product sums its partials in a second launch (the reduce kernel, a
    programmatic dependent of the first); replayed, it gives the eager call's bits (the in-kernel fix-up), at
    M = 1 (x by pointer loads) and M = 16, on fresh x each replay."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from triforge import launch

    for m, n, k in [(1, 896, 4864), (16, 4864, 896)]:
        tt = TernaryTensor.from_trits(random_trits(n, k, gen), random_scales(n, gen)).to("cuda").compact()
        codes = tt.tc_codes()
        x = torch.randn(m, k, generator=gen).to(device="cuda", dtype=torch.bfloat16)
        assert tc._tc_plan(m, n, k, codes.shape[1])[12][2] > 1  # K is split at this shape
        tc.ternary_matmul_tc(x, tt, codes=codes, cfg={"FIXUP": 0})  # compiled before capture
        tc.ternary_matmul_tc(x, tt, codes=codes)
        launch._compiled.pop("ternary_gemv_reduce", None)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = tc.ternary_matmul_tc(x, tt, codes=codes)
        assert "ternary_gemv_reduce" in launch._compiled  # the second launch was captured
        for _ in range(3):
            x.copy_(torch.randn(m, k, generator=gen).to(torch.bfloat16))
            y.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            y_eager = tc.ternary_matmul_tc(x, tt, codes=codes)
            assert torch.equal(y, y_eager), (m, n, k)
            assert compare(f"graph m={m}", matmul_dense_ref(x, tt), y, dtype=torch.bfloat16).ok


@pytest.mark.parametrize("cfg", [{"BLOCKS_K": 2}, {"ROW_REPS": 2}, {"num_warps": 8, "BLOCK_M": 32},
                                 {"PREFETCH": 2}, {"PREFETCH": 3, "programs_per_sm": 4},
                                 {"PREFETCH": 3, "BLOCKS_K": 2}, {"XPRE": 1}, {"XPRE": 1, "PREFETCH": 2},
                                 {"XPRE": 1, "PREFETCH": 3, "programs_per_sm": 4},
                                 {"TR": 128, "BLOCKS_K": 2, "programs_per_sm": 4}, {"TR": 32, "ROW_REPS": 2},
                                 {"TR": 64, "XPRE": 1, "programs_per_sm": 4},
                                 {"PDL": True, "XPRE": 1, "PREFETCH": 2, "programs_per_sm": 4}, {"PDL": True}],
                         ids=["blocks_k2", "row_reps2", "warps8", "prefetch2", "prefetch3_split", "prefetch3_k2",
                              "xpre", "xpre_prefetch2", "xpre_prefetch3_split", "tile128_k2_split", "tile32_row_reps2",
                              "tile64_xpre_split", "pdl_xpre_split", "pdl"])
def test_tc_matmul_configs(cfg, device, gen):
    """The GPU configs' shapes of the kernel (256-column steps with a partial last step, 128-row blocks,
    words loaded 2 and 3 steps ahead, also past a split's end) under the interpreter."""
    m, n, k = 9, 150, 700  # 48 code words per row: 3 steps of 16 words
    tt = TernaryTensor.from_trits(random_trits(n, k, gen), random_scales(n, gen)).to(device)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.float16)
    with poisoned():
        y = tc.ternary_matmul_tc(x, tt, cfg=cfg)
    assert compare(f"tc matmul {cfg}", matmul_dense_ref(x, tt), y, dtype=torch.float16).ok


@pytest.mark.parametrize("m,k,cfg,taken", [
    (1, 1400, {"WTMA": 1, "ROW_REPS": 2, "XPRE": 1, "num_stages": 3, "programs_per_sm": 2}, True),
    (9, 830, {"WTMA": 1, "BLOCKS_K": 2, "num_stages": 4}, True),
    (9, 1400, {"WTMA": 1, "num_stages": 2, "programs_per_sm": 2}, True),
    (9, 1400, {"WTMA": 1, "TMA": 1, "num_stages": 3, "programs_per_sm": 2}, True),
    (1, 100, {"WTMA": 1, "XPRE": 1}, True),
    (9, 830, {"WTMA": 1, "BLOCKS_K": 4}, False),
    (9, 830, {"WTMA": 1, "TR": 32}, False)],
    ids=["m1_xpre_splits_3332", "k2_odd_blocks", "splits_65", "x_by_tma", "one_block", "blocks_k4_falls_back",
         "tile32_falls_back"])
def test_tc_matmul_words_by_tma(m, k, cfg, taken, monkeypatch, device, gen):
    """The code words through a tensor descriptor (WTMA: [row tiles, KC 16 words] boxes, pipelined over num_stages):
    rows past N (150: the last 16-row tile half full, the last 128-row box past the tensor) and 128-column blocks
    past K (7 blocks at 256-column steps) read as zero words there; splits of several steps, the last one shorter;
    x by pointers one step ahead or through its own descriptor. The kernel must take the path (the launch says
    WTMA), except where a box row would pass 256 words (BLOCKS_K 4) or the tiles are not 16 rows: there the register
    loads run. The same bits as the register loads of the same config, and right against float64."""
    from triforge import launch

    n = 150
    tt = TernaryTensor.from_trits(random_trits(n, k, gen), random_scales(n, gen)).to(device)
    tr = cfg.get("TR", tc.TILE_ROWS)
    codes = tc.pack_tc(tt.plus, tt.minus, k, tr)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
    seen = []
    real = launch.launch

    def spy(name, *args, **kwargs):
        if name == "ternary_tc":
            seen.append(kwargs["WTMA"])
        return real(name, *args, **kwargs)

    monkeypatch.setattr(launch, "launch", spy)
    with poisoned():
        y = tc.ternary_matmul_tc(x, tt, codes=codes, cfg=cfg)
        y_regs = tc.ternary_matmul_tc(x, tt, codes=codes, cfg=dict(cfg, WTMA=0))
    assert seen == [taken, False]
    assert compare(f"tc matmul {cfg}", matmul_dense_ref(x, tt), y, dtype=torch.bfloat16).ok
    assert torch.equal(y, y_regs), (y - y_regs).abs().max()


def test_pdl_rule(monkeypatch, device, gen):
    """A launch is a programmatic dependent one (its first code words read before griddepcontrol.wait) only
    on codes an earlier launch read and nothing wrote since: not on fresh codes, not right after modify_dim
    (an in-place write the previous kernel may still be doing), never with TRIFORGE_TERNARY_PDL=0."""
    monkeypatch.setattr(tc.launch, "pdl_supported", lambda: True)
    tt = TernaryTensor.from_trits(random_trits(20, 100, gen), random_scales(20, gen)).to(device).compact()
    codes = tt.tc_codes()
    assert [tc._settled(codes) for _ in range(3)] == [False, True, True]
    tt.modify_dim(3, 7, -1)  # in place on the codes
    assert tt.tc_codes() is codes
    assert [tc._settled(codes) for _ in range(2)] == [False, True]
    codes.copy_(codes.clone())  # any in-place write
    assert tc._settled(codes) is False
    assert tc._settled(tc.pack_tc(tt.plus, tt.minus, 100)) is False  # fresh codes
    monkeypatch.setenv(tc.PDL_ENV, "0")
    assert tc._settled(codes) is False
    monkeypatch.setattr(tc.launch, "pdl_supported", lambda: False)
    monkeypatch.setenv(tc.PDL_ENV, "1")
    assert tc._settled(codes) is False


@pytest.mark.gpu
def test_pdl_chain_reads_its_predecessors_output(device, gen):
    """Compiled with PDL, each launch reading the previous launch's output: x is only read after the wait, so
    every link equals the float64 product of its own input (a read before the wait would see a stale y)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n = 1024
    tt = TernaryTensor.from_trits(random_trits(n, n, gen), torch.full((n,), 1.0 / 32)).to("cuda").compact()
    codes = tt.tc_codes()
    x = torch.randn(16, n, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    for cfg in ({"XPRE": 1, "PREFETCH": 2}, {}):
        tc._settled(codes)
        ins, outs = [x], []
        for _ in range(12):
            outs.append(tc.ternary_matmul_tc(ins[-1], tt, codes=codes, cfg=dict(cfg, PDL=True)))
            ins.append(outs[-1])
        torch.cuda.synchronize()
        for i, (a, y) in enumerate(zip(ins, outs)):
            assert compare(f"pdl chain {cfg} link {i}", matmul_dense_ref(a, tt), y, dtype=torch.bfloat16).ok


def test_tc_matmul_bad_input(device, gen):
    tt = TernaryTensor.from_trits(random_trits(8, 40, gen), torch.ones(8)).to(device)
    with pytest.raises(TypeError, match="fp16 or bf16"):
        tc.ternary_matmul_tc(torch.randn(2, 40, device=device), tt)
    with pytest.raises(ValueError, match="columns"):
        tc.ternary_matmul_tc(torch.randn(2, 41, device=device).half(), tt)


def test_matmul_dispatch_tc(monkeypatch, device, gen):
    """ternary.matmul's fp16/bf16 calls (any M) go to the tensor-core kernel on the cached codes (switch
    unset, or 1); an edit through modify_dim drops the cache; tensors with an all-zero chunk, fp32
    activations and TRIFORGE_TERNARY_TC=0 keep the plane kernels; another value is an error naming it."""
    from triforge.ops import ternary as T

    calls = []
    real = tc.ternary_matmul_tc
    monkeypatch.setattr(tc, "ternary_matmul_tc", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    n, k = 40, 300
    trits = random_trits(n, k, gen)
    trits[trits == 0] = 1  # no all-zero chunk anywhere
    tt = TernaryTensor.from_trits(trits, random_scales(n, gen)).to(device)
    x = torch.randn(3, 2, k, generator=gen).to(device=device, dtype=torch.bfloat16)
    monkeypatch.delenv(T.TC_ENV, raising=False)
    with poisoned():
        y = T.matmul(x, tt)
    assert calls == [(6, k)] and y.shape == (3, 2, n)
    assert compare("dispatch tc", matmul_dense_ref(x, tt), y, dtype=torch.bfloat16).ok
    codes = tt.tc_codes()
    assert tt.tc_codes() is codes  # cached
    tt.modify_dim(5, 7, -int(trits[5, 7]))
    assert torch.equal(tc.unpack_tc(tt.tc_codes(), k)[:n], tt.trits())  # re-packed after the edit
    monkeypatch.setenv(T.TC_ENV, "1")
    assert compare("dispatch tc after edit", matmul_dense_ref(x, tt), T.matmul(x, tt), dtype=torch.bfloat16).ok
    assert len(calls) == 2
    calls.clear()
    T.matmul(x.float(), tt)  # fp32 activations: plane kernels
    sparse = TernaryTensor.from_trits(torch.zeros(n, k, dtype=torch.int8), random_scales(n, gen)).to(device)
    T.matmul(x, sparse)  # all-zero chunks: plane kernels (they skip them)
    monkeypatch.setenv(T.TC_ENV, "0")
    T.matmul(x, tt)
    assert calls == []
    monkeypatch.setenv(T.TC_ENV, "yes")
    with pytest.raises(ValueError, match="TRIFORGE_TERNARY_TC"):
        T.matmul(x, tt)


# ----------------------------------------------------------------------------- the asm decode, emulated


def _constants(is_bf16: bool):
    """(sh, j, mask, c, d) [4, 2] int32 as the kernel computes them (run by the interpreter)."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(out_ptr, magic, IS_BF16: tl.constexpr):
        sh, j, mask, c, d = tc._decode_constants(magic, IS_BF16)
        o = tl.arange(0, 4)[:, None] * 2 + tl.arange(0, 2)[None, :]
        tl.store(out_ptr + o, sh)
        tl.store(out_ptr + 8 + o, j)
        tl.store(out_ptr + 16 + o, mask)
        tl.store(out_ptr + 24 + o, c)
        tl.store(out_ptr + 32 + o, d)

    out = torch.zeros(40, dtype=torch.int32)
    k[(1,)](out, tc.MAGIC_BF16 if is_bf16 else tc.MAGIC_F16, IS_BF16=is_bf16)
    return [out[8 * q: 8 * q + 8].view(4, 2) for q in range(5)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_asm_decode_constants_emulated(dtype, gen):
    """The compiled path decodes a field pair as sub16x2(lop3(src, mask, c, 0xEA), d) (the inline asm of
    ``tc._decode_asm``; the interpreter cannot run it): emulated here in torch with the kernel's own
    constants, for every field and code, it gives the trits the plain decode (and pack_tc) gives."""
    from triforge import _runtime

    if not _runtime.INTERPRET:
        pytest.skip("reads the constants through the interpreter")
    sh, j, mask, c, d = _constants(dtype == torch.bfloat16)
    codes = torch.randint(0, 3, (4096, 16), generator=gen, dtype=torch.int64)  # trit + 1 (code 3 is unused)
    codes[:3] = torch.arange(3)[:, None]  # all 0, all 1, all 2
    words = (codes << (2 * torch.arange(8).repeat(2) + 16 * torch.arange(2).repeat_interleave(8))).sum(1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    for kb2 in range(4):
        for h in range(2):
            i = 2 * kb2 + h
            src = words >> int(sh[kb2, h])  # arithmetic shift, as the kernel's
            p = (src & int(mask[kb2, h])) | int(c[kb2, h])  # lop3 0xEA: (a & b) | c
            pair = p.view(dtype).view(-1, 2) - torch.tensor([int(d[kb2, h])], dtype=torch.int32).view(dtype)
            lo, hi = codes[:, i] - 1, codes[:, 8 + i] - 1
            assert torch.equal(pair[:, 0].float(), lo.float()), (dtype, i)
            assert torch.equal(pair[:, 1].float(), hi.float()), (dtype, i)
            # the plain decode reads the same bits
            assert torch.equal((((src >> int(j[kb2, h])) & 3) - 1).long(), lo)


# ----------------------------------------------------------------------------- compiled for sm90 (no GPU needed)


def _tc_sm90_cases():
    """The prototype as the H100 would build it at N = K = 8192 with its fallback configs, M = 16, 64, 256
    (x tiles of 16, 64 and 128 rows)."""
    cases = []
    for m, dt, extra in [(16, "fp16", {}), (16, "bf16", {}), (64, "fp16", {}), (256, "fp16", {}), (256, "bf16", {}),
                         (16, "bf16", {"PREFETCH": 3}),
                         (16, "fp16", {"PREFETCH": 2, "XPRE": 1}),
                         (16, "bf16", {"PREFETCH": 2, "XPRE": 1, "PDL": True}), (64, "bf16", {"PDL": True})]:
        cfg = dict(tc.tc_fallback_config(m, 8192, 8192, interpreter=False), **extra)
        x = f"*{dt}"
        cases.append({
            "kernel": "triforge.ops.ternary.tc:ternary_tc_kernel",
            "signature": {"x_ptr": x, "codes_ptr": "*i32", "scale_ptr": "*fp32", "bias_ptr": x, "y_ptr": x,
                          "part_ptr": "*fp32", "cnt_ptr": "*i32"},
            "constexprs": dict(BLOCK_M=cfg["BLOCK_M"], ROW_REPS=cfg["ROW_REPS"], BLOCKS_K=cfg["BLOCKS_K"],
                               WARPS=cfg["num_warps"], IS_BF16=dt == "bf16", USE_ASM=True, TMA=not cfg.get("XPRE", 0), FINAL=False,
                               PREFETCH=cfg.get("PREFETCH", 1), XPRE=bool(cfg.get("XPRE", 0)),
                               FIXUP=m <= 64, FIX4=True, HAS_BIAS=True, RNE=False, TR=tc.TILE_ROWS,
                               PDL=bool(cfg.get("PDL", False))),
            "divisible": ["x_ptr", "codes_ptr", "scale_ptr", "bias_ptr", "y_ptr", "part_ptr", "cnt_ptr", "magic", "M",
                          "N", "K", "KC"],
            "options": {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
            "m": m,
        })
    return cases


def k_loop(loops):
    """The K loop: the innermost loop that holds both the tensor-core MMAs and the decode's HADD2s."""
    ks = [lp for lp in loops if any(op.startswith("HGMMA") for op in lp) and any(op.startswith("HADD2") for op in lp)]
    assert ks, loops
    return min(ks, key=lambda c: sum(c.values()))


def total_ok(loop, weights, per_weight):
    return sum(loop.values()) <= per_weight * weights


def test_tc_kernel_compiles_for_sm90():
    """Compiled for sm90a with TMA (the fallback configs at N = K = 8192): no spills or local memory; the
    decoded tile is the wgmma register operand as it is (no shared-memory round trip of the weights, no
    ldmatrix); per weight in the K loop 1/2 LOP3 and 1/2 HADD2 (one each per register pair), one SHF per
    word per shift (fp16 1, bf16 2), no int-to-float conversion; the whole K loop (loads, TMA and wgmma
    bookkeeping included) within 2.25 instructions per weight per thread unpipelined, 3.5 pipelined
    (the old tile kernel: ~11.4 per weight and per 64-row M tile); ptxas does not serialize the wgmma.
    """
    from ...sm90 import compile_for_sm90

    cases = _tc_sm90_cases()
    rows = compile_for_sm90([{k: v for k, v in c.items() if k != "m"} for c in cases])
    for case, r in zip(cases, rows):  # print every case before any assertion
        cx, warps = case["constexprs"], case["options"]["num_warps"]
        loop = k_loop(r["loops"])
        weights = 16 * warps * cx["ROW_REPS"] * 128 * cx["BLOCKS_K"] // (32 * warps)  # per thread per step
        total = sum(loop.values())
        print(f"M={case['m']} {'bf16' if cx['IS_BF16'] else 'fp16'} BLOCK_M={cx['BLOCK_M']} warps={warps} "
              f"stages={case['options']['num_stages']}: regs={r['regs']} spill={r['spill_bytes']} shared={r['shared']} "
              f"K loop {total} instructions / {weights} weights = {total / weights:.2f} per weight; "
              f"{sorted(loop.items(), key=lambda kv: -kv[1])[:12]}")
    for case, r in zip(cases, rows):
        cx, warps = case["constexprs"], case["options"]["num_warps"]
        assert r["spill_bytes"] == 0 and not any(op.startswith(("LDL", "STL")) for op in r["sass"]), (cx, r)
        assert r["serialized"] == "", (cx, r["serialized"])  # ptxas keeps the wgmma pipeline asynchronous
        loop = k_loop(r["loops"])
        weights = 16 * warps * cx["ROW_REPS"] * 128 * cx["BLOCKS_K"] // (32 * warps)  # per thread per step
        words = weights // 16
        hadd = "HADD2.BF16_V2" if cx["IS_BF16"] else "HADD2"
        if cx["XPRE"]:  # x by registers into shared (PRMT + STS): the decode's counts hold, the totals do not
            assert loop.get(hadd, 0) == weights // 2 and total_ok(loop, weights, 2.5), loop
            continue
        total = sum(loop.values())
        assert loop.get(hadd, 0) == weights // 2, loop
        assert weights // 2 <= loop["LOP3.LUT"] <= weights // 2 + 2, loop
        shf = sum(n for op, n in loop.items() if op.startswith("SHF"))
        # one SHF per word and shift of the decode; at most one more per step in the address arithmetic of the
        # tiled codes (the step's offset in tiles)
        assert words * (2 if cx["IS_BF16"] else 1) <= shf <= words * (2 if cx["IS_BF16"] else 1) + 1, loop
        assert not any(op.startswith(("I2F", "F2F", "I2FP", "PRMT", "LDSM")) for op in loop), loop
        if cx["TMA"]:  # x arrives by TMA, weights stay in registers
            assert not any(op.startswith("STS") for op in loop), loop
        assert total <= (2.25 if case["options"]["num_stages"] == 1 else 3.5) * weights, loop


@pytest.mark.parametrize("kernel", ["ternary_tc", "ternary_gemv"])
def test_the_tunes_time_over_copies_of_the_weights_that_compute_the_same(kernel, monkeypatch, device):
    """The ternary tunes rotate their timed calls over copies of x and the weights (tune.rotating; on a GPU as many
    as exceed the L2 four times): every copy is its own storage and gives set 0's output bit for bit, and the timed
    launch reads its x from the set it is given (x doubled there doubles y exactly)."""
    from triforge import tune

    built = {}
    rotating = tune.rotating

    def record(run_on, sets):
        built["run_on"], built["sets"] = run_on, sets
        return rotating(run_on, sets)

    monkeypatch.setattr(tune, "rotation_sets", lambda nbytes, dev: 3)
    monkeypatch.setattr(tune, "rotating", record)
    t = tune.get(kernel)
    assert t.graph
    run, _ = t.setup({"M": 2, "N": 40, "K": 200}, torch.float16, torch.device(device))
    sets = built["sets"]
    assert run.n_sets == len(sets) == 3
    assert all(len({s[i].data_ptr() for s in sets}) == 3 for i in range(len(sets[0])))  # every tensor copied
    assert all(torch.equal(a, b) for s in sets[1:] for a, b in zip(s, sets[0]))
    want = run(None)
    assert torch.isfinite(want).all() and want.abs().sum() > 0
    for _ in range(3):
        torch.testing.assert_close(run.timed(None), want, rtol=0, atol=0)
    doubled = (2 * sets[1][0],) + tuple(sets[1][1:])
    torch.testing.assert_close(built["run_on"](doubled, None), 2 * want, rtol=0, atol=0)
