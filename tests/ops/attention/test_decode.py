"""KV-cache decode (``flash_attn_with_kvcache``, flash-decoding split + merge kernels) against the
float64 golden reference ``kvcache_attention_ref``: o and lse, the in-place cache append (bitwise),
GQA, Sq > 1 with bottom-right causal alignment, forced split counts (1, 2, more splits than key
blocks: empty splits), decode equal to full attention over the cached prefix, step-by-step decoding,
the registered op through ``check_op``, torch.compile, opcheck, and input validation.

Every kernel call runs under ``poisoned()``: o, lse and the split partials start as NaN, so an element
the kernels never write (or a merge that reads an empty split's partial output) fails the comparison.
Under the interpreter the split kernel uses 16-key blocks, so caches of 40-80 rows run multi-block
loops, partial blocks and splits past the end of short rows.
"""

import pytest
import torch

import triforge  # noqa: F401  (sets TRITON_INTERPRET before triton kernels are defined)
from triforge import registry
from triforge.check import check_op
from triforge.launch import poisoned
from triforge.ops.attention import decode
from triforge.ops.attention.decode import choose_num_splits, flash_attn_with_kvcache, sdpa_decode
from triforge.ops.attention.reference import attention_ref, kvcache_attention_ref
from triforge.testing import compare

DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


# ----------------------------------------------------------------------------- helpers


def _randn(shape, dtype, gen, scale=1.0):
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)


def _inputs(gen, *, B=3, Sq=1, H=4, Hkv=2, D=64, S=48, Sn=1, dtype=torch.float16, seqlens=None, q_scale=1.0,
            device="cpu"):
    """Random q, caches (random past the lengths too), new k/v (Sn > 0) and int32 lengths: drawn on
    the CPU from ``gen`` (reproducible on any machine), then moved to ``device``."""
    q = _randn((B, Sq, H, D), dtype, gen, q_scale)
    kc = _randn((B, S, Hkv, D), dtype, gen)
    vc = _randn((B, S, Hkv, D), dtype, gen)
    k = _randn((B, Sn, Hkv, D), dtype, gen) if Sn else None
    v = _randn((B, Sn, Hkv, D), dtype, gen) if Sn else None
    if seqlens is None:
        seqlens = torch.randint(0, S - Sn + 1, (B,), generator=gen)
    seqlens = torch.as_tensor(seqlens, dtype=torch.int32)
    return tuple(None if t is None else t.to(device) for t in (q, kc, vc, seqlens, k, v))


def _to(t, device):
    """``t`` on ``device`` with its strides kept (``Tensor.to`` would make a non-dense view contiguous)."""
    if not isinstance(t, torch.Tensor) or t.device.type == torch.device(device).type:
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return out.copy_(t)


def _d(t):
    return None if t is None else t.to(torch.float64)


def _assert_ok(res):
    assert res.ok, res.line()


def _run_and_check(q, kc, vc, seqlens, k, v, *, causal=True, num_splits=0, softmax_scale=None):
    """Kernel (poisoned outputs) vs the float64 reference: o, lse, and the caches bitwise."""
    dtype = q.dtype
    ref, ref_kc, ref_vc = kvcache_attention_ref(_d(q), _d(kc), _d(vc), seqlens, _d(k), _d(v), causal, softmax_scale)
    kc0, vc0 = kc.clone(), vc.clone()
    with poisoned():
        o, lse = flash_attn_with_kvcache(q, kc, vc, seqlens, k, v, causal=causal, softmax_scale=softmax_scale,
                                         return_lse=True, num_splits=num_splits)
    assert o.shape == q.shape and o.dtype == dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    _assert_ok(compare("lse", ref["lse"], lse, dtype=dtype, verbose=False))
    _assert_ok(compare("o", ref["o"], o, dtype=dtype, verbose=False))
    # the append writes exactly the new rows, bit for bit, and nothing else
    exp_kc, exp_vc = kc0.clone(), vc0.clone()
    if k is not None:
        for b in range(q.shape[0]):
            n = int(seqlens[b])
            exp_kc[b, n : n + k.shape[1]] = k[b]
            exp_vc[b, n : n + k.shape[1]] = v[b]
    assert torch.equal(kc, exp_kc) and torch.equal(vc, exp_vc)
    assert torch.equal(kc, ref_kc.to(dtype)) and torch.equal(vc, ref_vc.to(dtype))
    return o, lse


def _lengths(gen, B, S, Sn, Sq):
    """Row lengths covering 1 and the fullest cache S - Sn, the rest random."""
    lens = [1, S - Sn] + torch.randint(1, S - Sn + 1, (max(0, B - 2),), generator=gen).tolist()
    return lens[:B]


# ----------------------------------------------------------------------------- parity


def _cases():
    """(dtype, D, G, Sq, Sn, num_splits): each value of every factor appears with each dtype, and
    every G with Sq 1 and 3, with and without new k/v (a covering design, not the full grid)."""
    rows = [
        # dtype, D, G, Sq, Sn, splits
        (torch.float16, 64, 1, 1, 1, 1),
        (torch.float16, 128, 2, 1, 0, 2),
        (torch.float16, 64, 4, 3, 3, 0),
        (torch.float16, 128, 1, 3, 0, 9),
        (torch.float16, 64, 2, 3, 1, 2),
        (torch.float16, 128, 4, 1, 2, 9),
        (torch.bfloat16, 128, 1, 1, 1, 0),
        (torch.bfloat16, 64, 2, 1, 0, 9),
        (torch.bfloat16, 128, 4, 3, 3, 1),
        (torch.bfloat16, 64, 1, 3, 0, 2),
        (torch.bfloat16, 128, 2, 3, 3, 9),
        (torch.bfloat16, 64, 4, 1, 0, 1),
    ]
    return [
        pytest.param(dt, D, G, Sq, Sn, ns, id=f"{DTYPE_IDS[dt]}-D{D}-G{G}-Sq{Sq}-Sn{Sn}-splits{ns}")
        for dt, D, G, Sq, Sn, ns in rows
    ]


