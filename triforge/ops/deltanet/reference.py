"""Gated DeltaNet (Qwen3-Next linear attention) in plain PyTorch: the golden reference.

Per sequence and value head a state S [K, V]; per token t

    S   <- exp(g_t) S
    u_t  = beta_t (v_t - S^T k_t)
    S   <- S + k_t u_t^T
    o_t  = S^T (scale q_t)

with scale = K^-1/2 by default, g <= 0 the log-space decay and beta in (0, 1). Value head hv reads
query/key head hv // (HV // H). With ``use_qk_l2norm_in_kernel`` q and k are first scaled to unit
length as Hugging Face's ``l2norm`` does: x * rsqrt(sum(x^2) + 1e-6).

Chunked form (chunk C = 64, WY representation), per chunk n with state S_n entering it:

    gamma  = cumsum(g) inside the chunk                         [C]
    decay  = exp(gamma_i - gamma_j) for i >= j, else 0          [C, C]
    A      = strictly_lower(beta_i k_i.k_j) * decay             [C, C]
    T      = (I + A)^-1                                         [C, C]
    w      = T diag(beta e^gamma) K                             [C, K]
    u      = T diag(beta) V                                     [C, V]
    v_new  = u - w S_n                                          [C, V]
    S_n+1  = e^gamma_last S_n + K^T diag(e^(gamma_last - gamma)) v_new
    o      = scale (diag(e^gamma) Q S_n + ((Q K^T) * decay) v_new)

Layouts (shared with the kernels' stage buffers): q, k [B, T, H, K]; v [B, T, HV, V]; g, beta
[B, T, HV]; gamma [B, T, HV]; decay, A, T [B, T, HV, C] (row t holds its chunk's row, columns
indexed from the chunk start); w [B, T, HV, K]; u, v_new, o [B, T, HV, V]; h [B, NT, HV, K, V]
(the state entering each chunk; with cu_seqlens B = 1 and NT counts the chunks of every sequence);
states [N, HV, K, V]. With cu_seqlens (B = 1) each sequence [cu[i], cu[i+1]) starts its own chunks.
"""

from collections import OrderedDict

import torch

CHUNK = 64
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (Hugging Face's / fla's l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def sequences(B: int, T: int, cu_seqlens) -> list[tuple[int, int, int]]:
    """(batch row, bos, eos) of every sequence: one per batch row, or one per cu_seqlens span."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, dtype):
    """Upcast to ``dtype``, expand q/k heads to HV, l2-normalise if asked; scale folded into q."""
    H, HV, K = q.shape[2], v.shape[2], q.shape[3]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    return q * scale, k, v, g, beta


def recurrent_ref(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    *,
    dtype=torch.float64,
):
    """Token by token, in ``dtype`` (float64 by default).

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; initial_state [N, HV, K, V].
    Returns (o [B, T, HV, V] in v's dtype, final state [N, HV, K, V] or None). The final state is
    float64 for float64 inputs, else float32.
    """
    B, T = q.shape[:2]
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    q, k, vv, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, dtype)
    if cu_seqlens is None:
        spans = [(slice(0, B), 0, T, initial_state)]  # every batch row at once
    else:
        spans = [(slice(0, 1), s, e, None if initial_state is None else initial_state[i : i + 1])
                 for i, (_, s, e) in enumerate(sequences(B, T, cu_seqlens))]
    outs, finals = [], []
    for rows, bos, eos, S in spans:
        S = torch.zeros(rows.stop - rows.start, HV, K, V, dtype=dtype, device=v.device) if S is None else S.to(dtype)
        for t in range(bos, eos):
            q_t, k_t, v_t = q[rows, t], k[rows, t], vv[rows, t]                # [b, HV, K or V]
            S = S * g[rows, t].exp()[..., None, None]                          # [b, HV, K, V]
            u = beta[rows, t][..., None] * (v_t - (S * k_t[..., None]).sum(-2))
            S = S + k_t[..., None] * u[..., None, :]
            outs.append((S * q_t[..., None]).sum(-2))
        finals.append(S)
    o = torch.stack(outs, 1) if outs else vv.new_zeros(B, 0, HV, V)
    final = torch.cat(finals).to(torch.float64 if v.dtype == torch.float64 else torch.float32) if output_final_state else None
    return o.to(v.dtype), final


def chunk_ref_stages(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    *,
    dtype=torch.float64,
    chunk_size=CHUNK,
):
    """The chunked algorithm stage by stage, in ``dtype``; returns an OrderedDict of stages.

    Stages: gamma, decay, A, T, w, u, h, v_new, o (and final_state when ``output_final_state``),
    in the layouts of the module docstring. Every stage is in ``dtype``; o is not cast back.
    Loops over chunks, vectorised over batch rows and value heads; with cu_seqlens, over
    sequences too. Differentiable (no in-place writes), so autograd through it gives gradients.
    """
    B, T = q.shape[:2]
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    C = chunk_size
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, dtype)
    if cu_seqlens is None:
        groups = [(0, T, initial_state)]  # every batch row at once
    else:
        groups = [(s, e, None if initial_state is None else initial_state[i : i + 1]) for i, (_, s, e) in enumerate(sequences(B, T, cu_seqlens))]
    names = ("gamma", "decay", "A", "T", "w", "u", "h", "v_new", "o")
    out = {n: [] for n in names}
    finals = []
    for bos, eos, S in groups:
        Bg = q.shape[0]
        if S is None:
            S = torch.zeros(Bg, HV, K, V, dtype=dtype, device=v.device)
        S = S.to(dtype)
        for s in range(bos, eos, C):
            e = min(s + C, eos)
            c = e - s
            # [Bg, HV, c, *]
            qc, kc, vc = (x[:, s:e].transpose(1, 2) for x in (q, k, v))
            gc, bc = g[:, s:e].transpose(1, 2), beta[:, s:e].transpose(1, 2)  # [Bg, HV, c]
            gam = gc.cumsum(-1)
            incl = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()
            dec = (gam[..., :, None] - gam[..., None, :]).masked_fill(~incl, float("-inf")).exp()
            Ac = (bc[..., None] * (kc @ kc.transpose(-1, -2)) * dec).tril(-1)
            eye = torch.eye(c, dtype=dtype, device=v.device)
            Tc = torch.linalg.solve_triangular(eye + Ac, eye.expand_as(Ac), upper=False, unitriangular=True)
            wc = Tc @ ((bc * gam.exp())[..., None] * kc)
            uc = Tc @ (bc[..., None] * vc)
            vn = uc - wc @ S
            oc = gam.exp()[..., None] * (qc @ S) + ((qc @ kc.transpose(-1, -2)) * dec) @ vn
            out["h"].append(S)
            S = gam[..., -1:, None].exp() * S + kc.transpose(-1, -2) @ ((gam[..., -1:] - gam).exp()[..., None] * vn)
            out["gamma"].append(gam.transpose(1, 2))
            for n, x in (("decay", dec), ("A", Ac), ("T", Tc)):
                out[n].append(torch.nn.functional.pad(x, (0, C - c)).transpose(1, 2))
            for n, x in (("w", wc), ("u", uc), ("v_new", vn), ("o", oc)):
                out[n].append(x.transpose(1, 2))
        finals.append(S)
    stages = OrderedDict((n, torch.stack(x, 1) if n == "h" else torch.cat(x, 1)) for n, x in out.items())
    if output_final_state:
        stages["final_state"] = torch.cat(finals)
    return stages
