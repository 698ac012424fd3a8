"""Compiled Gated DeltaNet forward and Triton backward at several head dims, each case in its own
process with CUDA_LAUNCH_BLOCKING=1 (an illegal address names its kernel and cannot poison the next
case): the forward against the float64 recurrence, the backward's gradients against the float64
reference backward (rel. rms), every kernel synchronised.

    PYTHONPATH=. python benchmarks/deltanet_probe.py [--cases 64x64,32x128,...]
"""

import argparse
import os
import subprocess
import sys
import traceback

DEV = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
CASES = "64x64,32x128,128x256,128x32,128x128,32x32,64x128,128x64"


def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def one(K, V, varlen, fuse):
    import torch
    import torch.nn.functional as F

    from triforge.ops.deltanet import chunk, chunk_bwd, recurrent_ref
    from triforge.ops.deltanet.reference import chunk_bwd_ref_stages

    gen = torch.Generator().manual_seed(K * 1000 + V + varlen)
    lengths = [200, 1, 64, 135] if varlen else None
    B, T = (1, sum(lengths)) if varlen else (2, 300)
    N = len(lengths) if varlen else B
    H, HV = 2, 4

    def r(*s):
        return torch.randn(s, generator=gen)

    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=F.logsigmoid(r(B, T, HV) + 1.0),
             beta=torch.sigmoid(r(B, T, HV)), initial_state=0.5 * r(N, HV, K, V))
    x = {n: t.to(DEV, torch.bfloat16 if n in ("q", "k", "v", "beta") else torch.float32) for n, t in x.items()}
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=DEV, dtype=torch.int32) if varlen else None
    scale = K ** -0.5
    stage = "intra"
    try:
        vl = chunk.prepare_varlen(cu)
        intra = chunk.chunk_fwd_intra(x["k"], x["v"], x["g"], x["beta"], l2norm=True, varlen=vl)
        _sync()
        stage = "forward (fuse_o=%s)" % fuse
        o, final = chunk.chunk_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"],
                                   l2norm=True, cu_seqlens=cu, fuse_o=fuse)
        _sync()
        x64 = {n: t.double() for n, t in x.items()}
        o_ref, f_ref = recurrent_ref(**x64, scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                     cu_seqlens=cu)
        rel = lambda a, b: float((a.double() - b).norm() / b.norm())
        msg = f"fwd o rel {rel(o, o_ref):.2e} final rel {rel(final, f_ref):.2e}"
        stage = "backward"
        do = torch.randn(x["v"].shape, generator=gen).to(DEV, torch.bfloat16)
        dht = torch.randn(N, HV, K, V, generator=gen).to(DEV)
        got = chunk_bwd.chunk_bwd(do, dht, x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"],
                                  l2norm=True, cu_seqlens=cu)
        _sync()
        ref = chunk_bwd_ref_stages(**x64, do=do.double(), dht=dht.double(), scale=scale,
                                   use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        parts = []
        for n, g in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got):
            parts.append(f"{n} {rel(g, ref[n]):.1e}" + ("" if torch.isfinite(g).all() else " NONFINITE"))
        print(f"OK   K={K} V={V} varlen={varlen} fuse={fuse}: {msg}; bwd rel " + " ".join(parts))
    except Exception as e:  # noqa: BLE001
        tb = [ln for ln in traceback.format_exc().splitlines() if "triforge/" in ln][-3:]
        print(f"FAIL K={K} V={V} varlen={varlen} fuse={fuse} at {stage}: {type(e).__name__}: {str(e)[:160]} | "
              + " | ".join(t.strip() for t in tb))


def check(shape):
    """check_op of the registered op at one shape (B,T,H,HV), verbose: every stage's parity row."""
    import torch

    from triforge import registry
    from triforge.check import check_op

    B, T, H, HV = (int(x) for x in shape.split("x"))
    res = check_op(registry.get("gated_delta_rule"), torch.bfloat16,
                   tier={"B": B, "T": T, "H": H, "HV": HV, "K": 128, "V": 128}, seed=3, verbose=True)
    print(f"CHECK {shape}: ok={res.ok} failed_stage={res.failed_stage} error={res.error}")
    if res.failed_stage in ("o", "final_state"):
        worst(registry.get("gated_delta_rule"), {"B": B, "T": T, "H": H, "HV": HV, "K": 128, "V": 128})


