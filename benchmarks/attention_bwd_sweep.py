"""The attention kernels (forward; the backward's dK/dV and dQ), each over a grid of launch configs, against SDPA.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/attention_bwd_sweep.py OUT.json [--d 64,128] [--warm 12]
        [--kinds fwd,dkdv,dq]

For each of the issue's bf16 (B, H, S, D) shapes whose D is selected, non-causal and causal:
  - SDPA's FLASH_ATTENTION (FA2) and CUDNN_ATTENTION backward (autograd.grad through their forward) are timed;
  - the preprocess, the dK/dV kernel and the dQ kernel of the default configs are timed one by one;
  - SDPA's forward too, and every forward config of FWD[D] (o without the rounding residual: inference);
  - every dK/dV config of DKDV[D] and every dQ config of DQ[D] is run, its outputs compared with the default
    config's (relative RMS over the whole tensor: a config above 5e-3, or non-finite, is reported, not timed),
    and timed alone (triton.testing.do_bench median), with its registers, spills and shared memory.
The compile cost is paid first by --warm worker processes (each launches a slice of the configs once on a small
shape with the same specialisation; Triton's disk cache then serves the timing process).
The table printed last gives, per shape: FA2 and cuDNN backward, the default total (preprocess + dK/dV + dQ),
the best dK/dV and dQ configs (by the sum over the selected shapes of a D and causal flag, as a config key covers
them all) and the total they give, and its ratio to FA2; then the forward's default and best against cuDNN.
"""

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [(16, 16, 2048, 64), (8, 16, 4096, 64), (4, 16, 8192, 128), (2, 16, 16384, 128)]
TOL = 5e-3


def c(bm, bn, w, s, tma=0, guard=1):
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}
    if tma:
        cfg["TMA"] = 1
    if not guard:  # the key loops without their ``if lo < hi`` (before 2026-11-24: ptxas serialized some kernels' wgmma)
        cfg["GUARD"] = 0
    return cfg


