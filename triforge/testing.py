"""Parity: compare a kernel's output with a float64 reference, stage by stage.

``compare`` gives one row per tensor; ``compare_stages`` walks named stages in order and stops
at the first that fails, so a failure points at one stage. ``poisoned()`` (from triforge.launch) makes
every output a launcher allocates start as NaN, so elements a kernel never writes cannot pass.
"""

import contextlib
import faulthandler
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from triforge.launch import new_output, poisoned




@contextlib.contextmanager
def time_limit(seconds: float, file=None):
    """Within the block, a run longer than ``seconds`` dumps every thread's stack to ``file`` (a file object or a file
    descriptor; default sys.stderr) and ends the process (exit code 1; faulthandler's timer: a hung CUDA wait cannot
    be interrupted by a signal handler in Python). ``seconds <= 0``: no limit. Under pytest's output capture pass a
    descriptor of the real stderr (tests/conftest.py does): what goes to the captured one is lost with the process."""
    if seconds <= 0:
        yield
        return
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr if file is None else file)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@dataclass(frozen=True)
class Tolerance:
    """Pass when rel_rms <= rel_rms and no element has |got-ref| > atol*rms(ref) + rtol*|ref|."""

    rel_rms: float
    atol: float
    rtol: float


TOLERANCES = {
    torch.float64: Tolerance(rel_rms=1e-10, atol=1e-9, rtol=1e-9),
    torch.float32: Tolerance(rel_rms=1e-5, atol=2e-5, rtol=2e-5),
    torch.float16: Tolerance(rel_rms=3e-3, atol=1e-2, rtol=1e-2),
    torch.bfloat16: Tolerance(rel_rms=1e-2, atol=5e-2, rtol=5e-2),
}


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    """Tolerance for results computed from operands of ``dtype`` (the op's input dtype)."""
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance defined for dtype {dtype}")
    return TOLERANCES[dtype]


@dataclass
class CompareResult:
    name: str
    ok: bool
    shape: tuple
    max_abs: float
    max_abs_at: tuple
    mean_abs: float
    rel_rms: float
    n_over: int
    nan_ref: int
    inf_ref: int
    nan_got: int
    inf_got: int
    tol: Tolerance
    reason: str = ""
    first_ref: list = field(default_factory=list)
    first_got: list = field(default_factory=list)

    def row(self) -> dict:
        return {
            "name": self.name,
            "ok": self.ok,
            "shape": list(self.shape),
            "max_abs": self.max_abs,
            "max_abs_at": list(self.max_abs_at),
            "mean_abs": self.mean_abs,
            "rel_rms": self.rel_rms,
            "n_over": self.n_over,
            "nan_inf_ref": [self.nan_ref, self.inf_ref],
            "nan_inf_got": [self.nan_got, self.inf_got],
            "reason": self.reason,
        }

    def line(self) -> str:
        status = "PASS" if self.ok else "FAIL"
        text = (
            f"{status} {self.name:<28} max_abs={self.max_abs:.3e} at {self.max_abs_at} "
            f"mean_abs={self.mean_abs:.3e} rel_rms={self.rel_rms:.3e} (tol {self.tol.rel_rms:.0e}) "
            f"over_tol={self.n_over} nan/inf ref={self.nan_ref}/{self.inf_ref} got={self.nan_got}/{self.inf_got}"
        )
        if not self.ok:
            text += f"\n     reason: {self.reason}\n     ref[:8]={self.first_ref}\n     got[:8]={self.first_got}"
        return text


def storage_floor(dtype: torch.dtype) -> float:
    """The error that storing a value in ``dtype`` alone can make where relative bounds vanish: half
    the spacing of its subnormals (fp16: 2^-25 ~ 3.0e-8; bf16 and fp32: below 1e-40). An fp16
    gradient element of exact value 1e-9 is stored as 0 or 6e-8 whatever the kernel computed before
    the store, so no bound proportional to the element or its terms can hold there."""
    if not dtype.is_floating_point or dtype == torch.float64:
        return 0.0
    fi = torch.finfo(dtype)
    return fi.smallest_normal * fi.eps / 2


