"""The ``triforge`` command: check, bench, tune, peaks, report, compare-dumps, trace, margins, parity, list."""

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console()

DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}


def _dtype(name):
    import torch

    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; use one of fp32, fp16, bf16")
    return getattr(torch, DTYPES[name])


def _progress():
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console)


def cmd_check(args) -> int:
    from triforge import _runtime, registry
    from triforge.check import check_op

    specs = registry.select(args.ops)
    where = "Triton CPU interpreter" if _runtime.INTERPRET else _runtime.device_name()
    table = Table(title=f"triforge check ({where}, seed {args.seed})")
    for col in ("op", "dtype", "shape", "compared", "worst rel_rms", "status"):
        table.add_column(col)
    failures = []
    jobs = [(s, d) for s in specs for d in (args.dtype or s.dtypes)]
    with _progress() as prog:
        task = prog.add_task("checking", total=len(jobs))
        for spec, dtype in jobs:
            prog.update(task, description=f"{spec.name} {str(dtype)[6:]}")
            res = check_op(spec, dtype, tier=args.tier, seed=args.seed, dump_dir=args.dump, verbose=args.verbose)
            worst = max((r.rel_rms for r in res.results), default=float("nan"))
            if res.ok:
                status = "[green]PASS[/green]"
            elif res.error:
                status = f"[red]ERROR[/red] {res.error[:80]}"
            else:
                status = f"[red]FAIL at {res.failed_stage}[/red]"
            table.add_row(spec.name, res.dtype, res.shape, str(len(res.results)), f"{worst:.2e}", status)
            if not res.ok:
                failures.append(res)
            prog.advance(task)
    console.print(table)
    for res in failures:
        console.print(f"[red]{res.op} {res.dtype}[/red]: {res.error or ''}")
        for r in res.results:
            if not r.ok:
                console.print("  " + r.line())
    if args.dump:
        console.print(f"stages written under {args.dump}/<op>-<dtype>/{{ref,got}}; compare with `triforge compare-dumps`")
    console.print(f"{len(jobs) - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


def _bench_table(result):
    from triforge.bench import HOST_BOUND
    from triforge.report import floor_and_rate_cells, host_bound

    table = Table(title=f"triforge bench — {result['device']} ({result['commit']}); * host-bound: the host's enqueue "
                        f"time per call is at least {HOST_BOUND:.0%} of the median")

    cols = ("op", "mode", "shape", "impl", "median ms", "mean / min / max ms", "floor ms", "tokens/s", "MB moved", "GB/s",
            "% copy", "triforge speedup")
    for col in cols:
        table.add_column(col, justify="right" if col not in ("op", "mode", "impl", "shape") else "left")

    def ms(r, key):
        return f"{r[key]:.4f}" if isinstance(r.get(key), (int, float)) else "-"

    for r in result["rows"]:
        if "error" in r:
            table.add_row(r["op"], r["mode"], r.get("shape", ""), r["impl"], f"[red]{r['error'][:60]}[/red]",
                          *[""] * (len(cols) - 5))
            continue
        sp = r.get("triforge_speedup")
        spread = " / ".join(ms(r, k) for k in ("mean_ms", "min_ms", "max_ms"))
        moved = f"{r['bytes'] / 1e6:.1f}" if isinstance(r.get("bytes"), (int, float)) else "-"
        median = f"{r['median_ms']:.4f}" + (" *" if host_bound(r) else "")
        table.add_row(r["op"], r["mode"], r["shape"], r["impl"], median, spread,
                      *floor_and_rate_cells(r, result.get("peaks")), moved,
                      f"{r['gbps']:.0f}", f"{r['pct_copy']:.1f}", "-" if sp is None else f"{sp:.2f}x")
    return table


def cmd_bench(args) -> int:
    from triforge import _runtime, bench, registry

    specs = registry.select(args.ops)
    _check_shape_dims(args.shape_dims, [(s.name, s.shape_names) for s in specs])
    done = _resumed_rows(args) if args.resume else None
    if done is False:
        return 2
    _runtime.require_gpu("triforge bench")
    modes = tuple(args.modes.split(","))

    def save(result):  # whole or not at all (a run killed mid-write must leave a file --resume can read)
        if args.json:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(result, indent=2))
            os.replace(tmp, path)

    with _progress() as prog:
        task = prog.add_task("benchmarking", total=len(specs))
        result = bench.run_bench(specs, dtype=args.dtype, modes=modes, peers=not args.no_peers,
                                 progress=lambda name: prog.advance(task), shape=args.shape_dims or None,
                                 on_partial=save, done_rows=done)
    console.print(_bench_table(result))
    save(result)
    if args.json:
        console.print(f"results written to {args.json}")
    failed = [r for r in result["rows"] if r["impl"] == "triforge" and "error" in r]
    return 1 if failed else 0


