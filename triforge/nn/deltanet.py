"""GatedDeltaNet: Qwen3-Next's linear-attention layer, Hugging Face's ``Qwen3NextGatedDeltaNet``.

Parameters carry Hugging Face's names, shapes and layouts, so ``load_state_dict(hf.state_dict())``
works both ways. Per token, with H key heads, HV = r * H value heads, head dims K and V:

    in_proj_qkvz  [C] -> [H, 2K + 2rV], per key head: q [K] | k [K] | v [rV] | z [rV]
    in_proj_ba    [C] -> [H, 2r],       per key head: b [r] | a [r]
    q, k, v       silu(causal depthwise conv1d, kernel W) over [q | k | v] (D = 2HK + HV V channels)
    beta          sigmoid(b)                                 [HV]
    g             -exp(A_log) * softplus(a + dt_bias)        [HV], fp32
    o             gated delta rule(q, k, v, g, beta), q and k l2-normalised       [HV, V]
    out           out_proj(rms_norm(o) * norm.weight * silu(z))                     [C]

The state between calls is explicit (``GatedDeltaNetCache``): the last W - 1 inputs of the
convolution and the recurrent state [B, HV, K, V] in fp32.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from triforge.ops.norm import rms_norm

BACKENDS = ("triton", "torch")


class GatedDeltaNetCache(NamedTuple):
    """State carried from one call to the next (one sequence per batch row).

    conv_state: [B, D, W - 1], hidden_states' dtype: the convolution's last W - 1 inputs, channels
        first (D = 2 * H * K + HV * V, zeros before the first token).
    recurrent_state: [B, HV, K, V], fp32 (fp64 for a float64 module): the delta rule's state.
    """

    conv_state: torch.Tensor
    recurrent_state: torch.Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs (Hugging Face upcasts the recurrence), fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm_gated(hidden_states: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   backend: str = "triton") -> torch.Tensor:
    """(weight * rms_norm(x)) * silu(gate) over the last dim, in Qwen3NextRMSNormGated's numerics.

    The normalised x is rounded to x's dtype before the weight, the gate is applied in fp32 and the
    result is returned in x's dtype. ``backend="triton"`` normalises with triforge's rms_norm kernel.
    """
    dtype = hidden_states.dtype
    cdt = _compute_dtype(dtype)
    if backend == "triton":
        y = rms_norm(hidden_states, weight, eps)
    else:
        x = hidden_states.to(cdt)
        y = weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)).to(dtype)
    return (y * F.silu(gate.to(cdt))).to(dtype)


class RMSNormGated(nn.Module):
    """Hugging Face's Qwen3NextRMSNormGated (same parameter and attribute names): rms_norm(x) * silu(gate)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, backend: str = "triton", device=None, dtype=None):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.backend = backend

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return rms_norm_gated(hidden_states, gate, self.weight, self.variance_epsilon, self.backend)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, backend={self.backend!r}"


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class GatedDeltaNet(nn.Module):
    """Qwen3-Next gated DeltaNet layer: [B, T, C] -> [B, T, C], with an explicit recurrent cache.

    ``backend="triton"`` runs the delta rule with triforge's kernels (``chunk_gated_delta_rule``
    for T > 1, ``fused_recurrent_gated_delta_rule`` for one token) and the gated norm with the
    rms_norm kernel; ``backend="torch"`` runs everything in plain PyTorch (the delta rule token by
    token through ``triforge.ops.deltanet.reference.recurrent_ref``), computing in fp32 as Hugging
    Face does.
    """

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel_size: int = 4, eps: float = 1e-6, *, backend: str = "triton", device=None, dtype=None):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_k_heads", num_k_heads),
                            ("num_v_heads", num_v_heads), ("head_k_dim", head_k_dim),
                            ("head_v_dim", head_v_dim), ("conv_kernel_size", conv_kernel_size)):
            _positive_int(name, value)
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
        if backend == "triton":  # the kernels' head dims (the torch backend takes any)
            from triforge.ops.deltanet import K_DIMS, V_DIMS

            if head_k_dim not in K_DIMS:
                raise ValueError(f"head_k_dim must be one of {K_DIMS} with backend='triton', got {head_k_dim}")
            if head_v_dim not in V_DIMS:
                raise ValueError(f"head_v_dim must be one of {V_DIMS} with backend='triton', got {head_v_dim}")
        self.hidden_size = hidden_size
        self.num_k_heads = num_k_heads
        self.num_v_heads = num_v_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.key_dim = num_k_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = conv_kernel_size
        self.layer_norm_epsilon = eps
        self.backend = backend
        factory = {"device": device, "dtype": dtype}
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim, bias=False,
                                padding=conv_kernel_size - 1, **factory)
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False, **factory)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False, **factory)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads, **factory))
        # A in [0.01, 16): exp(A_log) is the per-head decay rate, kept away from 0 so A_log is finite
        self.A_log = nn.Parameter(torch.empty(num_v_heads, **factory))
        if self.A_log.device.type != "meta":
            with torch.no_grad():
                self.A_log.copy_(torch.empty(num_v_heads, dtype=torch.float32).uniform_(0.01, 16).log())
        self.norm = RMSNormGated(head_v_dim, eps, backend=backend, **factory)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **factory)

    @classmethod
    def from_config(cls, config, *, backend: str = "triton", device=None, dtype=None) -> "GatedDeltaNet":
        """A freshly initialised layer with the dimensions of a Hugging Face ``Qwen3NextConfig``."""
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"config.hidden_act must be 'silu' (the convolution's activation), got {act!r}")
        return cls(config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                   config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim,
                   config.rms_norm_eps, backend=backend, device=device, dtype=dtype)

    @classmethod
    def from_hf(cls, module: nn.Module, *, backend: str = "triton") -> "GatedDeltaNet":
        """A GatedDeltaNet sharing (not copying) the parameters of a ``Qwen3NextGatedDeltaNet``."""
        needed = ("hidden_size", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel_size",
                  "layer_norm_epsilon", "in_proj_qkvz", "in_proj_ba", "conv1d", "dt_bias", "A_log", "norm",
                  "out_proj")
        missing = [n for n in needed if not hasattr(module, n)]
        if missing:
            raise TypeError(f"module must be a Qwen3NextGatedDeltaNet; {type(module).__name__} lacks {missing}")
        act = getattr(module, "activation", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"module.activation must be 'silu' (the convolution's activation), got {act!r}")
        new = cls(module.hidden_size, module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim,
                  module.conv_kernel_size, module.layer_norm_epsilon, backend=backend, device="meta",
                  dtype=module.A_log.dtype)
        new.in_proj_qkvz, new.in_proj_ba = module.in_proj_qkvz, module.in_proj_ba
        new.conv1d, new.out_proj = module.conv1d, module.out_proj
        new.dt_bias, new.A_log = module.dt_bias, module.A_log
        new.norm.weight = module.norm.weight
        eps = getattr(module.norm, "variance_epsilon", module.layer_norm_epsilon)
        new.norm.variance_epsilon = new.layer_norm_epsilon = eps
        return new

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_k_heads={self.num_k_heads}, num_v_heads={self.num_v_heads}, "
                f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, "
                f"conv_kernel_size={self.conv_kernel_size}, backend={self.backend!r}")

    def empty_cache(self, batch_size: int, *, dtype=None, device=None) -> GatedDeltaNetCache:
        """The state before any token: zeros (``dtype`` defaults to the parameters')."""
        dtype = dtype or self.in_proj_qkvz.weight.dtype
        device = device or self.in_proj_qkvz.weight.device
        return GatedDeltaNetCache(
            torch.zeros(batch_size, self.conv_dim, self.conv_kernel_size - 1, dtype=dtype, device=device),
            torch.zeros(batch_size, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                        dtype=_compute_dtype(dtype), device=device),
        )

    def _check_packed(self, hidden_states, attention_mask, cu_seqlens) -> None:
        if cu_seqlens is None:
            return
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor or None, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be a 1-D int32 or int64 tensor of N + 1 >= 2 offsets, "
                             f"got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device != hidden_states.device:
            raise ValueError(f"cu_seqlens must be on {hidden_states.device}, got {cu_seqlens.device}")
        if hidden_states.shape[0] != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (sequences packed along T), "
                             f"got hidden_states of shape {tuple(hidden_states.shape)}")
        if attention_mask is not None:
            raise ValueError("cu_seqlens (packed sequences) cannot be combined with attention_mask: packed sequences "
                             "have no padding")
        if self.backend == "torch" and not torch.compiler.is_compiling():
            # the offsets' values, read on the host; with backend='triton' the chunked op reads and checks them (one
            # device sync per call, not two), and the convolution before it indexes only inside its own buffer
            from triforge.ops.deltanet import _check_cu_seqlens

            _check_cu_seqlens(cu_seqlens, hidden_states.shape[1])

    def _check_inputs(self, hidden_states, cache, use_cache, attention_mask, cu_seqlens=None) -> None:
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        weight = self.in_proj_qkvz.weight
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [B, T, {self.hidden_size}] (hidden_size={self.hidden_size}), "
                             f"got shape {tuple(hidden_states.shape)}")
        if hidden_states.numel() == 0:
            raise ValueError(f"hidden_states must not be empty, got shape {tuple(hidden_states.shape)}")
        if hidden_states.dtype != weight.dtype:
            raise TypeError(f"hidden_states must have the parameters' dtype {weight.dtype}, got {hidden_states.dtype}")
        if hidden_states.device != weight.device:
            raise ValueError(f"hidden_states must be on the parameters' device {weight.device}, "
                             f"got {hidden_states.device}")
        if self.backend == "triton" and hidden_states.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"hidden_states must be float32, float16 or bfloat16 with backend='triton', "
                            f"got {hidden_states.dtype}")
        if not isinstance(use_cache, bool):
            raise TypeError(f"use_cache must be a bool, got {type(use_cache).__name__}")
        B, T = hidden_states.shape[:2]
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor):
                raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__}")
            if tuple(attention_mask.shape) != (B, T):
                raise ValueError(f"attention_mask must be [B, T] = {(B, T)}, got {tuple(attention_mask.shape)}")
            if attention_mask.device != hidden_states.device:
                raise ValueError(f"attention_mask must be on {hidden_states.device}, got {attention_mask.device}")
        self._check_packed(hidden_states, attention_mask, cu_seqlens)
        if cache is None:
            return
        rows, what = (B, f"hidden_states of batch {B}") if cu_seqlens is None else \
            (cu_seqlens.shape[0] - 1, f"{cu_seqlens.shape[0] - 1} packed sequences")
        if not isinstance(cache, GatedDeltaNetCache):
            raise TypeError(f"cache must be a GatedDeltaNetCache or None, got {type(cache).__name__}")
        expected = {
            "conv_state": ((rows, self.conv_dim, self.conv_kernel_size - 1), hidden_states.dtype),
            "recurrent_state": ((rows, self.num_v_heads, self.head_k_dim, self.head_v_dim),
                                _compute_dtype(hidden_states.dtype)),
        }
        for name, (shape, dtype) in expected.items():
            t = getattr(cache, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"cache.{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(f"cache.{name} must have shape {shape} for {what}, got {tuple(t.shape)}")
            if t.dtype != dtype:
                raise TypeError(f"cache.{name} must have dtype {dtype}, got {t.dtype}")
            if t.device != hidden_states.device:
                raise ValueError(f"cache.{name} must be on {hidden_states.device}, got {t.device}")

    def _short_conv(self, mixed: torch.Tensor, conv_state, cu_seqlens=None):
        """Causal depthwise conv + silu over [B, T, D]; returns ([B, T, D], the last W - 1 inputs [B, D, W - 1]).

        With ``cu_seqlens`` (B = 1) each packed sequence is convolved on its own: W - 1 zeros (or its row of
        ``conv_state``) go before every sequence, as before a batch row, so no sequence sees its
        predecessor's last tokens; the state returned has one row per sequence."""
        T, W = mixed.shape[1], self.conv_kernel_size
        x = mixed.transpose(1, 2)  # [B, D, T]
        if cu_seqlens is not None:
            # token t of sequence i goes to t + (i + 1)(W - 1) of a row whose W - 1 slots before each sequence hold
            # zeros or its cached inputs: the same convolution as separate calls, in one conv1d, without a host read
            n = cu_seqlens.shape[0] - 1
            t = torch.arange(T, device=x.device)
            cu = cu_seqlens.to(t.dtype)
            # the sequence of token t: how many inner boundaries lie at or before it (a count and a cumulative sum,
            # not searchsorted: Inductor's CUDA lowering of that on a slice of a computed offset raises)
            starts = torch.zeros(T + 1, dtype=t.dtype, device=x.device)
            starts.index_add_(0, cu[1:-1].clamp(0, T), torch.ones_like(cu[1:-1]))
            seq = starts[:T].cumsum(0).clamp_(max=n - 1)
            dest = t + (seq + 1) * (W - 1)
            window = torch.arange(n, device=x.device)[:, None] * (W - 1) + torch.arange(W - 1, device=x.device)  # [n, W-1]
            size = T + n * (W - 1)
            spread = x.new_zeros(x.shape[1], size)  # [D, T + n (W - 1)]
            # the slots before (and the last W - 1 of) each sequence; clamped so that offsets the chunked op will
            # refuse cannot index outside the buffer first (a device-side assert on a GPU)
            before, last = ((cu[:-1, None] + window).clamp(0, size - 1), (cu[1:, None] + window).clamp(0, size - 1))
            if conv_state is not None:
                spread[:, before] = conv_state.transpose(0, 1).to(x.dtype)
            spread[:, dest] = x[0]
            new_state = spread[:, last].transpose(0, 1).contiguous()  # each sequence's last W - 1
            w = self.conv1d.weight
            y = F.silu(F.conv1d(spread[None].to(w.dtype), w, self.conv1d.bias, groups=self.conv_dim))[..., dest - (W - 1)]
            return y.to(mixed.dtype).transpose(1, 2), new_state
        if conv_state is None:
            x = F.pad(x, (W - 1, 0))
        else:
            x = torch.cat([conv_state, x], dim=-1)
        new_state = x[..., T:].contiguous()  # [B, D, W - 1]
        w = self.conv1d.weight
        y = F.silu(F.conv1d(x.to(w.dtype), w, self.conv1d.bias, groups=self.conv_dim))
        return y.to(mixed.dtype).transpose(1, 2), new_state

    def _delta_rule(self, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens=None):
        # imported here: the kernels load (and compile) only when the layer first runs
        if self.backend == "torch":
            from triforge.ops.deltanet.reference import recurrent_ref

            return recurrent_ref(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                                 use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, dtype=_compute_dtype(v.dtype))
        from triforge.ops.deltanet import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        # the recurrent kernel is forward only: one token that needs gradients goes through the chunked op
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta))
        if cu_seqlens is not None:
            return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=True,
                                          cu_seqlens=cu_seqlens)
        rule = fused_recurrent_gated_delta_rule if q.shape[1] == 1 and not needs_grad else chunk_gated_delta_rule
        return rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                    use_qk_l2norm_in_kernel=True)

    def forward(self, hidden_states: torch.Tensor, cache: GatedDeltaNetCache | None = None, use_cache: bool = False,
                attention_mask: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None):
        """hidden_states [B, T, C] -> (out [B, T, C], new cache or None).

        ``cache`` continues each row's sequence from a previous call; the new cache is returned when
        ``use_cache`` is set or a cache was given (the old one is not modified). ``attention_mask``
        [B, T] (1 keep, 0 padding) zeroes padded tokens' inputs, as Hugging Face does.
        ``cu_seqlens`` [N + 1] (int32 / int64, B = 1): N sequences packed along T, each on its own,
        equal to N separate calls: its convolution and delta rule start from zeros, or from row i of
        ``cache`` (a cache of N rows: e.g. one returned by a packed call, or by a batch of N), and the
        new cache holds N rows, one per sequence (an empty sequence's passes through). Packed
        sequences have no padding: ``attention_mask`` is refused with them.
        """
        self._check_inputs(hidden_states, cache, use_cache, attention_mask, cu_seqlens)
        B, T, _ = hidden_states.shape
        H, HV, K, V = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        r = HV // H
        if attention_mask is not None:
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        qkvz = self.in_proj_qkvz(hidden_states).view(B, T, H, 2 * K + 2 * r * V)
        q, k, v, z = qkvz.split([K, K, r * V, r * V], dim=-1)
        b, a = self.in_proj_ba(hidden_states).view(B, T, H, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(B, T, H * K), k.reshape(B, T, H * K), v.reshape(B, T, HV * V)], dim=-1)
        mixed, conv_state = self._short_conv(mixed, None if cache is None else cache.conv_state, cu_seqlens)
        q, k, v = mixed.split([H * K, H * K, HV * V], dim=-1)
        q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V)
        beta = b.reshape(B, T, HV).sigmoid()
        cdt = _compute_dtype(hidden_states.dtype)
        g = -self.A_log.to(cdt).exp() * F.softplus(a.reshape(B, T, HV).to(cdt) + self.dt_bias)
        keep_state = use_cache or cache is not None
        o, state = self._delta_rule(q, k, v, g, beta, None if cache is None else cache.recurrent_state, keep_state,
                                    cu_seqlens)
        o = rms_norm_gated(o, z.reshape(B, T, HV, V), self.norm.weight, self.norm.variance_epsilon, self.backend)
        out = self.out_proj(o.reshape(B, T, HV * V))
        return out, (GatedDeltaNetCache(conv_state, state) if keep_state else None)


