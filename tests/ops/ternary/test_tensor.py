"""TernaryTensor storage: bit layout (bit 31 included), padding, edits, metadata, save/load, base-3 packing."""

import math

import pytest
import torch

from triforge.ops.ternary.tensor import (
    CHUNK_COLS,
    FORMAT_VERSION,
    SparsityMetadata,
    TernaryTensor,
    bits_to_words,
    padding_mask,
    popcount32,
    words_to_bits,
)

ODD_K = [1, 31, 32, 33, 100, 2049]


def random_trits(n, k, gen, sparsity=0.3):
    """Fresh random trits; each weight is 0 with probability ``sparsity``, else +-1."""
    u = torch.rand(n, k, generator=gen)
    s = torch.where(torch.rand(n, k, generator=gen) < 0.5, -1, 1)
    return torch.where(u < sparsity, 0, s).to(torch.int8)


def random_scales(n, gen):
    return (0.5 + torch.rand(n, generator=gen)).float()


def assert_invariants(tt):
    assert tt.plus.dtype == torch.int32 and tt.minus.dtype == torch.int32
    assert tt.plus.shape == (tt.out_features, math.ceil(tt.in_features / 32))
    assert not bool(((tt.plus & tt.minus) != 0).any()), "plus and minus both set"
    pad = padding_mask(tt.in_features)
    assert not bool((((tt.plus[:, -1] | tt.minus[:, -1]) & pad) != 0).any()), "padding bits set"


def test_bits_to_words_layout_and_bit31(gen):
    bits = torch.zeros(1, 64, dtype=torch.bool)
    bits[0, 31] = True  # bit 31 of word 0: the int32 sign bit
    bits[0, 32] = True  # bit 0 of word 1
    w = bits_to_words(bits)
    assert w.tolist() == [[-(2**31), 1]]
    assert torch.equal(words_to_bits(w, 64), bits)
    all_ones = bits_to_words(torch.ones(2, 32, dtype=torch.bool))
    assert all_ones.tolist() == [[-1], [-1]]
    assert popcount32(all_ones).tolist() == [[32], [32]]
    assert popcount32(torch.tensor([-(2**31), 0, 1, 0x7FFFFFFF], dtype=torch.int32)).tolist() == [1, 0, 1, 31]
    rnd = torch.rand(7, 95, generator=gen) < 0.5
    w = bits_to_words(rnd)
    assert torch.equal(words_to_bits(w, 95), rnd)
    assert torch.equal(popcount32(w).sum(-1), rnd.sum(-1))


@pytest.mark.parametrize("k", ODD_K)
def test_from_trits_round_trip_odd_k(k, gen):
    n = 5
    trits = random_trits(n, k, gen)
    trits[:, -1] = 1  # the last real column set: padding must still be 0
    scales = random_scales(n, gen)
    tt = TernaryTensor.from_trits(trits, scales)
    assert_invariants(tt)
    assert tt.shape == (n, k) and tt.k_words == math.ceil(k / 32)
    assert torch.equal(tt.trits(), trits)
    ref = trits.double() * scales.double()[:, None]
    assert torch.equal(tt.to_float(torch.float64), ref)
    assert torch.equal(tt.to_float(), ref.float())
    assert tt.sparsity() == pytest.approx(float((trits == 0).double().mean()))


def test_column_31_and_bit_positions(gen):
    trits = torch.zeros(3, 70, dtype=torch.int8)
    trits[0, 31], trits[1, 31], trits[2, 63] = 1, -1, -1
    tt = TernaryTensor.from_trits(trits, torch.ones(3))
    assert tt.plus[0, 0].item() == -(2**31) and tt.minus[0, 0].item() == 0
    assert tt.minus[1, 0].item() == -(2**31) and tt.plus[1, 0].item() == 0
    assert tt.minus[2, 1].item() == -(2**31)
    assert torch.equal(tt.trits(), trits)


def test_constructor_rejects_invalid_planes(gen):
    tt = TernaryTensor.from_trits(random_trits(4, 33, gen), random_scales(4, gen))
    bad = tt.minus.clone()
    bad[0, 0] = tt.plus[0, 0] | 1
    with pytest.raises(ValueError, match="plus and minus"):
        TernaryTensor(tt.plus | 1, tt.minus | 1, tt.scales, tt.shape)
    pad = tt.plus.clone()
    pad[2, 1] |= 1 << 5  # column 37 >= in_features 33
    with pytest.raises(ValueError, match="padding"):
        TernaryTensor(pad, tt.minus, tt.scales, tt.shape)
    with pytest.raises(TypeError, match="plus"):
        TernaryTensor(tt.plus.long(), tt.minus, tt.scales, tt.shape)
    with pytest.raises(ValueError, match="minus"):
        TernaryTensor(tt.plus, tt.minus[:, :1], tt.scales, tt.shape)
    with pytest.raises(ValueError, match="scales"):
        TernaryTensor(tt.plus, tt.minus, tt.scales[:2], tt.shape)
    with pytest.raises(TypeError, match="scales"):
        TernaryTensor(tt.plus, tt.minus, tt.scales.double(), tt.shape)


