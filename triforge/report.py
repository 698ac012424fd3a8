"""``triforge report``: Markdown tables and a roofline plot from ``triforge bench --json`` files."""

import json
import re
from pathlib import Path


def load_results(paths) -> list[dict]:
    """Each path a results file, optionally ``FILE::op1,op2`` to keep only those ops' rows (a family
    total is named "<family> total"): a README can take each op from the run that measured it last."""
    out = []
    for p in paths:
        path, _, ops = str(p).partition("::")
        res = json.loads(Path(path).read_text())
        if ops and "rows" in res:
            keep = set(ops.split(","))
            res["rows"] = [r for r in res["rows"] if r["op"] in keep]
        out.append(res)
    return out


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


_DIM = re.compile(r"\b(B|T|S|Sq|Tq|M)=(\d+)")


def tokens_per_call(row: dict) -> int | None:
    """The tokens one call of a bench row processes, as its shape names them: packed ``Tq`` (the sequences' total),
    decode ``B * Sq`` (the new queries, not the cache), ``B * T``, ``B * S``, a matmul's ``M`` rows; ``AxB`` (row-wise
    ops: A rows) and RoPE's ``q BxTxHxD`` (B * T). None where the shape names none of these."""
    shape = row.get("shape") or ""
    dims = {k: int(v) for k, v in _DIM.findall(shape)}
    batch = dims.get("B", 1)
    for key, per in (("Tq", 1), ("Sq", batch), ("T", batch), ("S", batch), ("M", 1)):
        if key in dims:
            return per * dims[key]
    sizes = re.match(r"(?:q )?(\d+(?:x\d+)+)", shape)
    if sizes is None:
        return None
    sizes = [int(v) for v in sizes.group(1).split("x")]
    return sizes[0] * sizes[1] if len(sizes) == 4 else sizes[0] if len(sizes) == 2 else None


def floor_ms(row: dict, peaks: dict) -> float | None:
    """The row's time floor (``bench.floor_ms`` of its bytes and FLOPs; the bench's own ``floor_ms`` where it
    recorded one)."""
    from triforge.bench import floor_ms as call_floor_ms

    if row.get("floor_ms") is not None:
        return row["floor_ms"]
    if row.get("bytes") is None or row.get("flops") is None or not peaks:
        return None
    return call_floor_ms(row["bytes"], row["flops"], peaks)


def _per_s(v) -> str:
    """A rate with an SI suffix (3 significant digits): 2.17e7 -> '21.7M'."""
    if v is None:
        return "-"
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:.3g}{unit}"
    return f"{v:.3g}"


def floor_and_rate_cells(row: dict, peaks: dict | None) -> tuple[str, str]:
    """A measured row's "floor ms" and "tokens/s" cells, as the report and the bench's printed table show them."""
    floor, tokens = floor_ms(row, peaks), tokens_per_call(row)
    return _fmt(floor, ".4f"), _per_s(None if tokens is None else tokens / (row["median_ms"] * 1e-3))


def _decode_markdown(res: dict) -> list[str]:
    """A ``benchmarks/qwen2_decode.py`` result: tokens/s per batch and implementation, then one decode
    step's kernels against their byte model."""
    out = [f"### {res['device']} — Qwen2.5-0.5B-sized decode ({res['layers']} layers, {res['dtype']}, prompt "
           f"{res['prompt']} + {res['new_tokens']} new tokens) — commit {res['commit']}, {res['date']}, torch "
           f"{res['torch']}, triton {res['triton']}, transformers {res['transformers']}\n",
           f"Correctness gate: {res['correctness']}\n",
           "| impl | batch | tokens/s | ms / step | triforge speedup |", "|---|---|---|---|---|"]
    for r in sorted(res["throughput"], key=lambda r: (r["batch"], r["impl"] != "triforge")):
        out.append(f"| {r['impl']} | {r['batch']} | {r['tokens_per_s']:.0f} | {r['ms_per_step']:.3f} | "
                   f"{_fmt(r.get('triforge_speedup'), '.2f')}x |")
    for s in res.get("skipped", []):
        out.append(f"| {s['impl']} | {s['batch']} | not run: {s['reason']} | | |")
    sp = res.get("step_profile")
    if sp and not sp.get("kernels_matched_roles", True):
        out.append(f"\nOne decode step at batch {sp['batch']}: sum of kernels {sp['sum_kernel_us']:.0f} us; the "
                   "profiled kernels did not match the script's per-layer roles, so no per-kernel byte model "
                   "(see the run's JSON for the kernels by name).\n")
    elif sp:
        out.append(f"\nOne decode step at batch {sp['batch']} ({sp['keys_attended']} keys), each kernel against its byte "
                   f"model (copy {res['copy_tbps']:.2f} TB/s): sum of kernels {sp['sum_kernel_us']:.0f} us, graph-replayed "
                   f"step {sp['graph_step_us']:.0f} us, {sp['bytes_per_step'] / 1e6:.0f} MB = "
                   f"{sp['ideal_us_at_copy_bw']:.0f} us at copy bandwidth.\n")
        out.append("| kernel | calls | mean us | total us | MB | % of copy |")
        out.append("|---|---|---|---|---|---|")
        for r in sorted(sp["kernels"], key=lambda r: -r["total_us"]):
            mb = f"{r['bytes'] / 1e6:.2f}" if r.get("bytes") else ""
            pct = f"{r['pct_copy']:.1f}%" if r.get("pct_copy") else ""
            out.append(f"| {r['role']} | {r['calls']} | {r['mean_us']:.2f} | {r['total_us']:.1f} | {mb} | {pct} |")
    out.append("")
    return out


