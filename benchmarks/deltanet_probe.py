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

    from triforge.ops.deltanet import chunk_bwd, chunk_bwd_torch
    from triforge.ops.deltanet.reference import chunk_bwd_ref_stages, rounding_samples, stored_error_scales
    from triforge.testing import tolerance_for

    x, do, dht = _bench_inputs(shape)
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


def _bench_inputs(shape):
    """(registry inputs, dO, dht) at a bench shape BxTxHxHV (K = V = 128, bf16), fixed seeds: the
    probes see the same inputs run to run."""
    import torch

    from triforge import _runtime, registry

    B, T, H, HV = (int(x) for x in shape.split("x"))
    x = registry.get("gated_delta_rule").make_inputs({"B": B, "T": T, "H": H, "HV": HV, "K": 128, "V": 128},
                                                     torch.bfloat16, _runtime.default_device(),
                                                     torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64).to(DEV, torch.bfloat16)
    dht = torch.randn(x["initial_state"].shape, generator=gen, dtype=torch.float64).to(DEV, torch.float32)
    return x, do, dht


def _bf(x):
    """x rounded to bf16 as a kernel stores it (the reference's rounding model)."""
    import torch

    from triforge.ops.deltanet.reference import Rounding

    return Rounding(torch.bfloat16)(x)


