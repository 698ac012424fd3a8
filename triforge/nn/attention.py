"""triforge's FlashAttention as a Hugging Face attention implementation.

    triforge.nn.register_hf_attention()                       # once: registers "triforge"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="triforge")
    model.set_attn_implementation("triforge")                 # or on a model already built

Every Hugging Face model that dispatches through ``ALL_ATTENTION_FUNCTIONS`` (Llama, Qwen2, Qwen3,
Mistral, ...) then runs triforge's kernels, forward and backward, as it would run flash-attn's:
the mask is Hugging Face's flash-attention mask (None when nothing is padded, else the 2D padding
mask), so

- no padding: ``flash_attn_func`` with the module's causality (bottom-right aligned, which is where
  cached decoding puts the queries);
- padding (a 2D mask): the rows are unpadded into packed sequences for ``flash_attn_varlen_func``
  and the output is scattered back, padded query rows getting zeros (as flash-attn's path does);
- packed sequences (``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k``,
  as DataCollatorWithFlattening passes them, batch 1): ``flash_attn_varlen_func`` directly.

Dropout, sliding windows, softcapping and attention sinks are refused by name (the kernels have none).
"""

import torch
import torch.nn.functional as F

NAME = "triforge"


def _seqlens(mask: torch.Tensor):
    """A [B, L] bool mask -> (flat indices of its kept positions, cu_seqlens int32 [B + 1], longest row)."""
    lengths = mask.sum(-1, dtype=torch.int32)
    idx = mask.flatten().nonzero().flatten()
    cu = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return idx, cu, int(lengths.max())


def hf_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                         softcap=None, **kwargs):
    """Hugging Face's attention-function signature: query [B, H, Sq, D], key / value [B, Hkv, Sk, D] (heads
    not repeated), ``attention_mask`` None or [B, L] (L <= Sk: a static cache's unused slots lie past L).
    Returns (attn_output [B, Sq, H, D], None)."""
    from triforge.ops.attention import flash_attn_func, flash_attn_varlen_func

    if dropout:
        raise NotImplementedError(f"attn_implementation='{NAME}': dropout={dropout} (the kernels have no dropout; "
                                  "set the model's attention_dropout to 0)")
    if sliding_window is not None:
        raise NotImplementedError(f"attn_implementation='{NAME}': sliding_window={sliding_window} is not supported")
    if softcap:
        raise NotImplementedError(f"attn_implementation='{NAME}': softcap={softcap} is not supported")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"attn_implementation='{NAME}': attention sinks (s_aux) are not supported")
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, heads, D], last dim contiguous
    B, Sq, H, D = q.shape
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
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
    if attention_mask is None:
        return flash_attn_func(q, k, v, causal=causal, softmax_scale=scaling), None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] > k.shape[1]:
        raise ValueError(f"attn_implementation='{NAME}' takes Hugging Face's flash-attention mask: None or [B, L <= "
                         f"Sk] = [{B}, <= {k.shape[1]}], got shape {tuple(attention_mask.shape)}")
    mask_k = attention_mask.bool()
    L = mask_k.shape[1]
    mask_q = mask_k[:, -Sq:] if Sq <= L else F.pad(mask_k, (Sq - L, 0), value=True)
    idx_q, cu_q, max_q = _seqlens(mask_q)
    idx_k, cu_k, max_k = _seqlens(mask_k)
    Hkv = k.shape[2]
    q_un = q.reshape(B * Sq, H, D)[idx_q]
    k_un = k[:, :L].reshape(B * L, Hkv, D)[idx_k]
    v_un = v[:, :L].reshape(B * L, Hkv, v.shape[-1])[idx_k]
    out_un = flash_attn_varlen_func(q_un, k_un, v_un, cu_q, cu_k, max_q, max_k, causal=causal, softmax_scale=scaling)
    out = out_un.new_zeros(B * Sq, H, out_un.shape[-1]).index_copy(0, idx_q, out_un)
    return out.view(B, Sq, H, -1), None


def register_hf_attention(name: str = NAME) -> str:
    """Register triforge's attention with Hugging Face transformers under ``name`` (its attention function and
    the flash-attention mask, None or the 2D padding mask); returns the name for ``attn_implementation``."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    AttentionInterface.register(name, hf_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
