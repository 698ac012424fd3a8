"""One-shot grid search over a kernel's launch parameters at one shape (no run-time autotuning).

A kernel registers a :class:`Tunable`; ``tune()`` times every point of its grid, skipping (and
counting) configs that fail to compile or exceed resources, and ``write_config`` stores the best
in ``triforge/configs/<arch>.json`` where the launcher finds it.
"""

import itertools
import json
from dataclasses import dataclass, field
from typing import Callable

import torch

from triforge import _runtime, launch


@dataclass
class Tunable:
    kernel: str
    space: dict  # parameter -> candidate values
    setup: Callable  # (shape: dict, dtype, device) -> (run(cfg) -> None, config key)
    shape_names: tuple  # e.g. ("M", "N")
    default_shape: dict = field(default_factory=dict)


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


def grid(space: dict) -> list[dict]:
    keys = list(space)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(space[k] for k in keys))]


def tune(tunable: Tunable, shape: dict, dtype: torch.dtype, *, top: int = 5, timer=None, progress=None) -> dict:
    """Time every config of ``tunable`` at ``shape``; return best, top-N and the failures."""
    if timer is None:
        from triforge.bench import time_ms

        timer = lambda fn: time_ms(fn, warmup=10, rep=60)["median_ms"]  # noqa: E731
    device = _runtime.default_device()
    run, key = tunable.setup(shape, dtype, device)
    timed, failed = [], []
    for cfg in grid(tunable.space):
        try:
            run(cfg)
            if device.type == "cuda":
                torch.cuda.synchronize()
            ms = timer(lambda: run(cfg))
        except Exception as e:  # compile errors, OutOfResources: skipped and counted
            failed.append({"config": cfg, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"})
        else:
            timed.append({"config": cfg, "ms": ms})
        if progress is not None:
            progress()
    timed.sort(key=lambda r: r["ms"])
    return {
        "kernel": tunable.kernel,
        "device": _runtime.device_name(),
        "arch": _runtime.arch(),
        "shape": shape,
        "dtype": str(dtype).replace("torch.", ""),
        "key": key,
        "best": timed[0] if timed else None,
        "top": timed[:top],
        "n_tried": len(timed) + len(failed),
        "n_failed": len(failed),
        "failed": failed,
    }


def write_config(result: dict, arch: str | None = None) -> str:
    """Store ``result['best']`` in triforge/configs/<arch>.json under kernel and key."""
    if not result.get("best"):
        raise ValueError(f"no config of {result['kernel']} ran; nothing to write")
    arch = arch or result["arch"]
    path = launch.CONFIG_DIR / f"{arch}.json"
    data = json.loads(path.read_text()) if path.exists() else {"arch": arch, "kernels": {}}
    entry = dict(result["best"]["config"])
    data.setdefault("kernels", {}).setdefault(result["kernel"], {})[result["key"]] = entry
    data.setdefault("provenance", {})[f"{result['kernel']}[{result['key']}]"] = {
        "device": result["device"],
        "shape": result["shape"],
        "ms": result["best"]["ms"],
    }
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    launch.reload()
    return str(path)
