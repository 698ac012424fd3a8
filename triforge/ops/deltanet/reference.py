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

Backward (``chunk_bwd_ref_stages``). Upstream gradients dO [B, T, HV, V] and dS_end = dht (the final
state's gradient, or 0). Below q is the scaled, normalised, head-expanded query (scale folded in as
in the forward), k the normalised expanded key, P = (Q K^T) * decay, e = e^gamma and
l = e^(gamma_last - gamma) [C]. Every exponent is <= 0 (no e^-gamma anywhere), so extreme decays
underflow to 0 and never overflow.

1. Recompute gamma, T, w, u (the intra stage), h (state entering each chunk) and v_new.
2. dh: a reverse recurrence over the chunks of each sequence. dh_n is the gradient of the state
   *leaving* chunk n (dh_last = dS_end); the one entering chunk 0 is d(initial_state):

       dv_new = P^T dO + diag(l) K dh_n                                   [C, V]   (= du)
       dh_n-1 = e^gamma_last dh_n + Q^T diag(e) dO - w^T dv_new           [K, V]

3. Per chunk, with S = h_n the state entering it and dS' = dh_n the one leaving it
   (dP = causal(dO v_new^T) * decay, the gradient of Q K^T through P):

       dq_hv        = diag(e) dO S^T + dP K                               [C, K]
       dk_local     = dP^T Q + diag(l) v_new dS'^T                        [C, K]
       dw           = -dv_new S^T                                         [C, K]
       dgamma_local = e * rowsum(Q * dO S^T) + rowsum(M) - colsum(M) - a,  M = dP * Q K^T,
                      a = l * rowsum(K * v_new dS'^T), and at the chunk's last row
                      + sum(a) + e^gamma_last sum(dS' * S)

4. Back through the WY representation (w = T diag(beta e) K, u = T diag(beta) V, T = (I + A)^-1):

       dT     = strictly_lower(dw (diag(beta e) K)^T + du (diag(beta) V)^T)   (the rest of T is constant)
       dA     = -strictly_lower(T^T dT T^T)
       dv     = diag(beta) T^T du
       dbeta  = rowsum(T^T du * V) + e * rowsum(T^T dw * K) + rowsum(dA * K K^T * decay)
       dk_hv  = dk_local + diag(beta e) T^T dw + (dKK + dKK^T) K,   dKK = diag(beta) dA * decay
       dgamma = dgamma_local + beta e * rowsum(T^T dw * K) + rowsum(M2) - colsum(M2),   M2 = dA * A
       dg     = reverse cumsum of dgamma inside each chunk (gamma = cumsum(g) there)

5. dq = l2norm_bwd(scale * sum over the HV / H value heads of a group of dq_hv), dk likewise from
   dk_hv (no scale); l2norm_bwd(x, dy) = r (dy - y (y . dy)) with r = rsqrt(|x|^2 + 1e-6), y = x r.
   Without the in-kernel l2norm the group sums are dq and dk.

Backward stage layouts: dh like h; dv_new, dv like v; dq_hv, dk_local, dw, dk_hv [B, T, HV, K];
dgamma_local, dgamma, dbeta, dg [B, T, HV]; dT, dA like T; dq, dk like q; dh0 like the states.

Stored intermediates (``store_dtype``). The Triton kernels keep gamma, T, the state and state
gradient they carry across chunks, dk_local, dk_hv and dgamma_local in fp32, but store these in the
input dtype, rounded to nearest (ties to even), and read them back from there: the normalised q and k
(with the in-kernel l2norm; A's k k^T is formed from the unrounded unit rows), w, u, h, v_new
(forward, and the backward's recompute), dh, dv_new, dw and the per-value-head dq_hv (backward; fla
stores its per-value-head dq and dk in the input dtype). dk_hv stays fp32: with a final-state gradient
the last rows of a sequence have dk_hv terms ~10 that the l2norm's backward cancels to ~5e-3, below a
16-bit rounding of the terms (bench parity at (8, 4096, 16, 32), 2026-11-24). With ``store_dtype`` the
references round exactly these tensors at exactly those points (fp32 first, then ``store_dtype``, as
a kernel's fp32 register is rounded) and go on from the rounded values where the kernels read them
back; the carried state and state gradient stay unrounded. Not modelled: 16-bit tensor-core operands
rounded inside a kernel (T, P, dP, diag(beta) V, ...). Default None: no rounding.
"""

from collections import OrderedDict

import torch

CHUNK = 64
SOLVE_BLOCK = 16  # the forward kernel's diagonal block of the triangular solve (chunk.BC)
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


class Rounding:
    """Where a kernel rounds an fp32 register to its storage or tensor-core operand ``dtype``.

    Without ``seed``: to nearest, ties to even (fp32 first, as a kernel rounds). With ``seed``: one
    other instance of the same rounding - x moved by uniform noise of +-half a unit in the last place
    of ``dtype`` before rounding to nearest, so each element's rounding error is a fresh draw of the
    size the kernel's own (whose values before rounding differ from the reference's in their last
    fp32 bits) can take. ``rounding_samples`` uses a few of them: one draw per element can be small
    by chance where the kernel's is not.

    fp32: the kernels' fp32 matrix products run at 3xTF32 (each operand split into two tf32 parts of
    11 significant bits: ~22 bits, the product of the low parts dropped), so a dithered fp32 instance
    moves x by up to half a unit of a 21-bit mantissa (2^-22 relative, 4 fp32 units) before rounding
    to fp32: the size of the perturbation the kernels' products make (the fp32 real-shape check of the
    Triton backward failed 8 of 67M dk elements on the H100 under fp32-sized draws).

    16-bit inputs, compiled: ``tf32`` ("rna" or "rz") also rounds the operands of the forward's fp32
    products - the triangular solve's block products - to tf32 (10 explicit mantissa bits), as
    input_precision "tf32" does on tensor cores; the CPU interpreter multiplies them in full fp32 (None).
    (k k^T is formed from k's 16-bit values, exact products, since session 27.)
    """

    MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
    DITHER_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 21}
    MIN_EXP = {torch.bfloat16: -126, torch.float16: -14, torch.float32: -126}

    def __init__(self, dtype: torch.dtype, seed: int | None = None, tf32: str | None = None):
        if dtype not in self.MANTISSA:
            raise ValueError(f"Rounding: dtype must be one of {list(self.MANTISSA)}, got {dtype}")
        if tf32 not in (None, "rna", "rz"):
            raise ValueError(f"Rounding: tf32 must be None, 'rna' or 'rz', got {tf32!r}")
        self.dtype, self.seed, self.tf32, self._gens = dtype, seed, tf32, {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.seed is not None:
            gen = self._gens.get(x.device)
            if gen is None:
                gen = self._gens[x.device] = torch.Generator(device=x.device).manual_seed(self.seed)
            _, e = torch.frexp(x)  # x = m 2^e, |m| in [0.5, 1): one unit in the last place 2^(e - 1 - mantissa)
            ulp = torch.ldexp(torch.ones_like(x),
                              (e - 1).clamp(min=self.MIN_EXP[self.dtype]) - self.DITHER_MANTISSA[self.dtype])
            x = x + (torch.rand(x.shape, generator=gen, device=x.device, dtype=x.dtype) - 0.5) * ulp
        return x.to(torch.float32).to(self.dtype).to(x.dtype)

    def __repr__(self):
        return f"Rounding({self.dtype}, seed={self.seed}, tf32={self.tf32!r})"


def tf32_round(x: torch.Tensor, mode: str | None) -> torch.Tensor:
    """x rounded to fp32, then to tf32 (10 explicit mantissa bits): "rna" to nearest, ties away from
    zero (cvt.rna.tf32.f32), "rz" toward zero (the low 13 bits dropped); None: x unchanged.
    Returned in x's dtype."""
    if mode is None:
        return x
    bits = x.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # sign | magnitude
    if mode == "rna":
        bits = bits + 0x1000  # half of the dropped field: the magnitude rounds half away from zero
    bits = bits & 0xFFFFE000
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32).to(x.dtype)


def solve_unit_lower_blocks(A: torch.Tensor, block: int, mode: str | None, diag: str = "product") -> torch.Tensor:
    """(I + A)^-1 for strictly lower [..., n, n] A as the forward kernel forms it (chunk.py,
    ``_solve_unit_lower``), its products' operands rounded to tf32 (``mode``). The diagonal blocks D (the
    block-diagonal part of A) are inverted first, Td = (I + D)^-1: ``diag="product"`` (the kernel's
    default, DIAG_PRODUCT, block 16) as (I - D)(I + D^2)(I + D^4)(I + D^8) in the kernel's order of
    tensor-core products; ``diag="substitute"`` exactly (the kernel's other path substitutes on CUDA cores in
    fp32). Then E = A - D, N = Td E and (I + A)^-1 = sum_p (-N)^p Td. n is padded to a multiple of ``block``."""
    if diag not in ("product", "substitute"):
        raise ValueError(f"diag must be 'product' or 'substitute', got {diag!r}")
    n = A.shape[-1]
    nb = -(-n // block)
    m = nb * block
    Ap = torch.nn.functional.pad(A, (0, m - n, 0, m - n))
    idx = torch.arange(m, device=A.device) // block
    same = idx[:, None] == idx[None, :]
    eye = torch.eye(m, dtype=A.dtype, device=A.device)

    def dot(a, b):
        return tf32_round(a, mode) @ tf32_round(b, mode)

    if diag == "product":
        if block != 16:
            raise ValueError(f"the product form inverts blocks of 16, got block={block}")
        D = Ap * same
        D2 = dot(D, D)
        D4 = dot(D2, D2)
        X = eye - D + D2 - dot(D, D2)  # (I - D)(I + D^2)
        D8 = dot(D4, D4)
        X = X + dot(X, D4)
        Td = X + dot(X, D8)
    else:
        Td = torch.linalg.solve_triangular(eye + Ap * same, eye.expand_as(Ap), upper=False, unitriangular=True)
    E = Ap * (idx[:, None] > idx[None, :])
    N = dot(Td, E)
    P, T = Td, Td
    for _ in range(1, nb):
        P = -dot(N, P)
        T = T + P
    return T[..., :n, :n]


def _store(x: torch.Tensor, store_dtype) -> torch.Tensor:
    """x rounded as a kernel rounds it (``store_dtype``: None for x itself, a dtype for round to
    nearest, or a ``Rounding``)."""
    if store_dtype is None:
        return x
    if isinstance(store_dtype, torch.dtype):
        store_dtype = Rounding(store_dtype)
    return store_dtype(x)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, dtype, store_dtype=None):
    """Upcast to ``dtype``, expand q/k heads to HV, l2-normalise if asked (the unit rows rounded to
    ``store_dtype`` when given, as the kernels store them); scale folded into q after that."""
    H, HV, K = q.shape[2], v.shape[2], q.shape[3]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = _store(l2norm(q), store_dtype), _store(l2norm(k), store_dtype)
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
    store_dtype=None,
):
    """The chunked algorithm stage by stage, in ``dtype``; returns an OrderedDict of stages.

    Stages: gamma, decay, A, T, w, u, h, v_new, o (and final_state when ``output_final_state``),
    in the layouts of the module docstring. Every stage is in ``dtype``; o is not cast back.
    Loops over chunks, vectorised over batch rows and value heads; with cu_seqlens, over
    sequences too. Differentiable (no in-place writes), so autograd through it gives gradients.
    ``store_dtype`` (a dtype or a ``Rounding``): round where the kernels round - the normalised q
    and k, w, u, h and v_new where they store them (module docstring), and the tensor-core operands
    they cast from fp32 registers: T, diag(beta e^gamma) K and diag(beta) V for w and u, (Q K^T) *
    decay for o, diag(e^(gamma_last - gamma)) v_new for the state update. The state carried to the
    next chunk stays unrounded. (The kernels apply ``scale`` after their products, the reference to
    q: those roundings are of the same size, not bit for bit the kernel's.)
    """
    B, T = q.shape[:2]
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    C = chunk_size
    raw = (q, k, v, g, beta)
    q, k, v, g, beta = _prepare(*raw, scale, use_qk_l2norm_in_kernel, dtype, store_dtype)
    # k_a: the keys of A's k k^T, which the intra kernel forms from the unrounded unit rows
    k_a = k if store_dtype is None else _prepare(*raw, scale, use_qk_l2norm_in_kernel, dtype)[1]
    tf32 = store_dtype.tf32 if isinstance(store_dtype, Rounding) else None
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
            qc, kc, vc, kac = (x[:, s:e].transpose(1, 2) for x in (q, k, v, k_a))
            gc, bc = g[:, s:e].transpose(1, 2), beta[:, s:e].transpose(1, 2)  # [Bg, HV, c]
            gam = gc.cumsum(-1)
            incl = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()
            dec = (gam[..., :, None] - gam[..., None, :]).masked_fill(~incl, float("-inf")).exp()
            # the intra kernel forms k k^T of the unit rows from k's stored values, whose products its dot makes
            # exactly, scaled by the rows' 1 / |k| (session 27; before, tf32 products of the fp32 unit rows)
            Ac = (bc[..., None] * (kac @ kac.transpose(-1, -2)) * dec).tril(-1)
            if tf32:
                Tc = solve_unit_lower_blocks(Ac, SOLVE_BLOCK, tf32)
            else:
                eye = torch.eye(c, dtype=dtype, device=v.device)
                Tc = torch.linalg.solve_triangular(eye + Ac, eye.expand_as(Ac), upper=False, unitriangular=True)
            Tr = _store(Tc, store_dtype)  # the operands of w's and u's products
            wc = _store(Tr @ _store((bc * gam.exp())[..., None] * kc, store_dtype), store_dtype)
            uc = _store(Tr @ _store(bc[..., None] * vc, store_dtype), store_dtype)
            hc = _store(S, store_dtype)
            vn = uc - wc @ hc
            vns = _store(vn, store_dtype)
            oc = gam.exp()[..., None] * (qc @ hc) + _store((qc @ kc.transpose(-1, -2)) * dec, store_dtype) @ vns
            out["h"].append(hc)
            S = gam[..., -1:, None].exp() * S + kc.transpose(-1, -2) @ _store(
                (gam[..., -1:] - gam).exp()[..., None] * vn, store_dtype)
            out["gamma"].append(gam.transpose(1, 2))
            for n, x in (("decay", dec), ("A", Ac), ("T", Tc)):
                out[n].append(torch.nn.functional.pad(x, (0, C - c)).transpose(1, 2))
            for n, x in (("w", wc), ("u", uc), ("v_new", vns), ("o", oc)):
                out[n].append(x.transpose(1, 2))
        finals.append(S)
    stages = OrderedDict((n, torch.stack(x, 1) if n == "h" else torch.cat(x, 1)) for n, x in out.items())
    if output_final_state:
        stages["final_state"] = torch.cat(finals)
    return stages