@pytest.mark.parametrize("dtype,D,G,Sq,Sn,num_splits", _cases())
def test_matches_reference(dtype, D, G, Sq, Sn, num_splits, gen, device):
    """S = 40 rows: 3 key blocks of 16 at most, so 9 splits leave most splits empty; row lengths
    include 1 and S - Sn (a full cache after the append)."""
    B, S, Hkv = 3, 40, 2
    seqlens = _lengths(gen, B, S, Sn, Sq)
    _run_and_check(*_inputs(gen, B=B, Sq=Sq, H=G * Hkv, Hkv=Hkv, D=D, S=S, Sn=Sn, dtype=dtype, seqlens=seqlens,
                            device=device), num_splits=num_splits)


def test_fp32(gen, device):
    _run_and_check(*_inputs(gen, B=2, Sq=2, H=4, Hkv=2, D=64, S=40, Sn=2, dtype=torch.float32, device=device),
                   num_splits=3)


@pytest.mark.parametrize("num_splits", [1, 2], ids=["direct", "split2"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_sq_gt_new_tokens(causal, num_splits, gen, device):
    """Sq = 4 queries, 1 new token: the first queries stop causally inside the cached keys; one row
    has fewer keys than queries (queries that see nothing: o = 0, lse = -inf). One split: the split
    kernel normalises and writes o and lse itself (no merge)."""
    inputs = _inputs(gen, B=3, Sq=4, H=4, Hkv=2, D=64, S=40, Sn=1, dtype=torch.float16, seqlens=[1, 20, 39],
                     device=device)
    o, lse = _run_and_check(*inputs, causal=causal, num_splits=num_splits)
    if causal:
        # row 0: 2 keys, 4 queries: queries 0 and 1 see no key
        assert torch.isneginf(lse[0, :, :2]).all() and (o[0, :2] == 0).all()
        assert torch.isfinite(lse[0, :, 2:]).all()


@pytest.mark.parametrize("num_splits", [1, 3], ids=["direct", "split3"])
def test_empty_rows_without_new_tokens(num_splits, gen, device):
    """A row with cache_seqlens 0 and no new k/v attends to nothing: o = 0, lse = -inf, no NaN.
    (kvcache_attention_ref cannot take a row with zero keys: amax over an empty dim; the non-empty
    row is checked against it, the empty rows against the documented 0 / -inf.)"""
    q, kc, vc, sl, _, _ = _inputs(gen, B=3, Sq=1, H=4, Hkv=1, D=64, S=40, Sn=0, dtype=torch.bfloat16,
                                  seqlens=[0, 17, 0], device=device)
    with poisoned():
        o, lse = flash_attn_with_kvcache(q, kc, vc, sl, return_lse=True, num_splits=num_splits)
    assert (o[0] == 0).all() and (o[2] == 0).all() and torch.isneginf(lse[[0, 2]]).all()
    ref, _, _ = kvcache_attention_ref(_d(q[1:2]), _d(kc[1:2]), _d(vc[1:2]), sl[1:2])
    _assert_ok(compare("lse", ref["lse"], lse[1:2], dtype=q.dtype, verbose=False))
    _assert_ok(compare("o", ref["o"], o[1:2], dtype=q.dtype, verbose=False))


def test_only_new_tokens(gen, device):
    """cache_seqlens 0 with new k/v: the new tokens are the whole context (split 0 alone sees keys)."""
    _run_and_check(*_inputs(gen, B=2, Sq=3, H=8, Hkv=2, D=128, S=40, Sn=3, dtype=torch.float16, seqlens=[0, 0],
                            device=device), num_splits=4)


def test_many_new_tokens(gen, device):
    """Sn = 20 new tokens: more than one 16-row block of new keys, appended and attended."""
    _run_and_check(*_inputs(gen, B=2, Sq=2, H=2, Hkv=2, D=64, S=48, Sn=20, dtype=torch.float16, seqlens=[5, 28],
                            device=device), num_splits=2)


@pytest.mark.parametrize("num_splits", [3, 7], ids=["split3", "split7"])
def test_new_tokens_across_split_boundaries(num_splits, gen, device):
    """The splits cut cached and new keys alike (16-key blocks here): row 0 (25 cached + 20 new) has its new tokens
    in two splits, row 1 (40 + 20) in one, with the last split empty, which still writes them into the caches."""
    _run_and_check(*_inputs(gen, B=2, Sq=2, H=4, Hkv=2, D=64, S=80, Sn=20, dtype=torch.bfloat16, seqlens=[25, 40],
                            device=device), num_splits=num_splits)


def test_merge_blocks():
    """All splits in one trip when they fit the tile, head-dim columns as many as fit (a power of two dividing D,
    16 at least); more splits than the tile holds take several trips."""
    for splits, D, tile, want in [(8, 128, 4096, (8, 128)), (66, 128, 4096, (128, 32)), (256, 64, 4096, (256, 16)),
                                  (1, 64, 4096, (1, 64)), (40, 64, 64, (4, 16)), (3, 128, 64, (4, 16))]:
        bs, bd = decode.merge_blocks(splits, D, tile)
        assert (bs, bd) == want, (splits, D, tile)
        assert D % bd == 0 and bs & (bs - 1) == 0


def test_many_query_rows(gen, device):
    """G * Sq = 8 * 9 = 72 query rows per kv head: two row blocks (64 rows a tile) share each split,
    and only the first writes the new rows."""
    _run_and_check(*_inputs(gen, B=2, Sq=9, H=16, Hkv=2, D=64, S=40, Sn=9, dtype=torch.float16, seqlens=[0, 31],
                            device=device), num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["direct", "split3"])
def test_large_scores_stay_finite(num_splits, gen, device):
    """|q.k| * scale ~ 1e4 (lse in the thousands): the online max and the merge keep everything finite and right."""
    q, kc, vc, sl, k, v = _inputs(gen, B=2, Sq=1, H=4, Hkv=2, D=64, S=40, Sn=1, dtype=torch.float16, q_scale=3000.0,
                                  device=device)
    o, lse = _run_and_check(q, kc, vc, sl, k, v, num_splits=num_splits)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all() and lse.abs().max() > 1e3


def test_softmax_scale_and_python_int_lengths(gen, device):
    q, kc, vc, _, k, v = _inputs(gen, B=2, Sq=2, H=4, Hkv=2, D=64, S=40, Sn=2, dtype=torch.float16, device=device)
    _run_and_check(q, kc, vc, torch.full((2,), 23, dtype=torch.int32, device=device), k, v, softmax_scale=0.3,
                   num_splits=2)
    # a Python int means the same length for every row
    q, kc, vc, _, k, v = _inputs(gen, B=2, Sq=2, H=4, Hkv=2, D=64, S=40, Sn=2, dtype=torch.float16, device=device)
    ref, _, _ = kvcache_attention_ref(_d(q), _d(kc), _d(vc), [23, 23], _d(k), _d(v), True, 0.3)
    with poisoned():
        o = flash_attn_with_kvcache(q, kc, vc, 23, k, v, softmax_scale=0.3)
    _assert_ok(compare("o", ref["o"], o, dtype=q.dtype, verbose=False))


def test_lengths_checked_once_per_call(gen, device, monkeypatch):
    """A tensor cache_seqlens is read on the host once per eager call (the wrapper's check; the op then skips its
    own), once when the op is called directly, once under a tracer (the op's own check, so a traced graph checks
    every replay), never with check_lengths=False or a Python int (checked on the host); the answer is the same."""
    from triforge import launch
    from triforge.ops.attention import decode

    calls = []
    real = decode._check_lengths
    monkeypatch.setattr(decode, "_check_lengths", lambda *a: calls.append(1) or real(*a))
    q, kc, vc, _, k, v = _inputs(gen, B=2, Sq=1, H=4, Hkv=2, D=64, S=40, Sn=1, device=device)
    sl = torch.full((2,), 23, dtype=torch.int32, device=device)

    def traced(c):  # as under make_fx or torch.jit.trace: launch.eager says no
        with monkeypatch.context() as m:
            m.setattr(launch, "eager", lambda *a: False)
            return flash_attn_with_kvcache(q, c[0], c[1], sl, k, v)

    outs = []
    for run in (lambda c: flash_attn_with_kvcache(q, c[0], c[1], sl, k, v),
                lambda c: torch.ops.triforge.flash_attn_with_kvcache(q, c[0], c[1], sl, k, v, True, 0.125, 0, True)[0],
                traced,
                lambda c: flash_attn_with_kvcache(q, c[0], c[1], sl, k, v, check_lengths=False),
                lambda c: flash_attn_with_kvcache(q, c[0], c[1], 23, k, v)):
        calls.clear()
        o = run((kc.clone(), vc.clone()))
        outs.append((o, len(calls)))
    assert [n for _, n in outs] == [1, 1, 1, 0, 0]
    assert all(torch.equal(outs[0][0], o) for o, _ in outs[1:])


def test_strided_caches(gen, device):
    """Caches that are views (every other kv head of a larger buffer): strides are honoured and the
    append lands in the underlying buffer."""
    B, S, D = 2, 40, 64
    big_k = _randn((B, S, 4, D), torch.float16, gen).to(device)
    big_v = _randn((B, S, 4, D), torch.float16, gen).to(device)
    kc, vc = big_k[:, :, ::2], big_v[:, :, ::2]  # views of the buffers on the device
    assert not kc.is_contiguous()
    q = _randn((B, 1, 4, D), torch.float16, gen).to(device)
    k, v = _randn((B, 1, 2, D), torch.float16, gen).to(device), _randn((B, 1, 2, D), torch.float16, gen).to(device)
    sl = torch.tensor([7, 39], dtype=torch.int32, device=device)
    untouched_k = big_k[:, :, 1::2].clone()
    _run_and_check(q, kc, vc, sl, k, v, num_splits=2)
    assert torch.equal(big_k[:, :, ::2], kc) and torch.equal(big_k[:, :, 1::2], untouched_k)


def test_deterministic(gen, device):
    q, kc, vc, sl, _, _ = _inputs(gen, B=2, Sq=1, H=8, Hkv=2, D=64, S=48, Sn=0, dtype=torch.bfloat16, device=device)
    o1, l1 = flash_attn_with_kvcache(q, kc, vc, sl, return_lse=True, num_splits=3)
    o2, l2 = flash_attn_with_kvcache(q, kc, vc, sl, return_lse=True, num_splits=3)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


# ----------------------------------------------------------------------------- decode vs full attention


@pytest.mark.parametrize("Sq", [1, 3])
def test_equals_full_attention_over_prefix(Sq, gen, device):
    """No new tokens, every row n keys: decode == attention_ref(q, k_cache[:, :n], v_cache[:, :n])."""
    B, S, n = 2, 48, 37
    q, kc, vc, _, _, _ = _inputs(gen, B=B, Sq=Sq, H=4, Hkv=2, D=64, S=S, Sn=0, dtype=torch.float16, device=device)
    ref = attention_ref(_d(q), _d(kc[:, :n]), _d(vc[:, :n]), causal=True)
    with poisoned():
        o, lse = flash_attn_with_kvcache(q, kc, vc, torch.full((B,), n, dtype=torch.int32, device=device),
                                         causal=True, return_lse=True, num_splits=2)
    _assert_ok(compare("lse", ref["lse"], lse, dtype=q.dtype, verbose=False))
    _assert_ok(compare("o", ref["o"], o, dtype=q.dtype, verbose=False))


def test_decode_steps_equal_full_attention(gen, device):
    """Prompt in the cache, then one token at a time (k/v appended by the kernel): at every step
    each row's output equals attention over its whole sequence so far."""
    B, S, H, Hkv, D, steps = 2, 40, 4, 2, 64, 5
    dtype = torch.float16
    prompt = [6, 17]
    seq_k = _randn((B, S, Hkv, D), dtype, gen).to(device)  # the sequence's keys/values, position by position
    seq_v = _randn((B, S, Hkv, D), dtype, gen).to(device)
    kc = _randn((B, S, Hkv, D), dtype, gen).to(device)  # garbage past the lengths
    vc = _randn((B, S, Hkv, D), dtype, gen).to(device)
    for b, n in enumerate(prompt):
        kc[b, :n], vc[b, :n] = seq_k[b, :n], seq_v[b, :n]
    lens = torch.tensor(prompt, dtype=torch.int32, device=device)
    for _ in range(steps):
        q = _randn((B, 1, H, D), dtype, gen).to(device)
        k_new = torch.stack([seq_k[b, int(lens[b])] for b in range(B)])[:, None]
        v_new = torch.stack([seq_v[b, int(lens[b])] for b in range(B)])[:, None]
        with poisoned():
            o, lse = flash_attn_with_kvcache(q, kc, vc, lens, k_new, v_new, return_lse=True, num_splits=2)
        for b in range(B):
            n = int(lens[b]) + 1
            ref = attention_ref(_d(q[b : b + 1]), _d(seq_k[b : b + 1, :n]), _d(seq_v[b : b + 1, :n]), causal=True)
            _assert_ok(compare("lse", ref["lse"], lse[b : b + 1], dtype=dtype, verbose=False))
            _assert_ok(compare("o", ref["o"], o[b : b + 1], dtype=dtype, verbose=False))
            assert torch.equal(kc[b, :n], seq_k[b, :n]) and torch.equal(vc[b, :n], seq_v[b, :n])
        lens = lens + 1


# ----------------------------------------------------------------------------- split count policy


def test_choose_num_splits():
    # batch-1 decode on a 132-SM H100 at one program per SM: 66 splits of each of 2 kv heads
    s = choose_num_splits(1, 2, 32768, 1, 64, 1, 2, num_sms=132)
    assert s == 66 and 1 * 2 * s <= 132 < 1 * 2 * (s + 1)
    # rounded down: 8 batch rows x 2 kv heads = 16 programs -> 8 splits (128 programs, not 9 x 16 = 144)
    assert choose_num_splits(8, 2, 4096, 1, 64, 1, 2, num_sms=132) == 8
    # big batches need no splitting: 128 programs already (B=64, 2 kv heads), and past one program per SM
    assert choose_num_splits(64, 2, 4096, 1, 64, 1, 2, num_sms=132) == 1
    assert choose_num_splits(512, 8, 4096, 1, 64, 4, 2, num_sms=132) == 1
    # several programs per SM where a config asks for them
    assert choose_num_splits(64, 8, 4096, 1, 64, 4, 2, num_sms=132) == 1
    assert choose_num_splits(8, 2, 4096, 1, 64, 4, 2, num_sms=132) == 32
    # short caches keep min_blocks_per_split blocks a split
    assert choose_num_splits(1, 1, 256, 1, 64, 4, 2, num_sms=132) == 2
    assert choose_num_splits(1, 1, 10, 1, 64, 4, 2, num_sms=132) == 1
    # never past MAX_SPLITS
    assert choose_num_splits(1, 1, 1 << 20, 1, 64, 8, 1, num_sms=132) == decode.MAX_SPLITS


def test_heuristic_split_count_runs(gen, device):
    """num_splits = 0 (heuristic) on a longer cache: several splits under the interpreter's 4 'SMs'."""
    B, S = 1, 80
    assert choose_num_splits(B, 2, S, 1, 16, 4, 1) > 1
    _run_and_check(*_inputs(gen, B=B, Sq=1, H=8, Hkv=2, D=64, S=S, Sn=1, dtype=torch.bfloat16, seqlens=[77],
                            device=device))


# ----------------------------------------------------------------------------- registry, peers, compile


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_registered_op_passes_check(dtype):
    spec = registry.get("flash_decode")
    assert spec.family == "attention_decode" and spec.outputs == ("o",) and spec.grad_inputs == ()
    res = check_op(spec, dtype, tier="tiny", seed=int(torch.randint(0, 2**31, (1,))))
    assert res.ok, (res.error, [r.line() for r in res.results])
    assert [r.name for r in res.results] == ["fwd.lse", "fwd.o"]


def test_registry_shapes_and_models():
    spec = registry.get("flash_decode")
    gen = torch.Generator().manual_seed(1)
    tiny = spec.make_inputs("tiny", torch.float16, "cpu", gen)
    assert tiny["q"].shape == (3, 1, 4, 64) and tiny["k_cache"].shape == (3, 80, 2, 64)
    assert tiny["k"].shape == (3, 1, 2, 64) and tiny["cache_seqlens"].dtype == torch.int32
    assert 1 <= int(tiny["cache_seqlens"].min()) and int(tiny["cache_seqlens"].max()) <= 70
    dims = {"B": 2, "S": 64, "H": 4, "Hkv": 1, "D": 128}
    small = spec.make_inputs(dims, torch.bfloat16, "cpu", gen)
    assert small["q"].shape == (2, 1, 4, 128) and small["k_cache"].shape == (2, 64, 1, 128)
    assert small["cache_seqlens"].tolist() == [63, 63]
    e = 2
    kv = 2 * (2 * 64) * 1 * 128 * e  # every row attends 63 cached + 1 new keys, K and V
    assert spec.bytes(small, "fwd") == kv + 2 * (2 * 1) * 1 * 128 * e + 2 * 2 * 4 * 128 * e
    assert spec.flops(small, "fwd") == 4 * 4 * 1 * 128 * (2 * 64)
    assert "B=2 S=64 H=4 Hkv=1 D=128" in spec.describe(small)
    assert set(spec.peers) == {"sdpa"}
    if not torch.cuda.is_available():
        assert spec.peers["sdpa"](small) is None
    from triforge import tune

    assert "flash_decode_split" in tune.all_tunables()


def test_sdpa_peer_math(gen):
    """The peer's PyTorch decode (used on the GPU) agrees with the reference, appends included."""
    q, kc, vc, sl, k, v = _inputs(gen, B=3, Sq=2, H=4, Hkv=2, D=64, S=40, Sn=2, dtype=torch.float32,
                                  seqlens=[3, 20, 38])
    ref, ref_kc, _ = kvcache_attention_ref(_d(q), _d(kc), _d(vc), sl, _d(k), _d(v), True)
    (o,) = sdpa_decode(q, kc, vc, sl, k, v, causal=True, s_used=40)
    _assert_ok(compare("o", ref["o"], o, dtype=torch.float32, verbose=False))
    assert torch.equal(kc, ref_kc.float())


def test_torch_compile_fullgraph(gen, device):
    """Both custom ops trace in one graph; the in-place append survives functionalization."""
    q, kc, vc, sl, k, v = _inputs(gen, B=2, Sq=1, H=4, Hkv=2, D=64, S=40, Sn=1, dtype=torch.float16,
                                  seqlens=[5, 30], device=device)
    ref, ref_kc, ref_vc = kvcache_attention_ref(_d(q), _d(kc), _d(vc), sl, _d(k), _d(v), True)
    ref_read = kvcache_attention_ref(_d(q), ref_kc, ref_vc, sl + 1, causal=True)[0]

    def step(q, kc, vc, sl, k, v):
        o1 = flash_attn_with_kvcache(q, kc, vc, sl, k, v, num_splits=2)
        o2 = flash_attn_with_kvcache(q, kc, vc, sl + 1, num_splits=2)  # reads the appended rows
        return o1, o2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    o1, o2 = compiled(q, kc, vc, sl, k, v)
    _assert_ok(compare("o_append", ref["o"], o1, dtype=q.dtype, verbose=False))
    _assert_ok(compare("o_read", ref_read["o"], o2, dtype=q.dtype, verbose=False))
    assert torch.equal(kc, ref_kc.to(kc.dtype)) and torch.equal(vc, ref_vc.to(vc.dtype))


def test_custom_ops_pass_opcheck(gen, device):
    q, kc, vc, sl, k, v = _inputs(gen, B=2, Sq=1, H=4, Hkv=2, D=64, S=32, Sn=1, dtype=torch.float16,
                                  seqlens=[3, 20], device=device)
    append = torch.ops.triforge.flash_attn_with_kvcache.default
    torch.library.opcheck(append, (q, kc, vc, sl, k, v, True, 0.125, 2, True))
    torch.library.opcheck(torch.ops.triforge.flash_attn_kvcache.default, (q, kc, vc, sl, True, 0.125, 2, False))


# ----------------------------------------------------------------------------- bad input


def _bad_cases():
    g = torch.Generator().manual_seed(0)

    def t(shape, dtype=torch.float16):
        return torch.randn(shape, generator=g).to(dtype)

    q, kc, vc = t((2, 1, 4, 64)), t((2, 16, 2, 64)), t((2, 16, 2, 64))
    k, v = t((2, 1, 2, 64)), t((2, 1, 2, 64))
    sl = torch.tensor([3, 5], dtype=torch.int32)
    base = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=sl)
    cases = [
        ("q-head-dim-96", dict(base, q=t((2, 1, 4, 96)), k_cache=t((2, 16, 2, 96)), v_cache=t((2, 16, 2, 96))),
         ValueError, "head_dim"),
        ("q-head-dim-32", dict(base, q=t((2, 1, 4, 32)), k_cache=t((2, 16, 2, 32)), v_cache=t((2, 16, 2, 32))),
         ValueError, "head_dim"),
        ("q-float64", dict(base, q=q.double()), TypeError, "q"),
        ("q-int", dict(base, q=torch.ones(2, 1, 4, 64, dtype=torch.int32)), TypeError, "q"),
        ("q-3d", dict(base, q=t((2, 4, 64))), ValueError, "q"),
        ("q-list", dict(base, q=[[1.0]]), TypeError, "q"),
        ("q-empty", dict(base, q=t((2, 0, 4, 64))), ValueError, "q"),
        ("k_cache-empty", dict(base, k_cache=t((2, 0, 2, 64)), v_cache=t((2, 0, 2, 64))), ValueError, "k_cache"),
        ("k_cache-dtype", dict(base, k_cache=kc.bfloat16()), TypeError, "k_cache"),
        ("v_cache-dtype", dict(base, v_cache=vc.float()), TypeError, "v_cache"),
        ("k_cache-batch", dict(base, k_cache=t((3, 16, 2, 64)), v_cache=t((3, 16, 2, 64))), ValueError, "k_cache"),
        ("k_cache-head-dim", dict(base, k_cache=t((2, 16, 2, 128)), v_cache=t((2, 16, 2, 128))), ValueError, "k_cache"),
        ("v_cache-shape", dict(base, v_cache=t((2, 15, 2, 64))), ValueError, "v_cache"),
        ("kv-heads-dont-divide", dict(base, k_cache=t((2, 16, 3, 64)), v_cache=t((2, 16, 3, 64))), ValueError,
         "kv heads"),
        ("k_cache-strided-last-dim", dict(base, k_cache=t((2, 16, 2, 128))[..., ::2]), ValueError, "k_cache"),
        ("k-without-v", dict(base, k=k), ValueError, "k and v"),
        ("v-without-k", dict(base, v=v), ValueError, "k and v"),
        ("k-heads", dict(base, k=t((2, 1, 4, 64)), v=t((2, 1, 4, 64))), ValueError, "k must be"),
        ("k-batch", dict(base, k=t((1, 1, 2, 64)), v=t((1, 1, 2, 64))), ValueError, "k must be"),
        ("k-dtype", dict(base, k=k.bfloat16(), v=v), TypeError, "k must"),
        ("v-dtype", dict(base, k=k, v=v.bfloat16()), TypeError, "v must"),
        ("v-shape", dict(base, k=k, v=t((2, 2, 2, 64))), ValueError, "v must"),
        ("k-empty", dict(base, k=t((2, 0, 2, 64)), v=t((2, 0, 2, 64))), ValueError, "k must"),
        ("cache_seqlens-int64", dict(base, cache_seqlens=sl.long()), TypeError, "cache_seqlens"),
        ("cache_seqlens-float", dict(base, cache_seqlens=sl.float()), TypeError, "cache_seqlens"),
        ("cache_seqlens-shape", dict(base, cache_seqlens=torch.tensor([3], dtype=torch.int32)), ValueError,
         "cache_seqlens"),
        ("cache_seqlens-2d", dict(base, cache_seqlens=sl[:, None]), ValueError, "cache_seqlens"),
        ("cache_seqlens-list", dict(base, cache_seqlens=[3, 5]), TypeError, "cache_seqlens"),
        ("cache_seqlens-bool", dict(base, cache_seqlens=True), TypeError, "cache_seqlens"),
        ("cache_seqlens-negative", dict(base, cache_seqlens=torch.tensor([3, -1], dtype=torch.int32)), ValueError,
         "cache_seqlens"),
        ("cache_seqlens-negative-int", dict(base, cache_seqlens=-2), ValueError, "cache_seqlens"),
        ("cache-overflow", dict(base, cache_seqlens=torch.tensor([3, 17], dtype=torch.int32)), ValueError,
         "cache_seqlens"),
        ("cache-overflow-append", dict(base, cache_seqlens=torch.tensor([16, 2], dtype=torch.int32), k=k, v=v),
         ValueError, "cache_seqlens"),
        ("cache-overflow-int", dict(base, cache_seqlens=16, k=k, v=v), ValueError, "cache_seqlens"),
        ("causal-int", dict(base, causal=1), TypeError, "causal"),
        ("softmax_scale-str", dict(base, softmax_scale="0.1"), TypeError, "softmax_scale"),
        ("softmax_scale-nan", dict(base, softmax_scale=float("nan")), ValueError, "softmax_scale"),
        ("softmax_scale-zero", dict(base, softmax_scale=0.0), ValueError, "softmax_scale"),
        ("softmax_scale-negative", dict(base, softmax_scale=-0.1), ValueError, "softmax_scale"),
        ("num_splits-negative", dict(base, num_splits=-1), ValueError, "num_splits"),
        ("num_splits-too-many", dict(base, num_splits=decode.MAX_SPLITS + 1), ValueError, "num_splits"),
        ("num_splits-float", dict(base, num_splits=2.0), TypeError, "num_splits"),
        ("check_lengths-int", dict(base, check_lengths=0), TypeError, "check_lengths"),
        ("k-longer-than-cache", dict(base, cache_seqlens=0, k=t((2, 17, 2, 64)), v=t((2, 17, 2, 64))), ValueError,
         "k has 17 new tokens"),
    ]
    return [pytest.param(kw, exc, match, id=name) for name, kw, exc, match in cases]


@pytest.mark.parametrize("kwargs,exc,match", _bad_cases())
def test_bad_input(kwargs, exc, match, device):
    # built on the CPU at collection time: every tensor argument moves to the kernels' device, strides
    # kept (k_cache-strided-last-dim must stay a view with a strided last dimension)
    kwargs = {name: _to(value, device) for name, value in kwargs.items()}
    caches = [kwargs["k_cache"].clone(), kwargs["v_cache"].clone()]
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**kwargs)
    # nothing was written into the caches
    assert torch.equal(kwargs["k_cache"], caches[0]) and torch.equal(kwargs["v_cache"], caches[1])


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache", "k", "v"])
def test_tensor_off_the_kernels_device_refused_by_name(name, gen, device):
    """Each tensor argument on another device (the meta device here) raises a ValueError naming it, before any
    write into the caches."""
    q, kc, vc, sl, k, v = _inputs(gen, B=2, Sq=1, H=4, Hkv=2, D=64, S=16, Sn=1, dtype=torch.float16, device=device)
    args = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=sl, k=k, v=v)
    args[name] = torch.empty(args[name].shape, dtype=args[name].dtype, device="meta")
    before = [kc.clone(), vc.clone()]
    with pytest.raises(ValueError, match=name):
        flash_attn_with_kvcache(**args)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_strided_q_and_new_kv(gen, device):
    """q and the new k, v as strided views (their storage [B, H, S, D]): the same output and cache rows as the
    contiguous call, bit for bit."""
    q, kc, vc, sl, k, v = _inputs(gen, B=2, Sq=2, H=4, Hkv=2, D=64, S=24, Sn=2, dtype=torch.float16, device=device)
    view = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731
    assert not view(q).is_contiguous()
    c1, c2 = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
    with poisoned():
        o1 = flash_attn_with_kvcache(q, *c1, sl, k, v)
        o2 = flash_attn_with_kvcache(view(q), *c2, sl, view(k), view(v))
    assert torch.equal(o1, o2) and torch.equal(c1[0], c2[0]) and torch.equal(c1[1], c2[1])


