"""Where the causal backward's dK / dV leave the per-element bound (issue 3): one compiled run per dtype,
the float64 reference head by head on the GPU, and for the worst key rows the error vector against
each query block's contribution (a missing or doubled block shows as alpha ~ -1 or +1 with cos ~ 1),
a float64 emulation of the kernel's 16-bit roundings of P and dS, and a second run (bitwise equal?).

    PYTHONPATH=. python benchmarks/attention_bwd_probe.py [--S 8192 --H 8 --dtypes fp16,bf16 --causal 1]
"""

import argparse

import torch

from triforge import launch
from triforge.ops import attention as A
from triforge.ops.attention.reference import attention_magnitudes, causal_mask
from triforge.testing import tolerance_for

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = {"fp16": torch.float16, "bf16": torch.bfloat16}


def head_ref(q, k, v, do, causal, scale):
    """float64 [S, D] slices of one head -> p, ds, dk, dv."""
    s = (q @ k.T) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[0], k.shape[0], q.device), float("-inf"))
    p = torch.softmax(s, -1)
    o = p @ v
    dp = do @ v.T
    delta = (do * o).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    return p, ds, scale * ds.T @ q, p.T @ do


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, default=8192)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--top", type=int, default=6)
    a = ap.parse_args()
    causal = bool(a.causal)
    for dname in a.dtypes.split(","):
        dt = DT[dname]
        tol = tolerance_for(dt)
        gen = torch.Generator().manual_seed(1)
        q, k, v, do = (torch.randn(1, a.S, a.H, a.D, generator=gen).to(DEV, dt) for _ in range(4))
        launch._compiled.clear()
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o = A.flash_attn_func(*leaves, causal=causal)
        dq, dk, dv = torch.autograd.grad(o, leaves, do)
        leaves2 = [t.clone().requires_grad_(True) for t in (q, k, v)]
        dq2, dk2, dv2 = torch.autograd.grad(A.flash_attn_func(*leaves2, causal=causal), leaves2, do)
        print(f"== {dname} causal={causal} S={a.S} H={a.H} D={a.D}: kernels {sorted(launch.recorded_kernels())}")
        print(f"   run-to-run bitwise: dq {torch.equal(dq, dq2)} dk {torch.equal(dk, dk2)} dv {torch.equal(dv, dv2)}")
        scale = a.D ** -0.5
        n_fail = {"dk": 0, "dv": 0}
        rows = []
        for h in range(a.H):
            qh, kh, vh, doh = (t[0, :, h].double() for t in (q, k, v, do))
            p, ds, dk_ref, dv_ref = head_ref(qh, kh, vh, doh, causal, scale)
            mags = attention_magnitudes(*(t[:, :, h : h + 1].double() for t in (q, k, v, do)), causal=causal)
            for name, ref, got, em in (
                ("dk", dk_ref, dk[0, :, h].double(), scale * ds.to(dt).double().T @ qh),
                ("dv", dv_ref, dv[0, :, h].double(), p.to(dt).double().T @ doh),
            ):
                sc = mags[name][0, :, 0]
                bound = tol.atol * sc + tol.rtol * ref.abs()
                err = (got - ref).abs()
                ratio = err / bound
                n_fail[name] += int((ratio > 1).sum())
                em_ratio = float(((em - ref).abs() / bound).max())
                worst = ratio.amax(1).topk(min(a.top, a.S))
                for r, j in zip(worst.values.tolist(), worst.indices.tolist()):
                    if r <= 1 and len(rows) > 4:
                        continue
                    e = got[j] - ref[j]
                    contrib = (p if name == "dv" else ds)[:, j]  # [S] over queries
                    mult = doh if name == "dv" else scale * qh
                    best = None
                    for bs in (64, 128):
                        for b0 in range(0, a.S, bs):
                            c = (contrib[b0 : b0 + bs, None] * mult[b0 : b0 + bs]).sum(0)
                            nc = float(c.norm())
                            if nc == 0:
                                continue
                            cos = float(e @ c) / (float(e.norm()) * nc + 1e-300)
                            if best is None or abs(cos) > abs(best[0]):
                                best = (cos, float(e @ c) / nc**2, bs, b0)
                    rows.append(f"   {name} h={h} key {j} (mod 64: {j % 64}, mod 128: {j % 128}) err/bound={r:.2f} "
                                f"|err|={float(e.norm()):.2e} |emul err|={float((em[j] - ref[j]).norm()):.2e} "
                                f"d over={int((ratio[j] > 1).sum())} scale~{float(sc[j].mean()):.2e} "
                                f"visible={int((contrib != 0).sum())} best block: cos={best[0]:+.3f} alpha={best[1]:+.3f} "
                                f"size {best[2]} queries [{best[3]}, {best[3] + best[2]}); emul max ratio {em_ratio:.2f}")
        print(f"   elements over the bound: dk {n_fail['dk']} dv {n_fail['dv']}")
        print("\n".join(rows[: 4 * a.top]))


if __name__ == "__main__":
    main()