class HFGatedDeltaNet(GatedDeltaNet):
    """GatedDeltaNet with Qwen3NextGatedDeltaNet's call signature, reading and writing Hugging Face's cache.

    ``forward(hidden_states, cache=None, attention_mask=None)`` returns only the output, as Hugging
    Face's layer does (the cache is also taken as ``cache_params``, its name before transformers 5.24);
    packed sequences come as Hugging Face passes them (``cu_seq_lens_q``, e.g. from
    DataCollatorWithFlattening), each run on its own (Hugging Face's PyTorch path ignores them and
    runs the packed row as one sequence: convolution and state carry across);
    the states live in the cache (a ``DynamicCache`` holding a
    linear-attention layer at ``layer_idx``). Hugging Face keeps W conv inputs where this layer needs
    W - 1: the oldest of the W, never read, is not kept exact.
    """

    def __init__(self, *args, layer_idx: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.layer_idx = layer_idx

    @classmethod
    def from_hf(cls, module: nn.Module, *, backend: str = "triton") -> "HFGatedDeltaNet":
        new = super().from_hf(module, backend=backend)
        new.layer_idx = getattr(module, "layer_idx", 0)
        return new

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None,
                cache_params=None, **kwargs):
        # transformers 5.24 renamed the argument ``cache_params`` to ``cache`` (its decoder layer passes ``cache=``);
        # both are taken, as Hugging Face's own layer does
        if cache is not None and cache_params is not None and cache is not cache_params:
            raise ValueError("HFGatedDeltaNet: pass the cache as `cache` or `cache_params`, not two different ones")
        cache_params = cache if cache is not None else cache_params
        idx, W = self.layer_idx, self.conv_kernel_size
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is not None:
            # packed sequences (flash-attention style, e.g. DataCollatorWithFlattening): each on its own. Hugging
            # Face's cache has one row per batch row, not per sequence: none is written. Its models make an empty
            # one whenever use_cache is on (the config's default, in training too), so an empty cache is taken,
            # and marked: a later call must not continue from it as if nothing had run
            if cache_params is not None:
                if cache_params.has_previous_state(idx):
                    raise NotImplementedError("HFGatedDeltaNet: packed sequences (cu_seq_lens_q) after earlier tokens "
                                              "in the cache (Hugging Face's cache holds one state per batch row, not "
                                              "per packed sequence)")
                cache_params._triforge_packed = getattr(cache_params, "_triforge_packed", set()) | {idx}
            return super().forward(hidden_states, attention_mask=attention_mask, cu_seqlens=cu_seqlens)[0]
        if cache_params is None:
            return super().forward(hidden_states, attention_mask=attention_mask)[0]
        if idx in getattr(cache_params, "_triforge_packed", ()):
            raise NotImplementedError("HFGatedDeltaNet: this cache went through a packed call (cu_seq_lens_q), which "
                                      "keeps no state in it; continue packed sequences with GatedDeltaNet's own "
                                      "cache (one row per sequence)")
        if idx < len(cache_params.layers) and getattr(cache_params.layers[idx], "record_past", False):
            raise NotImplementedError("HFGatedDeltaNet does not support caches that record past states "
                                      "(assisted generation)")
        cache = None
        if cache_params.has_previous_state(idx):
            layer = cache_params.layers[idx]
            conv = layer.conv_states[0]
            cache = GatedDeltaNetCache(conv[..., conv.shape[-1] - (W - 1):], layer.recurrent_states[0])
        out, new = super().forward(hidden_states, cache=cache, use_cache=True, attention_mask=attention_mask)
        cache_params.update_conv_state(new.conv_state, idx, conv_kernel_size=W)
        cache_params.update_recurrent_state(new.recurrent_state, idx)
        return out


def patch_hf_gated_deltanet(model: nn.Module, *, backend: str = "triton") -> int:
    """Replace every ``Qwen3NextGatedDeltaNet`` of a Hugging Face model in place by an HFGatedDeltaNet.

    Returns the number of modules replaced; weights are shared, not copied.
    """
    targets = [name for name, m in model.named_modules()
               if type(m).__name__.endswith("GatedDeltaNet") and not isinstance(m, GatedDeltaNet)]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, HFGatedDeltaNet.from_hf(getattr(parent, child), backend=backend))
    return len(targets)