def _resumed_rows(args):
    """``bench --resume``: the rows of the --json file (None where it does not exist yet), or False after saying why
    they cannot be continued (another commit, device or dtype: one file must describe one run's conditions)."""
    from triforge import _runtime, bench

    if not args.json:
        console.print("[red]error:[/red] --resume continues the --json file; name it")
        return False
    path = Path(args.json)
    if not path.exists():
        return None
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        console.print(f"[red]error:[/red] --resume: {path} is not a bench result ({e})")
        return False
    want = {"commit": bench.git_commit(), "device": _runtime.device_name(), "shape": args.shape_dims or None,
            "modes": args.modes.split(","), "peers": not args.no_peers}
    for key, value in want.items():
        if old.get(key) != value:
            console.print(f"[red]error:[/red] --resume: {path} is from {key} {old.get(key)!r}, this run is {value!r}")
            return False
    dtype = str(args.dtype).replace("torch.", "")
    other = sorted({r["dtype"] for r in old.get("rows", []) if r.get("dtype") not in (None, dtype)})
    if other:
        console.print(f"[red]error:[/red] --resume: {path} holds {other} rows, this run is {dtype}")
        return False
    return old.get("rows", [])


def _parse_shape(text, names):
    shape = {}
    for part in text.split(","):
        if "=" not in part:
            raise SystemExit(f"--shape expects NAME=VALUE pairs like {','.join(n + '=...' for n in names)}, got {text!r}")
        k, v = part.split("=", 1)
        shape[k.strip()] = int(v)
    missing = [n for n in names if n not in shape]
    if missing:
        raise SystemExit(f"--shape is missing {missing} (this kernel needs {list(names)})")
    return shape


def parse_space(text: str) -> dict:
    """``tune --space``: a JSON object of non-empty lists, the grid's values for those parameters (new ones added)."""
    try:
        space = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--space expects a JSON object of lists, e.g. '{{\"BLOCK_M\": [128, 256]}}': {e}") from e
    if not isinstance(space, dict) or not space or not all(
            isinstance(v, list) and v and all(isinstance(x, (int, float, str, bool)) for x in v) for v in space.values()):
        raise SystemExit(f"--space expects a JSON object of non-empty lists of numbers or strings, e.g. "
                         f"'{{\"BLOCK_M\": [128, 256]}}', got {text!r}")
    return space


def with_space(t, space: dict | None):
    """The tunable ``t`` with ``space``'s values replacing (or adding to) its grid's parameters."""
    import dataclasses

    return t if not space else dataclasses.replace(t, space={**t.space, **space})


def cmd_tune(args) -> int:
    from triforge import _runtime, tune

    if args.list or not args.kernel:
        for name in tune.all_tunables():
            t = tune.get(name)
            console.print(f"{name}: shape {list(t.shape_names)} (default {t.default_shape}), space {t.space}")
        return 0
    if (args.force or args.for_device) and not args.write:
        console.print("[red]error:[/red] --force and --for-device apply to --write; add --write")
        return 2
    args.space = parse_space(args.space) if args.space else None
    kernels = tune_targets(args.kernel)
    if not kernels:
        raise KeyError(f"unknown tunable kernel or family {args.kernel!r}; known: {', '.join(tune.all_tunables())}")
    if args.space and len(kernels) > 1:
        console.print(f"[red]error:[/red] --space applies to one kernel; {args.kernel!r} names {len(kernels)}")
        return 2
    for key in sorted(set(args.space or {}) - set(tune.get(kernels[0]).space)):
        console.print(f"[yellow]note:[/yellow] {key} is not in {kernels[0]}'s registered grid: its launcher must take "
                      "it (a key it ignores is timed as duplicates and stored with --write)")
    _runtime.require_gpu("triforge tune")
    status = 0
    for name in kernels:
        status |= _tune_one(args, with_space(tune.get(name), args.space))
    return status