def kernels(shape):
    """Each backward kernel (2: dqkw, 3: wy) against float64 arithmetic on the kernels' *own* inputs
    (their upstream buffers, as stored), with the kernel's operand roundings: what is left is the
    kernel's own error (fp32 accumulation, and a rounding that flips), so an outlier names its kernel.
    bf16, K = V = 128, T a multiple of 64, B = 1."""
    import torch

    from triforge.ops.deltanet import chunk, chunk_bwd

    B, T, H, HV = (int(x) for x in shape.split("x"))
    assert B == 1 and T % 64 == 0
    x, do, dht = _bench_inputs(shape)
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    scale = 128 ** -0.5
    intra = chunk.chunk_fwd_intra(k, v, g, beta, l2norm=True, store_t=True)
    gamma, w, tt = intra["gamma"], intra["w"], intra["T"]
    h, v_new, _ = chunk.chunk_fwd_h(k, w, intra["u"], gamma, x["initial_state"], l2norm=True, output_final_state=False)
    qn, kn = chunk_bwd.chunk_bwd_l2norm(q, k)
    dh, dv_new, _ = chunk_bwd.chunk_bwd_dh(qn, kn, w, gamma, do, dht, scale)
    local = chunk_bwd.chunk_bwd_dqkw(qn, kn, v_new, h, dh, do, dv_new, gamma, scale)
    def run_wy(**kw):  # on a copy of dk_local: the WY kernel writes dk_hv over it unless stages
        return chunk_bwd.chunk_bwd_wy(kn, v, beta, g.dtype, gamma, tt, local["dw"], dv_new, local["dk_local"].clone(),
                                      local["dgamma_local"], **kw)

    wy = run_wy(stages=True)
    _sync()
    NT, C, G = T // 64, 64, HV // H

    def ch(t, heads=HV):  # [1, T, heads, D] -> [NT, HV, C, D] (q/k heads expanded)
        t = t.double().reshape(NT, C, heads, -1)
        if heads != HV:
            t = t.repeat_interleave(G, dim=2)
        return t.permute(0, 2, 1, 3)

    def back(t):  # [NT, HV, C, D] -> [1, T, HV, D]
        return t.permute(0, 2, 1, 3).reshape(1, T, HV, -1)

    qc, kc = ch(qn, H), ch(kn, H)
    vnc, doc, dvn = ch(v_new), ch(do), ch(dv_new)
    S, dS = h.double().reshape(NT, HV, 128, 128), dh.double().reshape(NT, HV, 128, 128)
    gm = gamma.double().reshape(NT, C, HV).permute(0, 2, 1)  # [NT, HV, C]
    incl = torch.ones(C, C, dtype=torch.bool, device=gm.device).tril()
    dec = (gm[..., :, None] - gm[..., None, :]).masked_fill(~incl, float("-inf")).exp()
    eg, el = gm.exp(), (gm[..., -1:] - gm).exp()
    dOS = doc @ S.transpose(-1, -2)
    dP = (doc @ vnc.transpose(-1, -2)) * dec
    dPr = _bf(dP)
    vdS = vnc @ dS.transpose(-1, -2)
    want = {"dq_hv": back(eg[..., None] * dOS + dPr @ kc),
            "dk_local": back((dPr.transpose(-1, -2) @ qc) * scale + el[..., None] * vdS),
            "dw": back(-(dvn @ S.transpose(-1, -2)))}
    M = dP * (qc @ kc.transpose(-1, -2)) * scale
    a = el * (kc * vdS).sum(-1)
    dgl = eg * (qc * dOS).sum(-1) * scale + M.sum(-1) - M.sum(-2) - a
    dgl[..., -1] += a.sum(-1) + gm[..., -1].exp() * (dS * S).sum((-2, -1))
    want["dgamma_local"] = dgl.permute(0, 2, 1).reshape(1, T, HV)
    got = {"dq_hv": local["dq_hv"], "dk_local": local["dk_local"], "dw": local["dw"],
           "dgamma_local": local["dgamma_local"].sum(0)}
    # kernel 3 from kernel 2's outputs as stored
    dwc, dk_loc = ch(local["dw"]), ch(local["dk_local"])
    dgl_k = local["dgamma_local"].double().sum(0).reshape(NT, C, HV).permute(0, 2, 1)
    vc = ch(v)
    bc = beta.double().reshape(NT, C, HV).permute(0, 2, 1)
    Tm = tt.double().reshape(NT, C, HV, C).permute(0, 2, 1, 3).tril(-1) + torch.eye(C, dtype=torch.float64, device=gm.device)
    Tr = _bf(Tm)
    kbg, vb = _bf((bc * eg)[..., None] * kc), _bf(bc[..., None] * vc)
    dT = (dwc @ kbg.transpose(-1, -2) + dvn @ vb.transpose(-1, -2)).tril(-1)
    dA = -(Tm.transpose(-1, -2) @ dT @ Tm.transpose(-1, -2)).tril(-1)
    dvb, dkbg = Tr.transpose(-1, -2) @ dvn, Tr.transpose(-1, -2) @ dwc
    kk = kc @ kc.transpose(-1, -2)
    Gm = dA * kk * dec
    dkbg_k = (dkbg * kc).sum(-1)
    dbeta = (dvb * vc).sum(-1) + eg * dkbg_k + Gm.sum(-1)
    M2 = bc[..., None] * Gm
    dgamma = dgl_k + bc * eg * dkbg_k + M2.sum(-1) - M2.sum(-2)
    dKK = _bf(bc[..., None] * dA * dec)
    sc = lambda t: t.permute(0, 2, 1).reshape(1, T, HV)  # noqa: E731
    want.update(dT=back(dT), dA=back(dA), dv=back(bc[..., None] * dvb), dbeta=sc(dbeta), dgamma=sc(dgamma),
                dg=sc(dgamma.flip(-1).cumsum(-1).flip(-1)),
                dk_hv=back(dk_loc + (bc * eg)[..., None] * dkbg + (dKK + dKK.transpose(-1, -2)) @ kc))
    for n in ("dT", "dA", "dv", "dbeta", "dgamma", "dg", "dk_hv"):
        got[n] = wy[n]

    def report(tag, got):
        for n, gv in got.items():
            wv = want[n]
            gv = gv.double().reshape(wv.shape)
            if got[n].dtype == torch.bfloat16:  # stored rounded to nearest: compare with the rounded value
                wv = _bf(wv)
            err = (gv - wv).abs()
            rms = float(wv.square().mean().sqrt())
            flat = int(err.flatten().argmax())
            idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(flat), wv.shape))
            print(f"KERN {shape} {tag} {n:13s} rel {float((gv - wv).norm() / wv.norm()):.2e} max/rms "
                  f"{float(err.max()) / rms:.2e} at {list(idx)} (chunk row {idx[1] % 64}) want {float(wv[idx]):+.4e} "
                  f"got {float(gv[idx]):+.4e} n>1e-2rms {int((err > 1e-2 * rms).sum())}")
            sys.stdout.flush()

    report("default", got)
    # the same inputs through other launch configs of kernel 3 (WY): a miscompile follows its config;
    # each variant timed too (do_bench median, ms)
    variants = [{"num_warps": w, "num_stages": st} for w in (2, 4, 8) for st in (1, 2)]
    variants += [{"num_warps": 2, "num_stages": 1, "BK": 32, "BV": 32}]
    for var in variants:
        for kern in ("wy",):
            cfg = dict(chunk_bwd.bwd_config(f"gated_delta_rule_bwd_{kern}", 128, 128, torch.bfloat16), **var)
            tag = kern + "-" + ",".join(f"{a}={b}" for a, b in var.items())
            try:
                if kern == "dqkw":
                    out = chunk_bwd.chunk_bwd_dqkw(qn, kn, v_new, h, dh, do, dv_new, gamma, scale, cfg=cfg)
                    out["dgamma_local"] = out["dgamma_local"].sum(0)
                else:
                    out = run_wy(stages=True, cfg=cfg)
                _sync()
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
                print(f"KERN {shape} {tag} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            report(tag, {n: out[n] for n in want if n in out})
            if torch.cuda.is_available():
                from triton.testing import do_bench

                ms = do_bench(lambda: run_wy(cfg=cfg), rep=100)  # includes the dk_local copy, alike in every config
                print(f"KTIME {shape} {tag} {ms:.3f} ms")


def _set_prec(prec):
    """Every Gated DeltaNet kernel's fp32 tensor-core products at ``prec`` (tf32, tf32x3, ieee): the
    intra kernel's k k^T and triangular solve, the backward's dA."""
    from triforge.ops.deltanet import chunk, chunk_bwd

    flags = chunk._flags

    def patched(dtype):
        return {**flags(dtype), "PREC": prec}

    chunk._flags = chunk_bwd._flags = patched
    print(f"PREC {prec}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--one", default=None)
    ap.add_argument("--check", default=None, help="shapes BxTxHxHV,... for check_op (then the cases)")
    ap.add_argument("--grads", default=None, help="shapes BxTxHxHV,... for grads()")
    ap.add_argument("--kernels", default=None, help="shapes 1xTxHxHV,... for kernels()")
    ap.add_argument("--prec", default=None, help="fp32 products at tf32 / tf32x3 / ieee (default: the kernels' own)")
    a = ap.parse_args()
    if a.prec:
        _set_prec(a.prec)
    for shape in (a.kernels.split(",") if a.kernels else []):
        kernels(shape)
    if a.kernels and not (a.grads or a.check):
        return
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
