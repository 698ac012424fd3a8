"""One-shot grid search over a kernel's launch parameters at one shape (no run-time autotuning).

A kernel registers a :class:`Tunable`; ``tune()`` times every point of its grid, skipping (and
counting) configs that fail to compile or exceed resources, and ``write_config`` stores the best
in ``triforge/configs/<arch>.json`` where the launcher finds it.

``tune()`` also times the launcher's own config (the stored entry, else the fallback) in the same run
(``in_use``), and ``write_config`` does not replace a stored entry with a grid point that measured
slower than it: a grid need not contain the entry in use (an entry found by a wider sweep), and a
write must never make a kernel slower.

Each config's outputs are also checked against those of the launcher's own config (``run(None)``):
a config that returns NaN/Inf where that one is finite, or differs from it by more than
``MISMATCH_RTOL`` (relative RMS, by output dtype), is refused like one that fails to compile. Launch
configs change only the order of fp32 accumulations, so correct configs agree to a fraction of the
output's rounding; a config-dependent miscompile (found on the H100: Triton 3.6 pipelining the
Gated DeltaNet WY kernel at 4 and 8 warps) does not. The check compares configs with each other,
not with the math: the parity checks (``triforge check``, the tests) do that for the launcher's one.
"""

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from triforge import _runtime, launch


@dataclass
class Tunable:
    kernel: str
    space: dict  # parameter -> candidate values
    # (shape: dict, dtype, device) -> (run, config key); run(cfg) launches with cfg (None: the
    # launcher's own config) and returns the outputs (tensors, or tuples/lists/dicts of them) or None
    setup: Callable
    shape_names: tuple  # e.g. ("M", "N")
    default_shape: dict = field(default_factory=dict)
    # keys of a stored entry that the grid's configs do not take over (tune() runs every config with the entry's keys
    # outside the space, except these: the attention forward's GLUON switches to another kernel, whose tiles the
    # grid does not describe)
    not_inherited: tuple = ()
    # cfg -> the config as the launcher runs it (keys it ignores there dropped): the grid runs each distinct launch
    # once, and the best is reported (and written) in this form
    canonical: Callable | None = None
    # time each config as the bench times a ``bench_graph`` op: CUDA-graph replays (``bench.graph_time_ms``), the
    # calls stepping through the setup's input sets where its run is ``rotating``. A decode-size kernel (~10 us) timed
    # per call measures its host launch path: session 50's ternary_tc tune at M = 1 read 32 us for the 10.5 us that
    # the bench measures, and ranked configs by host time
    graph: bool = False
    # (kernel, field): this tunable's configs live in another kernel's entry, as its ``field`` (the attention
    # forward's Gluon kernel: flash_attn_fwd's GLUON), read there as the config in use and written there
    entry_of: tuple | None = None


def stored_entry(tunable: Tunable, key: str) -> dict | None:
    """The stored config of ``tunable`` at ``key`` (launch.stored_config; with ``entry_of`` that entry's field)."""
    if tunable.entry_of is None:
        return launch.stored_config(tunable.kernel, key)
    parent = launch.stored_config(tunable.entry_of[0], key)
    found = (parent or {}).get(tunable.entry_of[1])
    return None if found is None else dict(found)


_TUNABLES: dict[str, Tunable] = {}


def register(t: Tunable) -> Tunable:
    _TUNABLES[t.kernel] = t
    return t


def get(kernel: str) -> Tunable:
    import triforge.ops  # noqa: F401

    if kernel not in _TUNABLES:
        raise KeyError(f"unknown tunable kernel {kernel!r}; known: {', '.join(sorted(_TUNABLES))}")
    return _TUNABLES[kernel]


def all_tunables() -> list[str]:
    import triforge.ops  # noqa: F401

    return sorted(_TUNABLES)


