"""The Gluon DeltaNet forward (triforge/ops/deltanet/fused_ws.py) in both of the dispatch's configs on small odd
shapes, for compute-sanitizer (sm90 only: Gluon has no interpreter).

    compute-sanitizer --tool memcheck python3 benchmarks/deltanet_ws_memcheck.py

Dense lengths that end mid-chunk, packed sequences with an empty and a one-token sequence (the last chunk's tiles
read past the sequence, and past the tensor), an initial state, grouped heads, without l2norm; each run compared
with the float64 recurrent reference (relative RMS of o and the final state); exits 1 if any is off or non-finite.
"""

import sys

import torch

from triforge.ops.deltanet import chunk, fused_ws
from triforge.ops.deltanet.reference import recurrent_ref

CFGS = tuple(chunk.GLUON_CFGS.values())


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def main():
    bad = 0
    g0 = torch.Generator().manual_seed(1)
    for lengths, B, l2norm in (([300], 2, True), ([200, 0, 1, 64, 135, 63], 1, True), ([37], 3, False)):
        T = sum(lengths)
        N = B if len(lengths) == 1 else len(lengths)
        cu = None if len(lengths) == 1 else torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(),
                                                         dtype=torch.int32, device="cuda")
        r = lambda *s: torch.randn(*s, generator=g0).cuda()  # noqa: E731
        k = r(B, T, 2, 128)
        if not l2norm:
            k = torch.nn.functional.normalize(k, dim=-1)
        x = dict(q=r(B, T, 2, 128).bfloat16(), k=k.bfloat16(), v=r(B, T, 4, 128).bfloat16(),
                 g=torch.nn.functional.logsigmoid(r(B, T, 4) + 1.0), beta=torch.sigmoid(r(B, T, 4)).bfloat16(),
                 initial_state=0.5 * r(N, 4, 128, 128))
        o64, s64 = recurrent_ref(**{n: t.double() if t.is_floating_point() else t for n, t in x.items()},
                                 output_final_state=True, use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu)
        varlen = chunk.prepare_varlen(cu)
        intra = chunk.chunk_fwd_intra(x["k"], x["v"], x["g"], x["beta"], l2norm=l2norm, varlen=varlen,
                                      store_kn=l2norm)
        for cfg in CFGS:
            o, s = fused_ws.fwd_ws(x["q"], intra.get("kn", x["k"]), intra["w"], intra["u"], intra["gamma"],
                                   x["initial_state"], 128 ** -0.5, l2norm=l2norm,
                                   cu_seqlens=None if varlen is None else varlen.cu_seqlens, cfg=cfg)
            torch.cuda.synchronize()
            e = (rel(o, o64), rel(s, s64))
            ok = all(v == v and v < 2e-2 for v in e)
            bad += not ok
            print(f"lengths={lengths} B={B} l2norm={l2norm} BV={cfg['BV']}: o {e[0]:.2e} state {e[1]:.2e}"
                  f" {'ok' if ok else 'FAIL'}", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