def test_overflow_caught_by_the_op_itself(gen, device):
    """The custom op checks the lengths too (a direct call or a compiled graph skips the wrapper)."""
    q, kc, vc, _, k, v = _inputs(gen, B=2, Sq=1, H=4, Hkv=2, D=64, S=16, Sn=2, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="cache_seqlens"):
        torch.ops.triforge.flash_attn_with_kvcache(q, kc, vc, torch.tensor([15, 0], dtype=torch.int32, device=device),
                                                   k, v, True, 0.125, 0, True)


def test_unchecked_lengths_stay_inside_the_cache(gen, device):
    """check_lengths=False (no host sync): out-of-range lengths are clamped into [0, S_max - Sn] by
    the kernel, so nothing outside the caches is read or written; in-range rows stay exact."""
    B, S, Sn, D = 3, 32, 2, 64
    big_k = _randn((B, S + 8, 2, D), torch.float16, gen).to(device)
    big_v = _randn((B, S + 8, 2, D), torch.float16, gen).to(device)
    kc, vc = big_k[:, :S], big_v[:, :S]  # the caches are the first S rows of larger buffers (views on the device)
    tail_k, tail_v = big_k[:, S:].clone(), big_v[:, S:].clone()
    q = _randn((B, 1, 4, D), torch.float16, gen).to(device)
    k = _randn((B, Sn, 2, D), torch.float16, gen).to(device)
    v = _randn((B, Sn, 2, D), torch.float16, gen).to(device)
    sl = torch.tensor([40, -5, 11], dtype=torch.int32, device=device)  # overflow, negative, fine
    with poisoned():
        o = flash_attn_with_kvcache(q, kc, vc, sl, k, v, num_splits=2, check_lengths=False)
    assert torch.equal(big_k[:, S:], tail_k) and torch.equal(big_v[:, S:], tail_v)
    assert torch.isfinite(o).all()
    # clamped: row 0 appends at S - Sn, row 1 at 0
    assert torch.equal(kc[0, S - Sn :], k[0]) and torch.equal(kc[1, :Sn], k[1])
    ref, _, _ = kvcache_attention_ref(_d(q[2:]), _d(kc[2:]), _d(vc[2:]), sl[2:] + Sn)  # row 2 holds its append
    _assert_ok(compare("o", ref["o"], o[2:], dtype=q.dtype, verbose=False))
    assert torch.equal(kc[2, 11 : 11 + Sn], k[2])


