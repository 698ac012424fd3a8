"""The triforge command on a machine without a GPU: check runs, GPU-only commands refuse clearly."""

import json

import numpy as np
import pytest
import torch

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


def test_bench_resume_continues_only_the_same_run(tmp_path, capsys, monkeypatch):
    """--resume continues only its own --json file: the same commit, device, shape, modes, peers and dtype (checked
    before the GPU); a matching file's rows are handed on."""
    import argparse

    from triforge import bench
    from triforge.cli import _resumed_rows

    assert main(["bench", "rms_norm", "--resume"]) == 2
    assert "name it" in capsys.readouterr().out
    monkeypatch.setattr(bench, "git_commit", lambda: "abc1234")
    f = tmp_path / "r.json"
    rows = [{"op": "rms_norm", "impl": "triforge", "dtype": "bfloat16", "bench_shape": None, "median_ms": 1.0}]
    base = {"commit": "abc1234", "device": _runtime.device_name(), "shape": None, "modes": ["fwd", "bwd"],
            "peers": True, "rows": rows}
    for changed, word in (({"commit": "0000000"}, "commit"), ({"device": "other"}, "device"),
                          ({"modes": ["fwd"]}, "modes"), ({"peers": False}, "peers"), ({"shape": {"M": 4}}, "shape"),
                          ({"rows": [{**rows[0], "dtype": "float16"}]}, "float16")):
        f.write_text(json.dumps({**base, **changed}))
        assert main(["bench", "rms_norm", "--json", str(f), "--resume"]) == 2
        out = " ".join(capsys.readouterr().out.split())  # (rich wraps lines)
        assert "--resume" in out and word in out, word
    f.write_text(json.dumps(base)[:-20])  # a write cut off
    assert main(["bench", "rms_norm", "--json", str(f), "--resume"]) == 2
    assert "not a bench result" in " ".join(capsys.readouterr().out.split())
    f.write_text(json.dumps(base))
    args = argparse.Namespace(json=str(f), shape_dims={}, modes="fwd,bwd", no_peers=False, dtype=torch.bfloat16)
    assert _resumed_rows(args) == rows
    assert _resumed_rows(argparse.Namespace(**{**vars(args), "json": str(tmp_path / "new.json")})) is None


def test_run_bench_skips_the_shapes_a_resumed_file_measured(monkeypatch):
    """run_bench with done_rows keeps the shapes they measured, runs again a shape with any failed row (its old
    rows dropped) and the rest, and recomputes the family totals from old and new rows."""
    import types

    from triforge import bench

    ran = []

    def fake_bench_op(spec, *, shape=None, **kw):
        ran.append((spec.name, shape))
        return [{"op": spec.name, "mode": m, "impl": "triforge", "shape": str(shape), "bench_shape": shape,
                 "median_ms": 1.0, "bytes": 10, "flops": 0, "dtype": "bfloat16"} for m in ("fwd", "bwd")]

    monkeypatch.setattr(bench, "bench_op", fake_bench_op)
    monkeypatch.setattr(bench, "peaks", lambda: {"copy_tbps": 1.0, "matmul_bf16_tflops": 1.0})
    sweep = types.SimpleNamespace(name="op_a", family="fam_a", bench_shapes=({"M": 1}, {"M": 2}, {"M": 3}))
    layer = [types.SimpleNamespace(name=n, family="fam_b", bench_shapes=None) for n in ("op_b", "op_c")]

    def row(op, mode, shape, **kw):
        return {"op": op, "mode": mode, "impl": "triforge", "bench_shape": shape, "median_ms": 0.5, "bytes": 10,
                "flops": 0, "shape": "s", "dtype": "bfloat16", **kw}

    done = [row("op_a", "fwd", {"M": 1}), row("op_a", "bwd", {"M": 1}), {**row("op_a", "fwd", {"M": 1}), "impl": "peer"},
            row("op_a", "fwd", {"M": 2}), row("op_a", "bwd", {"M": 2}, error="RuntimeError: bwd"),
            row("op_b", "fwd", None), row("op_b", "bwd", None),
            {"op": "fam_b total", "mode": "bwd+fwd", "impl": "triforge", "median_ms": 99.0}]
    result = bench.run_bench([sweep, *layer], done_rows=done)
    assert ran == [("op_a", {"M": 2}), ("op_a", {"M": 3}), ("op_c", None)]
    got = [(r["op"], r["impl"], r.get("bench_shape"), r["median_ms"], "error" in r) for r in result["rows"]]
    assert got[:3] == [("op_a", "triforge", {"M": 1}, 0.5, False), ("op_a", "triforge", {"M": 1}, 0.5, False),
                       ("op_a", "peer", {"M": 1}, 0.5, False)]
    assert [g for g in got if g[2] == {"M": 2}] == [("op_a", "triforge", {"M": 2}, 1.0, False)] * 2
    assert [g[3] for g in got if g[0] == "fam_b total"] == [0.5 + 0.5 + 1.0 + 1.0]  # recomputed, not the old 99
    assert result["modes"] == ["fwd", "bwd"] and result["peers"] is True


