"""``triforge trace TRACE.json``: a torch.profiler Chrome trace summarised per GPU kernel.

Launches of triforge kernels made while the profiler runs are annotated with
``triforge::<kernel> bytes=<N>`` (see ``launch.launch``), so each of our kernels' time can be set
against its byte model where it ran, inside a real training step.
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
