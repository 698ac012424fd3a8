"""Run one library kernel a few times at its benchmark shape, for Nsight Compute to profile:

    ncu --clock-control none -k regex:KERNEL -s 2 -c 1 --section ... python benchmarks/ncu_targets.py TARGET

Targets: mhc_k1_bwd (T=65536, C=2560), gate_up (Qwen2.5-0.5B gate/up GEMV + RMSNorm, M=1),
down (down_proj GEMV + residual, M=1), ternary_m1 (ternary.matmul, M=1, 8192 x 8192: the tc kernel),
ternary_m1_ffn (the same at 28672 x 8192), gdn_intra / gdn_h / gdn_o (the Gated DeltaNet forward's intra kernel,
unfused recurrence and output kernel at (B, T, H, HV) = (1, 32768, 16, 32), K = V = 128).
"""

import sys

import torch

import triforge  # noqa: F401  (sets the interpreter up before any kernel is defined)


def main():
    target = sys.argv[1]
    dt = torch.bfloat16
    if target == "mhc_k1_bwd":
        from triforge.ops import mhc as M
        T, K = 65536, 4 * 2560
        x = torch.randn(T, K, device="cuda", dtype=dt)
        W = torch.randn(M.N_PROJ, K, device="cuda") * 0.02
        proj, inv = M.project_fwd(x, W, M.EPS)
        dproj = torch.randn_like(proj)
        fn = lambda: M.project_bwd(x, W, proj, inv, dproj, None)  # noqa: E731
    elif target in ("gate_up", "down"):
        from triforge.ops import gemv as G
        if target == "gate_up":
            x = torch.randn(1, 896, device="cuda", dtype=dt)
            w = torch.randn(9728, 896, device="cuda", dtype=dt) * 0.03
            nw = torch.ones(896, device="cuda", dtype=dt)
            fn = lambda: G.gemv_gate_up_launch(x, w, nw)  # noqa: E731
        else:
            x = torch.randn(1, 4864, device="cuda", dtype=dt)
            w = torch.randn(896, 4864, device="cuda", dtype=dt) * 0.014
            r = torch.randn(1, 896, device="cuda", dtype=dt)
            fn = lambda: G.gemv_launch(x, w, residual=r)  # noqa: E731
    elif target in ("ternary_m1", "ternary_m1_ffn"):
        from triforge.ternary import TernaryTensor, matmul
        n = 8192 if target == "ternary_m1" else 28672
        tt = TernaryTensor.from_float(torch.randn(n, 8192, device="cuda"), method="absmean").compact()
        x = torch.randn(1, 8192, device="cuda", dtype=dt)
        fn = lambda: matmul(x, tt)  # noqa: E731
    elif target in ("gdn_intra", "gdn_h", "gdn_o"):
        from triforge.ops import deltanet as D
        from triforge.ops.deltanet import chunk
        i = D._make_inputs("real", dt, "cuda", torch.Generator().manual_seed(0),
                           ((1, 32768, 16, 32, 128, 128), (1, 32768, 16, 32, 128, 128)))
        q, k, v, g, beta, h0 = (i[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
        # as chunk_fwd runs them: the intra kernel stores the normalised k (kn), the later kernels read it
        intra = chunk.chunk_fwd_intra(k, v, g, beta, l2norm=True, store_kn=True)
        w, u, gamma, kn = intra["w"], intra["u"], intra["gamma"], intra["kn"]
        h, v_new, _ = chunk.chunk_fwd_h(kn, w, u, gamma, h0, l2norm=True, k_normed=True)
        fn = {"gdn_intra": lambda: chunk.chunk_fwd_intra(k, v, g, beta, l2norm=True, store_kn=True),
              "gdn_h": lambda: chunk.chunk_fwd_h(kn, w, u, gamma, h0, l2norm=True, k_normed=True),
              "gdn_o": lambda: chunk.chunk_fwd_o(q, kn, v_new, h, gamma, 128**-0.5, l2norm=True, k_normed=True)}[target]
    else:
        raise SystemExit(f"unknown target {target}")
    for _ in range(4):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