def test_bench_dimensions_pick_the_rows_of_a_sweep():
    """`bench OP --M 256` on a swept op runs the sweep's shapes with M = 256 (all their dimensions); dimensions that
    match no sweep shape, or an op without a sweep, run the given shape itself."""
    import types

    from triforge import bench

    sweep = types.SimpleNamespace(bench_shapes=({"M": 1, "N": 8, "K": 8}, {"M": 256, "N": 8, "K": 8},
                                                {"M": 256, "N": 4, "K": 16}, {"M": 1, "N": 4, "K": 16}))
    assert bench.shapes_to_run(sweep, {"M": 256}) == [{"M": 256, "N": 8, "K": 8}, {"M": 256, "N": 4, "K": 16}]
    assert bench.shapes_to_run(sweep, {"M": 1, "K": 16}) == [{"M": 1, "N": 4, "K": 16}]
    assert bench.shapes_to_run(sweep, {"M": 64, "N": 8, "K": 8}) == [{"M": 64, "N": 8, "K": 8}]  # off the sweep
    assert bench.shapes_to_run(sweep, {"Q": 1}) == [{"Q": 1}]  # (the CLI refuses names an op does not take)
    assert bench.shapes_to_run(sweep, None) == list(sweep.bench_shapes)
    assert bench.shapes_to_run(types.SimpleNamespace(bench_shapes=()), {"T": 7}) == [{"T": 7}]
    assert bench.shapes_to_run(types.SimpleNamespace(bench_shapes=None), None) == [None]