def test_from_trits_rejects_non_ternary(gen):
    t = random_trits(3, 10, gen)
    t[1, 4] = 2
    with pytest.raises(ValueError, match="trits"):
        TernaryTensor.from_trits(t, torch.ones(3))
    with pytest.raises(ValueError, match="trits"):
        TernaryTensor.from_trits(torch.full((2, 3), 0.5), torch.ones(2))
    with pytest.raises(ValueError, match="trits"):
        TernaryTensor.from_trits(torch.ones(3), torch.ones(1))
    with pytest.raises(ValueError, match="method"):
        TernaryTensor.from_float(torch.randn(3, 4, generator=gen), method="xnor")


def test_modify_dim_every_value(gen):
    n, k = 3, 2 * CHUNK_COLS + 70
    trits = random_trits(n, k, gen, sparsity=0.5)
    tt = TernaryTensor.from_trits(trits, random_scales(n, gen))
    md = tt.sparsity_metadata()
    expect = trits.clone()
    cols = [0, 31, 32, 63, CHUNK_COLS - 1, CHUNK_COLS, k - 1] + torch.randint(0, k, (10,), generator=gen).tolist()
    for col in cols:
        row = int(torch.randint(0, n, (1,), generator=gen))
        for value in (1, -1, 0, -1, 1, 0, 1):
            tt.modify_dim(row, col, value)
            expect[row, col] = value
            assert int(tt.trits()[row, col]) == value
    assert torch.equal(tt.trits(), expect)
    assert_invariants(tt)
    assert tt.sparsity_metadata() is md  # updated in place, not rebuilt
    fresh = SparsityMetadata.from_ternary(tt)
    assert torch.equal(md.word_masks, fresh.word_masks) and torch.equal(md.active, fresh.active)


def test_modify_dim_clears_and_reactivates_chunk(gen):
    n, k = 2, 2 * CHUNK_COLS + 5
    trits = torch.zeros(n, k, dtype=torch.int8)
    trits[0, CHUNK_COLS + 63 * 32 + 31] = -1  # word 63 of chunk 1 (int64 bit 63), bit 31 (int32 sign bit)
    trits[1, 3] = 1
    tt = TernaryTensor.from_trits(trits, torch.ones(n))
    md = tt.sparsity_metadata()
    assert md.word_masks.dtype == torch.int64 and md.word_masks.shape == (n, 3)
    assert md.is_chunk_active(0, 1) and not md.is_chunk_active(0, 0) and not md.is_chunk_active(0, 2)
    assert md.word_mask(0, 1) == 1 << 63 and md.word_masks[0, 1].item() == -(2**63)
    assert md.chunk_sparsity() == pytest.approx(4 / 6)
    tt.modify_dim(0, CHUNK_COLS + 63 * 32 + 31, 0)
    assert not md.is_chunk_active(0, 1) and md.word_mask(0, 1) == 0
    assert md.chunk_sparsity() == pytest.approx(5 / 6)
    tt.modify_dim(0, k - 1, 1)
    assert md.is_chunk_active(0, 2) and md.word_mask(0, 2) == 1
    assert md.chunk_sparsity() == pytest.approx(4 / 6)


def test_modify_dim_errors_name_the_argument(gen):
    tt = TernaryTensor.from_trits(random_trits(3, 40, gen), torch.ones(3))
    before = tt.trits().clone()
    for bad in (2, -2, 0.5, True, "1"):
        with pytest.raises(ValueError, match="value"):
            tt.modify_dim(0, 0, bad)
    with pytest.raises(ValueError, match="row"):
        tt.modify_dim(3, 0, 1)
    with pytest.raises(ValueError, match="row"):
        tt.modify_dim(-1, 0, 1)
    with pytest.raises(ValueError, match="col"):
        tt.modify_dim(0, 40, 1)  # a padding column
    with pytest.raises(TypeError, match="col"):
        tt.modify_dim(0, 1.0, 1)
    assert torch.equal(tt.trits(), before)
    md = tt.sparsity_metadata()
    with pytest.raises(ValueError, match="chunk"):
        md.is_chunk_active(0, 1)
    with pytest.raises(ValueError, match="row"):
        md.is_chunk_active(5, 0)