# forward: BLOCK_M queries per program, BLOCK_N keys per step
FWD = {
    64: [c(128, 64, 4, 3), c(128, 64, 4, 4), c(128, 64, 4, 3, 1), c(128, 128, 8, 3), c(128, 128, 8, 3, 1),
         c(128, 64, 8, 3), c(64, 64, 4, 3), c(64, 128, 4, 3), c(128, 128, 4, 2), c(128, 64, 4, 5)],
    128: [c(128, 64, 8, 3), c(128, 128, 8, 2, 1), c(128, 64, 8, 3, 1), c(128, 64, 8, 4, 1), c(128, 128, 8, 2),
          c(64, 64, 4, 3), c(64, 128, 4, 2, 1), c(128, 32, 8, 4, 1), c(64, 64, 4, 4, 1), c(128, 64, 4, 3, 1)],
}
# a second round around the first one's picks (--fwd-round 2)
FWD2 = {
    64: [c(128, 64, 8, 3), c(64, 64, 4, 3), c(128, 64, 8, 4), c(128, 64, 8, 5), c(128, 64, 8, 3, 1),
         c(128, 64, 8, 4, 1), c(128, 32, 8, 4), c(64, 64, 4, 4), c(64, 64, 4, 5), c(64, 32, 4, 4), c(64, 64, 4, 4, 1)],
    128: [c(128, 64, 8, 4, 1), c(128, 64, 8, 3), c(128, 64, 8, 5, 1), c(128, 64, 8, 4), c(128, 32, 8, 5, 1),
          c(128, 32, 8, 6, 1), c(64, 64, 4, 5, 1), c(128, 64, 8, 2, 1)],
}
# a third round (--round 3) after the key loops' guard: the tuned configs with and without it, and the tiles the
# serialized D = 64 kernel may have hidden
FWD3 = {
    64: [c(128, 64, 8, 3), c(128, 64, 8, 3, 0, 0), c(64, 64, 4, 3), c(64, 64, 4, 3, 0, 0), c(128, 64, 8, 4),
         c(128, 128, 8, 2), c(128, 128, 8, 3), c(64, 64, 4, 4), c(128, 64, 4, 3), c(64, 128, 4, 3)],
    128: [c(128, 64, 8, 4, 1), c(128, 64, 8, 4, 1, 0), c(128, 64, 8, 3), c(128, 64, 8, 3, 0, 0), c(128, 64, 8, 3, 1),
          c(128, 128, 8, 2, 1), c(64, 64, 4, 3, 1), c(128, 64, 8, 5, 1)],
}
# dK/dV: BLOCK_M queries per step, BLOCK_N keys per program. dQ: BLOCK_M queries per program, BLOCK_N keys per step.
DKDV = {
    64: [c(32, 128, 8, 2), c(32, 128, 8, 3), c(32, 128, 8, 2, 1), c(32, 128, 8, 3, 1), c(64, 128, 8, 2),
         c(64, 128, 8, 2, 1), c(64, 128, 8, 3, 1), c(64, 64, 4, 2), c(64, 64, 4, 3, 1), c(32, 64, 4, 3),
         c(32, 64, 4, 3, 1), c(64, 64, 8, 3, 1)],
    128: [c(32, 128, 8, 1, 1), c(32, 128, 8, 2, 1), c(64, 64, 4, 1, 1), c(64, 64, 4, 2, 1), c(32, 64, 4, 2, 1),
          c(32, 64, 4, 3, 1), c(64, 128, 8, 1, 1), c(64, 64, 8, 2, 1), c(64, 64, 4, 2)],
}
DQ = {
    64: [c(128, 64, 8, 2), c(128, 64, 8, 3), c(128, 128, 8, 2), c(128, 64, 4, 3), c(64, 64, 4, 3),
         c(128, 64, 8, 2, 1), c(128, 128, 8, 3, 1), c(128, 64, 8, 3, 1)],
    128: [c(128, 64, 8, 2, 1), c(128, 64, 8, 3, 1), c(128, 128, 8, 2, 1), c(64, 64, 4, 3, 1), c(64, 128, 4, 2, 1),
          c(128, 64, 8, 2), c(64, 64, 4, 2), c(128, 32, 8, 3, 1)],
}
# a fourth round (--fwd-round 4, D = 128): around round 3's winner, 64-row tiles on one warpgroup (two programs
# per SM by shared memory, whose softmax and matmuls interleave)
FWD4 = {
    64: [c(128, 64, 8, 3), c(64, 64, 4, 3, 0, 0), c(64, 64, 4, 2), c(64, 32, 4, 4), c(64, 64, 4, 3, 1)],
    128: [c(64, 64, 4, 3, 1), c(64, 64, 4, 2, 1), c(64, 64, 4, 4, 1), c(64, 128, 4, 2, 1), c(64, 32, 4, 4, 1),
          c(64, 64, 4, 3, 1, 0), c(64, 64, 4, 3), c(64, 64, 4, 2), c(128, 64, 8, 3), c(64, 32, 4, 3, 1)],
}
DQ3 = {
    64: [c(128, 64, 8, 3, 1), c(128, 64, 8, 3, 1, 0), c(64, 64, 4, 3), c(64, 64, 4, 3, 0, 0), c(128, 64, 8, 2),
         c(128, 64, 8, 2, 0, 0), c(128, 64, 8, 3)],
    128: [c(128, 64, 8, 3, 1), c(128, 64, 8, 3, 1, 0), c(128, 64, 8, 3), c(128, 64, 8, 2)],
}


def name(cfg):
    return (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}w{cfg['num_warps']}s{cfg['num_stages']}" + ("tma" if cfg.get("TMA") else "")
            + ("g0" if not cfg.get("GUARD", 1) else ""))


def inputs(B, H, S, D, seed):
    from triforge.ops import attention as A

    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    return q, k, v, do, A