def test_configs_lists_what_a_device_reads(tmp_path, capsys, monkeypatch):
    """`triforge configs`: each stored entry an arch / device reads, merged, and the files it comes from."""
    from rich.console import Console

    from triforge import cli, launch

    monkeypatch.setattr(cli, "console", Console(width=300))  # (one line per row: cells not folded)

    monkeypatch.setattr(launch, "CONFIG_DIR", tmp_path)
    (tmp_path / "smx.json").write_text(json.dumps({"kernels": {"k_a": {"key1": {"p": 1, "q": 2}}, "k_b": {"key2": {"r": 3}}}}))
    (tmp_path / "smx.h200.json").write_text(json.dumps({"kernels": {"k_a": {"key1": {"p": 5}}, "k_c": {"key3": {"s": 1}}},
                                                        "provenance": {"k_a[key1]": {"device": "NVIDIA H200"},
                                                                       "k_c[key3]": "not a record"}}))
    launch.reload()
    try:
        assert main(["configs", "k_a", "k_c", "--arch", "smx", "--device", "NVIDIA H200"]) == 0  # (a name is tagged)
        out = " ".join(capsys.readouterr().out.split())
        assert '"p": 5, "q": 2' in out and "smx.json + smx.h200.json" in out and "? + NVIDIA H200" in out
        assert '"s": 1' in out and "k_b" not in out  # an entry of the device file alone, its provenance unreadable
        assert main(["configs", "--arch", "smx", "--device", "h100"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert '"p": 1, "q": 2' in out and '"r": 3' in out and "h200" not in out and "smx.h100.json" not in out
        assert main(["configs", "nothing_here", "--arch", "smx"]) == 0
        assert "no stored configs" in capsys.readouterr().out
    finally:
        launch.reload()


def test_tune_space_overrides_one_kernels_grid(capsys):
    """--space: a JSON object of non-empty lists replacing (or adding) grid parameters, for one kernel only; checked
    before the GPU."""
    from triforge import tune
    from triforge.cli import parse_space, with_space

    t = tune.get("ternary_tc")
    wider = with_space(t, parse_space('{"BLOCK_M": [128, 256], "programs_per_sm": [1, 2]}'))
    assert wider.space == {**t.space, "BLOCK_M": [128, 256], "programs_per_sm": [1, 2]} and t.space != wider.space
    assert len(tune.grid(wider.space)) == len(tune.grid(t.space)) // 3 * 2 * 2
    assert with_space(t, None) is t
    for bad in ("not json", "[1, 2]", "{}", '{"BLOCK_M": []}', '{"BLOCK_M": 128}', '{"BLOCK_M": [null]}',
                '{"BLOCK_M": [{"a": 1}]}'):
        with pytest.raises(SystemExit, match="--space expects"):
            main(["tune", "ternary_tc", "--space", bad])
    assert main(["tune", "mhc", "--space", '{"BLOCK_T": [64]}']) == 2  # a family: several kernels
    assert "one kernel" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--force", "--for-device"])
def test_tune_write_flags_need_write(flag, capsys):
    assert main(["tune", "rms_norm_fwd", flag]) == 2
    assert "add --write" in capsys.readouterr().out


def test_tune_prints_the_entrys_two_timings_and_counts_distinct_launches(capsys, monkeypatch):
    """The tune command's report (the GPU work stubbed): the entry in use's time with its runs before and after the
    grid, and a progress total of the distinct launches (mhc_post_res_bwd's canonical form folds its grid)."""
    from triforge import _runtime, tune

    seen = {}

    def fake_tune(t, shape, dtype, top, progress, budget_s):
        seen["n"] = len(tune.distinct_grid(t))
        return {"kernel": t.kernel, "dtype": "bfloat16", "n_tried": 1, "n_failed": 0, "n_mismatch": 0, "n_skipped": 0,
                "top": [{"config": {"BLOCK_T": 4}, "ms": 1.0}], "best": {"config": {"BLOCK_T": 4}, "ms": 1.0},
                "in_use": {"config": None, "ms": 1.25, "ms_runs": [1.5, 1.25]}}

    monkeypatch.setattr(_runtime, "require_gpu", lambda what: None)
    monkeypatch.setattr(tune, "tune", fake_tune)
    assert main(["tune", "mhc_post_res_bwd"]) == 0
    out = capsys.readouterr().out
    assert "1.2500 ms (before / after the grid: 1.5000 / 1.2500)" in out
    assert seen["n"] == 96 < len(tune.grid(tune.get("mhc_post_res_bwd").space)) == 288
    assert "CUDA-graph" not in out  # (per-call timing: no note)


def test_tune_says_when_it_timed_by_graph_replays(capsys, monkeypatch):
    from triforge import _runtime, tune

    def fake_tune(t, shape, dtype, top, progress, budget_s):
        return {"kernel": t.kernel, "dtype": "bfloat16", "n_tried": 1, "n_failed": 0, "n_mismatch": 0, "n_skipped": 0,
                "top": [{"config": {"ROW_REPS": 2}, "ms": 0.0105}], "best": {"config": {"ROW_REPS": 2}, "ms": 0.0105},
                "in_use": {"config": None, "ms": 0.0105}, "timing": "cuda_graph", "n_sets": 13}

    monkeypatch.setattr(_runtime, "require_gpu", lambda what: None)
    monkeypatch.setattr(tune, "tune", fake_tune)
    assert main(["tune", "ternary_tc", "--shape", "M=1,N=8192,K=8192"]) == 0
    assert "timed by CUDA-graph replays over 13 input set(s)" in capsys.readouterr().out


def test_tune_list(capsys):
    assert main(["tune", "--list"]) == 0
    assert "rms_norm_fwd" in capsys.readouterr().out


def test_tune_targets_a_kernel_alone_or_a_family():
    from triforge.cli import tune_targets

    assert tune_targets("gated_delta_rule_fwd_h") == ["gated_delta_rule_fwd_h"]  # not also ..._fwd_h_o
    family = tune_targets("gated_delta_rule_fwd")
    assert {"gated_delta_rule_fwd_h", "gated_delta_rule_fwd_h_o", "gated_delta_rule_fwd_intra"} <= set(family)
    assert not any(k.startswith("gated_delta_rule_bwd") for k in family)
    assert tune_targets("gated_del") == []  # a family prefix ends where a name has an underscore


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


def test_report_tokens_and_floor():
    """tokens/s and the floor per row: tokens as each op's bench shape names them; the floor is the larger of bytes
    over the copy rate and FLOPs over the matmul rate."""
    from triforge.report import floor_ms, markdown, tokens_per_call

    shapes = {"B=1 T=32768 H=16 HV=32 K=128 V=128": 32768, "B=64 T=1 H=16 HV=32 K=128 V=128": 64,
              "B=16 H=16 S=2048 D=64": 32768, "B=8 H=16 Tq=16384 D=128 causal": 16384,
              "B=8 S=32768 H=16 Hkv=2 D=128 Sq=1 Sn=1": 8, "T=65536 C=1024 n=4": 65536, "M=16 N=8192 K=8192": 16,
              "65536x4096": 65536, "q 8x4096x32x128 k 8x4096x8x128 cos 4096x128": 32768, "C=3": None, "": None}
    for shape, want in shapes.items():
        assert tokens_per_call({"shape": shape}) == want, shape
    pk = {"copy_tbps": 2.0, "matmul_bf16_tflops": 500.0}
    assert floor_ms({"bytes": 4e9, "flops": 1e12}, pk) == pytest.approx(2.0)  # bytes: 2 ms; FLOPs: 2 ms
    assert floor_ms({"bytes": 1e9, "flops": 5e12}, pk) == pytest.approx(10.0)  # FLOPs bound
    assert floor_ms({"bytes": 1e9, "flops": 5e12, "floor_ms": 3.0}, pk) == 3.0 and floor_ms({}, pk) is None
    row = {"op": "gated_delta_rule", "mode": "fwd", "shape": "B=1 T=32768 H=16", "dtype": "bfloat16", "impl": "triforge",
           "median_ms": 1.6384, "bytes": 4e9, "flops": 1e12, "gbps": 1.0, "pct_copy": 1.0, "tflops": 1.0,
           "triforge_speedup": 1.0}
    md = markdown([{"device": "d", "commit": "c", "date": "2026-11-29", "torch": "t", "triton": "3.6.0", "peaks": pk,
                    "rows": [row]}])
    assert "| median ms | floor ms | tokens/s |" in md and "| 1.6384 | 2.0000 | 20M |" in md  # 32768 / 1.6384 ms


def test_host_time_and_the_reports_host_bound_note(tmp_path):
    """bench.host_time_ms: the enqueue time of one call (a 2 ms sleep: at least 2 ms). The report names the rows whose
    host time reaches HOST_BOUND of the median, and no others (files without host_ms: no note)."""
    import time as _time

    from triforge import bench
    from triforge.report import host_bound, markdown

    assert 2.0 <= bench.host_time_ms(lambda: _time.sleep(0.002), calls=3, batches=2)["host_ms"] < 50.0
    pk = {"copy_tbps": 2.0, "matmul_bf16_tflops": 500.0}

    def row(impl, median, host):
        return {"op": "mhc_project", "mode": "bwd", "shape": "T=65536 C=1024 n=4", "dtype": "bfloat16", "impl": impl,
                "median_ms": median, "bytes": 1e9, "flops": 0, "gbps": 1.0, "pct_copy": 1.0, "tflops": 0.0,
                "triforge_speedup": 1.0, **({"host_ms": host} if host is not None else {})}

    rows = [row("triforge", 0.40, 0.35), row("torch.compile", 1.6, 0.2), row("eager", 2.0, None)]
    assert [host_bound(r) for r in rows] == [True, False, False]
    res = {"device": "d", "commit": "c", "date": "2026-11-29", "torch": "t", "triton": "3.6.0", "peaks": pk}
    md = markdown([{**res, "rows": rows}])
    assert "Host-bound rows" in md and "mhc_project bwd triforge (T=65536 C=1024 n=4): host 0.3500 ms" in md
    assert "torch.compile (" not in md
    assert "Host-bound" not in markdown([{**res, "rows": rows[1:]}])


def test_host_time_of_a_synchronising_call_is_not_a_host_time(monkeypatch):
    """A call that reads a device value on the host (torch's sync debug mode warns) gets no host_ms: its enqueue time
    would be its GPU time. The debug mode is restored after. (CUDA stubbed: the logic, not the driver.)"""
    import warnings

    from triforge import bench

    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def syncing():
        warnings.warn("called a synchronizing CUDA operation", UserWarning)

    assert bench.host_time_ms(syncing, calls=2, batches=1) == {"host_ms": None, "host_syncs": True}
    assert modes == ["warn", 0]
    assert bench.host_time_ms(lambda: None, calls=2, batches=1)["host_ms"] >= 0.0


def test_report_regenerates_readme_section(tmp_path):
    res = tmp_path / "r.json"
    _fake_results(res)
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench:begin (generated by `triforge report --readme`) -->\nold\n<!-- bench:end -->\noutro\n")
    assert main(["report", str(res), "--out", str(tmp_path / "rep"), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old" not in text
    assert "| rms_norm | fwd | 65536x4096 | bfloat16 | triforge | 0.4000 |" in text


def test_report_selects_ops_per_file(tmp_path):
    res = tmp_path / "r.json"
    _fake_results(res)
    assert main(["report", f"{res}::no_such_op", "--out", str(tmp_path / "none")]) == 0
    assert "| rms_norm |" not in (tmp_path / "none" / "report.md").read_text()
    assert main(["report", f"{res}::rms_norm", "--out", str(tmp_path / "rep")]) == 0
    assert "| rms_norm | fwd | 65536x4096 | bfloat16 | liger | 0.4400 |" in (tmp_path / "rep" / "report.md").read_text()


def test_report_renders_a_decode_engine_result_beside_bench_results(tmp_path):
    """A benchmarks/qwen2_decode.py result (tokens/s per batch, one step's kernels) is rendered next
    to triforge bench results, and left out of the roofline (it has no per-op rows)."""
    bench = tmp_path / "r.json"
    _fake_results(bench)
    dec = tmp_path / "d.json"
    dec.write_text(json.dumps({
        "benchmark": "qwen2_decode", "device": "NVIDIA H100 80GB HBM3", "commit": "abc1234", "date": "2026-11-22",
        "torch": "2.11", "triton": "3.6.0", "transformers": "5.17.0", "dtype": "bfloat16", "layers": 24,
        "prompt": 16, "new_tokens": 256, "copy_tbps": 3.0, "correctness": {"ok": True},
        "throughput": [
            {"impl": "hf_eager", "batch": 1, "tokens_per_s": 11.3, "ms_per_step": 88.5, "triforge_speedup": 80.0},
            {"impl": "triforge", "batch": 1, "tokens_per_s": 904.0, "ms_per_step": 1.106, "triforge_speedup": 1.0},
        ],
        "skipped": [{"impl": "hf_eager", "batch": 8, "reason": "time budget"}],
        "step_profile": {"batch": 1, "keys_attended": 145, "sum_kernel_us": 866.0, "graph_step_us": 966.0,
                         "bytes_per_step": 991e6, "ideal_us_at_copy_bw": 331.0,
                         "kernels": [{"role": "lm_head", "calls": 1, "mean_us": 106.6, "total_us": 106.6,
                                      "bytes": 272.6e6, "pct_copy": 85.3}]},
    }))
    assert main(["report", str(bench), str(dec), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| rms_norm | fwd | 65536x4096 | bfloat16 | liger | 0.4400 |" in md
    rows = md.split("| impl | batch | tokens/s | ms / step | triforge speedup |")[1]
    assert rows.index("| triforge | 1 | 904 | 1.106 | 1.00x |") < rows.index("| hf_eager | 1 | 11 | 88.500 | 80.00x |")
    assert "| hf_eager | 8 | not run: time budget |" in md
    assert "| lm_head | 1 | 106.60 | 106.6 | 272.60 | 85.3% |" in md
    assert (tmp_path / "rep" / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_timeline_per_gpu_with_streams_overlapping_and_its_longest_gaps(tmp_path):
    """trace.timeline: per GPU (the events' device argument), kernels on two streams that overlap count once; the
    gaps are where no kernel ran, longest first, with their neighbours; a kernel nested inside a longer one ends
    no gap."""
    from triforge import trace

    def k(name, ts, dur, dev):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 9, "args": {"device": dev}}

    events = [k("a", 0, 100, 0), k("b", 10, 20, 0), k("c", 50, 100, 0), k("d", 400, 10, 0), k("e", 170, 30, 0),
              k("x", 1000, 5, 1), k("y", 1006, 5, 1), {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9999}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(events))
    g0, g1 = trace.timeline(path, top=1)
    assert (g0["gpu"], g0["kernels"], g0["span_us"], g0["busy_us"]) == (0, 5, 410.0, 190.0)  # [0, 150] + [170, 200] + [400, 410]
    assert g0["gaps"] == [{"us": 200.0, "after": "e", "before": "d"}]
    assert (g1["gpu"], g1["span_us"], g1["busy_us"], g1["gaps"][0]["us"]) == (1, 11.0, 10.0, 1.0)


def test_trace_summarises_kernels_against_their_byte_model(tmp_path, capsys):
    from triforge import trace

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "triforge::mhc_post_res_fwd_kernel bytes=3000000000", "ts": 0, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "mhc_post_res_fwd_kernel", "ts": 1, "dur": 1000.0},
        {"ph": "X", "cat": "user_annotation", "name": "triforge::mhc_post_res_fwd_kernel bytes=3000000000", "ts": 2000, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "mhc_post_res_fwd_kernel", "ts": 2001, "dur": 1000.0},
        {"ph": "X", "cat": "kernel", "name": "ampere_bf16_gemm", "ts": 3000, "dur": 4000.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 2999, "dur": 4001.0},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    rows = trace.summarize(path, copy_tbps=3.0)
    assert [r["kernel"] for r in rows] == ["ampere_bf16_gemm", "mhc_post_res_fwd_kernel"]
    ours = rows[1]
    assert ours["calls"] == 2 and ours["total_us"] == 2000.0 and ours["triforge"]
    assert abs(ours["gbps"] - 3000.0) < 1e-6 and abs(ours["pct_copy"] - 100.0) < 1e-6
    assert not rows[0]["triforge"] and "gbps" not in rows[0]
    assert main(["trace", str(path), "--copy-tbps", "3.0"]) == 0
    out = capsys.readouterr().out
    assert "mhc_post_res_fwd_kernel" in out
    # the timeline: kernels at [1, 1001], [2001, 3001], [3000, 7000] (the last two overlap: counted once)
    (g,) = trace.timeline(path)
    assert g["kernels"] == 3 and g["span_us"] == 6999.0 and g["busy_us"] == 5999.0 and g["idle_us"] == 1000.0
    assert g["gaps"] == [{"us": 1000.0, "after": "mhc_post_res_fwd_kernel", "before": "mhc_post_res_fwd_kernel"}]
    assert "kernels ran 5.999 of the 6.999 ms" in " ".join(out.split()) and "85.7%" in out
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": events[-1:]}))
    assert main(["trace", str(empty)]) == 1


def test_launch_annotates_bytes_while_profiling():
    import torch

    from triforge.ops.norm import rms_norm

    x = torch.randn(5, 64, device=_runtime.default_device())
    w = torch.randn(64, device=_runtime.default_device())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        rms_norm(x, w)
    names = [e.name for e in prof.events()]
    assert f"triforge::rms_norm_fwd_kernel bytes={2 * 5 * 64 * 4 + 4 * 5}" in names


def test_shape_flags_are_checked_against_the_op():
    """``--NAME VALUE`` shape dimensions must be ones the op (bench) or kernel (tune) takes: a misspelt ``--t`` exits
    with a message naming it (before the GPU check) instead of being ignored while the default shape runs."""
    from triforge import registry, tune
    from triforge.cli import _check_shape_dims, tune_targets

    assert registry.get("mhc_project").shape_names == ("T", "C")
    assert set(registry.get("gated_delta_rule").shape_names) == {"B", "T", "H", "HV", "K", "V"}
    with pytest.raises(SystemExit, match="unknown: --t"):
        main(["bench", "mhc", "--t", "65536", "--C", "2560"])
    targets = tune_targets("mhc")
    assert targets
    for k in targets:
        names = tuple(tune.get(k).shape_names)
        assert set(names) == {"T", "C"}
        with pytest.raises(SystemExit, match="unknown: --c"):
            _check_shape_dims({"T": 65536, "c": 2560}, [(k, names)])
        _check_shape_dims({"T": 65536, "C": 2560}, [(k, names)])
    _check_shape_dims({"anything": 1}, [("an op that names none", ())])
    # every dimension an op reads counts, the optional ones too (attention's Hkv, Sq, Sk beside its bench shapes')
    attn = registry.get("flash_attn")
    _check_shape_dims({"B": 1, "H": 16, "S": 4096, "D": 128, "Hkv": 2, "Sq": 1, "Sk": 4096},
                      [(attn.name, attn.shape_names)])
    for spec in registry.select(None):
        if spec.bench_shapes:  # a bench shape's keys are names the op takes
            assert set(spec.bench_shapes[0]) <= set(spec.shape_names), spec.name


def test_bench_table_shows_spread_and_bytes():
    """The bench's printed table (what `triforge bench` shows) has each row's median, mean / min / max, bytes moved,
    GB/s and % of copy, from a stored result file (mHC at C = 2560, with its layer total); error rows stay readable."""
    from pathlib import Path

    from rich.console import Console

    from triforge.cli import _bench_table

    path = Path(__file__).resolve().parent.parent / "benchmarks/results/h100-2026-11-24-6039aec-mhc-c2560.json"
    result = json.loads(path.read_text())
    result["rows"].append({"op": "mhc_project", "mode": "fwd", "impl": "peer", "error": "RuntimeError: boom"})
    console = Console(record=True, width=400)
    console.print(_bench_table(result))
    text = console.export_text()
    for col in ("median ms", "mean / min / max ms", "floor ms", "tokens/s", "MB moved", "GB/s", "% copy"):
        assert col in text
    row = next(r for r in result["rows"] if r["impl"] == "triforge" and r["op"] == "mhc_pre_map" and r["mode"] == "fwd")
    assert f"{row['mean_ms']:.4f} / {row['min_ms']:.4f} / {row['max_ms']:.4f}" in text
    assert f"{row['bytes'] / 1e6:.1f}" in text and "boom" in text
    rate = 65536 / (row["median_ms"] * 1e-3)  # T tokens per call
    assert f"{rate / 1e6:.3g}M" in text
    assert any(r.get("op", "").endswith("total") for r in result["rows"])  # the layer total is a row of its own
    assert " *" not in text.split("\n", 2)[2]  # (a file from before host_ms: no row marked)
    row["host_ms"] = 0.9 * row["median_ms"]  # host-bound: its median is marked
    console = Console(record=True, width=400)
    console.print(_bench_table(result))
    assert f"{row['median_ms']:.4f} *" in console.export_text()


def test_margins_ranks_checks_and_exits_nonzero_only_when_asked(tmp_path, capsys):
    log = tmp_path / "m.jsonl"
    rows = [{"test": "t.py::close", "name": "dq", "elem": 0.9, "rms": 0.2, "ok": True},
            {"test": "t.py::far", "name": "o", "elem": 0.1, "rms": 0.05, "ok": True},
            {"test": "t.py::planted", "name": "bad", "elem": 50.0, "rms": 3.0, "ok": False}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["margins", str(log)]) == 0
    out = capsys.readouterr().out
    assert out.index("t.py::close") < out.index("t.py::far") < out.index("t.py::planted")
    assert "1 checks passed at or above 0.5" in out and "1 failed in every run" in out
    assert main(["margins", str(log), "--strict"]) == 1
    assert main(["margins", str(log), "--strict", "--warn", "0.95"]) == 0
    other = tmp_path / "run2.jsonl"  # a second run in which t.py::far failed
    other.write_text(json.dumps({"test": "t.py::far", "name": "o", "elem": 1.2, "rms": 0.05, "ok": False}) + "\n")
    capsys.readouterr()
    assert main(["margins", str(log), str(other), "--strict", "--warn", "0.95"]) == 1
    out = capsys.readouterr().out
    assert out.index("t.py::far") < out.index("t.py::close") and "1 checks failed in some runs" in out
    assert main(["margins", str(tmp_path / "missing.jsonl")]) == 1
