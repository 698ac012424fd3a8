"""Codes as the only resident form (TernaryTensor.compact, TernaryLinear.compact, quantize_model(compact=True)):
the same weights and products as the planes form, 2 bits per weight held, O(1) edits of the codes, conversions
both ways through state_dict, and the validation of from_codes."""

import math

import pytest
import torch
from torch import nn

from triforge import _runtime
from triforge.launch import poisoned
from triforge.nn import TernaryLinear
from triforge.ternary import matmul, matmul_w158a8, quantize_model
from triforge.ops.ternary import tc
from triforge.ops.ternary.reference import popcount_matmul_a8
from triforge.ops.ternary.tensor import TernaryTensor

from .test_tensor import random_scales, random_trits

KERNEL_DEVICE = _runtime.INTERPRET or torch.cuda.is_available()


def _pair(n, k, gen, device, per_row=True, sparsity=0.3):
    trits = random_trits(n, k, gen, sparsity=sparsity).to(device)
    scales = random_scales(n if per_row else 1, gen).to(device)
    return TernaryTensor.from_trits(trits, scales), TernaryTensor.from_trits(trits, scales).compact(), trits


@pytest.mark.parametrize("k", [1, 33, 127, 128, 200, 2049])
def test_compact_holds_the_same_weights(k, gen, device):
    full, small, trits = _pair(5, k, gen, device)
    assert small.resident == "codes" and full.resident == "planes"
    assert small._plus is None and small._minus is None and small._metadata is None
    assert torch.equal(small.trits(), trits) and torch.equal(small.to_float(), full.to_float())
    plus, minus = small.planes()
    assert torch.equal(plus, full.plus) and torch.equal(minus, full.minus)
    assert small.nonzeros() == full.nonzeros() and small.sparsity() == full.sparsity()
    assert small.k_words == full.k_words and small.device == full.device
    assert small.compact() is small  # idempotent
    assert "resident=codes" in repr(small)


def test_unpack_in_row_blocks(gen, device, monkeypatch):
    """planes() and trits() of a compact tensor unpack a few rows at a time (bounded intermediates): the same
    values with blocks of 1 row and of 3 rows (a partial last block) as in one block."""
    from triforge.ops.ternary import tensor as T

    full, small, trits = _pair(7, 300, gen, device)
    for elems in (1, 3 * tc.code_words(300) * 16):
        monkeypatch.setattr(T, "UNPACK_ELEMS", elems)
        assert torch.equal(small.trits(), trits)
        plus, minus = small.planes()
        assert torch.equal(plus, full.plus) and torch.equal(minus, full.minus)


