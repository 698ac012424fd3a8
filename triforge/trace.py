"""``triforge trace TRACE.json``: a torch.profiler Chrome trace summarised per GPU kernel.

Launches of triforge kernels made while the profiler runs are annotated with
``triforge::<kernel> bytes=<N>`` (see ``launch.launch``), so each of our kernels' time can be set
against its byte model where it ran, inside a real training step. ``timeline`` says how much of the
traced span each GPU spent running kernels and where its longest idle gaps were (a host-bound step,
or a launch between two short kernels, shows there and not in the per-kernel times).
"""

import gzip
import json
import re
from pathlib import Path

_ANNOTATION = re.compile(r"^triforge::(?P<kernel>\S+) bytes=(?P<bytes>\d+)$")


def _events(path):
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    data = json.loads(raw)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(path, copy_tbps: float | None = None) -> list[dict]:
    """Rows per kernel name, most total time first: calls, total/mean us, bytes and efficiency (ours)."""
    events = [e for e in _events(path) if e.get("ph") == "X"]
    kernels = [e for e in events if str(e.get("cat", "")).lower() == "kernel"]
    moved: dict[str, int] = {}
    for e in events:
        m = _ANNOTATION.match(e.get("name", ""))
        if m:
            moved[m["kernel"]] = moved.get(m["kernel"], 0) + int(m["bytes"])
    rows: dict[str, dict] = {}
    for e in kernels:
        row = rows.setdefault(e["name"], {"kernel": e["name"], "calls": 0, "total_us": 0.0})
        row["calls"] += 1
        row["total_us"] += float(e.get("dur", 0.0))
    for row in rows.values():
        row["mean_us"] = row["total_us"] / row["calls"]
        ours = next((k for k in moved if row["kernel"] == k or row["kernel"].startswith(k + "_") or row["kernel"].startswith(k + ".")), None)
        row["triforge"] = ours is not None
        if ours is not None and row["total_us"] > 0:
            row["bytes"] = moved[ours]
            row["gbps"] = moved[ours] / (row["total_us"] * 1e-6) / 1e9
            if copy_tbps:
                row["pct_copy"] = 100 * row["gbps"] / (copy_tbps * 1e3)
    return sorted(rows.values(), key=lambda r: -r["total_us"])


def timeline(path, top: int = 3) -> list[dict]:
    """Per GPU (the kernel events' ``device`` argument, else their process id): the span from its first kernel's start
    to its last kernel's end, the time some kernel ran (the union of the kernel intervals: overlapping streams count
    once), the idle rest, and the ``top`` longest gaps with the kernels on either side, in us."""
    kernels = [e for e in _events(path) if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel"]
    by_gpu: dict = {}
    for e in kernels:
        gpu = (e.get("args") or {}).get("device", e.get("pid"))
        start = float(e.get("ts", 0.0))
        by_gpu.setdefault(gpu, []).append((start, start + float(e.get("dur", 0.0)), e["name"]))
    out = []
    for gpu, spans in by_gpu.items():
        spans.sort()
        busy, gaps = 0.0, []
        cur_start, cur_end, cur_name = spans[0]
        for start, end, name in spans[1:]:
            if start > cur_end:  # a gap: every kernel so far has ended
                busy += cur_end - cur_start
                gaps.append({"us": start - cur_end, "after": cur_name, "before": name})
                cur_start, cur_end, cur_name = start, end, name
            elif end > cur_end:
                cur_end, cur_name = end, name
        busy += cur_end - cur_start
        span = max(end for _, end, _ in spans) - spans[0][0]
        out.append({"gpu": gpu, "kernels": len(spans), "span_us": span, "busy_us": busy, "idle_us": span - busy,
                    "gaps": sorted(gaps, key=lambda g: -g["us"])[:top]})
    return sorted(out, key=lambda r: str(r["gpu"]))