def l2norm_bwd(x: torch.Tensor, dy: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """Gradient of ``l2norm`` at x: r (dy - y (y . dy)) with r = rsqrt(sum(x^2) + eps), y = x r."""
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    y = x * r
    return r * (dy - y * (y * dy).sum(-1, keepdim=True))


def _chunks(B, T, cu_seqlens, C):
    """Per sequence group: (batch rows, [(h index, start, end) of each chunk], state rows)."""
    if cu_seqlens is None:
        return [(slice(0, B), [(i, s, min(s + C, T)) for i, s in enumerate(range(0, T, C))], slice(0, B))]
    groups, n = [], 0
    for i, (_, bos, eos) in enumerate(sequences(B, T, cu_seqlens)):
        chunks = [(n + j, s, min(s + C, eos)) for j, s in enumerate(range(bos, eos, C))]
        n += len(chunks)
        groups.append((slice(0, 1), chunks, slice(i, i + 1)))
    return groups


def chunk_bwd_ref_stages(
    q,
    k,
    v,
    g,
    beta,
    do,
    dht=None,
    scale=None,
    initial_state=None,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    *,
    dtype=torch.float64,
    chunk_size=CHUNK,
    store_dtype=None,
):
    """The chunked backward stage by stage (the module docstring's steps 2-5), in ``dtype``.

    do [B, T, HV, V] (the output's gradient), dht [N, HV, K, V] or None (the final state's).
    Returns an OrderedDict: dh, dv_new, dq_hv, dk_local, dw, dgamma_local, dT, dA, dv, dbeta, dk_hv,
    dgamma, dg, dq, dk (and dh0 with an initial state), in the layouts of the module docstring.
    Explicit formulas (no autograd); ``test_deltanet_bwd`` checks them against autograd.
    ``store_dtype`` (a dtype or a ``Rounding``): round the normalised q and k, the recomputed w, u,
    h, v_new and dh, dv_new, dw where the Triton backward stores them (module docstring), and the
    tensor-core operands it casts from fp32 registers: P^T and diag(scale e) dO (step 2), dP (step
    3), diag(beta e) K, diag(beta) V, T (not in dA) and diag(beta) dA * decay (step 4). The dh,
    dv_new, dw and dq_hv stages are then the rounded values (dq the sum of the rounded per-head ones);
    the state gradient carried to the previous chunk stays unrounded.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    C = chunk_size
    scale = K**-0.5 if scale is None else scale
    fwd = chunk_ref_stages(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, dtype=dtype,
                           chunk_size=C, store_dtype=store_dtype)
    qs, kn, vv, _, bb = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, dtype, store_dtype)
    do = do.to(dtype)
    gam, Tm, w, h, vn = (fwd[n] for n in ("gamma", "T", "w", "h", "v_new"))
    new = {n: torch.zeros_like(like) for n, like in (
        ("dh", h), ("dv_new", vn), ("dq_hv", w), ("dk_local", w), ("dw", w), ("dgamma_local", gam), ("dT", Tm),
        ("dA", Tm), ("dv", vn), ("dbeta", gam), ("dk_hv", w), ("dgamma", gam), ("dg", gam))}
    N = B if cu_seqlens is None else len(sequences(B, T, cu_seqlens))
    dh0 = torch.zeros(N, HV, K, V, dtype=dtype, device=v.device)

    def rows(x, s, e):  # [b, T, HV, *] -> [b, HV, c, *]
        return x[:, s:e].transpose(1, 2)

    def put(name, b, s, e, x):  # [b, HV, c, *] -> the stage's [b, T, HV, *] rows
        c = e - s
        if name in ("dT", "dA"):
            x = torch.nn.functional.pad(x, (0, C - c))
        new[name][b, s:e] = x.transpose(1, 2)

    groups = _chunks(B, T, cu_seqlens, C)
    for b, chunks, n in groups:
        dS = torch.zeros_like(dh0[n]) if dht is None else dht[n].to(dtype)
        for i, s, e in reversed(chunks):  # step 2: dh, dv_new
            dSs = _store(dS, store_dtype)
            new["dh"][b, i] = dSs
            qc, kc, wc, doc = (rows(x[b], s, e) for x in (qs, kn, w, do))
            gm = rows(gam[b], s, e)
            dec = _decay_ref(gm)
            el = (gm[..., -1:] - gm).exp()
            Pt = _store(((qc @ kc.transpose(-1, -2)) * dec).transpose(-1, -2), store_dtype)
            dvn = _store(Pt @ doc + el[..., None] * (kc @ dSs), store_dtype)
            put("dv_new", b, s, e, dvn)
            doe = _store(scale * gm.exp()[..., None] * doc, store_dtype)  # Q^T diag(e) dO = (Q / scale)^T doe
            dS = gm[..., -1, None, None].exp() * dS + (qc / scale).transpose(-1, -2) @ doe - wc.transpose(-1, -2) @ dvn
        dh0[n] = dS
        for i, s, e in chunks:  # steps 3 and 4
            c = e - s
            S, dSn = h[b, i], new["dh"][b, i]
            qc, kc, vc, wc, doc, vnc, dvn = (rows(x[b], s, e) for x in (qs, kn, vv, w, do, vn, new["dv_new"]))
            gm, bc = rows(gam[b], s, e), rows(bb[b], s, e)
            Tc = rows(Tm[b], s, e)[..., :c]
            dec = _decay_ref(gm)
            eg, el = gm.exp(), (gm[..., -1:] - gm).exp()
            dOS = doc @ S.transpose(-1, -2)
            dP = (doc @ vnc.transpose(-1, -2)) * dec
            qk = qc @ kc.transpose(-1, -2)
            vdS = vnc @ dSn.transpose(-1, -2)
            dPr = _store(dP, store_dtype)  # the operand of dq's and dk's products
            put("dq_hv", b, s, e, _store(eg[..., None] * dOS + dPr @ kc, store_dtype))
            dk_local = dPr.transpose(-1, -2) @ qc + el[..., None] * vdS
            put("dk_local", b, s, e, dk_local)
            dw = _store(-dvn @ S.transpose(-1, -2), store_dtype)
            put("dw", b, s, e, dw)
            M = dP * qk
            a = el * (kc * vdS).sum(-1)
            dgl = eg * (qc * dOS).sum(-1) + M.sum(-1) - M.sum(-2) - a
            last = torch.zeros_like(dgl)
            last[..., -1] = a.sum(-1) + gm[..., -1].exp() * (dSn * S).sum((-2, -1))
            dgl = dgl + last
            put("dgamma_local", b, s, e, dgl)

            kbg = _store((bc * eg)[..., None] * kc, store_dtype)
            dT = (dw @ kbg.transpose(-1, -2) + dvn @ _store(bc[..., None] * vc, store_dtype).transpose(-1, -2)).tril(-1)
            put("dT", b, s, e, dT)
            dA = -(Tc.transpose(-1, -2) @ dT @ Tc.transpose(-1, -2)).tril(-1)
            put("dA", b, s, e, dA)
            Tr = _store(Tc, store_dtype)  # the operand of dv's and dk's products (dA's stay fp32)
            dvb = Tr.transpose(-1, -2) @ dvn
            dkbg = Tr.transpose(-1, -2) @ dw
            put("dv", b, s, e, bc[..., None] * dvb)
            kk = kc @ kc.transpose(-1, -2)
            G = dA * kk * dec
            dkbg_k = (dkbg * kc).sum(-1)
            put("dbeta", b, s, e, (dvb * vc).sum(-1) + eg * dkbg_k + G.sum(-1))
            dKK = _store(bc[..., None] * dA * dec, store_dtype)
            put("dk_hv", b, s, e, dk_local + (bc * eg)[..., None] * dkbg + (dKK + dKK.transpose(-1, -2)) @ kc)
            M2 = bc[..., None] * G
            dgamma = dgl + bc * eg * dkbg_k + M2.sum(-1) - M2.sum(-2)
            put("dgamma", b, s, e, dgamma)
            put("dg", b, s, e, dgamma.flip(-1).cumsum(-1).flip(-1))

    G_ = HV // H
    dq = (scale * new["dq_hv"]).view(B, T, H, G_, K).sum(3)
    dk = new["dk_hv"].view(B, T, H, G_, K).sum(3)
    if use_qk_l2norm_in_kernel:
        dq, dk = l2norm_bwd(q.to(dtype), dq), l2norm_bwd(k.to(dtype), dk)
    stages = OrderedDict((n, new[n]) for n in ("dh", "dv_new", "dq_hv", "dk_local", "dw", "dgamma_local", "dT", "dA",
                                               "dv", "dbeta", "dk_hv", "dgamma", "dg"))
    stages["dq"], stages["dk"] = dq, dk
    if initial_state is not None:
        stages["dh0"] = dh0
    return stages


def _decay_ref(gam):
    """[.., c] -> [.., c, c] exp(gamma_i - gamma_j) for i >= j, else 0."""
    c = gam.shape[-1]
    incl = torch.ones(c, c, dtype=torch.bool, device=gam.device).tril()
    return (gam[..., :, None] - gam[..., None, :]).masked_fill(~incl, float("-inf")).exp()


STORE_C = 4.0  # a kernel's error allowed at an element: the default bound + STORE_C x the rounding change
ROUNDING_SAMPLES = 3  # instances of the kernel's roundings whose largest change sets an element's scale


def rounding_samples(run, dtype, n=ROUNDING_SAMPLES, lazy=False):
    """``run(store_dtype=...)`` (a reference stage function) with ``n`` instances of the kernels'
    roundings to ``dtype``: to nearest, then ``n - 1`` dithered (``Rounding``). A list, or with
    ``lazy`` a generator (one instance alive at a time: at LLM shapes each is gigabytes)."""
    gen = (run(store_dtype=Rounding(dtype, seed=None if i == 0 else i)) for i in range(n))
    return gen if lazy else list(gen)


def stored_error_scales(exact, stored, atol, c=STORE_C):
    """Per-element error scales (``testing.compare``'s ``scale``) for a 16-bit run of the kernels.

    The kernels keep their intermediates in fp32 but round some to the input dtype - where they
    store them and read them back, and where they cast fp32 registers to tensor-core operands
    (``store_dtype`` above). ``stored`` is the float64 reference rounding exactly those tensors at
    exactly those points (a dict of stages, or a list of them: ``rounding_samples``), so
    |stored - exact| is the change one instance of those roundings makes to each element,
    cancellation after them included (the recurrence over chunks, T = (I + A)^-1, q S + (q k^T)
    v_new, the sum over value heads): where an element's terms cancel it is of the terms' size, not
    the element's. The kernel rounds at the same points (other instances: its values before rounding
    differ in their last fp32 bits) plus factors of its tensor-core products (the same kind and
    size), so its error is of that size too. One instance can be small at an element by chance
    where the kernel's is not (1-4 elements of a million failed so on the H100); with several the
    largest change is taken. scale = rms(exact) + (c / atol) max |stored - exact| makes the bound
    atol * scale + rtol |ref| the dtype's default bound plus c times that change. Returns
    {name: scale} for the names in all. ``stored`` may be an iterator
    (``rounding_samples(lazy=True)``): one instance is held at a time.
    """
    return scales_from_changes(exact, error_changes(exact, stored), atol, c)


def error_changes(exact, stored):
    """{name: max over the instances ``stored`` of |stored - exact|} for the floating tensors in all of them
    (``stored``: a dict of stages, a list, or an iterator consumed once, one instance held at a time)."""
    samples = [stored] if isinstance(stored, dict) else stored
    names = [n for n, r in exact.items() if isinstance(r, torch.Tensor) and r.is_floating_point()]
    change = {}
    for st in samples:
        names = [n for n in names if n in st]
        for n in names:
            d = (st[n] - exact[n]).abs()
            change[n] = d if n not in change else torch.maximum(change[n], d)
        del st
    return {n: change[n] for n in names}


def scales_from_changes(exact, change, atol, c=STORE_C):
    """stored_error_scales' rms(exact) + (c / atol) change, for the names in ``change``."""
    out = {}
    for n, d in change.items():
        r = exact[n]
        rms = float(r.square().mean().sqrt()) if r.numel() else 0.0
        out[n] = (rms if rms > 0 else 1.0) + (c / atol) * d
    return out


def abs_l2norm_bwd(x: torch.Tensor, d: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """An elementwise bound on |l2norm_bwd(x, dy)| over every dy with |dy| <= d: r (d + |y| (|y| . d)),
    r = rsqrt(|x|^2 + eps), y = x r (the projection's two terms in absolute value, so whatever cancels in
    them is counted at full size)."""
    r = torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)
    y = (x * r).abs()
    return r * (d + y * (y * d).sum(-1, keepdim=True))