def test_metadata_all_zero_rows_and_chunks(gen):
    n, k = 6, 3 * CHUNK_COLS + 17
    trits = random_trits(n, k, gen, sparsity=0.95)
    trits[2] = 0  # all-zero row
    trits[:, CHUNK_COLS : 2 * CHUNK_COLS] = 0  # all-zero chunk in every row
    trits[4, 3 * CHUNK_COLS :] = 0
    trits[4, -1] = 1  # only the last (partial) word of row 4's last chunk
    tt = TernaryTensor.from_trits(trits, random_scales(n, gen))
    md = tt.sparsity_metadata()
    nz = (trits != 0)
    for r in range(n):
        for c in range(md.n_chunks):
            cols = nz[r, c * CHUNK_COLS : (c + 1) * CHUNK_COLS]
            assert md.is_chunk_active(r, c) == bool(cols.any())
            words = torch.nn.functional.pad(cols, (0, CHUNK_COLS - cols.numel())).view(64, 32).any(-1)
            assert md.word_mask(r, c) == sum(1 << j for j in range(64) if words[j])
    expect = 1 - sum(bool(nz[r, c * CHUNK_COLS : (c + 1) * CHUNK_COLS].any()) for r in range(n) for c in range(4)) / (n * 4)
    assert md.chunk_sparsity() == pytest.approx(expect)
    assert md.active.dtype == torch.int32


def test_to_device_and_sizes(gen, device):
    n, k = 8, 100
    tt = TernaryTensor.from_trits(random_trits(n, k, gen), random_scales(n, gen))
    tt.sparsity_metadata()
    moved = tt.to(device)
    assert moved.device.type == device.type and torch.equal(moved.trits().cpu(), tt.trits())
    assert moved.sparsity_metadata().word_masks.device.type == device.type
    assert tt.nbytes() == 2 * n * 4 * 4 + n * 4
    assert tt.nbytes("base3") == math.ceil(n * k / 5) + n * 4
    assert tt.bits_per_weight() == pytest.approx(8 * tt.nbytes() / (n * k))
    big = TernaryTensor.from_trits(random_trits(4, 8192, gen), torch.ones(1))
    assert big.bits_per_weight() == pytest.approx(2.0, abs=2e-3)  # scales: 32 bits over 4 * 8192 weights
    assert big.bits_per_weight("base3") == pytest.approx(1.6, abs=2e-3)
    assert 8 * big.pack_base3().numel() / (4 * 8192) == pytest.approx(1.6, abs=1e-4)
    # the trits alone are 10x smaller than fp16 in base 3; with the fp32 scales slightly less than 10x
    assert 16 * 4 * 8192 / (8 * big.pack_base3().numel()) == pytest.approx(10.0, abs=1e-2)


@pytest.mark.parametrize("n,k", [(1, 1), (1, 4), (3, 7), (5, 33), (7, 2049)])
def test_base3_round_trip(n, k, gen):
    trits = random_trits(n, k, gen)
    scales = random_scales(n, gen)
    tt = TernaryTensor.from_trits(trits, scales)
    packed = tt.pack_base3()
    assert packed.dtype == torch.uint8 and packed.shape == (math.ceil(n * k / 5),)
    assert int(packed.max()) <= 242
    back = TernaryTensor.unpack_base3(packed, (n, k), scales)
    assert torch.equal(back.trits(), trits) and torch.equal(back.plus, tt.plus) and torch.equal(back.minus, tt.minus)
    assert torch.equal(back.scales, tt.scales)


def test_base3_errors(gen):
    tt = TernaryTensor.from_trits(random_trits(3, 11, gen), torch.ones(3))
    packed = tt.pack_base3()
    with pytest.raises(ValueError, match="packed"):
        TernaryTensor.unpack_base3(packed[:-1], (3, 11), tt.scales)
    bad = packed.clone()
    bad[0] = 243
    with pytest.raises(ValueError, match="packed"):
        TernaryTensor.unpack_base3(bad, (3, 11), tt.scales)
    with pytest.raises(TypeError, match="packed"):
        TernaryTensor.unpack_base3(packed.to(torch.int16), (3, 11), tt.scales)
    with pytest.raises(ValueError, match="shape"):
        TernaryTensor.unpack_base3(packed, (3, 0), tt.scales)


@pytest.mark.parametrize("storage", ["planes", "base3"])
@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "per_tensor"])
def test_save_load_round_trip(storage, per_row, tmp_path, gen):
    n, k = 6, 2049
    tt = TernaryTensor.from_float(torch.randn(n, k, generator=gen), method="twn", per_row=per_row)
    path = tmp_path / "w.safetensors"
    tt.save(path, storage=storage)
    back = TernaryTensor.load(path)
    assert back.shape == tt.shape
    assert torch.equal(back.plus, tt.plus) and torch.equal(back.minus, tt.minus)
    assert torch.equal(back.scales, tt.scales)
    assert_invariants(back)


