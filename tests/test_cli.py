"""The triforge command on a machine without a GPU: check runs, GPU-only commands refuse clearly."""

import json

import numpy as np
import pytest

from triforge import _runtime
from triforge.cli import main

cpu_only = pytest.mark.skipif(not _runtime.INTERPRET, reason="exercises the no-GPU paths")


def test_check_passes_and_exits_zero(capsys):
    assert main(["check", "rms_norm", "--dtype", "fp32", "--tier", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "1 passed, 0 failed" in out


def test_check_unknown_op_exits_nonzero(capsys):
    assert main(["check", "no_such_op"]) == 2
    assert "unknown op" in capsys.readouterr().out


@cpu_only
@pytest.mark.parametrize("argv", [["bench"], ["peaks"], ["tune", "rms_norm_fwd"]])
def test_gpu_only_commands_refuse_without_gpu(argv, capsys):
    assert main(argv) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_tune_list(capsys):
    assert main(["tune", "--list"]) == 0
    assert "rms_norm_fwd" in capsys.readouterr().out


def test_check_dump_then_compare_dumps(tmp_path, capsys):
    assert main(["check", "rms_norm", "--dtype", "bf16", "--tier", "tiny", "--dump", str(tmp_path)]) == 0
    ref, got = tmp_path / "rms_norm-bfloat16" / "ref", tmp_path / "rms_norm-bfloat16" / "got"
    assert sorted(p.name for p in ref.iterdir()) == ["00_rstd.npy", "01_y.npy"]
    capsys.readouterr()
    assert main(["compare-dumps", str(ref), str(got)]) == 0
    out = capsys.readouterr().out
    assert "rstd" in out and "worst" in out
    # a NaN planted in the kernel's dump makes compare-dumps fail
    y = np.load(got / "01_y.npy")
    y[0, 0] = np.nan
    np.save(got / "01_y.npy", y)
    assert main(["compare-dumps", str(ref), str(got)]) == 1


def _fake_results(path):
    rows = []
    for impl, ms in (("triforge", 0.40), ("liger", 0.44)):
        nbytes, flops = 1.07e9, 1.07e9
        rows.append({
            "op": "rms_norm", "mode": "fwd", "impl": impl, "shape": "65536x4096", "dtype": "bfloat16",
            "median_ms": ms, "bytes": nbytes, "flops": flops, "gbps": nbytes / ms / 1e6,
            "tflops": flops / ms / 1e9, "pct_copy": 100 * nbytes / ms / 1e6 / 3020,
            "triforge_speedup": ms / 0.40,
            "kernels": {"rms_norm_fwd": {"registers": 40, "spills": 0, "shared_bytes": 0, "num_warps": 8}} if impl == "triforge" else None,
        })
    rows.append({"op": "rms_norm", "mode": "bwd", "impl": "liger", "error": "RuntimeError: boom"})
    data = {"device": "NVIDIA H100 80GB HBM3", "arch": "sm90", "commit": "abc1234", "date": "2026-11-22T00:00:00+00:00",
            "torch": "2.11", "triton": "3.6.0", "peaks": {"copy_tbps": 3.02, "matmul_bf16_tflops": 730.0}, "rows": rows}
    path.write_text(json.dumps(data))


def test_report_renders_tables_and_roofline(tmp_path, capsys):
    res = tmp_path / "r.json"
    _fake_results(res)
    assert main(["report", str(res), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| rms_norm | fwd | 65536x4096 | bfloat16 | liger | 0.4400 |" in md
    assert "1.10x" in md  # liger takes 1.10x triforge's time
    assert "error: RuntimeError: boom" in md
    assert "| rms_norm | fwd | rms_norm_fwd | 40 | 0 | 0 | 8 |" in md
    png = (tmp_path / "rep" / "roofline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
