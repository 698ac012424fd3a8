"""Run one library kernel a few times at its benchmark shape, for Nsight Compute to profile:

    ncu --clock-control none -k regex:KERNEL -s 2 -c 1 --section ... python benchmarks/ncu_targets.py TARGET

Targets: mhc_k1_bwd (T=65536, C=2560), mhc_k1_fwd / mhc_k1_fwd_1024 (K1's forward at C=2560 / 1024), mhc_k4_bwd
(post-res backward, C=2560), gate_up (Qwen2.5-0.5B gate/up GEMV + RMSNorm, M=1),
down (down_proj GEMV + residual, M=1), ternary_m1 (ternary.matmul, M=1, 8192 x 8192: the tc kernel),
ternary_m1_ffn (the same at 28672 x 8192), gdn_intra / gdn_h / gdn_o (the Gated DeltaNet forward's intra kernel,
unfused recurrence and output kernel at (B, T, H, HV) = (1, 32768, 16, 32), K = V = 128), gdn_bwd (the backward's
kernels at (8, 4096, 16, 32) from a saving forward: pick one with -k), decode_1x32k / decode_8x4k (flash-decoding's
split and merge kernels, 16 / 2 heads, D 128, full caches of 32k at B=1 and 4k at B=8).
"""

import sys

import torch

import triforge  # noqa: F401  (sets the interpreter up before any kernel is defined)


def main():
    target = sys.argv[1]
    dt = torch.bfloat16
    if target in ("mhc_k1_fwd", "mhc_k1_fwd_1024"):
        from triforge.ops import mhc as M
        T, K = 65536, 4 * (2560 if target == "mhc_k1_fwd" else 1024)
        x = torch.randn(T, K, device="cuda", dtype=dt)
        W = torch.randn(M.N_PROJ, K, device="cuda") * 0.02
        fn = lambda: M.project_fwd(x, W, M.EPS)  # noqa: E731
    elif target == "mhc_k1_bwd":
        from triforge.ops import mhc as M
        T, K = 65536, 4 * 2560
        x = torch.randn(T, K, device="cuda", dtype=dt)
        W = torch.randn(M.N_PROJ, K, device="cuda") * 0.02
        proj, inv = M.project_fwd(x, W, M.EPS)
        dproj = torch.randn_like(proj)
        fn = lambda: M.project_bwd(x, W, proj, inv, dproj, None)  # noqa: E731
    elif target == "mhc_k4_bwd":
        from triforge.ops import mhc as M
        T, C = 65536, 2560
        x = torch.randn(T, 4, C, device="cuda", dtype=dt)
        f = torch.randn(T, C, device="cuda", dtype=dt)
        H = torch.rand(T, 4, 4, device="cuda") * 0.5
        hp = torch.rand(T, 4, device="cuda") * 2
        g = torch.randn_like(x)
        fn = lambda: M.post_res_bwd(g, x, f, H, hp)  # noqa: E731
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
    elif target == "gdn_bwd":
        from triforge.ops import deltanet as D
        from triforge.ops.deltanet import chunk, chunk_bwd
        i = D._make_inputs("real", dt, "cuda", torch.Generator().manual_seed(0),
                           ((8, 4096, 16, 32, 128, 128), (8, 4096, 16, 32, 128, 128)))
        q, k, v, g, beta = (i[n] for n in ("q", "k", "v", "g", "beta"))
        scale = 128**-0.5
        o, _, saved = chunk.chunk_fwd(q, k, v, g, beta, scale, l2norm=True, save=True)
        do = torch.randn_like(o)
        fn = lambda: chunk_bwd.chunk_bwd(do, None, q, k, v, g, beta, scale, l2norm=True, saved=saved)  # noqa: E731
    elif target in ("decode_1x32k", "decode_8x4k"):
        from triforge.ops.attention import decode
        B, S = (1, 32768) if target == "decode_1x32k" else (8, 4096)
        i = decode._make_inputs({"B": B, "S": S}, dt, "cuda", torch.Generator().manual_seed(0))
        fn = lambda: decode.flash_attn_with_kvcache(i["q"], i["k_cache"], i["v_cache"], i["cache_seqlens"],  # noqa: E731
                                                    check_lengths=False)
    else:
        raise SystemExit(f"unknown target {target}")
    for _ in range(4):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