def tune_targets(name: str) -> list[str]:
    """The tunables ``triforge tune NAME`` runs: NAME alone where it is a kernel (gated_delta_rule_fwd_h, not
    also gated_delta_rule_fwd_h_o), else every kernel of the family prefix NAME (mhc: mhc_project_fwd, ...)."""
    from triforge import tune

    if name in tune.all_tunables():
        return [name]
    return [k for k in tune.all_tunables() if k.startswith(name + "_")]


def _tune_one(args, t) -> int:
    from triforge import tune

    shape = dict(t.default_shape)
    if args.shape:
        shape = _parse_shape(args.shape, t.shape_names)
    _check_shape_dims(args.shape_dims, [(t.kernel, tuple(dict.fromkeys((*t.shape_names, *t.default_shape))))])
    shape.update(args.shape_dims)
    n = len(tune.distinct_grid(t))  # (as tune() runs it: each distinct launch once)
    with _progress() as prog:
        task = prog.add_task(f"tuning {t.kernel}", total=n)
        result = tune.tune(t, shape, args.dtype, top=args.top, progress=lambda: prog.advance(task), budget_s=args.budget)
    if args.space:
        result["space_override"] = args.space  # (kept in the provenance of a written entry)
    if result["n_skipped"]:
        console.print(f"[yellow]budget:[/yellow] {result['n_skipped']} of {n} configs not started after the "
                      f"{args.budget:g} s budget")
    table = Table(title=f"{t.kernel} at {shape} {result['dtype']} — {result['n_tried']} tried, {result['n_failed']} failed"
                  f" ({result['n_mismatch']} whose outputs disagree with the launcher's config)")
    table.add_column("rank")
    table.add_column("config")
    table.add_column("median ms", justify="right")
    table.add_column("spills", justify="right")
    for i, r in enumerate(result["top"], 1):
        table.add_row(str(i), json.dumps(r["config"]), f"{r['ms']:.4f}", "-" if r.get("spills") is None else str(r["spills"]))
    console.print(table)
    if result.get("timing") == "cuda_graph":  # (as the bench times the op: the host's launch path is out of it)
        console.print(f"timed by CUDA-graph replays over {result.get('n_sets', 1)} input set(s)")
    in_use = result["in_use"]
    where = json.dumps(in_use["config"]) if in_use["config"] is not None else "the fallback"
    if in_use.get("timed_without"):
        where += f", timed without {', '.join(in_use['timed_without'])}"
    runs = in_use.get("ms_runs")
    console.print(f"in use ({where}): " + (f"{in_use['ms']:.4f} ms" if in_use["ms"] is not None else in_use.get("error", ""))
                  + (f" (before / after the grid: {runs[0]:.4f} / {runs[1]:.4f})" if runs else ""))
    if args.json:
        path = Path(args.json)
        if path.suffix != ".json" or path.is_dir():
            path.mkdir(parents=True, exist_ok=True)
            path = path / f"tune-{t.kernel}.json"
        path.write_text(json.dumps(result, indent=2))
    if args.write and not result["best"]:
        console.print("not written: no config ran")
    elif args.write:
        path = tune.write_config(result, force=args.force, for_device=args.for_device)
        if path is None:
            console.print("not written: the config in use measured at least as fast as the grid's best "
                          "(--force writes it anyway)")
        else:
            console.print(f"best config written to {path}")
    return 0 if result["best"] else 1


def cmd_peaks(args) -> int:
    from triforge import bench

    p = bench.peaks(force=args.force)
    console.print(f"{p['device']}: copy {p['copy_tbps']:.2f} TB/s (read + write), bf16 matmul {p['matmul_bf16_tflops']:.0f} TFLOP/s")
    return 0


def cmd_report(args) -> int:
    from triforge import report

    md, png = report.write_report(args.results, args.out)
    console.print(f"wrote {md} and {png}")
    if args.readme:
        console.print(f"updated {report.update_readme(args.results, args.readme)}")
    return 0


