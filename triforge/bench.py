"""Timing against the roofline and the peers, in one process.

- ``time_ms``: CUDA-event timing through ``triton.testing.do_bench`` (which flushes L2 before
  every run); min / median / p95 / max / mean over all repeats.
- ``peaks``: the device's measured ceilings (device-to-device copy, bf16 8192^3 matmul), cached
  per device name.
- ``bench_op``: an op's triforge kernels and its peers on the same inputs, forward and backward;
  inputs rotate among enough sets to exceed the L2 four times (at most ``MAX_SETS``; peers that hold a
  prepared form of some input must build it per set, e.g. the ternary fp16 weights). Timing only starts
  after the op passes its parity check at the same shape.
"""

import datetime as _dt
import itertools
import json
import math
import os
import subprocess
import time
from pathlib import Path

import torch

from triforge import _runtime, launch

PEAKS_CACHE = Path(os.environ.get("TRIFORGE_CACHE", Path.home() / ".cache" / "triforge")) / "peaks.json"


def time_ms(fn, *, warmup: int = 25, rep: int = 200) -> dict:
    """Median and spread of ``fn``'s run time in ms (warmup and rep are milliseconds of running)."""
    import triton.testing

    times = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="all")
    return _stats(times)


HOST_BOUND = 0.8  # a row whose host enqueue time reaches this fraction of its median is marked host-bound


def host_time_ms(fn, *, calls: int = 10, batches: int = 3) -> dict:
    """The host's time to enqueue one call of ``fn``, as {"host_ms": ms}: ``calls`` calls back to back with no
    synchronisation, the fastest of ``batches`` batches (host noise only adds). Where it nears the GPU time of a
    call, the GPU waits on the host's launches (a per-call timing then measures the host path; a captured or
    host-ahead run would not). A call that synchronises with the GPU (a device value read on the host: torch's sync
    debug mode warns) would measure its GPU time here: {"host_ms": None, "host_syncs": True} instead."""
    import warnings

    cuda = torch.cuda.is_available()
    best = float("inf")
    mode = torch.cuda.get_sync_debug_mode() if cuda else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            for _ in range(batches):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                best = min(best, (time.perf_counter() - t0) / calls)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(mode)
                torch.cuda.synchronize()
    if any("synchroniz" in str(w.message) for w in caught):
        return {"host_ms": None, "host_syncs": True}
    return {"host_ms": best * 1e3}


def sm_clock_mhz() -> int | None:
    """The SM clock now (MHz), where torch can read it (through pynvml), else None. Sampled right after a row's timing:
    a streaming kernel's time follows the clock its L2 runs at, and a GPU warmed by the rows before may have lowered it
    (session 50: an entry 2.4% faster alone ran 2-3% slower after the family's heavier rows)."""
    try:
        return int(torch.cuda.clock_rate())
    except Exception:  # (no pynvml, or no GPU)
        return None


def _stats(times) -> dict:
    """min / median / p95 / max / mean (ms) and n of a list of per-call times."""
    times = sorted(float(t) for t in times)
    n = len(times)
    return {
        "min_ms": times[0],
        "median_ms": times[n // 2] if n % 2 else 0.5 * (times[n // 2 - 1] + times[n // 2]),
        "p95_ms": times[min(n - 1, math.ceil(0.95 * n) - 1)],
        "max_ms": times[-1],
        "mean_ms": sum(times) / n,
        "n": n,
    }


def capture_graph(fn, calls: int):
    """A CUDA graph of ``calls`` calls of ``fn`` (fn rotates its own input sets), replayed once: warmed up first outside
    capture and then on the capture stream."""
    for _ in range(calls):  # every input set once at least: lazy per-set state (caches) made outside capture
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(calls):  # warm-up on the capture stream (its own per-stream state, e.g. counters)
            fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=side):
            for _ in range(calls):
                fn()
    torch.cuda.current_stream().wait_stream(side)
    g.replay()
    torch.cuda.synchronize()
    return g


def graph_time_ms(fn, *, calls: int = 16, replays: int = 30) -> dict:
    """Per-call time of ``fn`` as CUDA-graph replay: ``calls`` calls (fn rotates its own input sets)
    captured once (``capture_graph``), the graph replayed ``replays`` times between CUDA events; statistics over the
    replays of (replay time / calls), in time_ms's keys. Host launch overhead is out of the timing, and
    back-to-back kernels overlap their tails as they do in a captured decode step."""
    g = capture_graph(fn, calls)
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    del g
    return _stats(times)


