"""Probe: the Gluon dqkw kernel (triforge/ops/deltanet/bwd_ws.py) against the Triton one (chunk_bwd.chunk_bwd_dqkw)
on the same inputs: agreement at awkward and bench shapes, then kernel times (CUDA events, median) per config.
    python benchmarks/gdn_dqkw_ws_probe.py [--cfgs JSON-list] [--json OUT.json]"""
import argparse
import json
import os

import torch
import torch.nn.functional as F

from triforge.ops.deltanet import bwd_ws, chunk, chunk_bwd

SHAPES = [(1, 32768, 16, 32), (8, 4096, 16, 32), (4, 8192, 16, 16), (1, 8192, 32, 32)]
SMALL = [(1, 64, 1, 1), (2, 300, 2, 4), (1, 37, 1, 2), (3, 200, 2, 2), (2, 1000, 4, 8), (1, 129, 2, 4)]


def inputs(B, T, H, HV, K=128, V=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)
    NT = (T + 63) // 64
    qn = F.normalize(r(B, T, H, K), dim=-1).to(dtype)
    kn = F.normalize(r(B, T, H, K), dim=-1).to(dtype)
    glog = F.logsigmoid(r(B, T, HV) + 2.0)
    pad = NT * 64 - T
    gp = F.pad(glog, (0, 0, 0, pad)).view(B, NT, 64, HV).cumsum(2).view(B, NT * 64, HV)[:, :T].contiguous()
    return dict(qn=qn, kn=kn, v_new=r(B, T, HV, V).to(dtype), h=(0.3 * r(B, NT, HV, K, V)).to(dtype),
                dh=(0.3 * r(B, NT, HV, K, V)).to(dtype), do=r(B, T, HV, V).to(dtype),
                dv_new=r(B, T, HV, V).to(dtype), gamma=gp.float())


def run_triton(x, scale):
    """The Triton kernel: chunk_bwd_dqkw with the Gluon dispatch switched off for this call."""
    old = os.environ.get(chunk.GLUON_ENV)
    os.environ[chunk.GLUON_ENV] = "0"
    try:
        return chunk_bwd.chunk_bwd_dqkw(x["qn"], x["kn"], x["v_new"], x["h"], x["dh"], x["do"], x["dv_new"],
                                        x["gamma"], scale)
    finally:
        if old is None:
            del os.environ[chunk.GLUON_ENV]
        else:
            os.environ[chunk.GLUON_ENV] = old


def run_ws(x, scale, cfg):
    return bwd_ws.dqkw_ws(x["qn"], x["kn"], x["v_new"], x["h"], x["dh"], x["do"], x["dv_new"], x["gamma"], scale,
                          cfg=cfg)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)), float((a - b).abs().max())


def compare(x, cfg):
    scale = 128 ** -0.5
    t = run_triton(x, scale)
    w = run_ws(x, scale, cfg)
    out = {}
    for n in ("dq_hv", "dk_local", "dw"):
        assert w[n].isfinite().all(), n
        out[n] = rel(w[n], t[n])
    out["dgamma"] = rel(w["dgamma_local"].sum(0), t["dgamma_local"].sum(0))
    return out


def bench(fns, rounds=6, n=10):
    """Median time (ms) of each of ``fns``, timed in interleaved rounds of ``n`` calls (CUDA events)."""
    return [t[len(t) // 2] for t in event_times(fns, rounds, n)]


def event_times(fns, rounds=6, n=10):
    """Each of ``fns``'s times per call (ms, sorted), timed in interleaved rounds of ``n`` calls (CUDA events)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    ts = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            for _ in range(n):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                ts[i].append(s.elapsed_time(e))
    return [sorted(t) for t in ts]


def quantiles(ts):
    """min / median / p95 of sorted per-call times (as the bench reports them)."""
    return {"min": ts[0], "median": ts[len(ts) // 2], "p95": ts[int(0.95 * len(ts))]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfgs", default="[{}]")
    ap.add_argument("--json")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--check-first", action="store_true", help="check the first config only")
    ap.add_argument("--small", action="store_true", help="check the small shapes only (for compute-sanitizer)")
    a = ap.parse_args()
    cfgs = json.loads(a.cfgs)
    res = {"check": [], "time": []}
    ok = True
    for cfg in [c for c in cfgs if not c.get("PROBE")][:1 if a.check_first else None]:
        for shp in SMALL + ([] if a.small else SHAPES[1:2]):
            for dt in (torch.bfloat16, torch.float16):
                if shp in SHAPES and dt == torch.float16:
                    continue
                x = inputs(*shp, dtype=dt)
                r = compare(x, cfg)
                bad = any(v[0] > 2e-2 for v in r.values())
                ok &= not bad
                res["check"].append(dict(cfg=cfg, shape=shp, dtype=str(dt), rel=r, bad=bad))
                print("check", cfg, shp, str(dt)[6:], {k: f"{v[0]:.1e}" for k, v in r.items()}, "BAD" if bad else "")
    if not a.no_time:
        scale = 128 ** -0.5
        for shp in SHAPES:
            x = inputs(*shp)
            fns = [lambda: run_triton(x, scale)] + [lambda c=c: run_ws(x, scale, c) for c in cfgs]
            row = dict(shape=shp, **dict(zip(["triton"] + [f"ws{i}" for i in range(len(cfgs))], bench(fns))))
            res["time"].append(row)
            print("time", shp, {k: (f"{v * 1e3:.0f}us" if isinstance(v, float) else v) for k, v in row.items()
                                if k != "shape"})
            del x
            torch.cuda.empty_cache()
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)
    print("ALL OK" if ok else "MISMATCH")


if __name__ == "__main__":
    main()