def host_bound(row: dict) -> bool:
    """Whether a per-call row's host enqueue time (the bench's host_ms) reaches HOST_BOUND of its median."""
    from triforge.bench import HOST_BOUND

    return bool(row.get("host_ms")) and "error" not in row and row["host_ms"] >= HOST_BOUND * row["median_ms"]


def _host_bound_lines(rows) -> list[str]:
    """A note under a table naming its host-bound rows (none: no note; files from before host_ms: none)."""
    from triforge.bench import HOST_BOUND

    hb = [r for r in rows if host_bound(r)]
    if not hb:
        return []
    cells = "; ".join(f"{r['op']} {r['mode']} {r['impl']} ({r['shape']}): host {r['host_ms']:.4f} ms per call against "
                      f"a median of {r['median_ms']:.4f}" for r in hb)
    return [f"\nHost-bound rows (the host's enqueue time per call is at least {HOST_BOUND:.0%} of the median, so the "
            f"per-call time there measures the host's launches as much as the kernels): {cells}.\n"]


def markdown(results: list[dict]) -> str:
    """One table per results file: every op, mode and implementation, with ratios to triforge."""
    out = []
    for res in results:
        if res.get("benchmark") == "qwen2_decode":
            out += _decode_markdown(res)
            continue
        pk = res["peaks"]
        out.append(
            f"### {res['device']} — commit {res['commit']}, {res['date'][:10]}, torch {res['torch']}, triton {res['triton']}\n"
        )
        out.append(
            f"Measured ceilings: copy {pk['copy_tbps']:.2f} TB/s (read + write), "
            f"bf16 matmul {pk['matmul_bf16_tflops']:.0f} TFLOP/s.\n"
        )
        out.append("| op | mode | shape | dtype | impl | median ms | floor ms | tokens/s | GB/s | % of copy | TFLOP/s | "
                   "triforge speedup |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in res["rows"]:
            if "error" in r:
                out.append(f"| {r['op']} | {r['mode']} | {r.get('shape', '')} | {r.get('dtype', '')} | {r['impl']} | "
                           f"error: {r['error']} | | | | | | |")
                continue
            speed = r.get("triforge_speedup")
            floor, rate = floor_and_rate_cells(r, pk)
            out.append(
                f"| {r['op']} | {r['mode']} | {r['shape']} | {r['dtype']} | {r['impl']} | {r['median_ms']:.4f} | "
                f"{floor} | {rate} | "
                f"{r['gbps']:.0f} | {r['pct_copy']:.1f}% | {_fmt(r.get('tflops'), '.1f')} | {_fmt(speed, '.2f')}x |"
            )
        out += _host_bound_lines(res["rows"])
        res_rows = [(r["op"], r["mode"], k, v) for r in res["rows"] if r.get("impl") == "triforge" for k, v in (r.get("kernels") or {}).items() if v]
        if res_rows:
            out.append("\nKernel resources (compiled metadata of the benchmarked launch):\n")
            out.append("| op | mode | kernel | registers | spills | shared bytes | warps |")
            out.append("|---|---|---|---|---|---|---|")
            for op, mode, k, v in res_rows:
                out.append(f"| {op} | {mode} | {k} | {v.get('registers')} | {v.get('spills')} | {v.get('shared_bytes')} | {v.get('num_warps')} |")
        out.append("")
    return "\n".join(out)


def roofline(results: list[dict], path) -> str:
    """Achieved TFLOP/s against arithmetic intensity, under the measured ceilings (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    markers = {"triforge": "o", "liger": "s", "torch.compile": "^"}
    for res in results:
        if "peaks" not in res:  # a decode-engine result: no per-op rows to place
            continue
        bw, mm = res["peaks"]["copy_tbps"], res["peaks"]["matmul_bf16_tflops"]
        xs = [10 ** (i / 20) for i in range(-60, 81)]
        ax.plot(xs, [min(mm, x * bw) for x in xs], "k-", lw=1, label=f"ceiling ({bw:.2f} TB/s, {mm:.0f} TFLOP/s)")
        for r in res["rows"]:
            if "error" in r or not r.get("flops") or not r.get("bytes"):
                continue
            ai = r["flops"] / r["bytes"]
            ax.scatter(ai, r["tflops"], marker=markers.get(r["impl"], "x"), s=30)
            if r["impl"] == "triforge":
                ax.annotate(f"{r['op']} {r['mode']}", (ai, r["tflops"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title("triforge roofline (o triforge, s liger, ^ torch.compile)")
    ax.grid(True, which="both", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def write_report(paths, out_dir) -> tuple[str, str]:
    results = load_results(paths)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "report.md"
    png = out / "roofline.png"
    md.write_text(markdown(results) + f"\n![roofline]({png.name})\n")
    roofline(results, png)
    return str(md), str(png)


BEGIN, END = "<!-- bench:begin (generated by `triforge report --readme`) -->", "<!-- bench:end -->"


def update_readme(paths, readme) -> str:
    """Replace the README's generated benchmark section with tables from ``paths``."""
    text = Path(readme).read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{readme} has no generated section; add the lines {BEGIN!r} and {END!r}")
    sources = "\n".join(f"Source: `{p}`" for p in paths)
    body = f"{BEGIN}\n{sources}\n\n{markdown(load_results(paths))}\n{END}"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    Path(readme).write_text(head + body + tail)
    return str(readme)
