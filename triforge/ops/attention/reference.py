"""Exact attention in plain PyTorch: the golden reference (run it in float64).

Layout follows flash-attn: q [B, Sq, H, D], k/v [B, Sk, Hkv, D] with H a multiple of Hkv (query
head h reads key/value head h // (H // Hkv)). Causal masking is bottom-right aligned as in
flash-attn: query i sees keys j <= i + (Sk - Sq). A query row that sees no key returns 0 and its
log-sum-exp is -inf (never NaN).
"""

from collections import OrderedDict

import torch


def _expand_kv(t, n_heads):
    return t.repeat_interleave(n_heads // t.shape[2], dim=2)


def causal_mask(Sq: int, Sk: int, device=None) -> torch.Tensor:
    """[Sq, Sk] bool, True where query i may see key j (bottom-right aligned)."""
    i = torch.arange(Sq, device=device)[:, None]
    j = torch.arange(Sk, device=device)[None, :]
    return j <= i + (Sk - Sq)


def attention_ref(q, k, v, causal: bool = False, softmax_scale: float | None = None, key_mask=None):
    """Returns stages: lse [B, H, Sq] (natural log) and o [B, Sq, H, D].

    ``key_mask`` [B, Sq, Sk] bool (optional) further restricts which keys each query sees.
    """
    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    if Sk == 0:  # nothing to attend to: every row returns 0 with lse -inf
        lse = torch.full((B, H, Sq), float("-inf"), dtype=q.dtype, device=q.device)
        return OrderedDict(lse=lse, o=torch.zeros(B, Sq, H, v.shape[-1], dtype=q.dtype, device=q.device) + 0 * q.sum())
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    k, v = _expand_kv(k, H), _expand_kv(v, H)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    allowed = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)
    if causal:
        allowed = causal_mask(Sq, Sk, q.device)
    allowed = allowed.expand(B, 1, Sq, Sk)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows that see nothing: no exp(-inf - -inf)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = torch.einsum("bhqk,bkhd->bqhd", p / torch.where(l == 0, torch.ones_like(l), l), v)
    lse = torch.where(l == 0, torch.full_like(l, float("-inf")), m + torch.log(torch.where(l == 0, torch.ones_like(l), l)))
    return OrderedDict(lse=lse.squeeze(-1), o=o)


def _magnitude_floor(dtype) -> float:
    """The least a seen key's P or dS counts in attention_magnitudes for a kernel storing them in
    ``dtype``: max(dtype's smallest normal, fp32's smallest normal / u)."""
    return max(torch.finfo(dtype).tiny, torch.finfo(torch.float32).tiny / (torch.finfo(dtype).eps / 2))


