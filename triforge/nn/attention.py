"""triforge's FlashAttention as a Hugging Face attention implementation.

    triforge.nn.register_hf_attention()                       # once: registers "triforge"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="triforge")
    model.set_attn_implementation("triforge")                 # or on a model already built

Every Hugging Face model that dispatches through ``ALL_ATTENTION_FUNCTIONS`` (Llama, Qwen2, Qwen3,
Mistral, ...) then runs triforge's kernels, forward and backward, as it would run flash-attn's.
The mask is Hugging Face's flash-attention mask (None when nothing is padded, else the 2D padding
mask; here also the 2D mask of the tokens seen where a static cache's keys run past them), so

- a 2D mask (padding, or a static cache): the rows are unpadded into packed sequences for
  ``flash_attn_varlen_func`` and the output is scattered back, padded query rows getting zeros (as
  flash-attn's path does);
- packed sequences, batch 1: given as ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``max_length_q`` /
  ``max_length_k``), or only by ``position_ids`` that restart (DataCollatorWithFlattening's two
  forms): ``flash_attn_varlen_func`` over them;
- a decoding step (one query per row against the cached keys, no gradient wanted, head dim 64 or
  128): ``flash_attn_with_kvcache`` over the keys as they are (flash-decoding: the keys split across
  programs, so batch-1 decoding fills the GPU);
- otherwise ``flash_attn_func`` with the module's causality (bottom-right aligned, which is where
  cached decoding puts the queries).

Dropout, softcapping and attention sinks are refused by name (the kernels have none); a sliding
window is accepted while it spans every key (Mistral's 4096 over shorter sequences) and refused
once it would cut one off.
"""

import torch
import torch.nn.functional as F

NAME = "triforge"


def _seqlens(mask: torch.Tensor):
    """A [B, L] bool mask -> (cu_seqlens int32 [B + 1] of its kept positions, longest row)."""
    lengths = mask.sum(-1, dtype=torch.int32)
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)), int(lengths.max())


def _restarts(position_ids, B: int, Sq: int, Sk: int):
    """cu_seqlens int32 of the sequences packed in one row, from position ids that restart (a new sequence
    starts wherever the position does not follow the previous one), or None: no position ids, not a
    single-row prefill, or one sequence. Reads the positions on the host (as Hugging Face's flash path does)."""
    if position_ids is None or B != 1 or Sq != Sk or Sq < 2 or position_ids.numel() != Sq:
        return None
    p = position_ids.reshape(-1)
    starts = ((p[1:] - p[:-1]) != 1).nonzero().flatten() + 1
    if starts.numel() == 0:
        return None
    ends = torch.tensor([0, Sq], dtype=starts.dtype, device=starts.device)
    return torch.cat([ends[:1], starts, ends[1:]]).to(torch.int32)


