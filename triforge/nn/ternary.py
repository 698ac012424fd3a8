"""TernaryLinear: an nn.Linear replacement holding bit-sliced ternary weights (see triforge.ops.ternary)."""

import torch
from torch import nn

from triforge.ops.ternary import matmul
from triforge.ops.ternary.tensor import TernaryTensor, WORD_BITS


class TernaryLinear(nn.Module):
    """y = x @ (scales * trits)^T + bias, trits in {-1, 0, 1}.

    The planes ``plus`` / ``minus`` (int32 [out_features, ceil(in_features / 32)]) and ``scales`` (fp32) are
    buffers, so ``.to()``, ``state_dict()`` and ``load_state_dict()`` carry them; ``bias`` is a Parameter.

    ``compact()`` swaps the planes for one buffer ``codes`` (int32 [out_features, 8 ceil(in_features / 128)],
    the tensor-core kernel's 2-bit codes): fp16/bf16 inputs then read 2 bits per weight and nothing else is
    kept, where a planes layer also caches the codes on its first fp16/bf16 call (4 bits per weight resident).
    A compact layer's state_dict holds ``codes``; either kind loads the other's state_dict (converted).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, per_row: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"in_features and out_features must be >= 1, got {in_features}, {out_features}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        kw = -(-self.in_features // WORD_BITS)
        self.register_buffer("plus", torch.zeros(out_features, kw, dtype=torch.int32, device=device))
        self.register_buffer("minus", torch.zeros(out_features, kw, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.ones(out_features if per_row else 1, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype or torch.float32))
        else:
            self.register_parameter("bias", None)
        self._tt = None
        self._compact = False

    @classmethod
    def from_ternary(cls, tt: TernaryTensor, bias: torch.Tensor | None = None) -> "TernaryLinear":
        if not isinstance(tt, TernaryTensor):
            raise TypeError(f"tt must be a TernaryTensor, got {type(tt).__name__}")
        m = cls(tt.in_features, tt.out_features, bias=bias is not None, per_row=tt.per_row, device=tt.device,
                dtype=bias.dtype if bias is not None else None)
        if tt.resident == "codes":  # a compact tensor makes a compact layer (its codes, no planes)
            m._hold_codes(tt._tc_codes)
            m.scales = tt.scales
        else:
            m.plus, m.minus, m.scales = tt.plus, tt.minus, tt.scales
        if bias is not None:
            m.bias = nn.Parameter(bias.detach().clone().to(tt.device), requires_grad=bias.requires_grad)
        m._tt = tt
        return m

    @classmethod
    def from_linear(cls, linear: nn.Linear, method: str = "absmean", per_row: bool = True) -> "TernaryLinear":
        """Quantize ``linear.weight`` with ``method`` ("twn" or "absmean"); the bias is copied unchanged."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        tt = TernaryTensor.from_float(linear.weight.detach(), method=method, per_row=per_row)
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls.from_ternary(tt, bias)

    @property
    def ternary(self) -> TernaryTensor:
        """A TernaryTensor over the current buffers (its sparsity metadata is cached between calls)."""
        tt = self._tt
        shape = (self.out_features, self.in_features)
        if self._compact:
            if tt is None or tt._tc_codes is not self.codes or tt.scales is not self.scales:
                tt = self._tt = TernaryTensor._of_codes(self.codes, self.scales, shape)
            return tt
        if tt is None or tt._plus is not self.plus or tt._minus is not self.minus or tt.scales is not self.scales:
            tt = TernaryTensor(self.plus, self.minus, self.scales, shape, validate=False)
            self._tt = tt
        return tt

    def compact(self) -> "TernaryLinear":
        """Keep only the 2-bit tc codes (buffer ``codes``) and the scales (see the class docstring). Returns self."""
        if not self._compact:
            src = self.ternary  # possibly the caller's tensor (from_ternary): left as it was
            had = src._tc_codes is not None
            codes = src.tc_codes()
            if not had:
                src._tc_codes = None  # packed here for the layer: not left cached on the caller's tensor
            self._hold_codes(codes)
        return self

    def _hold_codes(self, codes: torch.Tensor) -> None:
        """The plane buffers go, ``codes`` becomes the weights' buffer (state_dict now holds codes)."""
        del self.plus, self.minus
        self.register_buffer("codes", codes)
        self._compact = True
        self._tt = None

    def _apply(self, fn, recurse=True):
        scales = self.scales
        super()._apply(fn, recurse)
        if self.scales.dtype != torch.float32:
            # module.to(dtype) / .half() cast floating buffers: keep the fp32 scales exact (moved only)
            self.scales = scales.to(self.scales.device)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        from triforge.ops.ternary import tc

        pk, mk, ck, sk = (prefix + n for n in ("plus", "minus", "codes", "scales"))
        shape = (self.out_features, self.in_features)
        try:
            if self._compact and ck not in state_dict and pk in state_dict and mk in state_dict:
                planes = TernaryTensor(state_dict[pk], state_dict[mk], state_dict.get(sk, self.scales).float(), shape)
                state_dict[ck] = tc.pack_tc(planes.plus, planes.minus, self.in_features)
                del state_dict[pk], state_dict[mk]
            elif ck in state_dict:
                codes = state_dict[ck]
                scales = state_dict.get(sk, self.scales).to(device=codes.device, dtype=torch.float32)
                tt = TernaryTensor.from_codes(codes, scales, shape)  # validated: shape, fields, padding
                if not self._compact and pk not in state_dict:
                    del state_dict[ck]
                    state_dict[pk], state_dict[mk] = tt.planes()
            elif pk in state_dict and mk in state_dict:  # planes into a planes layer: validated as well
                TernaryTensor(state_dict[pk], state_dict[mk], state_dict.get(sk, self.scales).float(), shape)
        except (TypeError, ValueError) as e:  # reported like torch's own size mismatches
            error_msgs.append(f"invalid ternary weights for {prefix or 'the layer'} ({shape[0]}x{shape[1]}): {e}")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._tt = None  # buffers were overwritten in place: metadata is stale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.ternary, self.bias)

    def extra_repr(self) -> str:
        tt = self.ternary
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"resident={tt.resident}, bits_per_weight={tt.bits_per_weight('resident'):.3f}, "
                f"sparsity={tt.sparsity():.3f}")


__all__ = ["TernaryLinear"]