def cmd_compare_dumps(args) -> int:
    from triforge.testing import compare_dumps

    rows = compare_dumps(args.ref_dir, args.got_dir, worst=args.worst)
    if not rows:
        console.print(f"[red]no .npy stages found in {args.ref_dir}[/red]")
        return 1
    table = Table(title=f"{args.ref_dir} vs {args.got_dir}")
    for col in ("stage", "shape", "max diff", "mean diff", "NaN in got"):
        table.add_column(col)
    bad = False
    for r in rows:
        if "max_diff" not in r:
            bad = True
            table.add_row(r["stage"], "[red]missing or shape mismatch[/red]", "", "", "")
            continue
        bad |= r["nan_got"] > 0
        table.add_row(r["stage"], str(r["shape"]), f"{r['max_diff']:.3e}", f"{r['mean_diff']:.3e}", str(r["nan_got"]))
    console.print(table)
    for r in rows:
        if r.get("worst"):
            worst = ", ".join(f"{w['index']}: ref {w['ref']:.5g} got {w['got']:.5g}" for w in r["worst"])
            console.print(f"[bold]{r['stage']}[/bold] worst: {worst}")
    return 1 if bad else 0


def cmd_trace(args) -> int:
    import json as _json

    from triforge import trace
    from triforge.bench import PEAKS_CACHE

    copy_tbps = args.copy_tbps
    if copy_tbps is None and PEAKS_CACHE.exists():
        cached = list(_json.loads(PEAKS_CACHE.read_text()).values())
        copy_tbps = cached[0]["copy_tbps"] if len(cached) == 1 else None
    rows = trace.summarize(args.trace, copy_tbps)
    if not rows:
        console.print(f"[red]no GPU kernel events in {args.trace}[/red] (profile with ProfilerActivity.CUDA)")
        return 1
    table = Table(title=f"{args.trace}: {len(rows)} kernels" + (f", copy ceiling {copy_tbps:.2f} TB/s" if copy_tbps else ""))
    for col in ("kernel", "calls", "total ms", "mean us", "GB/s", "% copy"):
        table.add_column(col, justify="left" if col == "kernel" else "right")
    for r in rows[: args.top]:
        name = ("[bold]" + r["kernel"][:60] + "[/bold]") if r["triforge"] else r["kernel"][:60]
        table.add_row(name, str(r["calls"]), f"{r['total_us'] / 1e3:.3f}", f"{r['mean_us']:.1f}",
                      f"{r['gbps']:.0f}" if "gbps" in r else "", f"{r['pct_copy']:.1f}" if "pct_copy" in r else "")
    console.print(table)
    for g in trace.timeline(args.trace):
        busy = 100 * g["busy_us"] / g["span_us"] if g["span_us"] > 0 else 100.0
        gaps = "; ".join(f"{x['us']:.1f} us after {x['after'][:40]} before {x['before'][:40]}" for x in g["gaps"])
        console.print(f"GPU {g['gpu']}: kernels ran {g['busy_us'] / 1e3:.3f} of the {g['span_us'] / 1e3:.3f} ms from the "
                      f"first kernel's start to the last one's end ({busy:.1f}%, {g['kernels']} kernels)"
                      + (f"; longest gaps: {gaps}" if gaps else ""))
    return 0


def cmd_margins(args) -> int:
    from rich.markup import escape

    from triforge.testing import rank_margins

    missing = [p for p in args.logs if not Path(p).is_file()]
    if missing:
        console.print(f"[red]no such margin log: {', '.join(missing)}[/red] (run the tests with TRIFORGE_MARGIN_LOG=PATH)")
        return 1
    rows = rank_margins(args.logs)
    if not rows:
        console.print(f"[red]no comparisons in {', '.join(args.logs)}[/red]")
        return 1
    flaky = [r for r in rows if 0 < r["failed"] < r["runs"]]
    always = [r for r in rows if r["failed"] == r["runs"]]
    near = [r for r in rows if max(r["elem"], r["rms"]) >= args.warn]
    table = Table(title=f"{len(rows)} checks over {len(args.logs)} runs: failed in some runs only, then by how close "
                  "their passing comparisons came (1.0 fails)")
    for col in ("margin", "element", "rel_rms", "runs", "failed runs"):
        table.add_column(col, justify="right")
    table.add_column("check", overflow="fold")
    for r in rows[: args.top]:
        m = max(r["elem"], r["rms"])
        style = "red" if 0 < r["failed"] < r["runs"] else "yellow" if m >= args.warn else ""
        cells = [f"{m:.3f}", f"{r['elem']:.3f}", f"{r['rms']:.3f}", str(r["runs"]), str(r["failed"]), escape(f"{r['test']} :: {r['name']}")]
        table.add_row(*(f"[{style}]{c}[/{style}]" if style else c for c in cells))
    console.print(table)
    console.print(f"{len(flaky)} checks failed in some runs and not in others; {len(near)} checks passed at or above "
                  f"{args.warn} of their bound; {len(always)} failed in every run (planted errors of negative tests, "
                  "or a failing test: see the test run's own report)")
    return 1 if args.strict and (flaky or near) else 0