def rotating(run_on: Callable, sets: list) -> Callable:
    """A setup's run over several input sets: ``run(cfg)`` computes on ``sets[0]`` (the outputs the tune checks),
    ``run.timed(cfg)`` on the next set at each call (the timed calls, so that each finds its inputs out of L2, as the
    bench's rotation does), ``run.n_sets`` their count. ``run_on(set, cfg)`` launches on one set."""
    step = itertools.cycle(sets)

    def run(cfg):
        return run_on(sets[0], cfg)

    run.timed = lambda cfg: run_on(next(step), cfg)
    run.n_sets = len(sets)
    return run


def rotation_sets(set_bytes: int, device) -> int:
    """Input sets a tune setup on ``device`` should rotate through: enough to exceed the L2 four times on a GPU (the
    bench's ``rotation_count``), one elsewhere (no L2 to defeat: the interpreter's tunes only check outputs)."""
    if torch.device(device).type != "cuda":
        return 1
    from triforge.bench import l2_bytes, rotation_count

    return rotation_count(set_bytes, l2_bytes())


def graph_timed(tunable: "Tunable") -> bool:
    """Whether ``default_timer`` times this tunable by CUDA-graph replays: a ``graph`` tunable whose tune runs on a GPU
    (not through the interpreter, which a GPU host may also run with TRITON_INTERPRET=1)."""
    return tunable.graph and _runtime.default_device().type == "cuda"


def default_timer(tunable: "Tunable", n_sets: int = 1) -> Callable:
    """fn -> median ms: CUDA-graph replays of whole rotations over ``n_sets`` (``bench.graph_calls``) for a ``graph``
    tunable on a GPU (the bench's timing of ``bench_graph`` ops), else per-call CUDA events (``bench.time_ms``). A
    config whose calls cannot be captured fails like one that does not compile (the grid is not timed two ways)."""
    from triforge.bench import graph_calls, graph_time_ms, time_ms

    if graph_timed(tunable):
        calls = graph_calls(n_sets)
        return lambda fn: graph_time_ms(fn, calls=calls)["median_ms"]
    return lambda fn: time_ms(fn, warmup=10, rep=60)["median_ms"]


def grid(space: dict) -> list[dict]:
    keys = list(space)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(space[k] for k in keys))]


# relative RMS difference from the launcher's config's outputs above which a config is refused
MISMATCH_RTOL = {torch.float32: 1e-3, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}


def _tensors(out) -> list:
    """The tensors of a run's outputs, in order (None entries skipped)."""
    if out is None:
        return []
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def output_mismatch(want: list, got: list) -> str | None:
    """Why ``got`` (one config's output tensors) disagrees with ``want`` (the launcher's config's), or
    None: same count, shapes and dtypes; no NaN/Inf where ``want`` is finite; relative RMS difference
    within MISMATCH_RTOL of the dtype (integer outputs: equal)."""
    if len(got) != len(want):
        return f"mismatch: {len(got)} outputs, the launcher's config gives {len(want)}"
    for i, (w, g) in enumerate(zip(want, got)):
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"mismatch: output {i} is {tuple(g.shape)} {g.dtype}, expected {tuple(w.shape)} {w.dtype}"
        if not w.is_floating_point():
            if not torch.equal(g, w):
                return f"mismatch: output {i} ({g.dtype}) differs from the launcher's config's"
            continue
        w64, g64 = w.double(), g.double()
        finite = torch.isfinite(w64)
        bad = int((finite & ~torch.isfinite(g64)).sum())
        if bad:
            return f"mismatch: output {i} has {bad} NaN/Inf where the launcher's config's is finite"
        w64, g64 = w64[finite], g64[finite]
        if w64.numel() == 0:
            continue
        norm = float(w64.norm())
        rel = float((g64 - w64).norm()) / norm if norm > 0 else float((g64 - w64).abs().max())
        tol = MISMATCH_RTOL.get(w.dtype, 1e-3)
        if not rel <= tol:
            return f"mismatch: output {i} differs from the launcher's config's by rel. RMS {rel:.2e} (> {tol:g})"
    return None