def worst(spec, tier):
    """The elements of o furthest over the bf16 bound (atol * rms + rtol * |ref|), with their place."""
    import torch

    from triforge import _runtime
    from triforge.testing import tolerance_for

    inputs = spec.make_inputs(tier, torch.bfloat16, _runtime.default_device(), torch.Generator().manual_seed(3))
    got = spec.stages(**inputs)
    ref = spec.reference(**{n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
                            for n, t in inputs.items()})
    tol = tolerance_for(torch.bfloat16)
    for name in ("o", "final_state"):
        r, g = ref[name], got[name].double()
        rms = float(r.square().mean().sqrt())
        ratio = (g - r).abs() / (tol.atol * rms + tol.rtol * r.abs())
        n_over = int((ratio > 1).sum())
        print(f"  {name}: rms {rms:.3e}, over {n_over} of {r.numel()}, nonfinite got {int((~g.isfinite()).sum())}")
        if name == "o" and n_over:
            over = (ratio > 1).nonzero()
            t_over = over[:, 1]
            print(f"  o over: tokens {t_over.unique().numel()} (t mod 64 hist {torch.bincount(t_over % 64, minlength=64).tolist()}),"
                  f" heads {over[:, 2].unique().tolist()[:40]}, v-cols mod 64 {torch.bincount(over[:, 3] % 64, minlength=64).tolist()}")
            # row norms: is the whole token row wrong (a chunk / block defect) or single elements (rounding)?
            row_err = (g - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)
            top = row_err.flatten().topk(8)
            for val, flat in zip(top.values.tolist(), top.indices.tolist()):
                b, t, h = (int(i) for i in torch.unravel_index(torch.tensor(flat), row_err.shape))
                print(f"    row b={b} t={t} (chunk {t // 64}, pos {t % 64}) hv={h}: rel err {val:.3e} "
                      f"|ref| {float(r[b, t, h].norm()):.3e}")
        top = ratio.flatten().topk(5)
        for val, flat in zip(top.values.tolist(), top.indices.tolist()):
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), r.shape))
            print(f"    {name}{list(idx)} err/bound {val:.2f} ref {float(r[idx]):+.4e} got {float(g[idx]):+.4e}")