def test_cache_seqlens_device(gen, device):
    """cache_seqlens on another device than q: host lengths with CUDA q on the GPU; where the kernels run
    on the CPU (the interpreter) the meta device stands in for the other device."""
    q, kc, vc, sl, _, _ = _inputs(gen, Sn=0, device=device)
    other = "cpu" if device.type != "cpu" else "meta"
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, kc, vc, sl.to(other))


# ----------------------------------------------------------------------------- compiled for sm90 (no GPU needed)

_SM90_COMPILE = r'''
import json, os, re, subprocess, sys, tempfile
os.environ["TRITON_INTERPRET"] = "0"  # real @triton.jit kernels, compiled for sm90 without a device
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from triforge.ops.attention import decode as dec

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def compile_(fn, ptrs, floats, consts, cfg):
    names = fn.arg_names
    sig = {n: ("constexpr" if n in consts else ptrs.get(n, "fp32" if n in floats else "i32")) for n in names}
    # as a launch specialises them: pointers and strides divisible by 16
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in ptrs or n.startswith("stride")}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=cfg)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    out = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                         text=True, check=True)
    txt = out.stdout + out.stderr
    return {"regs": int(re.search(r"Used (\d+) registers", txt).group(1)),
            "spills": int(re.search(r"(\d+) bytes spill stores", txt).group(1)),
            "cp_async": k.asm["ptx"].count("cp.async."), "shared": k.metadata.shared,
            "prefetch": k.asm["ptx"].count("prefetch.global.L2")}


rows = []
for dtype, D, G, Sq, append, causal in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    t = TYPES[dtype]
    m_rows = G * Sq
    bm = dec._block_m(m_rows)
    sc = dec._split_config(D, dtype, bm)
    ptrs = {n: "*" + t for n in ("q_ptr", "kc_ptr", "vc_ptr", "kn_ptr", "vn_ptr")}
    ptrs.update({"acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "seqlens_ptr": "*i32", "o_ptr": "*" + t,
                 "lse_ptr": "*fp32"})
    # both PDL forms, both output forms (partials / DIRECT)
    consts = dict(H=2 * G, HKV=2, GROUP=G, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=sc["BLOCK_N"], BLOCK_NEW=16,
                  CAUSAL=causal, APPEND=append, UPCAST=False, IEEE=dtype == torch.float32, PDL=bool(append),
                  DIRECT=bool(causal), L2PF=4 if append else 0)
    r = compile_(dec.flash_decode_split_kernel, ptrs, ("qk_scale",), consts,
                 {"num_warps": sc["num_warps"], "num_stages": sc["num_stages"]})
    rows.append(dict(r, kernel="split", dtype=t, D=D, G=G, Sq=Sq, L2PF=consts["L2PF"]))
    mc = dec._merge_config(D, dtype)
    ptrs = {"acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "o_ptr": "*" + t, "lse_ptr": "*fp32"}
    for splits in (8, 66, 256):  # one trip over all the splits, head-dim columns as they fit
        bs, bd = dec.merge_blocks(splits, D, mc["tile"])
        consts = dict(H=2 * G, HKV=2, GROUP=G, HEAD_DIM=D, BLOCK_S=bs, BLOCK_D=bd, PDL=bool(append))
        r = compile_(dec.flash_decode_merge_kernel, ptrs, (), consts, {"num_warps": mc["num_warps"], "num_stages": 1})
        rows.append(dict(r, kernel=f"merge/{splits}", dtype=t, D=D, G=G, Sq=Sq))
print("RESULT" + json.dumps(rows))
'''