def test_resident_bytes(gen, device):
    """Planes: 2 bits per weight; the codes cached beside them on a tc call: 4; compact: 2 (+ scales)."""
    n, k = 16, 4096
    full, small, _ = _pair(n, k, gen, device)
    scales = n * 4
    assert full.nbytes("resident") == 2 * n * (k // 32) * 4 + scales == full.nbytes("planes")
    full.tc_codes()
    assert full.resident == "planes+codes"
    assert full.nbytes("resident") == full.nbytes("planes") + n * tc.code_words(k) * 4
    assert full.bits_per_weight("resident") == pytest.approx(4.0, abs=0.01)
    assert small.nbytes("resident") == n * tc.code_words(k) * 4 + scales == small.nbytes("codes")
    odd = _pair(100, 256, gen, device)[1]  # rows padded to a whole 16-row tile
    assert odd.nbytes("codes") == odd.nbytes("resident") == 112 * tc.code_words(256) * 4 + 100 * 4
    assert small.bits_per_weight("resident") == pytest.approx(2.0, abs=0.01)
    small.kernel_operands()  # row scales are a view of the scales: no new bytes
    assert small.nbytes("resident") == small.nbytes("codes")
    with pytest.raises(ValueError, match="storage must be"):
        small.nbytes("fp16")


@pytest.mark.skipif(not KERNEL_DEVICE, reason="needs the kernels' device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("m", [1, 5])
def test_compact_matmul_equals_planes(m, dtype, gen, device):
    """Every dispatch path gives the planes form's result: fp16/bf16 through the tc kernel (the same kernel
    for both forms where no chunk is all zero), fp32 through the plane kernels on unpacked planes; and a
    matrix with all-zero chunks (the planes form skips them, the compact form runs the tc kernel) within
    the dtype's rounding of it. The compact tensor still holds only its codes afterwards."""
    n, k = 24, 2 * 2048 + 72
    full, small, trits = _pair(n, k, gen, device)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    bias = torch.randn(n, generator=gen).to(device)
    with poisoned():
        y_small = matmul(x, small, bias)
    y_full = matmul(x, full, bias)
    assert torch.equal(y_small, y_full)
    assert small.resident == "codes" and small.nbytes("resident") == small.nbytes("codes")
    # all-zero 2048-column chunks in every row: different kernels, same math
    trits[:, :2048] = 0
    scales = random_scales(n, gen).to(device)
    full2, small2 = TernaryTensor.from_trits(trits, scales), TernaryTensor.from_trits(trits, scales).compact()
    ref = x.double() @ (trits.double() * scales.double()[:, None]).T
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for tt in (full2, small2):
        y = matmul(x, tt).double()
        assert bool(torch.isfinite(y).all())
        assert float((y - ref).abs().max()) <= tol * float(ref.abs().max()), tt.resident


def test_compact_a8_path_is_exact(gen, device):
    full, small, _ = _pair(6, 300, gen, device)
    x = torch.randint(-128, 128, (3, 300), generator=gen, dtype=torch.int8).to(device)
    assert torch.equal(popcount_matmul_a8(x, small), popcount_matmul_a8(x, full))
    xf = torch.randn(3, 300, generator=gen).to(device)
    assert torch.equal(matmul_w158a8(xf, small), matmul_w158a8(xf, full))


@pytest.mark.parametrize("k", [70, 2 * 2048 + 70])
def test_modify_dim_on_codes(k, gen, device):
    """O(1) edits of the codes, compact and cached beside the planes: every value at columns that land in
    every part of a code word (both halves, all 8 fields, the 8 words of a 128-column block, the padding
    block), against the expected trits; the cached codes stay equal to a fresh pack of the edited planes."""
    n = 3
    full, small, trits = _pair(n, k, gen, device, sparsity=0.5)
    full.tc_codes()
    expect = trits.clone()
    cols = sorted({0, 1, 2, 7, 8, 15, 16, 63, 64, 65, 127, 128, 129, k - 1} & set(range(k)))
    cols += torch.randint(0, k, (12,), generator=gen).tolist()
    for col in cols:
        row = int(torch.randint(0, n, (1,), generator=gen))
        for value in (1, -1, 0, -1, 1, 0, 1):
            small.modify_dim(row, col, value)
            full.modify_dim(row, col, value)
            expect[row, col] = value
    assert torch.equal(small.trits(), expect)
    assert torch.equal(full.trits(), expect)
    assert full.resident == "planes+codes"
    assert torch.equal(full._tc_codes, tc.pack_tc(full.plus, full.minus, k))
    assert torch.equal(small._tc_codes, full._tc_codes)
    with pytest.raises(ValueError, match="value must be one of"):
        small.modify_dim(0, 0, 2)


def test_code_index_inverts_pack(gen):
    n, k = 260, 384
    for row, col in ((0, 0), (1, 1), (15, 9), (16, 17), (200, 70), (259, 127), (3, 128), (130, 255), (259, 383)):
        t = torch.zeros(n, k, dtype=torch.int8)
        t[row, col] = -1  # field value 0 where every other field is 1
        codes = TernaryTensor.from_trits(t, torch.ones(1)).tc_codes()
        word, shift = tc.code_index(row, col, codes.shape[1])
        fields = (codes.view(-1).to(torch.int64) & 0xFFFFFFFF)[:, None] >> torch.arange(0, 32, 2) & 3
        zero = (fields == 0).nonzero().tolist()
        assert zero == [[word, shift // 2]], (row, col, zero)


def test_to_device_save_load_and_base3(tmp_path, gen, device):
    full, small, trits = _pair(4, 100, gen, device, per_row=False)
    moved = small.to("cpu")
    assert moved.resident == "codes" and torch.equal(moved.trits(), trits.cpu())
    small.save(tmp_path / "w.safetensors")  # planes on disk, unpacked for the write
    back = TernaryTensor.load(tmp_path / "w.safetensors")
    assert torch.equal(back.trits(), trits.cpu()) and torch.equal(back.scales, small.scales.cpu())
    assert torch.equal(small.pack_base3(), full.pack_base3())
    cached = full.to(device)
    cached.tc_codes()
    assert cached.to("cpu").resident == "planes+codes"


def test_strided_codes_metadata_after_edits_and_setters(gen, device):
    """A strided codes view is copied contiguous (the kernel reads whole tiles); the sparsity metadata
    of a compact tensor is rebuilt after an edit, not left stale; planes of a compact tensor cannot be set, and
    setting a plane of a planes tensor drops its cached codes and metadata."""
    full, small, trits = _pair(4, 200, gen, device)
    kc = small._tc_codes.shape[1]
    wide = torch.zeros(16, 2 * kc, dtype=torch.int32, device=device)
    wide[:, :kc] = small._tc_codes
    strided = TernaryTensor.from_codes(wide[:, :kc], small.scales, (4, 200))
    assert strided._tc_codes.is_contiguous() and torch.equal(strided.trits(), trits)
    if KERNEL_DEVICE:
        x = torch.randn(3, 200, generator=gen).to(device, torch.float16)
        assert torch.equal(matmul(x, strided), matmul(x, full))
    md = small.sparsity_metadata()
    assert bool(md.active[0].all())
    for col in range(200):
        small.modify_dim(0, col, 0)
    assert not bool(small.sparsity_metadata().active[0].any())
    assert small.sparsity_metadata().word_mask(0, 0) == 0
    with pytest.raises(AttributeError, match="compact"):
        small.plus = full.plus
    full.tc_codes()
    full.sparsity_metadata()
    full.minus = full.minus.clone()
    assert full.resident == "planes" and full._metadata is None


def test_from_codes_validates(gen, device):
    full, small, trits = _pair(3, 70, gen, device)
    codes, scales = small._tc_codes, small.scales
    again = TernaryTensor.from_codes(codes.clone(), scales, (3, 70))
    assert torch.equal(again.trits(), trits)
    with pytest.raises(TypeError, match="codes must have dtype int32"):
        TernaryTensor.from_codes(codes.to(torch.int64), scales, (3, 70))
    with pytest.raises(ValueError, match="codes must have shape"):
        TernaryTensor.from_codes(codes[:, :4], scales, (3, 70))
    with pytest.raises(ValueError, match="codes must have shape"):  # rows not padded to a whole tile
        TernaryTensor.from_codes(codes[:3], scales, (3, 70))
    row_pad = codes.clone()
    row_pad.view(-1)[tc.code_index(5, 0, codes.shape[1])[0]] = 0x55555556  # padding row 5: a field 2 (trit +1)
    with pytest.raises(ValueError, match="padding rows"):
        TernaryTensor.from_codes(row_pad, scales, (3, 70))
    bad = codes.clone()
    bad[0, 0] |= 3  # field 0 of word 0 = 3
    with pytest.raises(ValueError, match="field 3"):
        TernaryTensor.from_codes(bad, scales, (3, 70))
    word, shift = tc.code_index(1, 100, codes.shape[1])  # a padding column (in_features = 70) holding trit +1
    pad = codes.clone()
    flat = pad.view(-1)
    v = (int(flat[word]) & 0xFFFFFFFF & ~(3 << shift)) | (2 << shift)
    flat[word] = v - (1 << 32) if v >= 1 << 31 else v
    with pytest.raises(ValueError, match="past in_features"):
        TernaryTensor.from_codes(pad, scales, (3, 70))
    with pytest.raises(ValueError, match="scales must be fp32"):
        TernaryTensor.from_codes(codes, scales.double(), (3, 70))
    with pytest.raises(ValueError, match="finite"):
        TernaryTensor.from_codes(codes, torch.full_like(scales, float("nan")), (3, 70))


def _linear(k, n, gen):
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen))
        lin.bias.copy_(torch.randn(n, generator=gen))
    return lin


def test_ternary_linear_compact_and_state_dict(gen, device):
    lin = _linear(200, 12, gen).to(device)
    full = TernaryLinear.from_linear(lin)
    small = TernaryLinear.from_linear(lin).compact()
    assert set(small.state_dict()) == {"codes", "scales", "bias"}
    assert set(full.state_dict()) == {"plus", "minus", "scales", "bias"}
    assert "resident=codes" in small.extra_repr() and "resident=planes" in full.extra_repr()
    x = torch.randn(3, 200, generator=gen).to(device)
    assert torch.equal(small(x), full(x))
    # planes state_dict into a compact layer, and codes into a planes layer: converted on load
    other = TernaryLinear(200, 12).to(device).compact()
    other.load_state_dict(full.state_dict())
    assert torch.equal(other.ternary.trits(), full.ternary.trits())
    plain = TernaryLinear(200, 12).to(device)
    plain.load_state_dict(small.state_dict())
    assert torch.equal(plain.plus, full.plus) and torch.equal(plain.minus, full.minus)
    assert torch.equal(plain(x), full(x))
    # invalid codes or planes are reported by load_state_dict, like a size mismatch
    bad = dict(small.state_dict())
    bad["codes"] = bad["codes"] | 3  # field 0 of every word = 3
    for layer in (TernaryLinear(200, 12).to(device).compact(), TernaryLinear(200, 12).to(device)):
        with pytest.raises(RuntimeError, match="invalid ternary weights"):
            layer.load_state_dict(bad)
    bad_planes = dict(full.state_dict())
    bad_planes["minus"] = bad_planes["plus"].clone()  # plus & minus both set
    for layer in (TernaryLinear(200, 12).to(device).compact(), TernaryLinear(200, 12).to(device)):
        with pytest.raises(RuntimeError, match="invalid ternary weights"):
            layer.load_state_dict(bad_planes)
    # a compact tensor makes a compact layer holding the same codes
    from_tt = TernaryLinear.from_ternary(TernaryTensor.from_codes(small.codes.clone(), small.scales, (12, 200)),
                                         small.bias.detach())
    assert from_tt._compact and set(from_tt.state_dict()) == {"codes", "scales", "bias"}
    assert torch.equal(from_tt(x), small(x))
    # compacting a layer leaves the caller's tensor as it was (planes, no codes cached on it)
    user = TernaryTensor.from_float(lin.weight.detach())
    TernaryLinear.from_ternary(user).compact()
    assert user.resident == "planes"
    # .half() keeps the codes int32 and the scales fp32; the layer follows its moved buffers
    half = TernaryLinear.from_linear(lin).compact().half()
    assert half.codes.dtype == torch.int32 and half.scales.dtype == torch.float32
    assert half.ternary._tc_codes is half.codes
    # edits through the layer's tensor land in its buffer
    small.ternary.modify_dim(0, 5, -1)
    assert int(TernaryTensor.from_codes(small.codes, small.scales, (12, 200)).trits()[0, 5]) == -1


def test_quantize_model_compact_report(gen):
    model = nn.Sequential(_linear(256, 512, gen), nn.ReLU(), _linear(512, 256, gen))
    ref = nn.Sequential(_linear(256, 512, gen), nn.ReLU(), _linear(512, 256, gen))
    ref.load_state_dict(model.state_dict())
    r_full = quantize_model(ref, verbose=False)
    r = quantize_model(model, verbose=False, compact=True)
    held = lambda m: sum(x.ternary.nbytes("resident") for x in m if isinstance(x, TernaryLinear))  # noqa: E731
    assert held(ref) == r_full["bytes_after"] and held(model) == r["bytes_after"]  # what they hold on return
    fp16 = 2 * 2 * 256 * 512
    assert r["bytes_before"] == r_full["bytes_before"] == fp16
    codes = tc.code_words(256) * 512 * 4 + 512 * 4 + tc.code_words(512) * 256 * 4 + 256 * 4  # codes + row scales
    assert r["bytes_after"] == codes and r["compact"] is True
    assert r["ratio"] == pytest.approx(fp16 / codes)
    x = torch.randn(2, 256, generator=gen)
    assert torch.equal(model(x), ref(x))
    assert all(m.ternary.resident == "codes" for m in model if isinstance(m, TernaryLinear))
    planes = 2 * (512 * math.ceil(256 / 32) + 256 * math.ceil(512 / 32)) * 4 + 4 * 768
    assert r_full["bytes_after"] == planes  # the planes form, before any codes are cached
    # what the layers hold after a first bf16 call: the planes layers cache the codes too, the compact ones do not
    assert r["bytes_after_half_call"] == r["bytes_after"] and r["ratio_after_half_call"] == r["ratio"]
    meta = (512 + 256) * (8 + 4)  # the sparsity metadata: an int64 bitmap and an int32 flag per (row, 2048 columns)
    assert r_full["bytes_after_half_call"] == planes + codes - 4 * 768 + meta
    for m in (model, ref):
        m.to(torch.bfloat16)(torch.randn(2, 256, generator=gen).to(torch.bfloat16))
    if all(x.ternary.resident == "planes+codes" for x in ref if isinstance(x, TernaryLinear)):  # the tc path ran
        assert held(ref) == r_full["bytes_after_half_call"]
    assert held(model) == r["bytes_after_half_call"]


@pytest.mark.parametrize("n,k", [(16, 4096), (7, 1003)])
def test_bench_memory_report_counts_the_base3_checkpoint(n, k, gen, device):
    """The bench's memory report (registry extras): base-3 = ceil(N K / 5) packed bytes + fp32 row scales, the
    file = that + the safetensors header (round trips: test_tensor)."""
    import triforge.ops.ternary as T

    full, small, trits = _pair(n, k, gen, device)
    rep = T._registry_extras({"tt": small})["weights"]
    base3 = math.ceil(n * k / 5) + 4 * n
    assert rep["base3_bytes"] == base3 and rep["fp16_bytes"] == 2 * n * k
    assert rep["base3_x_smaller_than_fp16"] == pytest.approx(2 * n * k / base3)
    assert base3 < rep["base3_file_bytes"] < base3 + 1024
    assert rep["resident_bytes"] == small.nbytes("codes")