def _kernel_breakdown(shape, fn, reps=20):
    """Each GPU kernel's mean time per call of ``fn`` (torch.profiler), largest first: where the
    backward's time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / reps / 1e3, e.count // reps) for e in prof.key_averages()
            if e.device_time_total > 0]
    total = sum(ms for _, ms, _ in rows)
    for name, ms, n in sorted(rows, key=lambda r: -r[1])[:12]:
        print(f"KERNEL {shape} {name[:60]:60s} {ms:.3f} ms x{n} ({100 * ms / total:.0f}%)")


def grads(shape):
    """The Triton backward's gradients at a bench shape against the float64 reference under the
    registry's error scales (stored_error_scales): elements over, the worst ones with the reference
    run with 16-bit stores and the fp32 PyTorch backward at the same place."""
    import torch

    from triforge import _runtime, registry
    from triforge.ops.deltanet import chunk_bwd, chunk_bwd_torch
    from triforge.ops.deltanet.reference import chunk_bwd_ref_stages, rounding_samples, stored_error_scales
    from triforge.testing import tolerance_for

    B, T, H, HV = (int(x) for x in shape.split("x"))
    spec = registry.get("gated_delta_rule")
    x = spec.make_inputs({"B": B, "T": T, "H": H, "HV": HV, "K": 128, "V": 128}, torch.bfloat16,
                         _runtime.default_device(), torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64).to(DEV, torch.bfloat16)
    dht = torch.randn(x["initial_state"].shape, generator=gen, dtype=torch.float64).to(DEV, torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    scale = 128 ** -0.5
    got = chunk_bwd.chunk_bwd(do, dht, *args, scale, x["initial_state"], l2norm=True)
    fp32 = chunk_bwd_torch(do, dht, *args, scale, x["initial_state"], True, None)
    x64 = {n: x[n].double() for n in ("q", "k", "v", "g", "beta", "initial_state")}
    kw = dict(do=do.double(), dht=dht.double(), scale=scale, use_qk_l2norm_in_kernel=True)
    exact = chunk_bwd_ref_stages(**x64, **kw)
    samples = rounding_samples(lambda **r: chunk_bwd_ref_stages(**x64, **kw, **r), torch.bfloat16)
    stored = samples[0]
    tol = tolerance_for(torch.bfloat16)
    scales = stored_error_scales(exact, samples, tol.atol)
    if torch.cuda.is_available():  # timing of the unverified Triton backward beside the forward (NOTES only)
        from triton.testing import do_bench

        from triforge.ops.deltanet import chunk

        fwd_ms = do_bench(lambda: chunk.chunk_fwd(*args, scale, x["initial_state"], l2norm=True), rep=200)
        bwd_ms = do_bench(lambda: chunk_bwd.chunk_bwd(do, dht, *args, scale, x["initial_state"], l2norm=True), rep=200)
        print(f"TIME {shape}: forward {fwd_ms:.3f} ms, Triton backward {bwd_ms:.3f} ms ({bwd_ms / fwd_ms:.2f}x)")
        _kernel_breakdown(shape, lambda: chunk_bwd.chunk_bwd(do, dht, *args, scale, x["initial_state"], l2norm=True))
    for i, n in enumerate(("dq", "dk", "dv", "dg", "dbeta", "dh0")):
        r, g, f, st, sc = exact[n], got[i].double(), fp32[i].double(), stored[n], scales[n]
        bound = tol.atol * sc + tol.rtol * r.abs()
        ratio = (g - r).abs() / bound
        rel = float((g - r).norm() / r.norm())
        print(f"GRAD {shape} {n}: rel {rel:.2e} (fp32 bwd {float((f - r).norm() / r.norm()):.2e}, stored ref "
              f"{float((st - r).norm() / r.norm()):.2e}), over {int((ratio > 1).sum())} of {r.numel()}, "
              f"fp32 bwd over {int(((f - r).abs() / bound > 1).sum())}")
        top = ratio.flatten().topk(4)
        for val, flat in zip(top.values.tolist(), top.indices.tolist()):
            idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(flat), r.shape))
            row = r[idx[:-1]] if r.dim() == 4 else None
            extra = f" row rms {float(row.square().mean().sqrt()):.2e}" if row is not None else ""
            print(f"    {n}{list(idx)} err/bound {val:.2f} ref {float(r[idx]):+.4e} got {float(g[idx]):+.4e} "
                  f"stored {float(st[idx]):+.4e} fp32 {float(f[idx]):+.4e} scale {float(sc[idx]):.2e}{extra}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--one", default=None)
    ap.add_argument("--check", default=None, help="shapes BxTxHxHV,... for check_op (then the cases)")
    ap.add_argument("--grads", default=None, help="shapes BxTxHxHV,... for grads()")
    a = ap.parse_args()
    for shape in (a.grads.split(",") if a.grads else []):
        grads(shape)
        sys.stdout.flush()
    if a.grads and not a.check:
        return
    for shape in (a.check.split(",") if a.check else []):
        check(shape)
        sys.stdout.flush()
    if a.one:
        K, V, varlen, fuse = a.one.split(",")
        one(int(K), int(V), int(varlen), None if fuse == "None" else fuse == "True")
        return
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    for case in a.cases.split(","):
        K, V = case.split("x")
        for varlen in (0, 1):
            for fuse in ("None", "False") if int(V) >= 64 else ("None",):
                p = subprocess.run([sys.executable, __file__, "--one", f"{K},{V},{varlen},{fuse}"], env=env,
                                   capture_output=True, text=True, timeout=300)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith(("OK", "FAIL"))]
                print(lines[-1] if lines else f"CRASH K={K} V={V} varlen={varlen} fuse={fuse} rc={p.returncode}: "
                      + p.stderr.strip().splitlines()[-1][:200] if p.stderr.strip() else "")
                sys.stdout.flush()


if __name__ == "__main__":
    main()