def test_kernels_compile_for_sm90_without_spills():
    """The kernels as the H100 would build them (TRITON_INTERPRET=0, sm90 target, the launch configs'
    fallbacks, ptxas from the triton wheel): they compile, spill nothing, and the 16-bit split kernel's
    K/V loads are software-pipelined (cp.async). The interpreter never compiles them; this does."""
    import json
    import os
    import subprocess
    import sys

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("triton's bundled ptxas is not installed")
    cases = [
        ("bfloat16", 128, 8, 1, True, False),
        ("float16", 64, 1, 3, False, True),
        ("bfloat16", 64, 4, 16, True, True),
        ("float32", 128, 2, 1, True, False),
    ]
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _SM90_COMPILE, json.dumps(cases)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.split("RESULT", 1)[1])
    for r in rows:
        assert r["spills"] == 0, r
        if r["kernel"] == "split" and r["dtype"] != "fp32":
            assert r["cp_async"] > 0, r
            assert r["shared"] <= 120 * 1024, r
        if r["kernel"] == "split":  # the L2 prefetch before the PDL wait: compiled in where asked, only there
            assert (r["prefetch"] > 0) == (r["L2PF"] > 0), r


# ----------------------------------------------------------------------------- compiled, on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,S,Sq", [(1, 4096, 1), (8, 4096, 1), (3, 2048, 4)])
def test_gpu_heuristic_splits(B, S, Sq, dtype, gen):
    """Compiled kernels at decode shapes with the heuristic split count, random row lengths."""
    q, kc, vc, sl, k, v = _inputs(gen, B=B, Sq=Sq, H=16, Hkv=2, D=128, S=S, Sn=Sq, dtype=dtype)
    _run_and_check(*(t.cuda() if t is not None else None for t in (q, kc, vc, sl, k, v)))