def _tensor_span(data: bytes, name: str) -> tuple[int, int]:
    """(start, end) of tensor ``name``'s bytes in a safetensors file (8-byte header length, JSON header, data)."""
    import json
    import struct

    n = struct.unpack("<Q", data[:8])[0]
    begin, end = json.loads(data[8:8 + n])[name]["data_offsets"]
    return 8 + n + begin, 8 + n + end


@pytest.mark.parametrize("storage,name", [("planes", "plus"), ("planes", "minus"), ("planes", "scales"),
                                          ("base3", "base3"), ("base3", "scales")])
def test_load_rejects_a_flipped_payload_bit(storage, name, tmp_path, gen):
    """A bit flipped in the weights or scales of a saved file (still a well-formed file, and for most flips still
    valid ternary weights) fails the checksum that save stored: a ValueError, not a silently different model. The
    untouched file loads; a file without a checksum (written before it existed) loads unchecked."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tt = TernaryTensor.from_trits(random_trits(6, 300, gen), random_scales(6, gen))
    path = tmp_path / "w.safetensors"
    tt.save(path, storage=storage)
    data = bytearray(path.read_bytes())
    start, end = _tensor_span(bytes(data), name)
    at = start + int(torch.randint(0, end - start, (1,), generator=gen))
    for bit in (0, 1):  # low bits: a base-3 byte stays <= 242 for most values, a scale stays finite
        flipped = bytearray(data)
        flipped[at] ^= 1 << bit
        bad = tmp_path / f"bad{bit}.safetensors"
        bad.write_bytes(bytes(flipped))
        with pytest.raises(ValueError, match="corrupt"):
            TernaryTensor.load(bad)
    assert torch.equal(TernaryTensor.load(path).trits(), tt.trits())
    with safe_open(str(path), framework="pt") as f:
        meta = {k: v for k, v in f.metadata().items() if k != "sha256"}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    old = tmp_path / "old.safetensors"
    save_file(tensors, str(old), metadata=meta)
    assert torch.equal(TernaryTensor.load(old).trits(), tt.trits())


def test_load_rejects_corrupt_truncated_and_foreign_files(tmp_path, gen):
    from safetensors.torch import save_file

    tt = TernaryTensor.from_trits(random_trits(4, 70, gen), random_scales(4, gen))
    good = tmp_path / "good.safetensors"
    tt.save(good)
    data = good.read_bytes()

    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(data[: len(data) - 9])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        TernaryTensor.load(trunc)

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(bytes(torch.randint(0, 256, (200,), generator=gen, dtype=torch.uint8).tolist()))
    with pytest.raises(ValueError, match="corrupt or truncated"):
        TernaryTensor.load(garbage)

    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(ValueError):
        TernaryTensor.load(empty)

    with pytest.raises(FileNotFoundError):
        TernaryTensor.load(tmp_path / "missing.safetensors")

    tensors = {"plus": tt.plus, "minus": tt.minus, "scales": tt.scales, "shape": torch.tensor(tt.shape),
               "format_version": torch.tensor([FORMAT_VERSION + 1])}
    wrong = tmp_path / "wrong_version.safetensors"
    save_file(tensors, str(wrong), metadata={"format": "triforge.ternary", "format_version": str(FORMAT_VERSION + 1)})
    with pytest.raises(ValueError, match="version"):
        TernaryTensor.load(wrong)

    foreign = tmp_path / "foreign.safetensors"
    save_file({"weight": torch.randn(3, 3, generator=gen)}, str(foreign))
    with pytest.raises(ValueError, match="not a triforge ternary"):
        TernaryTensor.load(foreign)

    tensors["format_version"] = torch.tensor([FORMAT_VERSION])
    meta = {"format": "triforge.ternary", "format_version": str(FORMAT_VERSION)}
    overlap = tmp_path / "overlap.safetensors"
    save_file({**tensors, "minus": tt.minus | tt.plus}, str(overlap), metadata=meta)
    with pytest.raises(ValueError, match="invalid ternary tensor"):
        TernaryTensor.load(overlap)

    missing = tmp_path / "missing_plane.safetensors"
    save_file({k: v for k, v in tensors.items() if k != "minus"}, str(missing), metadata=meta)
    with pytest.raises(ValueError, match="minus"):
        TernaryTensor.load(missing)

    bad_shape = tmp_path / "bad_shape.safetensors"
    save_file({**tensors, "shape": torch.tensor([4, 100])}, str(bad_shape), metadata=meta)
    with pytest.raises(ValueError, match="invalid ternary tensor"):
        TernaryTensor.load(bad_shape)
