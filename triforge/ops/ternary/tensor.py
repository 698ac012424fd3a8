"""Bit-sliced ternary tensors and their chunk-level sparsity metadata.

Layout (what the GPU kernels read):
- ``plus`` / ``minus``: int32 [out_features, k_words], k_words = ceil(in_features / 32). Bit b of word w is
  column 32 w + b; a weight is +1 where its ``plus`` bit is set, -1 where its ``minus`` bit is set, 0 otherwise.
  Bit 31 is the int32 sign bit: words are built with two's complement (a word with bit 31 set is negative).
  Invariants: ``plus & minus == 0``; padding bits (columns >= in_features) are 0 in both planes.
- ``scales``: fp32, per row [out_features] or per tensor [1]. Dense weight = scales[:, None] * trits.

``SparsityMetadata``: chunks of 2048 columns (64 words). For each (row, chunk) an int64 bitmap (bit j: word
64 c + j of the row is non-zero in plus | minus; bit 63 is the int64 sign bit) and an int32 active flag
(1 when the bitmap is non-zero). Kernels skip inactive chunks.
"""

import math
import operator
from pathlib import Path

import torch

from triforge.ops.ternary.quantize import METHODS, quantize

WORD_BITS = 32
CHUNK_WORDS = 64
CHUNK_COLS = WORD_BITS * CHUNK_WORDS  # 2048
FORMAT_NAME = "triforge.ternary"
FORMAT_VERSION = 1
TRITS_PER_BYTE = 5
_POW3 = (1, 3, 9, 27, 81)
_MAX_BASE3_BYTE = 242  # 3**5 - 1
_ROW_BLOCK_ELEMS = 1 << 24  # bound on temporary elements when converting between bits and words


def _pow2_weights(bits: int, dtype, device) -> torch.Tensor:
    """[bits] weights 2^j in two's complement of ``dtype`` (the top one is the negative minimum)."""
    vals = [1 << j for j in range(bits - 1)] + [-(1 << (bits - 1))]
    return torch.tensor(vals, dtype=dtype, device=device)