def compare(name, ref, got, *, dtype=None, tol=None, scale=None, verbose=True) -> CompareResult:
    """Compare ``got`` with the float64 reference ``ref``; print and return one row.

    ``dtype`` is the dtype the op computed from (it picks the tolerance; default got.dtype).
    Non-finite values pass only where the reference has the same value (NaN never passes).
    An element fails when |got - ref| > atol * scale + rtol * |ref| + storage_floor(got.dtype). ``scale`` defaults to the rms of
    ``ref``; an op whose elements' error scales differ by orders passes its own (a tensor shaped like
    ``ref``): for a dot product, the sum of its terms' absolute values, which bounds its rounding
    error where the result itself cancels to ~0 (see attention_magnitudes). With such a tensor the
    rel_rms criterion divides by the larger of ||ref|| and ||scale||: an ill-conditioned result (a
    softmax gradient whose every column is one near-one-hot column) is held to the rounding of its
    terms, which even torch's own float32 kernel cannot beat relative to ||ref||.
    """
    if tol is None:
        tol = tolerance_for(dtype or got.dtype)
    floor = storage_floor(got.dtype)
    ref_d = ref.detach().to(torch.float64)
    got_d = got.detach().to(ref_d.device, torch.float64)
    if ref_d.shape != got_d.shape:
        result = CompareResult(
            name, False, tuple(got_d.shape), math.inf, (), math.inf, math.inf, got_d.numel(),
            0, 0, 0, 0, tol, reason=f"shape mismatch: ref {tuple(ref_d.shape)} vs got {tuple(got_d.shape)}",
        )
        if verbose:
            print(result.line())
        return result
    nan_ref, inf_ref = int(ref_d.isnan().sum()), int(ref_d.isinf().sum())
    nan_got, inf_got = int(got_d.isnan().sum()), int(got_d.isinf().sum())
    finite = ref_d.isfinite() & got_d.isfinite()
    diff = torch.where(finite, (got_d - ref_d).abs(), torch.zeros_like(ref_d))
    ref_fin = ref_d.isfinite()
    if scale is None:
        scale = float(torch.where(ref_fin, ref_d, 0.0).square().sum() / ref_fin.sum().clamp(min=1)) ** 0.5
        scale = scale if scale > 0 else 1.0
    else:
        scale = scale.detach().to(ref_d.device, torch.float64)
    bound = tol.atol * scale + tol.rtol * ref_d.abs().nan_to_num(0.0, 0.0, 0.0) + floor
    over = diff > bound
    # a non-finite got passes only where the reference holds the same infinity
    bad_nonfinite = ~got_d.isfinite() & ~((got_d == ref_d) & ref_d.isinf())
    bad_nonfinite |= ~ref_fin & got_d.isfinite()
    n_over = int(over.sum()) + int(bad_nonfinite.sum())
    flat = int(diff.argmax()) if diff.numel() else 0
    max_abs_at = tuple(int(i) for i in np.unravel_index(flat, tuple(diff.shape))) if diff.numel() else ()
    ref_f = torch.where(finite, ref_d, torch.zeros_like(ref_d))
    got_f = torch.where(finite, got_d, torch.zeros_like(got_d))
    denom = float(ref_f.norm())
    if isinstance(scale, torch.Tensor):
        # a result that cancels (its terms large, its value small) is judged by its terms: the rms
        # error relative to the rms of the error scales, where those exceed the values themselves
        denom = max(denom, float(torch.where(finite, scale.expand_as(ref_d), 0.0).norm()))
    rel_rms = float((got_f - ref_f).norm()) / denom if denom > 0 else float((got_f - ref_f).norm())
    reasons = []
    if nan_got:
        reasons.append(f"{nan_got} NaN in output")
    if int(bad_nonfinite.sum()) - nan_got > 0:
        reasons.append("non-finite values differ from the reference")
    if rel_rms > tol.rel_rms:
        reasons.append(f"rel_rms {rel_rms:.3e} > {tol.rel_rms:.0e}")
    if int(over.sum()):
        reasons.append(f"{int(over.sum())} elements over tolerance")
    result = CompareResult(
        name=name,
        ok=not reasons,
        shape=tuple(got_d.shape),
        max_abs=float(diff.max()) if diff.numel() else 0.0,
        max_abs_at=max_abs_at,
        mean_abs=float(diff.mean()) if diff.numel() else 0.0,
        rel_rms=rel_rms,
        n_over=n_over,
        nan_ref=nan_ref,
        inf_ref=inf_ref,
        nan_got=nan_got,
        inf_got=inf_got,
        tol=tol,
        reason="; ".join(reasons),
        first_ref=[round(v, 6) for v in ref_d.flatten()[:8].cpu().tolist()],
        first_got=[round(v, 6) for v in got_d.flatten()[:8].cpu().tolist()],
    )
    if verbose:
        print(result.line())
    _log_margin(result, diff, bound)
    return result