GRIDS = {"fwd": FWD, "dkdv": DKDV, "dq": DQ}
KERNELS = {"fwd": "flash_attn_fwd", "dkdv": "flash_attn_bwd_dkdv", "dq": "flash_attn_bwd_dq"}


def jobs(ds, kinds):
    return [(D, causal, kind, cfg) for D in ds for causal in (False, True) for kind in kinds for cfg in GRIDS[kind][D]]


def warm(job_slice):
    """Compile (launch once on a small shape of the same specialisation) the given configs."""
    torch.cuda.init()
    for D, causal, kind, cfg in job_slice:
        try:
            q, k, v, do, A = inputs(1, 16, 256, D, 0)
            scale = D**-0.5
            if kind == "fwd":
                A.attn_fwd(q, k, v, causal, scale, cfg)
                torch.cuda.synchronize()
                continue
            o, lse, o_res = A.attn_fwd(q, k, v, causal, scale, residual=True)
            delta = A.attn_bwd_preprocess(o, do, o_res)
            if kind == "dkdv":
                A.attn_bwd_dkdv(q, k, v, do, lse, delta, causal, scale, cfg)
            else:
                A.attn_bwd_dq(q, k, v, do, lse, delta, causal, scale, cfg)
            torch.cuda.synchronize()
        except Exception as e:  # reported again (and recorded) by the timing pass
            print(f"warm {kind} {name(cfg)} D={D} causal={causal}: {type(e).__name__}: {str(e)[:120]}", flush=True)


def bench_ms(fn):
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def rel_rms(got, ref):
    got, ref = got.double(), ref.double()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def resources(kernel):
    from triforge import launch

    r = launch.kernel_resources(kernel) or {}
    return {"registers": r.get("registers"), "spills": r.get("spills"), "shared": r.get("shared_bytes")}


def sdpa_fwd(backend, q, k, v, causal):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return run


def sdpa_bwd(backend, q, k, v, do, causal):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
    with sdpa_kernel(backend):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    dot = do.transpose(1, 2)
    return lambda: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True)