def cmd_parity(args) -> int:
    from triforge.models import parity

    dtype = args.dtype
    try:
        report = parity.run_parity(
            config=args.config, layers=args.layers, dtype=dtype, tokens=args.tokens, prompt=args.prompt,
            batch=args.batch, seed=args.seed, dump=args.dump, model_dir=args.model, log=console.print,
        )
    except (ValueError, ImportError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    lowp = dtype.itemsize < 4
    table = Table(title=f"triforge parity {args.model_name}: engine vs Hugging Face eager "
                        f"({str(dtype).replace('torch.', '')}; t < {report.prefill_len} prefill, then decode)")
    cols = ["stage", "max_diff", "avg_diff", "rel_rms", "first mismatch (index: hf / engine)"]
    cols += ["drift engine", "drift HF"] if lowp else []
    for col in cols + ["status"]:
        table.add_column(col, justify="left" if col.startswith(("stage", "first")) else "right",
                         no_wrap=col == "stage", overflow="fold")
    for r in report.rows:
        first = "-" if r.first_mismatch is None else f"{r.first_mismatch[0]}: {r.first_mismatch[1]:.5g} / {r.first_mismatch[2]:.5g}"
        cells = [r.name, f"{r.max_diff:.2e}", f"{r.avg_diff:.2e}", f"{r.rel_rms:.2e}", first]
        if lowp:
            cells += [f"{r.drift_engine:.2e}", f"{r.drift_hf:.2e}"]
        table.add_row(*cells, "[green]ok[/green]" if r.ok else "[red]DRIFT[/red]")
    Console(width=max(console.width, 150)).print(table)
    if report.argmax_agreement is not None:
        line = f"logits argmax agreement with Hugging Face: {100 * report.argmax_agreement:.2f}%"
        if report.argmax_agreement_decisive is not None:
            line += (f"; on the {100 * report.decisive_fraction:.1f}% decisive positions (fp32 top-2 gap beyond "
                     f"rounding noise): {100 * report.argmax_agreement_decisive:.2f}%")
        if report.argmax_agreement_golden is not None:
            line += (f"; with Hugging Face fp32: engine {100 * report.argmax_agreement_golden:.2f}%, "
                     f"Hugging Face {str(dtype).replace('torch.', '')} {100 * report.hf_agreement_golden:.2f}%")
        console.print(line)
    if args.dump:
        console.print(f"stages written under {args.dump}/{{hf,engine}}; compare with "
                      f"`triforge compare-dumps {args.dump}/hf {args.dump}/engine`")
    if report.ok:
        console.print("[green]parity OK[/green]: every stage within tolerance")
        return 0
    console.print(f"[red]parity FAILED[/red]: first drift beyond tolerance at [bold]{report.first_failure}[/bold]")
    return 1


def cmd_list(args) -> int:
    from triforge import registry, tune

    table = Table(title="registered ops")
    for col in ("op", "family", "outputs", "gradients", "peers"):
        table.add_column(col)
    for s in registry.all_ops():
        table.add_row(s.name, s.family, ", ".join(s.outputs), ", ".join(s.grad_inputs) or "-", ", ".join(s.peers) or "-")
    console.print(table)
    console.print("tunable kernels: " + ", ".join(tune.all_tunables()))
    return 0


def cmd_configs(args) -> int:
    from rich.markup import escape

    from triforge import _runtime, launch

    arch, device = _runtime.config_scope()
    arch, device = args.arch or arch, _runtime.device_tag_of(args.device) if args.device else device
    rows = [r for r in launch.config_sources(arch, device) if not args.kernels or r[0] in args.kernels
            or any(r[0].startswith(k + "_") for k in args.kernels)]
    files = " and ".join(f.name for f in (launch.configs_file(arch), launch.configs_file(arch, device)) if f.exists()) \
        or f"no {launch.configs_file(arch).name} or {launch.configs_file(arch, device).name}"
    if not rows:
        console.print(f"no stored configs for {' '.join(args.kernels) or 'any kernel'} in {files} (the launchers' "
                      "fallbacks apply)")
        return 0
    table = Table(title=f"tuned launch configs read on {arch} / {device} ({files}; a key not listed takes the "
                  "launcher's fallback)")
    for col in ("kernel", "key", "entry", "from", "tuned on"):
        table.add_column(col, overflow="fold")
    for kernel, key, entry, source, tuned_on in rows:
        table.add_row(kernel, key, escape(json.dumps(entry, sort_keys=True)), source, escape(tuned_on))
    console.print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="triforge", description="Fused Triton kernels: parity, benchmarks, tuning.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("check", help="parity of every op (stages, then gradients) against float64 references")
    c.add_argument("ops", nargs="*", help="op or family names (default: all)")
    c.add_argument("--dtype", type=_dtype, action="append", help="fp32, fp16 or bf16 (repeatable; default: all)")
    c.add_argument("--tier", choices=("tiny", "real"), default=None, help="input sizes (default: tiny on CPU, real on GPU)")
    c.add_argument("--seed", type=int, default=None, help="input seed (default: fresh each run)")
    c.add_argument("--dump", metavar="DIR", help="write every stage of reference and kernel as .npy")
    c.add_argument("--verbose", action="store_true", help="print every compared row")
    c.set_defaults(func=cmd_check)

    b = sub.add_parser("bench", help="time ops and peers on the GPU (GPU only)")
    b.add_argument("ops", nargs="*")
    b.add_argument("--json", metavar="FILE", help="write the results here (e.g. benchmarks/results/...json)")
    b.add_argument("--dtype", type=_dtype, default="bf16")
    b.add_argument("--modes", default="fwd,bwd")
    b.add_argument("--no-peers", action="store_true")
    b.add_argument("--resume", action="store_true", help="with --json: keep the file's rows (a run cut off by a time "
                   "limit, same commit, device and dtype) and run only the shapes it has not measured")
    b.set_defaults(func=cmd_bench)

    t = sub.add_parser("tune", help="grid-search a kernel's launch parameters at one shape (GPU only)")
    t.add_argument("kernel", nargs="?", help="a kernel (alone), or a family prefix (e.g. mhc) to tune each of its kernels")
    t.add_argument("--shape", help="e.g. M=65536,N=4096 (default: the kernel's default shape)")
    t.add_argument("--dtype", type=_dtype, default="bf16")
    t.add_argument("--top", type=int, default=5)
    t.add_argument("--json", metavar="FILE", help="a .json file, or a folder for one file per kernel")
    t.add_argument("--write", action="store_true", help="store the best config in triforge/configs/<arch>.json "
                   "(not over a stored entry that measured at least as fast in the same run)")
    t.add_argument("--force", action="store_true", help="with --write: replace the stored entry even where it was faster")
    t.add_argument("--for-device", action="store_true", help="with --write: store in triforge/configs/<arch>.<device>.json "
                   "(e.g. sm90.h200.json), read over <arch>.json on this device model only")
    t.add_argument("--space", metavar="JSON", help="one kernel's grid with these parameters' values replaced or added, "
                   "e.g. '{\"BLOCK_M\": [128, 256], \"programs_per_sm\": [1, 2]}'")
    t.add_argument("--budget", type=float, metavar="SECONDS", default=None,
                   help="start no config after this many seconds of the kernel's tune (the first always runs; the best "
                        "of those tried is written, unless the config in use, even the fallback, measured as fast)")
    t.add_argument("--list", action="store_true", help="list the tunable kernels")
    t.set_defaults(func=cmd_tune)

    k = sub.add_parser("peaks", help="measure the device's copy bandwidth and bf16 matmul rate (GPU only)")
    k.add_argument("--force", action="store_true", help="re-measure even when cached")
    k.set_defaults(func=cmd_peaks)

    r = sub.add_parser("report", help="Markdown tables and a roofline PNG from bench results")
    r.add_argument("results", nargs="+")
    r.add_argument("--out", required=True)
    r.add_argument("--readme", metavar="README", help="also regenerate the README's benchmark section")
    r.set_defaults(func=cmd_report)

    d = sub.add_parser("compare-dumps", help="per-stage diff of two --dump folders")
    d.add_argument("ref_dir")
    d.add_argument("got_dir")
    d.add_argument("--worst", type=int, default=10)
    d.set_defaults(func=cmd_compare_dumps)

    tr = sub.add_parser("trace", help="summarise a torch.profiler Chrome trace per kernel (ours against their byte model)")
    tr.add_argument("trace")
    tr.add_argument("--copy-tbps", type=float, default=None, help="copy ceiling for the efficiency column (default: the cached peaks)")
    tr.add_argument("--top", type=int, default=30)
    tr.set_defaults(func=cmd_trace)

    mg = sub.add_parser("margins", help="rank parity checks by how close they came to failing (TRIFORGE_MARGIN_LOG files)")
    mg.add_argument("logs", nargs="+", help="files written by test runs with TRIFORGE_MARGIN_LOG=PATH")
    mg.add_argument("--top", type=int, default=30)
    mg.add_argument("--warn", type=float, default=0.5, help="highlight passing checks at or above this fraction of their bound")
    mg.add_argument("--strict", action="store_true", help="exit 1 when a check failed in some runs only, or passed at or above --warn")
    mg.set_defaults(func=cmd_margins)

    pa = sub.add_parser("parity", help="layer-by-layer parity of a model engine against Hugging Face transformers")
    pa.add_argument("model_name", choices=("qwen2",), help="the engine to check")
    pa.add_argument("--config", default="qwen2.5-0.5b",
                    help="qwen2.5-0.5b (default), tiny, or a config.json / model directory (random weights)")
    pa.add_argument("--model", metavar="DIR", help="a local Hugging Face model directory: its real weights")
    pa.add_argument("--layers", type=int, default=2, help="decoder layers of the random model (default 2)")
    pa.add_argument("--dtype", type=_dtype, default="fp32", help="fp32 (default), bf16 or fp16")
    pa.add_argument("--tokens", type=int, default=8, help="tokens per row (default 8)")
    pa.add_argument("--prompt", type=int, default=4, help="of which the first PROMPT go through prefill (default 4)")
    pa.add_argument("--batch", type=int, default=1)
    pa.add_argument("--seed", type=int, default=0)
    pa.add_argument("--dump", metavar="DIR", help="write every stage of both sides as .npy for compare-dumps")
    pa.set_defaults(func=cmd_parity)

    cf = sub.add_parser("configs", help="the tuned launch configs this device reads (or --arch / --device's), and from "
                        "which file")
    cf.add_argument("kernels", nargs="*", help="kernel names or family prefixes (default: all)")
    cf.add_argument("--arch", help="e.g. sm90 (default: this device's)")
    cf.add_argument("--device", help="a device tag, e.g. h200 (default: this device's)")
    cf.set_defaults(func=cmd_configs)

    ls = sub.add_parser("list", help="registered ops and tunable kernels")
    ls.set_defaults(func=cmd_list)
    return p


def _check_shape_dims(dims: dict, named: list) -> None:
    """Exit with a message naming the flag when a ``--NAME VALUE`` shape dimension is not one that each (name,
    dimension names) pair takes (a misspelt ``--t`` would otherwise be ignored and the default shape run)."""
    for name, names in named:
        unknown = sorted(set(dims) - set(names)) if names else []
        if unknown:
            raise SystemExit(f"{name} takes the shape dimensions {' '.join('--' + n for n in names)}; "
                             f"unknown: {' '.join('--' + n for n in unknown)}")


def _shape_dims(extra) -> dict:
    """Leftover ``--T 65536 --C 2560`` style arguments as a shape dict."""
    dims, it = {}, iter(extra)
    for flag in it:
        value = next(it, None)
        if not flag.startswith("--") or value is None or not value.lstrip("-").isdigit():
            raise SystemExit(f"unrecognised arguments: {' '.join(extra)} (shape dimensions go as --T 65536 --C 2560)")
        dims[flag[2:]] = int(value)
    return dims


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("bench", "tune"):
        parser.error(f"unrecognised arguments: {' '.join(extra)}")
    args.shape_dims = _shape_dims(extra)
    if getattr(args, "dtype", None) == "bf16":
        args.dtype = _dtype("bf16")
    if getattr(args, "seed", 0) is None:
        import random

        args.seed = random.SystemRandom().randrange(2**31)
    from triforge._runtime import GPURequiredError

    try:
        return args.func(args)
    except (GPURequiredError, KeyError) as e:
        console.print(f"[red]error:[/red] {e.args[0] if e.args else e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