def _log_margin(result: CompareResult, diff, bound) -> None:
    """With TRIFORGE_MARGIN_LOG set, append how close this comparison came to failing (one JSON line:
    the test, the worst element's |got - ref| / bound and rel_rms / its tolerance). A check that
    passes at 0.9 of its bound fails now and then on fresh inputs: a few runs of the suite with the
    log find such checks before CI does (``triforge margins LOG`` ranks them)."""
    path = os.environ.get("TRIFORGE_MARGIN_LOG")
    if not path:
        return
    elem = float((diff / bound.clamp_min(1e-300)).max()) if diff.numel() else 0.0
    row = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0], "name": result.name,
           "elem": elem, "rms": result.rel_rms / result.tol.rel_rms, "ok": result.ok}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def rank_margins(paths) -> list[dict]:
    """Merge TRIFORGE_MARGIN_LOG files, one per test run: one row per check (test id, compared name)
    with the worst element and rel_rms margins of its passing comparisons, the runs it appears in and
    the runs in which it failed. A check that failed in some runs and not in others is flaky and
    comes first; then every check by how close its passing comparisons came to their bounds. A check
    that fails in every run is a negative test's planted error (its test asserts the failure) or a
    test that fails outright; its passing comparisons still count."""
    worst = {}
    for run, path in enumerate(paths):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                w = worst.setdefault((row["test"], row["name"]), {"test": row["test"], "name": row["name"],
                                                                  "elem": 0.0, "rms": 0.0, "runs": set(), "failed": set()})
                w["runs"].add(run)
                if row["ok"]:
                    w["elem"] = max(w["elem"], row["elem"])
                    w["rms"] = max(w["rms"], row["rms"])
                else:
                    w["failed"].add(run)
    rows = [dict(w, runs=len(w["runs"]), failed=len(w["failed"])) for w in worst.values()]
    return sorted(rows, key=lambda w: (not 0 < w["failed"] < w["runs"], -max(w["elem"], w["rms"])))


def compare_stages(ref_stages: dict, got_stages: dict, *, dtype, tols=None, scales=None, prefix="", verbose=True):
    """Compare named stages in the reference's order; stop at the first failing stage.

    ``tols`` / ``scales``: per-stage overrides (see ``compare``). Returns (results,
    first_failing_stage_name_or_None). Stages after a failure are not compared.
    """
    results = []
    for name, ref in ref_stages.items():
        if name not in got_stages:
            raise KeyError(f"kernel did not expose stage {name!r} (it exposes {list(got_stages)})")
        tol = (tols or {}).get(name)
        res = compare(prefix + name, ref, got_stages[name], dtype=dtype, tol=tol,
                      scale=(scales or {}).get(name), verbose=verbose)
        results.append(res)
        if not res.ok:
            return results, name
    return results, None


def dump_stages(directory, stages: dict) -> None:
    """Write each stage as ``<dir>/<index>_<name>.npy`` (float64), in stage order."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for i, (name, t) in enumerate(stages.items()):
        np.save(d / f"{i:02d}_{name}.npy", t.detach().to("cpu", torch.float64).numpy())


def load_dump(directory) -> dict:
    d = Path(directory)
    out = {}
    for f in sorted(d.glob("*.npy")):
        stem = f.stem
        name = stem.split("_", 1)[1] if "_" in stem and stem.split("_", 1)[0].isdigit() else stem
        out[name] = np.load(f)
    return out


def compare_dumps(ref_dir, got_dir, worst: int = 10) -> list[dict]:
    """Per-stage max/mean diff and the ``worst`` largest differences between two dump folders."""
    ref, got = load_dump(ref_dir), load_dump(got_dir)
    rows = [{"stage": name, "missing_in_ref": True} for name in got if name not in ref]
    for name, r in ref.items():
        if name not in got:
            rows.append({"stage": name, "missing": True})
            continue
        g = got[name]
        if r.shape != g.shape:
            rows.append({"stage": name, "shape_mismatch": [list(r.shape), list(g.shape)]})
            continue
        diff = np.abs(g - r)
        diff = np.where(np.isnan(diff), np.inf, diff)
        order = np.argsort(diff, axis=None)[::-1][:worst]
        rows.append(
            {
                "stage": name,
                "shape": list(r.shape),
                "max_diff": float(diff.max()) if diff.size else 0.0,
                "mean_diff": float(np.mean(diff)) if diff.size else 0.0,
                "nan_got": int(np.isnan(g).sum()),
                "worst": [
                    {
                        "index": [int(i) for i in np.unravel_index(j, r.shape)],
                        "ref": float(r.flat[j]),
                        "got": float(g.flat[j]),
                    }
                    for j in order
                ],
            }
        )
    return rows


__all__ = [
    "Tolerance",
    "TOLERANCES",
    "tolerance_for",
    "CompareResult",
    "compare",
    "compare_stages",
    "dump_stages",
    "load_dump",
    "compare_dumps",
    "poisoned",
    "new_output",
]