def sweep_shape(shape, causal, rows, log, kinds):
    from torch.nn.attention import SDPBackend

    B, H, S, D = shape
    tag = f"{B}x{H}x{S}x{D}{' causal' if causal else ''}"
    q, k, v, do, A = inputs(B, H, S, D, S + D + causal)
    scale = D**-0.5
    base = {"shape": tag, "B": B, "H": H, "S": S, "D": D, "causal": causal}

    def add(**kw):
        row = dict(base, **kw)
        rows.append(row)
        log(row)

    for peer, backend in (("sdpa_fa2", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        for kind, make in (("peer_fwd", lambda b: sdpa_fwd(b, q, k, v, causal)),
                           ("peer", lambda b: sdpa_bwd(b, q, k, v, do, causal))):
            wanted = "fwd" in kinds if kind == "peer_fwd" else ("dkdv" in kinds or "dq" in kinds)
            if not wanted:
                continue
            try:
                add(kind=kind, variant=peer, ms=bench_ms(make(backend)))
            except Exception as e:
                add(kind=kind, variant=peer, error=f"{type(e).__name__}: {str(e)[:160]}")
    if "fwd" in kinds:
        ref_o = A.attn_fwd(q, k, v, causal, scale)[0]
        d_fwd = A._cfg("flash_attn_fwd", D, causal, q.dtype)
        for cfg in FWD[D]:
            fn = lambda cfg=cfg: (A.attn_fwd(q, k, v, causal, scale, cfg)[0],)  # noqa: E731
            run_cfg(add, "fwd", cfg, same_config(cfg, d_fwd), fn, (ref_o,))
        del ref_o
    if "dkdv" not in kinds and "dq" not in kinds:
        return
    o, lse, o_res = A.attn_fwd(q, k, v, causal, scale, residual=True)
    delta = A.attn_bwd_preprocess(o, do, o_res)
    add(kind="pre", variant="default", ms=bench_ms(lambda: A.attn_bwd_preprocess(o, do, o_res)))
    ref_kv = A.attn_bwd_dkdv(q, k, v, do, lse, delta, causal, scale)
    ref_q = A.attn_bwd_dq(q, k, v, do, lse, delta, causal, scale)
    default = {kind: A._cfg(KERNELS[kind], D, causal, q.dtype) for kind in ("dkdv", "dq")}
    for kind in ("dkdv", "dq"):
        if kind not in kinds:
            continue
        for cfg in GRIDS[kind][D]:
            if kind == "dkdv":
                fn = lambda cfg=cfg: A.attn_bwd_dkdv(q, k, v, do, lse, delta, causal, scale, cfg)  # noqa: E731
                ref = ref_kv
            else:
                fn = lambda cfg=cfg: (A.attn_bwd_dq(q, k, v, do, lse, delta, causal, scale, cfg),)  # noqa: E731
                ref = (ref_q,)
            run_cfg(add, kind, cfg, same_config(cfg, default[kind]), fn, ref)
    del q, k, v, do, o, lse, o_res, delta, ref_kv, ref_q
    torch.cuda.empty_cache()


def run_cfg(add, kind, cfg, is_default, fn, ref):
    """Run one config: outputs against the default config's, then (when they agree) its time."""
    row = {"kind": kind, "variant": name(cfg), "cfg": cfg, "default": is_default}
    try:
        out = fn()
        errs = [rel_rms(a, b) for a, b in zip(out, ref)]
        row["rel_rms"] = [round(e, 6) for e in errs]
        row.update(resources(KERNELS[kind]))
        if all(math.isfinite(e) and e < TOL for e in errs):
            row["ms"] = bench_ms(fn)
        else:
            row["wrong"] = True
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    add(**row)


def _at_shape(rows, tag, peer_kind):
    """(D, causal, rows of the shape by (kind, variant), FA2 ms, cuDNN ms) of one shape's rows."""
    rs = [r for r in rows if r["shape"] == tag]
    get = {(r["kind"], r["variant"]): r for r in rs}
    fa2 = get.get((peer_kind, "sdpa_fa2"), {}).get("ms")
    cud = get.get((peer_kind, "sdpa_cudnn"), {}).get("ms")
    return rs[0]["D"], rs[0]["causal"], rs, get, fa2, cud


def same_config(a, b):
    """Launch configs equal up to TMA's default (0 when absent)."""
    return ({**a, "TMA": a.get("TMA", 0), "GUARD": a.get("GUARD", 1)}
            == {**b, "TMA": b.get("TMA", 0), "GUARD": b.get("GUARD", 1)})


def table(rows):
    out = []
    keyed = {}
    for r in rows:
        keyed.setdefault((r["D"], r["causal"], r["kind"], r["variant"]), []).append(r)
    best = {}
    for D in sorted({r["D"] for r in rows}):
        for causal in (False, True):
            for kind in ("fwd", "dkdv", "dq"):
                cands = {}
                for (d, cz, kd, var), rs in keyed.items():
                    if (d, cz, kd) == (D, causal, kind) and all("ms" in r for r in rs):
                        cands[var] = sum(r["ms"] for r in rs)
                if cands:
                    best[(D, causal, kind)] = min(cands, key=cands.get)
    f = lambda x: f"{x:.3f}" if x else "-"  # noqa: E731
    r_ = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
    tags = list(dict.fromkeys(r["shape"] for r in rows))
    if any(r["kind"] == "fwd" for r in rows):
        out.append("| shape | FA2 fwd | cuDNN fwd | default | vs cuDNN | best | vs cuDNN |")
        out.append("|---|---|---|---|---|---|---|")
        for tag in tags:
            D, causal, rs, get, fa2, cud = _at_shape(rows, tag, "peer_fwd")
            dflt = next((r.get("ms") for r in rs if r["kind"] == "fwd" and r.get("default")), None)
            bf = best.get((D, causal, "fwd"))
            bms = get.get(("fwd", bf), {}).get("ms")
            out.append(f"| {tag} | {f(fa2)} | {f(cud)} | {f(dflt)} | {r_(cud, dflt)} | {bf} ({f(bms)}) | {r_(cud, bms)} |")
        out.append("")
    if not any(r["kind"] in ("dkdv", "dq") for r in rows):
        return "\n".join(out), {f"d={k[0]},causal={int(k[1])},{k[2]}": v for k, v in best.items()}
    out.append("| shape | FA2 bwd | cuDNN bwd | default total | vs FA2 | best dK/dV | best dQ | best total | vs FA2 |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for tag in tags:
        D, causal, rs, get, fa2, cud = _at_shape(rows, tag, "peer")
        pre = get.get(("pre", "default"), {}).get("ms", 0.0)
        dflt = {r["kind"]: r.get("ms") for r in rs if r.get("default")}
        tot = pre + dflt["dkdv"] + dflt["dq"] if dflt.get("dkdv") and dflt.get("dq") else None
        bk, bq = best.get((D, causal, "dkdv")), best.get((D, causal, "dq"))
        btot = None
        if bk and bq:
            btot = pre + get[("dkdv", bk)]["ms"] + get[("dq", bq)]["ms"]
        ms_k, ms_q = get.get(("dkdv", bk), {}).get("ms"), get.get(("dq", bq), {}).get("ms")
        out.append(f"| {tag} | {f(fa2)} | {f(cud)} | {f(tot)} | {r_(fa2, tot)} | {bk} ({f(ms_k)}) | "
                   f"{bq} ({f(ms_q)}) | {f(btot)} | {r_(fa2, btot)} |")
    return "\n".join(out), {f"d={k[0]},causal={int(k[1])},{k[2]}": v for k, v in best.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--d", default="64,128", help="head dims to sweep")
    ap.add_argument("--warm", type=int, default=12, help="compile worker processes (0: compile while timing)")
    ap.add_argument("--kinds", default="fwd,dkdv,dq", help="kernels to sweep: fwd, dkdv, dq")
    ap.add_argument("--fwd-round", type=int, default=1, help="2: the forward's second grid (FWD2); 3: FWD3 and DQ3; 4: FWD4")
    args = ap.parse_args()
    if args.fwd_round in (2, 3, 4):
        FWD.clear()
        FWD.update({2: FWD2, 3: FWD3, 4: FWD4}[args.fwd_round])
    if args.fwd_round == 3:
        DQ.clear()
        DQ.update(DQ3)
    ds = [int(x) for x in args.d.split(",")]
    kinds = [k for k in args.kinds.split(",") if k]
    t0 = time.time()
    if args.warm:
        js = jobs(ds, kinds)
        slices = [js[i::args.warm] for i in range(args.warm)]
        with mp.get_context("spawn").Pool(args.warm) as pool:
            pool.map(warm, slices)
        print(f"[{time.time() - t0:6.1f}s] compiled {len(js)} configs in {args.warm} processes", flush=True)
    import triton

    rows = []

    def log(r):
        msg = f"[{time.time() - t0:6.1f}s] {r['shape']:<22} {r['kind']:<8} {r['variant']:<18}"
        if "error" in r:
            msg += " ERROR " + r["error"]
        elif r.get("wrong"):
            msg += f" WRONG rel_rms={r['rel_rms']}"
        else:
            msg += f" {r['ms']:8.3f} ms"
            if "registers" in r:
                msg += f"  {r['registers']}r {r['spills']}sp {(r['shared'] or 0) // 1024}K rel_rms={r['rel_rms']}"
        print(msg, flush=True)

    def save(best=None):
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "commit": os.environ.get("TRIFORGE_COMMIT", "unknown"), "rows": rows, "best": best}, f, indent=1)

    for shape in SHAPES:
        if shape[3] not in ds:
            continue
        for causal in (False, True):
            sweep_shape(shape, causal, rows, log, kinds)
            save()
    text, best = table(rows)
    save(best)
    print(text)
    print(json.dumps(best))


if __name__ == "__main__":
    main()