def attention_magnitudes(q, k, v, do=None, causal: bool = False, softmax_scale: float | None = None, dtype=None):
    """The scale of each output element's rounding error (run it in float64): the root-sum-square of
    the terms that produce it. Kernels round each term (P to 16 bits before P V, dS before dS K, ...)
    independently, so a dot product's error grows like the rss of its terms, not like its result,
    which can cancel to ~0 (a causal row that sees one key has dq = 0; one that sees two has
    gradients ~100x those of a row that sees thousands), nor like the sum of |terms| (the worst case,
    ~sqrt(n) times the rss: it would hide real errors in long rows).

        o:  sqrt(P^2 V^2)                         (P the softmax probabilities)
        dS: P (max(|dP|, sqrt(dO^2 (V^2)^T)) + max(|delta|, sqrt(rowsum(dO^2 o^2))))
                                                  (dS = P (dP - delta), dP = dO V^T, delta = rowsum(dO o):
                                                  each dot's value, or the rss of its own terms where
                                                  it cancels below them - its rounding error does not
                                                  cancel: a row that sees one key has dP = delta and
                                                  dq = 0 in exact arithmetic, and their fp32 sums
                                                  round apart)
        dq: scale sqrt(dS^2 K^2),  dk: scale sqrt(dS^2^T Q^2),  dv: sqrt(P^2^T dO^2)
                                                  (dk, dv: the sum over each GQA group under the root)

    ``dtype``: the dtype the kernel stores P and dS in (its unit roundoff u). Rounding a term errs by
    at most u max(|term|, dtype's smallest normal) (below it the spacing is fixed), and a term under
    fp32's smallest normal, 1.2e-38, may come back as anything up to it (fp32 arithmetic flushes or
    loses it: bf16 gradients made of P ~ 1e-38 came back with errors ~1e-38). So each visible key's
    P and dS count at least max(dtype's smallest normal, fp32's smallest normal / u): fp16 6.1e-5
    (a near-one-hot row's other keys, P ~ 1e-9, are stored to 3e-8), bf16 3.0e-36. Without
    ``dtype`` the terms count at their values.

    Returns {"o"} and, with ``do``, also {"dq", "dk", "dv"}, in the shapes of o, q, k, v.
    """
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    out = OrderedDict()
    if Sk == 0:
        out["o"] = torch.zeros(B, Sq, H, v.shape[-1], dtype=q.dtype, device=q.device)
        if do is not None:
            out.update(dq=torch.zeros_like(q), dk=torch.zeros_like(k), dv=torch.zeros_like(v))
        return out
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    ke, ve = _expand_kv(k, H), _expand_kv(v, H)
    s = torch.einsum("bqhd,bkhd->bhqk", q, ke) * scale
    if causal:
        s = s.masked_fill(~causal_mask(Sq, Sk, q.device), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    l = p.sum(-1, keepdim=True)
    p = p / torch.where(l == 0, torch.ones_like(l), l)  # rows that see no key: p = 0
    floor = 0.0 if dtype is None else _magnitude_floor(dtype)
    visible = torch.isfinite(s)
    p2 = torch.where(visible, p.clamp_min(floor), 0.0).square()
    out["o"] = torch.einsum("bhqk,bkhd->bqhd", p2, ve.square()).sqrt()
    if do is None:
        return out
    o = torch.einsum("bhqk,bkhd->bqhd", p, ve)
    delta = (do * o).sum(-1).transpose(1, 2)[..., None]  # [B, H, Sq, 1]
    delta_rss = (do * o).square().sum(-1).sqrt().transpose(1, 2)[..., None]
    dp = torch.einsum("bqhd,bkhd->bhqk", do, ve).abs()
    dp_rss = torch.einsum("bqhd,bkhd->bhqk", do.square(), ve.square()).sqrt()
    ds = p * (torch.maximum(dp, dp_rss) + torch.maximum(delta.abs(), delta_rss))
    ds2 = torch.where(visible, ds.clamp_min(floor), 0.0).square()
    out["dq"] = scale * torch.einsum("bhqk,bkhd->bqhd", ds2, ke.square()).sqrt()
    group = H // Hkv
    dk2 = torch.einsum("bhqk,bqhd->bkhd", ds2, q.square()).view(B, Sk, Hkv, group, D).sum(3)
    out["dk"] = scale * dk2.sqrt()
    out["dv"] = torch.einsum("bhqk,bqhd->bkhd", p2, do.square()).view(B, Sk, Hkv, group, -1).sum(3).sqrt()
    return out


def varlen_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, softmax_scale=None):
    """Packed sequences: q [Tq, H, D], k/v [Tk, Hkv, D]; each sequence attended on its own.
    Returns stages lse [H, Tq] and o [Tq, H, D]."""
    outs, lses = [], []
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        st = attention_ref(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], causal, softmax_scale)
        outs.append(st["o"][0])
        lses.append(st["lse"][0])
    return OrderedDict(lse=torch.cat(lses, dim=1), o=torch.cat(outs, dim=0))


def kvcache_attention_ref(q, k_cache, v_cache, cache_seqlens, k=None, v=None, causal=True, softmax_scale=None):
    """Decode against a cache [B, S_max, Hkv, D]: new k/v [B, Sq, Hkv, D] (optional) are placed at
    cache_seqlens[b] and each batch row attends over its first cache_seqlens[b] + Sq keys.
    Returns (stages {lse, o}, updated k_cache, updated v_cache) without touching the inputs."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    B, Sq = q.shape[:2]
    outs, lses = [], []
    for b in range(B):
        n = int(cache_seqlens[b])
        if k is not None:
            k_cache[b, n : n + k.shape[1]] = k[b]
            v_cache[b, n : n + v.shape[1]] = v[b]
            n += k.shape[1]
        st = attention_ref(q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n], causal, softmax_scale)
        outs.append(st["o"])
        lses.append(st["lse"])
    return OrderedDict(lse=torch.cat(lses), o=torch.cat(outs)), k_cache, v_cache