@pytest.mark.gpu
def test_gpu_cache_past_2gib(gen):
    """A cache of more than 2**31 bytes: the last row's keys (and its appended token) lie past
    2 GiB from the base pointer, so 32-bit address arithmetic would read or write elsewhere."""
    B, S, Hkv, D = 4, 270000, 8, 128
    dtype = torch.bfloat16
    kc = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype)
    vc = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype)
    assert kc.numel() * kc.element_size() > 2**31
    q = torch.randn(B, 1, Hkv, D, device="cuda", dtype=dtype)
    k = torch.randn(B, 1, Hkv, D, device="cuda", dtype=dtype)
    v = torch.randn(B, 1, Hkv, D, device="cuda", dtype=dtype)
    sl = torch.tensor([5, 100, 1000, S - 1], dtype=torch.int32, device="cuda")
    with poisoned():
        o, lse = flash_attn_with_kvcache(q, kc, vc, sl, k, v, return_lse=True)
    assert torch.equal(kc[3, S - 1], k[3, 0]) and torch.equal(vc[3, S - 1], v[3, 0])
    b = slice(3, 4)
    ref, _, _ = kvcache_attention_ref(_d(q[b]), _d(kc[b]), _d(vc[b]), sl[b], _d(k[b]), _d(v[b]))
    _assert_ok(compare("lse", ref["lse"], lse[b], dtype=dtype, verbose=False))
    _assert_ok(compare("o", ref["o"], o[b], dtype=dtype, verbose=False))