def _row_blocks(n_rows: int, elems_per_row: int):
    step = max(1, _ROW_BLOCK_ELEMS // max(1, elems_per_row))
    for r0 in range(0, n_rows, step):
        yield r0, min(n_rows, r0 + step)


def bits_to_words(bits: torch.Tensor) -> torch.Tensor:
    """bool/0-1 [N, K] -> int32 [N, ceil(K / 32)]; bit b of word w is column 32 w + b (zero padding).

    Summing distinct powers of two with bit 31 weighted -2^31 never overflows int32, so the words are
    exact two's complement without any wider intermediate.
    """
    n, k = bits.shape
    kw = math.ceil(k / WORD_BITS)
    w = _pow2_weights(WORD_BITS, torch.int32, bits.device)
    out = torch.empty((n, kw), dtype=torch.int32, device=bits.device)
    for r0, r1 in _row_blocks(n, kw * WORD_BITS):
        b = torch.nn.functional.pad(bits[r0:r1].to(torch.int32), (0, kw * WORD_BITS - k))
        out[r0:r1] = (b.view(r1 - r0, kw, WORD_BITS) * w).sum(-1, dtype=torch.int32)
    return out


def words_to_bits(words: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [N, KW] -> bool [N, k] (column 32 w + b is bit b of word w)."""
    n, kw = words.shape
    sh = torch.arange(WORD_BITS, dtype=torch.int32, device=words.device)
    out = torch.empty((n, k), dtype=torch.bool, device=words.device)
    for r0, r1 in _row_blocks(n, kw * WORD_BITS):
        # arithmetic right shift keeps bit b at position 0 for negative words too
        b = (words[r0:r1, :, None] >> sh) & 1
        out[r0:r1] = b.reshape(r1 - r0, kw * WORD_BITS)[:, :k].bool()
    return out


def popcount32(words: torch.Tensor) -> torch.Tensor:
    """Population count of each int32 word (SWAR on int64, bit 31 counted), as int64."""
    v = words.to(torch.int64) & 0xFFFFFFFF
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    return ((v * 0x01010101) >> 24) & 0xFF


def padding_mask(in_features: int) -> int:
    """int32 value of the bits of the last word that lie beyond ``in_features`` (0 when none)."""
    valid = in_features - WORD_BITS * (math.ceil(in_features / WORD_BITS) - 1)
    m = ((1 << WORD_BITS) - 1) ^ ((1 << valid) - 1)
    return m - (1 << WORD_BITS) if m >= 1 << (WORD_BITS - 1) else m


def _bit_i32(b: int) -> int:
    return (1 << b) if b < WORD_BITS - 1 else -(1 << (WORD_BITS - 1))


UNPACK_ELEMS = 1 << 22  # weights unpacked from the codes at a time (compact tensors' planes() / trits())


def _signed_i32(v: int) -> int:
    """A 32-bit pattern as the int32 value with those bits."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _bit_i64(j: int) -> int:
    return (1 << j) if j < 63 else -(1 << 63)


def _index(name: str, value, size: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got bool")
    try:
        i = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if not 0 <= i < size:
        raise ValueError(f"{name} must be in [0, {size}), got {i}")
    return i


# ----------------------------------------------------------------------------- checkpoints


def _digest(tensors: dict) -> str:
    """sha256 over a checkpoint's tensors in name order: each name, dtype, shape and raw bytes."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- sparsity metadata


class SparsityMetadata:
    """Per (row, 2048-column chunk): an int64 bitmap of the non-zero words and an int32 active flag.

    ``word_masks``: int64 [out_features, n_chunks]; bit j of entry (r, c) is set when word 64 c + j of row r
    is non-zero in plus | minus (bit 63 is the sign bit: read it as two's complement).
    ``active``: int32 [out_features, n_chunks]; 1 where the bitmap is non-zero (layout the kernels read).
    """

    def __init__(self, word_masks: torch.Tensor, active: torch.Tensor, in_features: int):
        self.word_masks = word_masks
        self.active = active
        self.in_features = int(in_features)
        self._has_inactive = None

    @classmethod
    def from_planes(cls, plus: torch.Tensor, minus: torch.Tensor, in_features: int) -> "SparsityMetadata":
        n, kw = plus.shape
        n_chunks = math.ceil(kw / CHUNK_WORDS)
        nz = torch.nn.functional.pad(((plus | minus) != 0).to(torch.int64), (0, n_chunks * CHUNK_WORDS - kw))
        w = _pow2_weights(64, torch.int64, plus.device)
        masks = (nz.view(n, n_chunks, CHUNK_WORDS) * w).sum(-1)
        return cls(masks.contiguous(), (masks != 0).to(torch.int32).contiguous(), in_features)

    @classmethod
    def from_ternary(cls, tt: "TernaryTensor") -> "SparsityMetadata":
        if not isinstance(tt, TernaryTensor):
            raise TypeError(f"tt must be a TernaryTensor, got {type(tt).__name__}")
        return cls.from_planes(tt.plus, tt.minus, tt.in_features)

    @property
    def out_features(self) -> int:
        return self.word_masks.shape[0]

    @property
    def n_chunks(self) -> int:
        return self.word_masks.shape[1]

    def is_chunk_active(self, row: int, chunk: int) -> bool:
        r = _index("row", row, self.out_features)
        c = _index("chunk", chunk, self.n_chunks)
        return bool(self.active[r, c])

    def word_mask(self, row: int, chunk: int) -> int:
        """The chunk's 64-bit word bitmap as a non-negative Python int."""
        r = _index("row", row, self.out_features)
        c = _index("chunk", chunk, self.n_chunks)
        return int(self.word_masks[r, c]) & ((1 << 64) - 1)

    def chunk_sparsity(self) -> float:
        """Fraction of (row, chunk) pairs with no non-zero weight."""
        return 1.0 - float(self.active.sum()) / self.active.numel()

    def has_inactive_chunks(self) -> bool:
        """Whether any (row, chunk) has no non-zero weight, i.e. whether kernels can skip anything.

        Cached (reading it syncs with the device once, not on every matmul); ``update_word`` resets it.
        """
        if self._has_inactive is None:
            self._has_inactive = bool((self.active == 0).any())
        return self._has_inactive

    def update_word(self, row: int, word: int, nonzero: torch.Tensor) -> None:
        """O(1) in place: set or clear the bit of ``word`` in ``row`` (``nonzero``: 0-d bool tensor)."""
        c, j = divmod(word, CHUNK_WORDS)
        m = self.word_masks[row, c]  # 0-d view
        bit = _bit_i64(j)
        m.copy_(torch.where(nonzero, m | bit, m & ~bit))
        self.active[row, c].copy_((m != 0).to(torch.int32))
        self._has_inactive = None

    def to(self, device) -> "SparsityMetadata":
        return SparsityMetadata(self.word_masks.to(device), self.active.to(device), self.in_features)

    def __repr__(self) -> str:
        return (f"SparsityMetadata(out_features={self.out_features}, n_chunks={self.n_chunks}, "
                f"chunk_sparsity={self.chunk_sparsity():.4f})")


# ----------------------------------------------------------------------------- ternary tensor


class TernaryTensor:
    """Ternary weights {-1, 0, +1} x scales, stored as two bit planes (see the module docstring)."""

    def __init__(self, plus: torch.Tensor, minus: torch.Tensor, scales: torch.Tensor, shape, *, validate=True):
        self._plus = plus  # None once compact(): the tc codes are then the only resident form
        self._minus = minus
        self.scales = scales
        self.shape = (int(shape[0]), int(shape[1]))
        self._metadata = None
        self._operands = None  # kernel_operands(), cached
        self._tc_codes = None  # tc_codes(), cached (the weights themselves once compact())
        if validate:
            self._validate()

    @classmethod
    def _of_codes(cls, codes: torch.Tensor, scales: torch.Tensor, shape) -> "TernaryTensor":
        """A compact tensor over ``codes`` and ``scales`` as they are (unvalidated: from_codes checks them)."""
        tt = cls(None, None, scales, shape, validate=False)
        tt._tc_codes = codes
        return tt

    def _plane(name: str, index: int, doc: str):  # noqa: N805  (a property factory, used in the class body)
        def get(self) -> torch.Tensor:
            held = getattr(self, "_" + name)
            return held if held is not None else self.planes()[index]

        def put(self, value: torch.Tensor) -> None:
            self._set_plane(name, value)

        return property(get, put, doc=doc)

    plus = _plane("plus", 0, "int32 [out_features, k_words] plane of the +1 weights (derived from the codes, "
                             "not kept, once compact()).")
    minus = _plane("minus", 1, "int32 [out_features, k_words] plane of the -1 weights (derived, not kept, "
                               "once compact()).")
    del _plane

    def _set_plane(self, name: str, value: torch.Tensor) -> None:
        if self._plus is None:
            raise AttributeError(f"{name} of a compact TernaryTensor is derived from its codes and cannot be set; "
                                 "build a new TernaryTensor from planes (or edit weights with modify_dim)")
        setattr(self, "_" + name, value)
        self._tc_codes = None  # cached codes of the old planes
        self._metadata = None
        self._operands = None

    def planes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(plus, minus): the resident planes, or after compact() planes unpacked from the codes for this call."""
        if self._plus is not None:
            return self._plus, self._minus
        n, kw = self.out_features, self.k_words
        plus = torch.empty((n, kw), dtype=torch.int32, device=self.device)
        minus = torch.empty_like(plus)
        for r0, r1, t in self._code_trits():
            plus[r0:r1] = bits_to_words(t == 1)
            minus[r0:r1] = bits_to_words(t == -1)
        return plus, minus

    def _code_trits(self):
        """(r0, r1, int8 trits of rows r0..r1) from the codes, a few million weights at a time (the unpack's
        intermediates are int64: 8 bytes per weight)."""
        from triforge.ops.ternary import tc

        codes = self._tc_codes
        # whole tiles of rows at a time (the codes' storage unit); the last one's padding rows are cut
        rows = tc.TILE_ROWS * max(1, UNPACK_ELEMS // max(1, codes.shape[1] * 16 * tc.TILE_ROWS))
        n = self.out_features
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            yield r0, r1, tc.unpack_tc(codes[r0:r0 + rows], self.in_features)[: r1 - r0]

    @property
    def resident(self) -> str:
        """What this tensor holds: "planes", "planes+codes" (tc codes cached beside them) or "codes" (compact())."""
        if self._plus is None:
            return "codes"
        return "planes+codes" if self._tc_codes is not None else "planes"

    def compact(self) -> "TernaryTensor":
        """Keep only the tc codes (2 bits per weight in the tensor-core kernel's order) and the scales: the
        planes and the sparsity metadata are dropped, so the weights take 2 bits each instead of 4 while the
        codes are cached beside the planes. fp16/bf16 activations run the tc kernel at every M (no chunk
        skipping); everything that reads planes (fp32 activations, the A8 popcount path, trits(), save) unpacks
        them from the codes per call. modify_dim edits the codes in place. Returns self."""
        if self._plus is None:
            return self
        self.tc_codes()
        self._plus = self._minus = None
        self._metadata = None
        self._operands = None
        return self

    # --------------------------------------------------------------- construction

    def _validate(self) -> None:
        if not (isinstance(self.shape, tuple) and len(self.shape) == 2 and min(self.shape) >= 1):
            raise ValueError(f"shape must be (out_features, in_features) with both >= 1, got {self.shape}")
        n, k = self.shape
        kw = math.ceil(k / WORD_BITS)
        for name in ("plus", "minus"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.int32:
                raise TypeError(f"{name} must have dtype int32, got {t.dtype}")
            if tuple(t.shape) != (n, kw):
                raise ValueError(f"{name} must have shape {(n, kw)} for shape {self.shape}, got {tuple(t.shape)}")
        s = self.scales
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"scales must be a torch.Tensor, got {type(s).__name__}")
        if s.dtype != torch.float32:
            raise TypeError(f"scales must have dtype float32, got {s.dtype}")
        if s.dim() != 1 or s.shape[0] not in (1, n):
            raise ValueError(f"scales must have shape ({n},) (per row) or (1,) (per tensor), got {tuple(s.shape)}")
        if not bool(torch.isfinite(s).all()):
            raise ValueError("scales must be finite")
        if self.minus.device != self.plus.device:
            raise ValueError(f"minus is on {self.minus.device} but plus is on {self.plus.device}")
        if s.device != self.plus.device:
            raise ValueError(f"scales is on {s.device} but plus is on {self.plus.device}")
        if bool(((self.plus & self.minus) != 0).any()):
            raise ValueError("plus and minus must not both be set for any weight (plus & minus != 0)")
        pad = padding_mask(k)
        if pad and bool((((self.plus[:, -1] | self.minus[:, -1]) & pad) != 0).any()):
            raise ValueError(f"padding bits beyond in_features={k} must be 0 in plus and minus")

    @classmethod
    def from_trits(cls, trits: torch.Tensor, scales: torch.Tensor) -> "TernaryTensor":
        """From an integer tensor [N, K] with values in {-1, 0, 1} and fp32 scales [N] or [1]."""
        if not isinstance(trits, torch.Tensor):
            raise TypeError(f"trits must be a torch.Tensor, got {type(trits).__name__}")
        if trits.dim() != 2 or trits.numel() == 0:
            raise ValueError(f"trits must be a non-empty 2-D tensor [out_features, in_features], got shape {tuple(trits.shape)}")
        if trits.is_floating_point() or trits.is_complex():
            if not bool((trits == trits.round()).all()):
                raise ValueError("trits must hold only the values -1, 0, 1 (found non-integer values)")
        elif trits.dtype == torch.bool:
            raise TypeError("trits must be an integer or float tensor, got bool")
        if not bool(((trits == -1) | (trits == 0) | (trits == 1)).all()):
            raise ValueError("trits must hold only the values -1, 0, 1")
        if not isinstance(scales, torch.Tensor):
            raise TypeError(f"scales must be a torch.Tensor, got {type(scales).__name__}")
        scales = scales.to(device=trits.device, dtype=torch.float32).reshape(-1).contiguous()
        plus = bits_to_words(trits == 1)
        minus = bits_to_words(trits == -1)
        return cls(plus, minus, scales, tuple(trits.shape))

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, shape) -> "TernaryTensor":
        """A compact() tensor from tc codes int32 [out_features padded to a multiple of 16, 8 ceil(in_features /
        128)] (``tc.pack_tc``'s tiled layout; every field 0, 1 or 2, i.e. trit + 1, and 1 past in_features and
        in the padding rows) and fp32 scales [N] or [1]."""
        from triforge.ops.ternary import tc

        n, k = int(shape[0]), int(shape[1])
        if not isinstance(codes, torch.Tensor):
            raise TypeError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
        if codes.dtype != torch.int32:
            raise TypeError(f"codes must have dtype int32, got {codes.dtype}")
        codes = codes.contiguous()  # (a strided view is copied: the kernels read whole 512-byte tiles)
        shape_c = (tc.code_rows(n), tc.code_words(k))
        if tuple(codes.shape) != shape_c:
            raise ValueError(f"codes must have shape {shape_c} for shape {(n, k)} (pack_tc: rows padded to a multiple "
                             f"of {tc.TILE_ROWS}), got {tuple(codes.shape)}")
        if bool(((codes & (codes >> 1) & 0x55555555) != 0).any()):  # a field with both bits set
            raise ValueError("codes hold a field 3 (fields are trit + 1: 0, 1 or 2)")
        tt = cls._of_codes(codes, scales, (n, k))
        tail = k % tc.BLOCK_COLS  # the last 128-column block's columns past in_features
        if tail:
            nb = shape_c[1] // tc.WORDS_PER_BLOCK
            last = codes.view(-1, nb, tc.TILE_ROWS, tc.WORDS_PER_BLOCK)[:, -1].reshape(-1, tc.WORDS_PER_BLOCK)
            if bool((tc.unpack_words(last, tc.BLOCK_COLS)[:, tail:] != 0).any()):
                raise ValueError(f"codes past in_features={k} must hold trit 0 (field 1)")
        if shape_c[0] > n and bool((codes[-tc.TILE_ROWS:].view(-1, tc.TILE_ROWS, tc.WORDS_PER_BLOCK)
                                    [:, n % tc.TILE_ROWS:] != 0x55555555).any()):
            raise ValueError(f"codes of the padding rows past out_features={n} must hold trit 0 (field 1)")
        s = scales
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.dim() != 1 or s.shape[0] not in (1, n):
            raise ValueError(f"scales must be fp32 of shape ({n},) or (1,), got "
                             f"{getattr(s, 'dtype', type(s).__name__)} {tuple(getattr(s, 'shape', ()))}")
        if s.device != codes.device:
            raise ValueError(f"scales is on {s.device} but codes is on {codes.device}")
        if not bool(torch.isfinite(s).all()):
            raise ValueError("scales must be finite")
        return tt

    @classmethod
    def from_float(cls, w: torch.Tensor, method: str = "absmean", per_row: bool = True) -> "TernaryTensor":
        """Quantize a float weight [out_features, in_features] with ``method`` in ("twn", "absmean")."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        trits, scales = quantize(w, method=method, per_row=per_row)
        return cls.from_trits(trits, scales)

    # --------------------------------------------------------------- properties

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def k_words(self) -> int:
        return math.ceil(self.in_features / WORD_BITS)

    @property
    def device(self) -> torch.device:
        return self.scales.device

    @property
    def per_row(self) -> bool:
        return self.scales.numel() == self.out_features

    def row_scales(self) -> torch.Tensor:
        """fp32 [out_features] scales (per-tensor scales broadcast)."""
        return self.scales.expand(self.out_features)

    # --------------------------------------------------------------- views

    def trits(self) -> torch.Tensor:
        """int8 [out_features, in_features] in {-1, 0, 1}."""
        k = self.in_features
        if self._plus is None:
            out = torch.empty((self.out_features, k), dtype=torch.int8, device=self.device)
            for r0, r1, t in self._code_trits():
                out[r0:r1] = t
            return out
        return words_to_bits(self.plus, k).to(torch.int8) - words_to_bits(self.minus, k).to(torch.int8)

    def to_float(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense weight scales[:, None] * trits, computed in fp32 (fp64 for dtype float64), cast to dtype."""
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype}")
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        return (self.trits().to(acc) * self.scales.to(acc)[:, None]).to(dtype)

    def nonzeros(self) -> int:
        if self._plus is None:  # counted block by block, not through a whole int8 copy (trits())
            return sum(int((t != 0).sum()) for _, _, t in self._code_trits())
        return int(popcount32(self.plus).sum() + popcount32(self.minus).sum())

    def sparsity(self) -> float:
        """Fraction of weights equal to 0."""
        return 1.0 - self.nonzeros() / (self.out_features * self.in_features)

    def sparsity_metadata(self) -> SparsityMetadata:
        """Chunk activity metadata, built once and kept up to date by ``modify_dim``."""
        if self._metadata is None or self._metadata.word_masks.device != self.device:
            self._metadata = SparsityMetadata.from_ternary(self)
        return self._metadata

    def invalidate_metadata(self) -> None:
        """Drop the cached metadata (call after editing the planes other than through ``modify_dim``; after
        compact() the codes are the weights and are kept)."""
        self._metadata = None
        self._operands = None
        if self._plus is not None:
            self._tc_codes = None

    def kernel_operands(self):
        """(row scales [out_features] fp32, ``active`` [out_features, n_chunks] or None): what the kernels
        read besides the planes, ``active`` only where some chunk is all zero (else nothing to skip).
        Cached for the per-call path; ``modify_dim`` and ``invalidate_metadata`` drop it."""
        ops = self._operands
        if ops is None:
            if self._plus is None:  # compact(): no metadata kept, nothing skipped
                ops = self._operands = (self.row_scales(), None)
            else:
                meta = self.sparsity_metadata()
                ops = self._operands = (self.row_scales(), meta.active if meta.has_inactive_chunks() else None)
        return ops

    def tc_codes(self) -> torch.Tensor:
        """The planes re-packed for the tensor-core kernel (``tc.pack_tc``: 2 bits per weight in the MMA
        fragment's order), made on first use and cached beside the planes (4 bits per weight resident while
        cached); ``modify_dim`` and ``invalidate_metadata`` drop it."""
        if self._tc_codes is None or self._tc_codes.device != self.device:
            from triforge.ops.ternary import tc

            self._tc_codes = tc.pack_tc(self.plus, self.minus, self.in_features)
        return self._tc_codes

    # --------------------------------------------------------------- edits

    def modify_dim(self, row: int, col: int, value: int) -> None:
        """Set weight (row, col) to ``value`` in {-1, 0, 1} in place: O(1) bit edits, metadata updated."""
        r = _index("row", row, self.out_features)
        c = _index("col", col, self.in_features)
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"value must be one of -1, 0, 1, got a tensor of shape {tuple(value.shape)}")
            value = value.item()
        if isinstance(value, bool) or value not in (-1, 0, 1) or (isinstance(value, float) and not float(value).is_integer()):
            raise ValueError(f"value must be one of -1, 0, 1, got {value!r}")
        value = int(value)
        w, b = divmod(c, WORD_BITS)
        if self._tc_codes is not None:  # the codes (cached or the only form): edited in place too
            from triforge.ops.ternary import tc

            cw, shift = tc.code_index(r, c, self._tc_codes.shape[1])
            f = self._tc_codes.view(-1)[cw]  # 0-d view
            f.bitwise_and_(~_signed_i32(3 << shift))  # clear the 2-bit field, then set trit + 1
            f.bitwise_or_(_signed_i32((value + 1) << shift))
        if self._plus is None:
            self._metadata = None  # (built from unpacked planes if asked for; rebuilt on the next request)
        else:
            bit = _bit_i32(b)
            p = self._plus[r, w]  # 0-d views into the planes
            m = self._minus[r, w]
            p.bitwise_and_(~bit)
            m.bitwise_and_(~bit)
            if value == 1:
                p.bitwise_or_(bit)
            elif value == -1:
                m.bitwise_or_(bit)
            if self._metadata is not None:
                self._metadata.update_word(r, w, (p | m) != 0)
        self._operands = None

    # --------------------------------------------------------------- device / size

    def to(self, device) -> "TernaryTensor":
        """A copy on ``device`` holding what this one holds (planes, cached codes, or only the codes)."""
        device = torch.device(device)
        if self._plus is None:
            return TernaryTensor._of_codes(self._tc_codes.to(device), self.scales.to(device), self.shape)
        out = TernaryTensor(self._plus.to(device), self._minus.to(device), self.scales.to(device), self.shape,
                            validate=False)
        if self._metadata is not None:
            out._metadata = self._metadata.to(device)
        if self._tc_codes is not None:
            out._tc_codes = self._tc_codes.to(device)
        return out

    def nbytes(self, storage: str = "planes") -> int:
        """Bytes of the weights in one form + scales: "planes" (2 int32 planes), "codes" (the tc codes, 2 bits
        per weight in 128-column blocks), "base3" (the 1.6-bit checkpoint form); or "resident": every tensor
        this object holds now (planes, cached codes, sparsity metadata, kernel operands), what it costs in
        memory."""
        s = self.scales.numel() * 4
        n, k = self.shape
        if storage == "planes":
            return 2 * n * self.k_words * 4 + s
        if storage == "codes":
            from triforge.ops.ternary import tc

            return tc.code_rows(n) * tc.code_words(k) * 4 + s
        if storage == "base3":
            return math.ceil(n * k / TRITS_PER_BYTE) + s
        if storage == "resident":
            held = [self.scales, self._plus, self._minus, self._tc_codes]
            if self._metadata is not None:
                held += [self._metadata.word_masks, self._metadata.active]
            if self._operands is not None:
                held += list(self._operands)
            seen, total = set(), 0
            for t in held:
                if t is not None and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
            return total
        raise ValueError(f"storage must be 'planes', 'codes', 'base3' or 'resident', got {storage!r}")

    def bits_per_weight(self, storage: str = "planes") -> float:
        """8 * nbytes(storage) / (out_features * in_features): ~2 for planes and codes, ~1.6 for base 3 (scales
        included); "resident": what this object holds now (~4 while codes are cached beside the planes)."""
        return 8.0 * self.nbytes(storage) / (self.out_features * self.in_features)

    # --------------------------------------------------------------- base-3 packing

    def pack_base3(self) -> torch.Tensor:
        """uint8 [ceil(N*K / 5)]: trits flattened row-major, 5 per byte, byte = sum_i (t_i + 1) 3^i."""
        d = (self.trits().reshape(-1).to(torch.int16) + 1)
        pad = (-d.numel()) % TRITS_PER_BYTE
        d = torch.nn.functional.pad(d, (0, pad), value=1)  # padding trits are 0
        p = torch.tensor(_POW3, dtype=torch.int16, device=d.device)
        return (d.view(-1, TRITS_PER_BYTE) * p).sum(-1).to(torch.uint8)

    @classmethod
    def unpack_base3(cls, packed: torch.Tensor, shape, scales: torch.Tensor) -> "TernaryTensor":
        """Inverse of ``pack_base3``."""
        if not (isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 2 and all(int(s) >= 1 for s in shape)):
            raise ValueError(f"shape must be (out_features, in_features) with both >= 1, got {shape!r}")
        n, k = int(shape[0]), int(shape[1])
        if not isinstance(packed, torch.Tensor):
            raise TypeError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
        if packed.dtype != torch.uint8:
            raise TypeError(f"packed must have dtype uint8, got {packed.dtype}")
        nbytes = math.ceil(n * k / TRITS_PER_BYTE)
        if packed.dim() != 1 or packed.numel() != nbytes:
            raise ValueError(f"packed must be 1-D with {nbytes} bytes for shape {(n, k)}, got shape {tuple(packed.shape)}")
        v = packed.to(torch.int16)
        if bool((v > _MAX_BASE3_BYTE).any()):
            raise ValueError(f"packed holds bytes > {_MAX_BASE3_BYTE}: not a base-3 packing of 5 trits")
        p = torch.tensor(_POW3, dtype=torch.int16, device=v.device)
        t = ((v[:, None] // p) % 3 - 1).reshape(-1)
        if bool((t[n * k:] != 0).any()):
            raise ValueError("packed has non-zero padding trits after the last weight")
        return cls.from_trits(t[: n * k].to(torch.int8).view(n, k), scales)

    # --------------------------------------------------------------- save / load

    def save(self, path, storage: str = "planes") -> None:
        """Write a safetensors file: planes (or the base-3 form), scales, shape and the format version."""
        from safetensors.torch import save_file

        if storage not in ("planes", "base3"):
            raise ValueError(f"storage must be 'planes' or 'base3', got {storage!r}")
        tensors = {
            "scales": self.scales.detach().cpu().contiguous(),
            "shape": torch.tensor(self.shape, dtype=torch.int64),
            "format_version": torch.tensor([FORMAT_VERSION], dtype=torch.int64),
        }
        if storage == "planes":
            tensors["plus"] = self.plus.detach().cpu().contiguous()
            tensors["minus"] = self.minus.detach().cpu().contiguous()
        else:
            tensors["base3"] = self.pack_base3().cpu().contiguous()
        meta = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "storage": storage,
                "sha256": _digest(tensors)}
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path, device="cpu") -> "TernaryTensor":
        """Read a file written by ``save``; corrupt, truncated or foreign files raise ValueError. ``save`` stores a
        sha256 of the tensors (names, dtypes, shapes and bytes) in the file's metadata and ``load`` checks it, so a
        flipped bit in the weights or scales is an error, not a different model (files written before session 45
        carry none and load unchecked)."""
        from safetensors import safe_open

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"path {str(path)!r} does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises its own error type for bad headers and short files
            raise ValueError(f"path {str(path)!r} is not a readable safetensors file (corrupt or truncated): {e}") from e
        if meta.get("format") != FORMAT_NAME:
            raise ValueError(f"path {str(path)!r} is not a triforge ternary checkpoint (format {meta.get('format')!r})")
        version = tensors.get("format_version")
        if meta.get("format_version") != str(FORMAT_VERSION) or version is None or version.tolist() != [FORMAT_VERSION]:
            raise ValueError(
                f"path {str(path)!r} has format version {meta.get('format_version')!r}; this build reads {FORMAT_VERSION}"
            )
        if "sha256" in meta and meta["sha256"] != _digest(tensors):
            raise ValueError(
                f"path {str(path)!r} is corrupt: its tensors' sha256 does not match the one saved with them")
        storage = meta.get("storage", "planes")
        need = {"scales", "shape"} | ({"plus", "minus"} if storage == "planes" else {"base3"})
        missing = need - set(tensors)
        if missing:
            raise ValueError(f"path {str(path)!r} lacks tensor(s) {sorted(missing)}")
        shape_t = tensors["shape"]
        if shape_t.dtype != torch.int64 or shape_t.numel() != 2 or bool((shape_t < 1).any()):
            raise ValueError(f"path {str(path)!r} holds an invalid shape tensor {shape_t.tolist()}")
        shape = tuple(int(s) for s in shape_t.tolist())
        try:
            if storage == "planes":
                tt = cls(tensors["plus"], tensors["minus"], tensors["scales"], shape)
            elif storage == "base3":
                tt = cls.unpack_base3(tensors["base3"], shape, tensors["scales"])
            else:
                raise ValueError(f"unknown storage {storage!r}")
        except (TypeError, ValueError) as e:
            raise ValueError(f"path {str(path)!r} holds an invalid ternary tensor: {e}") from e
        return tt.to(device)

    # --------------------------------------------------------------- misc

    def __repr__(self) -> str:
        kind = "per-row" if self.per_row else "per-tensor"
        return (f"TernaryTensor(shape={self.shape}, scales={kind}, device={self.device}, resident={self.resident}, "
                f"bits_per_weight={self.bits_per_weight('resident'):.3f}, sparsity={self.sparsity():.4f})")


__all__ = [
    "TernaryTensor",
    "SparsityMetadata",
    "bits_to_words",
    "words_to_bits",
    "popcount32",
    "padding_mask",
    "WORD_BITS",
    "CHUNK_WORDS",
    "CHUNK_COLS",
    "FORMAT_VERSION",
]
