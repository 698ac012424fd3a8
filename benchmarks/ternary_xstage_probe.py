"""What the per-step staging of x costs the M = 1 ternary tensor-core kernel (issue 6): a bound, not a kernel.

At M = 1 each K step of ``ternary_tc_kernel`` stores x's [16, 128] tile to shared memory for the wgmma (XPRE: x by
pointer loads one step ahead), behind CTA barriers (session 21's ncu: the barrier is the largest stall). This probe
times, as CUDA-graph replay over input copies that exceed the L2 four times, the library's kernel against a copy of
it whose x tile is a constant (``tl.full``: hoisted out of the loop, so the loop stores nothing and has no x barrier;
its outputs are wrong, and only its time is used), and a copy whose decode (LOP3 + HADD2 per pair of weights) is
replaced by the words' 16-bit halves as they are (``no_decode``: the MMA and the loads without the decode's
instructions), each with the code words by register loads and by TMA (WTMA). If the constant-x kernel is far faster, a
kernel that stages x once per split is worth building; if the no-decode one is, the decode's instructions bound it.

    PYTHONPATH=. python benchmarks/ternary_xstage_probe.py [--shapes 8192x8192 8192x28672] [--json PATH]
"""

import argparse
import importlib.util
import inspect
import json
import sys
import tempfile
from pathlib import Path

import triforge  # noqa: F401,I001  (first: sets the interpreter up before triton is imported)
import torch

from triforge import _runtime, bench
from triforge.ops.ternary import tc
from ternary_floor_probe import m1_sets, report  # noqa: I001  (benchmarks/, this script's folder, is on the path)

_X_STEP = "        if XPRE:\n            b_x = xw\n"
_X_CONST = "        if XPRE:\n            b_x = tl.full([BLOCK_M, BK], 1.0, x_ptr.dtype.element_ty)\n"
_DECODE = "            lo, hi = _decode_asm(src, mask, c, d, IS_BF16)\n"
_NO_DECODE = "            lo, hi = _halves_asm(src, IS_BF16)\n"
_HALVES = '''

@triton.jit
def _halves_asm(src, IS_BF16: tl.constexpr):
    """The word's two 16-bit halves as they are (no decode: a bound)."""
    dt = tl.bfloat16 if IS_BF16 else tl.float16
    return tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [src], dtype=(dt, dt), is_pure=True, pack=1)
'''


def variant_module(folder: Path, name: str, old: str, new: str):
    """tc.py with ``old`` replaced by ``new`` (and a halves helper added), imported as its own module (its own
    kernel)."""
    src = inspect.getsource(tc)
    if old not in src:
        raise RuntimeError(f"tc.py no longer holds {old!r}: update this probe")
    path = folder / f"{name}.py"
    path.write_text(src.replace(old, new) + _HALVES)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def const_x_module(folder: Path):
    """tc.py with the XPRE step's x tile replaced by a constant."""
    return variant_module(folder, "tc_const_x", _X_STEP, _X_CONST)


def no_decode_module(folder: Path):
    """tc.py with the decode (LOP3 + HADD2 per pair) replaced by the words' halves as they are."""
    return variant_module(folder, "tc_no_decode", _DECODE, _NO_DECODE)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["8192x8192", "8192x28672"])
    ap.add_argument("--json")
    args = ap.parse_args()
    _runtime.require_gpu("ternary_xstage_probe")
    copy = bench.peaks()["copy_tbps"]
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        cx = const_x_module(Path(d))
        nd = no_decode_module(Path(d))
        for shape in args.shapes:
            N, K = (int(v) for v in shape.split("x"))
            tt, nbytes, sets = m1_sets(N, K, g)
            n_sets = len(sets)
            entry = dict(tc.tc_config(1, N, K), XPRE=1)  # (the constant-x copy replaces the XPRE branch only)
            variants = {}
            for name, mod in (("library", tc), ("const_x", cx), ("no_decode", nd)):
                variants[f"{name}"] = (mod, {})
                for st in (2, 3, 4):
                    variants[f"{name} WTMA st={st}"] = (mod, {"WTMA": 1, "num_stages": st})
                for pps in (2, 3, 8):
                    variants[f"{name} pps={pps}"] = (mod, {"programs_per_sm": pps})
                    variants[f"{name} WTMA st=3 pps={pps}"] = (mod, {"WTMA": 1, "num_stages": 3, "programs_per_sm": pps})
            row = {"N": N, "K": K, "entry": entry, "sets": n_sets, "us": {}}
            for key, (mod, cfg) in variants.items():
                try:
                    row["us"][key] = bench.graph_us_over(
                        lambda s, mod=mod, cfg=cfg: mod.ternary_matmul_tc(s[0], tt, codes=s[1], cfg=dict(entry, **cfg)),
                        sets)
                except Exception as e:  # out of resources and the like: reported
                    row["us"][key] = None
                    print(f"  {key}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            report(f"N={N} K={K}: {nbytes / 1e6:.1f} MB of codes, entry {entry}", row["us"], nbytes, copy)
            rows.append(row)
            del sets
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