@pytest.mark.parametrize("env,want", [(None, True), ("1", True), ("0", False)], ids=["default", "on", "off"])
def test_op_launches_with_pdl_unless_turned_off(env, want, monkeypatch, gen, device):
    """flash_attn_with_kvcache asks for programmatic dependent launch (both kernels wait for the previous kernel
    before any access, so it is safe after any producer); TRIFORGE_PDL=0 turns it off. (Where PDL is unsupported,
    the interpreter included, launch.pdl_options drops it.)"""
    seen = []
    real = decode.flash_decode_fwd

    def spy(*args, **kwargs):
        seen.append(kwargs.get("pdl"))
        return real(*args, **kwargs)

    monkeypatch.setattr(decode, "flash_decode_fwd", spy)
    if env is None:
        monkeypatch.delenv("TRIFORGE_PDL", raising=False)
    else:
        monkeypatch.setenv("TRIFORGE_PDL", env)
    q, kc, vc, sl, k, v = _inputs(gen, B=2, S=40, device=device)
    o = flash_attn_with_kvcache(q, kc, vc, sl, k=k, v=v)
    assert seen == [want] and torch.isfinite(o).all()


@pytest.mark.gpu
def test_gpu_pdl_chain_reads_its_predecessors_output(gen, monkeypatch):
    """A chain of decode calls, each one's q the previous call's output (so the split kernel's first reads are the
    merge kernel's writes, with both launched as programmatic dependents): the same bits as the chain launched
    plainly (TRIFORGE_PDL=0), and every link equal to attention over its cache in float64."""
    B, H, Hkv, D, S = 2, 16, 2, 128, 4096
    q0, kc, vc, sl, _, _ = (t.cuda() if t is not None else None
                            for t in _inputs(gen, B=B, H=H, Hkv=Hkv, D=D, S=S, Sn=0, dtype=torch.bfloat16,
                                             seqlens=[S, 3000]))
    chains = {}
    for env in ("0", "1"):
        monkeypatch.setenv("TRIFORGE_PDL", env)
        q, outs = q0, []
        for _ in range(12):
            q = flash_attn_with_kvcache(q, kc, vc, sl, check_lengths=False)
            outs.append(q)
        torch.cuda.synchronize()
        chains[env] = outs
    for a, b in zip(chains["0"], chains["1"]):
        assert torch.equal(a, b)
    q = q0
    for o in chains["1"]:
        ref = kvcache_attention_ref(q.double(), kc.double(), vc.double(), sl, causal=True)[0]
        _assert_ok(compare("pdl chain link", ref["o"], o, dtype=torch.bfloat16, verbose=False))
        q = o