def measure_peaks() -> dict:
    """Measure the copy bandwidth (bytes read + written) and the bf16 matmul rate."""
    _runtime.require_gpu("triforge peaks")
    n = 1 << 29  # 1 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t_copy = time_ms(lambda: dst.copy_(src))["median_ms"]
    del src, dst
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    t_mm = time_ms(lambda: a @ b)["median_ms"]
    return {
        "device": _runtime.device_name(),
        "copy_tbps": 2 * n * 2 / (t_copy * 1e-3) / 1e12,
        "matmul_bf16_tflops": 2 * m**3 / (t_mm * 1e-3) / 1e12,
        "measured": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def peaks(force: bool = False) -> dict:
    """Ceilings of this device: from the cache when present, else measured and cached."""
    _runtime.require_gpu("triforge peaks")
    name = _runtime.device_name()
    cache = json.loads(PEAKS_CACHE.read_text()) if PEAKS_CACHE.exists() else {}
    if force or name not in cache:
        cache[name] = measure_peaks()
        PEAKS_CACHE.parent.mkdir(parents=True, exist_ok=True)
        PEAKS_CACHE.write_text(json.dumps(cache, indent=2))
    return cache[name]


def _input_sets(spec, dtype, n_sets, seed, tier="real"):
    gen = torch.Generator().manual_seed(seed)
    try:
        return [spec.make_inputs(tier, dtype, _runtime.default_device(), gen) for _ in range(n_sets)]
    except (KeyError, TypeError) as e:
        if isinstance(tier, dict):
            raise ValueError(f"op {spec.name} does not take a shape {tier}: {e}") from e
        raise


GRAPH_CALLS = 16  # calls per captured graph at least (bench_graph ops)
MAX_SETS = 64  # input sets rotated at most: 64 sets of 3.2 MB already exceed a 50 MB L2 four times


def graph_calls(n_sets: int) -> int:
    """Calls per captured graph over ``n_sets`` rotated input sets: at least GRAPH_CALLS and each set twice, rounded up
    to a whole number of rotations, so that the rotation also holds across the boundary between two replays (16 calls
    over 3 sets ran set 0 twice in a row there, its data still in L2)."""
    n = max(1, n_sets)
    return n * -(-max(GRAPH_CALLS, 2 * n) // n)


def set_bytes(inputs: dict) -> int:
    """Device bytes one input set occupies: its tensors, and the objects that report what they hold through a
    ``nbytes("resident")`` method (a TernaryTensor: its codes or planes and scales)."""
    total = 0
    for v in inputs.values():
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif callable(getattr(v, "nbytes", None)):
            total += int(v.nbytes("resident"))
    return total


def rotation_count(nbytes: int, l2_bytes: int) -> int:
    """Input sets to rotate so that together they exceed the L2 four times (each call then finds its inputs
    evicted by the three-plus L2s of data touched since its set last ran), at most ``MAX_SETS``."""
    return min(MAX_SETS, max(1, math.ceil(4 * l2_bytes / max(nbytes, 1))))


def l2_bytes() -> int:
    """The GPU's L2 size in bytes (50 MB where torch does not report it)."""
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)


def _rotation(spec, dtype, seed, tier="real") -> list:
    """Enough input sets that consecutive calls never find their data in L2 (``rotation_count``)."""
    first = _input_sets(spec, dtype, 1, seed, tier)
    n_sets = rotation_count(set_bytes(first[0]), l2_bytes())
    return first + _input_sets(spec, dtype, n_sets - 1, seed + 1, tier)


def rotating_fn(call, sets):
    """A no-argument function that runs ``call(set)`` on the input sets in turn, one set per call."""
    step = itertools.cycle(sets)
    return lambda: call(next(step))


def graph_us_over(call, sets, *, replays: int = 30) -> float:
    """Median microseconds per call of ``call(set)`` over the rotated input sets, as CUDA-graph replays of whole
    rotations (``graph_calls``, ``graph_time_ms``): the benchmarks' probes time their variants so."""
    return graph_time_ms(rotating_fn(call, sets), calls=graph_calls(len(sets)), replays=replays)["median_ms"] * 1e3


def _fwd_fn(impl, sets):
    return rotating_fn(lambda inputs: impl(**inputs), sets)


def _bwd_fn(impl, spec, sets):
    """Backward only: forward graphs are built once per set, then grads are replayed."""
    prepared = []
    for inputs in sets:
        leaves = {k: (v.detach().clone().requires_grad_(True) if k in spec.grad_inputs else v) for k, v in inputs.items()}
        outs = impl(**leaves)
        grads = [torch.randn_like(o) for o in outs]
        prepared.append((outs, [leaves[k] for k in spec.grad_inputs], grads))
    state = {"i": 0}

    def run():
        outs, wrt, grads = prepared[state["i"] % len(prepared)]
        state["i"] += 1
        return torch.autograd.grad(outs, wrt, grads, retain_graph=True)

    return run


def git_commit() -> str:
    """The commit being measured (TRIFORGE_COMMIT wins: the GPU machine's copy has no .git)."""
    if os.environ.get("TRIFORGE_COMMIT"):
        return os.environ["TRIFORGE_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def floor_ms(nbytes, flops, ceil: dict) -> float:
    """A call's time floor: its bytes over the measured copy rate or its FLOPs over the matmul rate, the larger."""
    return 1e3 * max(nbytes / (ceil["copy_tbps"] * 1e12), flops / (ceil["matmul_bf16_tflops"] * 1e12))


def bench_op(spec, *, dtype=torch.bfloat16, modes=("fwd", "bwd"), peers=True, seed=0, check=True, shape=None) -> list[dict]:
    """Rows for each mode and implementation (triforge first, then the peers).

    ``shape`` (e.g. {"T": 65536, "C": 1024}) replaces the op's real-tier shape where the op takes one.
    """
    tier = shape or "real"
    from triforge.check import check_op

    _runtime.require_gpu("triforge bench")
    ceil = peaks()
    if check:
        verdict = check_op(spec, dtype, tier=tier, seed=seed)
        if not verdict.ok:
            failed = verdict.error or verdict.failed_stage
            return [{"op": spec.name, "mode": m, "impl": "triforge", "shape": verdict.shape, "dtype": verdict.dtype,
                     "bench_shape": shape, "error": f"parity check failed: {failed}"} for m in modes]
    sets = _rotation(spec, dtype, seed, tier)
    impls = {"triforge": spec.call}
    if peers:
        for name, build in spec.peers.items():
            fn = build(sets[0])
            if fn is not None:
                impls[name] = fn
    rows = []
    for mode in modes:
        if mode == "bwd" and not spec.grad_inputs:
            continue
        ours = None
        for name, impl in impls.items():
            row = {"op": spec.name, "mode": mode, "impl": name, "shape": spec.describe(sets[0]),
                   "dtype": str(dtype).replace("torch.", ""), "n_input_sets": len(sets), "bench_shape": shape}
            try:
                fn = _fwd_fn(impl, sets) if mode == "fwd" else _bwd_fn(impl, spec, sets)
                launch._compiled.clear()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fn()
                torch.cuda.synchronize()
                row["peak_mem_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
                if name == "triforge":
                    row["kernels"] = {k: launch.kernel_resources(k) for k in launch.recorded_kernels()}
                    if spec.extras is not None:
                        row.update(spec.extras(sets[0]))
                if spec.bench_graph and mode == "fwd":
                    try:
                        # each set at least twice, and 16 calls at least: the replay's own start (and the first
                        # kernel's, which no predecessor overlaps) is spread over as many calls whatever the set count
                        row.update(graph_time_ms(fn, calls=graph_calls(len(sets))))
                        row["timing"] = "cuda_graph"
                    except Exception as e:  # not capturable: timed per call, and said so
                        torch.cuda.synchronize()
                        row.update(time_ms(fn))
                        row["timing"] = f"per_call (graph capture failed: {type(e).__name__})"
                else:
                    row.update(time_ms(fn))
                    row["timing"] = "per_call"
                row["sm_mhz"] = sm_clock_mhz()  # (right after the timing)
                if row["timing"] == "per_call":
                    try:  # (a diagnostic: a failure here leaves the timed row as it is)
                        row.update(host_time_ms(fn))
                    except Exception as e:
                        torch.cuda.synchronize()
                        row["host_ms"], row["host_error"] = None, f"{type(e).__name__}"
            except Exception as e:  # a peer that crashes or refuses the shape is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                rows.append(row)
                continue
            nbytes, flops = spec.bytes(sets[0], mode), spec.flops(sets[0], mode)
            sec = row["median_ms"] * 1e-3
            row["bytes"], row["flops"] = nbytes, flops
            row["gbps"] = nbytes / sec / 1e9
            row["tflops"] = flops / sec / 1e12
            row["pct_copy"] = 100 * row["gbps"] / (ceil["copy_tbps"] * 1e3)
            row["floor_ms"] = floor_ms(nbytes, flops, ceil)
            if name == "triforge":
                ours = row["median_ms"]
            row["triforge_speedup"] = (row["median_ms"] / ours) if ours else None
            rows.append(row)
        del ours
    return rows


def family_totals(specs, rows) -> list[dict]:
    """For each family of several ops: every kernel's time and bytes summed, per implementation
    that ran them all (the layer's forward + backward against the copy ceiling)."""
    ceil = peaks()
    out = []
    by_family = {}
    for spec in specs:
        if not spec.bench_shapes:  # a sweep over shapes has no single layer to total
            by_family.setdefault(spec.family, []).append(spec.name)
    for family, names in by_family.items():
        if len(names) < 2:
            continue
        fam_rows = [r for r in rows if r["op"] in names and "error" not in r]
        for impl in dict.fromkeys(r["impl"] for r in fam_rows):
            mine = [r for r in fam_rows if r["impl"] == impl]
            wanted = {(r["op"], r["mode"]) for r in fam_rows if r["impl"] == "triforge"}
            if {(r["op"], r["mode"]) for r in mine} != wanted:
                continue  # this peer does not cover every kernel of the family
            ms = sum(r["median_ms"] for r in mine)
            nbytes = sum(r["bytes"] for r in mine)
            flops = sum(r["flops"] for r in mine)
            out.append({"op": f"{family} total", "mode": "+".join(sorted({r["mode"] for r in mine})), "impl": impl,
                        "shape": mine[0]["shape"], "dtype": mine[0]["dtype"], "median_ms": ms, "bytes": nbytes,
                        "flops": flops, "gbps": nbytes / (ms * 1e-3) / 1e9, "tflops": flops / (ms * 1e-3) / 1e12,
                        "pct_copy": 100 * nbytes / (ms * 1e-3) / (ceil["copy_tbps"] * 1e12)})
    for r in out:
        ours = next(o["median_ms"] for o in out if o["op"] == r["op"] and o["impl"] == "triforge")
        r["triforge_speedup"] = r["median_ms"] / ours
    return out


def _measured(rows, op: str, shape) -> bool:
    """Whether ``rows`` hold ``op``'s triforge rows at bench shape ``shape``, none of them failed (a shape whose
    forward ran and backward raised is run again)."""
    ours = [r for r in rows if r["op"] == op and r["impl"] == "triforge" and r.get("bench_shape", ()) == shape]
    return bool(ours) and not any("error" in r for r in ours)


def shapes_to_run(spec, shape) -> list:
    """The bench shapes of ``spec`` at CLI dimensions ``shape``: its sweep (``bench_shapes``) without them; with
    them, the sweep's shapes that agree on every given dimension (``--M 256``: the M = 256 row of a matmul sweep),
    else ``shape`` itself (a shape off the sweep, or an op without one)."""
    if not spec.bench_shapes:
        return [shape]
    if not shape:
        return list(spec.bench_shapes)
    picked = [s for s in spec.bench_shapes if all(k in s and s[k] == v for k, v in shape.items())]
    return picked or [shape]


def run_bench(specs, *, dtype=torch.bfloat16, modes=("fwd", "bwd"), peers=True, progress=None, shape=None,
              on_partial=None, done_rows=None) -> dict:
    """Every op's rows plus family totals; ``on_partial(result)`` sees the result after each op. ``done_rows``
    (a cut-off run's rows at this commit, ``triforge bench --resume``) are kept, and the shapes they measured
    are not run again."""
    rows = [r for r in (done_rows or []) if not r["op"].endswith(" total")]
    for spec in specs:
        for one in shapes_to_run(spec, shape):
            if _measured(rows, spec.name, one):
                continue
            rows = [r for r in rows if not (r["op"] == spec.name and r.get("bench_shape", ()) == one)]  # failed
            rows += bench_op(spec, dtype=dtype, modes=modes, peers=peers, shape=one)
            if on_partial is not None:  # a sweep cut off by a time limit (or a fault) keeps its finished shapes,
                on_partial(_result(rows, shape, modes, peers))  # and a failed shape's rows name the failing call
            torch.cuda.empty_cache()
        if progress is not None:
            progress(spec.name)
    rows += family_totals(specs, rows)
    return _result(rows, shape, modes, peers)


def _result(rows, shape, modes, peers) -> dict:
    """A bench result file's content: the run's conditions (what ``--resume`` must find unchanged) and its rows."""
    return {
        "device": _runtime.device_name(),
        "arch": _runtime.arch(),
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "peaks": peaks(),
        "shape": shape,
        "modes": list(modes),
        "peers": bool(peers),
        "rows": rows,
    }