def _decode_step(q, k, *tensors) -> bool:
    """One query per row against more keys (a cached decoding step), at a head dim flash-decoding takes,
    with no gradient wanted."""
    from triforge.ops.attention.decode import HEAD_DIMS as DECODE_HEAD_DIMS

    if q.shape[1] != 1 or k.shape[1] <= 1 or q.shape[-1] not in DECODE_HEAD_DIMS:
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def hf_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                         softcap=None, **kwargs):
    """Hugging Face's attention-function signature: query [B, H, Sq, D], key / value [B, Hkv, Sk, D] (heads
    not repeated), ``attention_mask`` None or [B, L] (L <= Sk: a static cache's unused slots lie past L).
    Returns (attn_output [B, Sq, H, D], None)."""
    from triforge.ops.attention import flash_attn_func, flash_attn_varlen_func

    if dropout:
        raise NotImplementedError(f"attn_implementation='{NAME}': dropout={dropout} (the kernels have no dropout; "
                                  "set the model's attention_dropout to 0)")
    if sliding_window is not None and key.shape[2] > sliding_window:  # query i sees key j where i - j < window
        raise NotImplementedError(f"attn_implementation='{NAME}': sliding_window={sliding_window} shorter than the "
                                  f"{key.shape[2]} keys is not supported")
    if softcap:
        raise NotImplementedError(f"attn_implementation='{NAME}': softcap={softcap} is not supported")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"attn_implementation='{NAME}': attention sinks (s_aux) are not supported")
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, heads, D], last dim contiguous
    B, Sq, H = q.shape[:3]
    if attention_mask is None:
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if cu_q is None and cu_k is None:
            cu_q = cu_k = _restarts(kwargs.get("position_ids"), B, Sq, k.shape[1])
        if cu_q is None and cu_k is None:
            if _decode_step(q, k, query, key, value):
                # one new token against the cached keys, nothing to differentiate: flash-decoding splits the keys
                # across programs (the training kernel would run one program per head over all of them); the
                # length is a Python int, so no host sync and the step stays graph-capturable
                from triforge.ops.attention.decode import flash_attn_with_kvcache

                return flash_attn_with_kvcache(q, k, v, cache_seqlens=k.shape[1], causal=causal,
                                               softmax_scale=scaling), None
            return flash_attn_func(q, k, v, causal=causal, softmax_scale=scaling), None
        if cu_q is None or cu_k is None or B != 1:
            raise ValueError(f"attn_implementation='{NAME}': packed sequences need cu_seq_lens_q and cu_seq_lens_k "
                             f"with batch 1, got {'both' if cu_q is not None and cu_k is not None else 'one'} "
                             f"with batch {B}")
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = int(max_q) if max_q is not None else int((cu_q[1:] - cu_q[:-1]).max())
        max_k = int(max_k) if max_k is not None else int((cu_k[1:] - cu_k[:-1]).max())
        out = flash_attn_varlen_func(q[0], k[0], v[0], cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k,
                                     causal=causal, softmax_scale=scaling)
        return out[None], None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] > k.shape[1]:
        raise ValueError(f"attn_implementation='{NAME}' takes Hugging Face's flash-attention mask: None or [B, L <= "
                         f"Sk] = [{B}, <= {k.shape[1]}], got shape {tuple(attention_mask.shape)}")
    mask_k = attention_mask.bool()
    L = mask_k.shape[1]
    if not causal:  # the mask is the keys' (an encoder's padding, for cross-attention): every query is kept
        mask_q = torch.ones(B, Sq, dtype=torch.bool, device=mask_k.device)
    elif Sq == L:  # self-attention prefill: the queries are the keys' tokens
        mask_q = mask_k
    else:  # self-attention: the queries are the last Sq of the tokens the mask covers
        mask_q = mask_k[:, -Sq:] if Sq < L else F.pad(mask_k, (Sq - L, 0), value=True)
    cu_k, max_k = _seqlens(mask_k)
    cu_q, max_q = (cu_k, max_k) if mask_q is mask_k else _seqlens(mask_q)
    # the kept rows gathered straight from the [B, S, heads, D] views (one copy each), packed row-major as cu_* count
    out_un = flash_attn_varlen_func(q[mask_q], k[:, :L][mask_k], v[:, :L][mask_k], cu_q, cu_k, max_q, max_k,
                                    causal=causal, softmax_scale=scaling)
    out = out_un.new_zeros(B, Sq, H, out_un.shape[-1])
    out[mask_q] = out_un
    return out, None


def hf_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                      attention_mask=None, **kwargs):
    """Hugging Face's flash-attention mask (None, or the 2D padding mask sliced to the keys), and for a causal
    mask that is None while the keys run past the tokens seen (a static cache's unused slots), the 2D mask
    of the seen ones: the kernels align the queries with the last key, so the unused slots must be cut off.
    A bidirectional mask (an encoder's, or cross-attention's, where the keys are another sequence) is left
    as Hugging Face makes it."""
    from transformers.masking_utils import causal_mask_function, flash_attention_mask

    mask = flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                                mask_function or causal_mask_function, attention_mask, **kwargs)
    seen = int(q_offset) + int(q_length)
    if mask is None and seen < kv_length and "allow_is_bidirectional_skip" not in kwargs:  # not create_bidirectional_mask
        mask = torch.ones(batch_size, seen, dtype=torch.bool, device=kwargs.get("device"))
    return mask


def register_hf_attention(name: str = NAME) -> str:
    """Register triforge's attention with Hugging Face transformers under ``name`` (hf_attention_forward and
    hf_attention_mask); returns the name for ``attn_implementation``."""
    import transformers

    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as e:
        raise ImportError(f"register_hf_attention needs a transformers with AttentionInterface and "
                          f"AttentionMaskInterface (4.53 or later); found {transformers.__version__}") from e
    AttentionInterface.register(name, hf_attention_forward)
    AttentionMaskInterface.register(name, hf_attention_mask)
    return name
