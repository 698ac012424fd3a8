"""``triforge report``: Markdown tables and a roofline plot from ``triforge bench --json`` files."""

import json
from pathlib import Path


def load_results(paths) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in paths]


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def markdown(results: list[dict]) -> str:
    """One table per results file: every op, mode and implementation, with ratios to triforge."""
    out = []
    for res in results:
        pk = res["peaks"]
        out.append(
            f"### {res['device']} — commit {res['commit']}, {res['date'][:10]}, torch {res['torch']}, triton {res['triton']}\n"
        )
        out.append(
            f"Measured ceilings: copy {pk['copy_tbps']:.2f} TB/s (read + write), "
            f"bf16 matmul {pk['matmul_bf16_tflops']:.0f} TFLOP/s.\n"
        )
        out.append("| op | mode | shape | dtype | impl | median ms | GB/s | % of copy | triforge speedup |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for r in res["rows"]:
            if "error" in r:
                out.append(f"| {r['op']} | {r['mode']} | {r.get('shape', '')} | {r.get('dtype', '')} | {r['impl']} | error: {r['error']} | | | |")
                continue
            speed = r.get("triforge_speedup")
            out.append(
                f"| {r['op']} | {r['mode']} | {r['shape']} | {r['dtype']} | {r['impl']} | {r['median_ms']:.4f} | "
                f"{r['gbps']:.0f} | {r['pct_copy']:.1f}% | {_fmt(speed, '.2f')}x |"
            )
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
