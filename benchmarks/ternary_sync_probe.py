"""What the M <= 16 ternary loop would gain without its synchronisation (issue 6): timing bounds, not kernels.

The tensor-core kernel (triforge/ops/ternary/tc.py) at M = 1 stages x into shared memory for the wgmma's B operand
at every K step (STS + a CTA barrier per step) and ends with the split-K fix-up (an acq_rel arrival counter whose
result is broadcast through shared memory). ncu (session 33) puts barrier stalls first. This probe builds, from
tc.py's own source at run time, a copy of the kernel with two switches that give *wrong results on purpose*:

- XONCE: the split's first x tile serves every step (the STS leaves the loop; one barrier per step is left);
- NOFIX: the partials are stored and the program ends (no arrival counter, no fix-up);

and times the config in use with each (CUDA graphs, weights and x rotated past the L2), beside the kernel itself,
at the issue's M = 1 shapes (and M = 4, 16 with --m). The gaps bound what a kernel without these costs (x kept in
shared memory for a whole split, a fix-up without the broadcast) could buy.

    PYTHONPATH=. python benchmarks/ternary_sync_probe.py [--json PATH] [--m 1 4] [--pps 4 6]
"""

import argparse
import importlib.util
import inspect
import json
import os
import sys
import tempfile

import torch

from triforge import launch as _launch
from triforge.ops.ternary import tc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ternary_tc_probe import graph_us, weight_sets  # noqa: E402

SHAPES = [(8192, 8192), (28672, 8192), (8192, 28672)]


def probe_kernel():
    """tc.py with the two switches, imported from a temporary module (the kernel itself is unchanged)."""
    src = inspect.getsource(tc)
    edits = [
        ("    PDL: tl.constexpr,  # programmatic dependent launch: the first words in flight before griddepcontrol.wait\n):",
         "    PDL: tl.constexpr,  # programmatic dependent launch: the first words in flight before griddepcontrol.wait\n"
         "    XONCE: tl.constexpr = False,\n    NOFIX: tl.constexpr = False,\n):"),
        ("        if XPRE:\n            x_next = _load_x(", "        if XPRE and not XONCE:\n            x_next = _load_x("),
        ("        if PREFETCH == 1:\n            words = words_next\n            if XPRE:\n                xw = x_next",
         "        if PREFETCH == 1:\n            words = words_next\n            if XPRE and not XONCE:\n                xw = x_next"),
        ("        if FIXUP:\n            # serial", "        if FIXUP and not NOFIX:\n            # serial"),
    ]
    for a, b in edits:
        assert src.count(a) == 1, a
        src = src.replace(a, b)
    d = tempfile.mkdtemp()
    path = os.path.join(d, "ternary_tc_syncprobe.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("ternary_tc_syncprobe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ternary_tc_kernel


SWITCHES = {}
_real_launch = _launch.launch


def _patched(name, fn, grid, *args, **kw):
    if fn is tc.ternary_tc_kernel and SWITCHES:
        return _real_launch(name + "_probe", PROBE, grid, *args, **kw, **SWITCHES)
    return _real_launch(name, fn, grid, *args, **kw)


def main():
    global PROBE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--m", nargs="*", type=int, default=[1])
    ap.add_argument("--pps", nargs="*", type=int, default=[], help="extra split targets (programs per SM) to time")
    args = ap.parse_args()
    PROBE = probe_kernel()
    _launch.launch = _patched
    gen = torch.Generator().manual_seed(0)
    rows = []
    variants = [("kernel", {}), ("probe off", {"XONCE": False, "NOFIX": False}), ("XONCE", {"XONCE": True}),
                ("NOFIX", {"NOFIX": True}), ("XONCE+NOFIX", {"XONCE": True, "NOFIX": True})]
    for N, K in SHAPES:
        tts, codes = weight_sets(N, K, gen)
        for M in args.m:
            xs = [torch.randn(M, K, generator=gen).cuda().to(torch.bfloat16) for _ in tts]
            cur = dict(tc.tc_config(M, N, K))
            cfgs = [("in use", cur)] + [(f"pps {p}", dict(cur, programs_per_sm=p)) for p in args.pps]
            for clab, cfg in cfgs:
                for vlab, sw in variants:
                    SWITCHES.clear()
                    SWITCHES.update(sw)
                    fns = [lambda t=t, c=c, x=x: tc.ternary_matmul_tc(x, t, codes=c, cfg=cfg) for t, c, x in zip(tts, codes, xs)]
                    us = graph_us(fns)
                    SWITCHES.clear()
                    rows.append({"N": N, "K": K, "M": M, "config": clab, "variant": vlab, "us": us})
                    print(f"N={N:6d} K={K:6d} M={M:3d} {clab:7s} {vlab:12s} {us:8.2f} us", flush=True)
        del tts, codes
        torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print("\nsummary (us; the variants give wrong results on purpose)")
    keys = sorted({(r["N"], r["K"], r["M"], r["config"]) for r in rows}, key=str)
    for k in keys:
        t = {r["variant"]: r["us"] for r in rows if (r["N"], r["K"], r["M"], r["config"]) == k}
        print(f"{k}: " + "  ".join(f"{v} {t[v]:.2f}" for v, _ in variants if v in t))


if __name__ == "__main__":
    main()