def _error_line(e: Exception) -> str:
    """The exception's type and the first line of its message (at most 200 characters)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _spills() -> int | None:
    """Registers spilled by the kernels the last run launched, summed (None where none was compiled: the
    interpreter). Shown beside each config's time and kept in a written entry's provenance; not a filter (a config
    that spills a few registers may still be the fastest, as the H200's ternary_tc at 8192^2, M = 256 was)."""
    n = [r["spills"] for r in map(launch.kernel_resources, launch.recorded_kernels()) if r and r["spills"] is not None]
    return sum(n) if n else None


def distinct_grid(tunable: Tunable, fixed: dict | None = None) -> list[dict]:
    """The configs tune() runs: the grid of ``tunable.space``, each with ``fixed``'s keys (the entry in use's keys
    outside the space) and in its canonical form, duplicates dropped (first occurrence kept, grid order)."""
    configs, seen = [], set()
    for c in grid(tunable.space):
        c = {**(fixed or {}), **c}
        c = tunable.canonical(c) if tunable.canonical else c
        k = json.dumps(c, sort_keys=True, default=str)
        if k not in seen:
            seen.add(k)
            configs.append(c)
    return configs


def tune(tunable: Tunable, shape: dict, dtype: torch.dtype, *, top: int = 5, timer=None, progress=None,
         budget_s: float | None = None) -> dict:
    """Time every config of ``tunable`` at ``shape``; return best, top-N and the failures (configs
    that raise, and configs whose outputs disagree with the launcher's config's: ``n_mismatch``).
    ``budget_s``: start no config after that many seconds from the tune's start (the first is always tried; the rest
    are counted in ``n_skipped``; the best is the best of those tried), so a tune under a device call's time limit
    ends with a result (the last config started may still take its compile and timing past the budget).
    The grid's configs carry the entry in use's keys that the space does not hold; the entry in use is timed before
    the grid and after it, and keeps the faster time (``in_use["ms_runs"]`` has both)."""
    deadline = None if budget_s is None else time.monotonic() + budget_s
    device = _runtime.default_device()
    run, key = tunable.setup(shape, dtype, device)
    timed_run = getattr(run, "timed", run)  # (a rotating run: timed calls step through its input sets)
    n_sets = getattr(run, "n_sets", 1)
    timing = "given"  # (a caller's timer)
    if timer is None:
        timer = default_timer(tunable, n_sets)
        timing = "cuda_graph" if graph_timed(tunable) else "per_call"
    want = [t.clone() for t in _tensors(run(None))]
    stored = stored_entry(tunable, key)
    # the entry in use is timed as the grid's configs run: where it holds a key the grid leaves out
    # (``not_inherited``: the attention forward's GLUON, which runs another kernel), without that key, so its
    # tiles race the grid's like for like (timed as the launcher runs it, the Gluon kernel's time guarded the
    # Triton tiles, and a tune of them rarely wrote)
    dropped = sorted(k for k in (stored or {}) if k in tunable.not_inherited)
    in_use_cfg = {k: v for k, v in stored.items() if k not in dropped} if dropped else None

    def run_in_use():
        return timed_run(in_use_cfg)

    try:  # the config in use, timed beside the grid (same process, same inputs), again after it (below)
        if in_use_cfg is not None:
            why = output_mismatch(want, _tensors(run(in_use_cfg)))
            if why:
                raise RuntimeError(f"the entry without {dropped}: {why}")
        in_use = {"config": stored, "ms": timer(run_in_use)}
    except Exception as e:
        in_use = {"config": stored, "ms": None, "error": _error_line(e)}
    if dropped:
        in_use["timed_without"] = dropped
    timed, failed = [], []
    n_mismatch = 0
    # keys of the entry in use that the grid does not vary (ternary_tc's XPRE, the attention forward's GLUON) hold
    # for every config of the grid, so the grid is timed like for like with the entry (session 49: ternary_tc's grid,
    # run without the entry's XPRE 1, timed its best at 0.4x the entry and won writes that the bench then found no
    # faster)
    fixed = {k: v for k, v in (stored or {}).items() if k not in tunable.space and k not in tunable.not_inherited}
    configs = distinct_grid(tunable, fixed)
    n_skipped = 0
    for i, cfg in enumerate(configs):
        if deadline is not None and i > 0 and time.monotonic() >= deadline:  # (one config at least)
            n_skipped = len(configs) - i
            break
        try:
            launch._compiled.clear()
            got = _tensors(run(cfg))
            if device.type == "cuda":
                torch.cuda.synchronize()
            spills = _spills()
            why = output_mismatch(want, got) if want else None
            del got
            ms = None if why else timer(lambda: timed_run(cfg))
        except Exception as e:  # compile errors, OutOfResources: skipped and counted
            failed.append({"config": cfg, "error": _error_line(e)})
        else:
            if why:
                n_mismatch += 1
                failed.append({"config": cfg, "error": why})
            else:
                timed.append({"config": cfg, "ms": ms, "spills": spills})
        if progress is not None:
            progress()
    timed.sort(key=lambda r: r["ms"])
    if in_use["ms"] is not None and timed:  # timed first in the process, the entry may have met a cold GPU (clocks,
        # caches, lazy set-up): its time is the faster of a run before the grid and one after (one timing more, also
        # after a budget ran out)
        try:
            again = timer(run_in_use)
        except Exception:  # (it ran before the grid: a failure now leaves the first time)
            again = None
        if again is not None:
            in_use["ms_runs"] = [in_use["ms"], again]
            in_use["ms"] = min(in_use["ms"], again)
    return {
        "kernel": tunable.kernel,
        "device": _runtime.device_name(),
        "arch": _runtime.arch(),
        "device_tag": _runtime.device_tag(),
        "shape": shape,
        "dtype": str(dtype).replace("torch.", ""),
        "key": key,
        "space_keys": sorted(tunable.space),  # (the grid's parameters: write_config stores these and the file's own)
        "best": timed[0] if timed else None,
        "in_use": in_use,  # the launcher's config: the stored entry (config None: the fallback), timed
        "top": timed[:top],
        "n_tried": len(timed) + len(failed),
        "n_failed": len(failed),
        "n_mismatch": n_mismatch,
        "n_skipped": n_skipped,  # configs not tried: the budget ran out
        "checked": bool(want),
        "failed": failed,
        "timing": timing,  # cuda_graph / per_call (the default timers), given (a caller's timer)
        "n_sets": n_sets,  # input sets the timed calls rotate through
        "entry_of": list(tunable.entry_of) if tunable.entry_of else None,  # (where write_config stores it)
    }


def keeps_entry_in_use(result: dict) -> bool:
    """Whether ``write_config`` keeps the config in use: a stored entry that measured at least as fast as the grid's
    best in the same run; and after a tune cut short by its budget (a corner of the grid), the launcher's fallback
    too when it measured at least as fast. A tunable stored as another kernel's field (``entry_of``) is always
    guarded: with no field stored the launcher runs another kernel (the attention forward without GLUON: the Triton
    kernel), and writing the field switches it over, so the grid's best must beat what ran."""
    in_use = result.get("in_use") or {}
    best = result.get("best")
    guarded = (in_use.get("config") is not None or result.get("n_skipped", 0) > 0
               or bool(result.get("entry_of")))
    return bool(guarded and in_use.get("ms") is not None and best and in_use["ms"] <= best["ms"])


def _write_field(result: dict, data: dict, path) -> str:
    """write_config for a tunable with ``entry_of`` (kernel, field): the best config, whole, as that field of the
    kernel's entry at the key (the entry created if this file has none: launch merges a device file's entry over the
    arch's field by field), its provenance under the field's lower-case name in the kernel's provenance."""
    kernel, field_name = result["entry_of"]
    entry = data.setdefault("kernels", {}).setdefault(kernel, {}).setdefault(result["key"], {})
    # the grid ran with the merged field's keys outside the space (device file over the arch's): of those, this file
    # takes only the ones its own field had (as write_config does for whole entries)
    space = set(result.get("space_keys") or ()) | set(result.get("space_override") or ())
    old = entry.get(field_name) or {}
    entry[field_name] = {k: v for k, v in result["best"]["config"].items() if k in space or k in old or not space}
    note = {"device": result["device"], "shape": result["shape"], "ms": result["best"]["ms"],
            "tuned_as": result["kernel"]}
    if result["best"].get("spills"):
        note["spills"] = result["best"]["spills"]
    if result.get("n_skipped"):
        note["n_tried"], note["n_skipped"] = result["n_tried"], result["n_skipped"]
    if result.get("space_override"):
        note["space_override"] = result["space_override"]
    if result.get("timing") == "cuda_graph":
        note["timing"] = "cuda_graph"
    prov = data.setdefault("provenance", {}).setdefault(f"{kernel}[{result['key']}]", {})
    prov.setdefault("device", result["device"])  # (an entry this write created: where its file's values come from)
    prov[field_name.lower()] = note
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    launch.reload()
    return str(path)


def write_config(result: dict, arch: str | None = None, force: bool = False, for_device: bool = False) -> str | None:
    """Store ``result['best']`` in triforge/configs/<arch>.json under kernel and key (``for_device``: in
    <arch>.<device tag>.json, read over the arch's file on that device model only); unless ``force``, not over
    a stored entry that measured at least as fast in the same run (then nothing is written and None is
    returned)."""
    if not result.get("best"):
        raise ValueError(f"no config of {result['kernel']} ran; nothing to write")
    if not force and keeps_entry_in_use(result):
        return None
    arch = arch or result["arch"]
    if for_device and not result.get("device_tag"):
        raise ValueError("for_device: the tune result names no device_tag (tuned before per-device configs)")
    path = launch.configs_file(arch, result["device_tag"] if for_device else None)
    data = json.loads(path.read_text()) if path.exists() else {"arch": arch, "kernels": {}}
    if for_device:
        data.setdefault("device", result["device"])
    if result.get("entry_of"):
        return _write_field(result, data, path)
    # keys outside the space go to this file only where its entry had them: the grid ran with the merged entry's
    # (device file over the arch's), so a key of the other file stays there (a device entry holds what its tune
    # varied, and an arch write on a device with its own file does not take the device's keys)
    registered = _TUNABLES[result["kernel"]].space if result["kernel"] in _TUNABLES else {}
    space = set(result.get("space_keys") or ()) or set(registered) | set(result.get("space_override") or ())
    old = data.get("kernels", {}).get(result["kernel"], {}).get(result["key"], {})
    entry = {k: v for k, v in result["best"]["config"].items() if k in space or k in old or not space}
    prov_key = f"{result['kernel']}[{result['key']}]"
    provenance = {"device": result["device"], "shape": result["shape"], "ms": result["best"]["ms"]}
    if result["best"].get("spills"):
        provenance["spills"] = result["best"]["spills"]
    if result.get("n_skipped"):  # (tune --budget ran out: the entry won among the configs tried)
        provenance["n_tried"], provenance["n_skipped"] = result["n_tried"], result["n_skipped"]
    if result.get("space_override"):  # (tune --space: the grid this entry won in)
        provenance["space_override"] = result["space_override"]
    if result.get("timing") == "cuda_graph":  # (how its ms was measured, where it is not per-call events)
        provenance["timing"] = "cuda_graph"
    # keys of the entry that the tuning space does not hold (the attention forward's GLUON and EMU) stay, with their
    # provenance notes (under the key's lower-case name); tune() ran the grid with them, so the best config usually
    # holds them already
    for key in sorted(set(old) - set(space)):
        entry.setdefault(key, old[key])
        note = data.get("provenance", {}).get(prov_key, {}).get(key.lower())
        if note is not None and entry[key] == old[key]:
            provenance[key.lower()] = note
    data.setdefault("kernels", {}).setdefault(result["kernel"], {})[result["key"]] = entry
    data.setdefault("provenance", {})[prov_key] = provenance
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    launch.reload()
    return str(path)
