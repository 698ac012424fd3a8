"""The harness itself: compare / compare_stages / poisoning / dumps (triforge.testing), check_op
(triforge.check), the grid tuner (triforge.tune) and launch-config lookup (triforge.launch).

Each test here must be able to fail: the harness is what every kernel test trusts.
"""

import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import triforge  # noqa: F401  (sets TRITON_INTERPRET before the test kernels below are defined)
import triton
import triton.language as tl

from triforge import _runtime, launch, registry, tune
from triforge.check import check_op
from triforge.ops.norm import rms_norm_stages
from triforge.testing import (
    TOLERANCES,
    Tolerance,
    compare,
    compare_dumps,
    compare_stages,
    dump_stages,
    load_dump,
    new_output,
    poisoned,
    rank_margins,
    tolerance_for,
)

DEV = _runtime.default_device()  # where kernels run: cpu through the interpreter, cuda when compiled
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]

ROW_FIELDS = {
    "name", "ok", "shape", "max_abs", "max_abs_at", "mean_abs", "rel_rms", "n_over",
    "nan_inf_ref", "nan_inf_got", "reason",
}


def _ref(shape, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64) + 0.5


def _rms(t):
    return float(t.square().mean().sqrt())


# ----------------------------------------------------------------------------- compare: passing


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_compare_passes_on_equal_and_on_rounding(dtype, gen):
    ref = _ref((17, 33), gen)
    r = compare("same", ref, ref.clone(), dtype=dtype, verbose=False)
    assert r.ok and r.max_abs == 0 and r.rel_rms == 0 and r.n_over == 0 and r.reason == ""
    # the reference rounded to the dtype is within that dtype's tolerance
    r = compare("rounded", ref, ref.to(dtype), verbose=False)
    assert r.ok, r.line()
    assert r.tol == tolerance_for(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_compare_passes_small_perturbation(dtype, gen):
    tol = TOLERANCES[dtype]
    ref = _ref((64, 40), gen)
    a = 0.5 * min(tol.rtol, tol.rel_rms)
    rel = (torch.rand(ref.shape, generator=gen, dtype=torch.float64) * 2 - 1) * a
    got = ref * (1 + rel)
    r = compare("small", ref, got, tol=tol, verbose=False)
    assert r.ok, r.line()
    assert 0 < r.rel_rms <= a
    assert r.max_abs == pytest.approx(float((got - ref).abs().max()))


def test_compare_fails_on_rel_rms_only(gen):
    ref = _ref((50, 50), gen)
    tol = Tolerance(rel_rms=1e-3, atol=1.0, rtol=1.0)  # elementwise bound too loose to trip
    r = compare("scaled", ref, ref * 1.01, tol=tol, verbose=False)
    assert not r.ok
    assert r.rel_rms == pytest.approx(0.01, rel=1e-6)
    assert r.n_over == 0
    assert "rel_rms" in r.reason and "over tolerance" not in r.reason


@pytest.mark.parametrize("shape", [(10000,), (40, 250), (8, 25, 50)], ids=["1d", "2d", "3d"])
def test_compare_fails_on_single_element_and_locates_it(shape, gen):
    ref = _ref(shape, gen)
    tol = Tolerance(rel_rms=1.0, atol=1e-3, rtol=0.0)  # rel_rms bound too loose to trip
    got = ref.clone()
    flat = int(torch.randint(0, ref.numel(), (1,), generator=gen))
    idx = tuple(int(i) for i in np.unravel_index(flat, shape))
    delta = 0.05 * _rms(ref)
    got[idx] += delta
    r = compare("one", ref, got, tol=tol, verbose=False)
    assert not r.ok
    assert r.n_over == 1
    assert r.max_abs_at == idx
    assert r.max_abs == pytest.approx(delta, rel=1e-9)
    assert r.reason == "1 elements over tolerance"
    assert r.row()["max_abs_at"] == list(idx)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_compare_default_tolerance_catches_an_element_error(dtype, gen):
    """One element off by 3x the dtype's elementwise bound fails with the dtype's own tolerance."""
    tol = TOLERANCES[dtype]
    ref = _ref((64, 64), gen)
    got = ref.clone()
    i, j = 5, 7
    got[i, j] += 3 * (tol.atol * _rms(ref) + tol.rtol * abs(float(ref[i, j])))
    r = compare("elt", ref, got, tol=tol, verbose=False)
    assert not r.ok and r.n_over == 1 and r.max_abs_at == (i, j)


def test_compare_scale_judges_each_element_by_its_own_error_scale(gen):
    """Elements whose error scales differ by orders (attention gradients of rows that see 2 keys and
    rows that see thousands): with a per-element ``scale``, an error of 1% of a big element's scale
    passes where the tensor-wide rms would fail it, and a small element's error that the tensor-wide
    rms would hide fails."""
    tol = Tolerance(rel_rms=1.0, atol=5e-2, rtol=0.0)
    ref = _ref((64, 128), gen)
    ref[0] *= 1000.0  # one big row
    ref[5, 3] = 0.3  # a small element: its own scale is 0.5, the tensor-wide bound ~0.05 * 125
    scale = ref.abs().clamp(min=0.5)  # each element's own error scale
    got = ref.clone()
    got[0] += 0.01 * scale[0] * torch.sign(torch.randn(128, generator=gen, dtype=ref.dtype))
    assert compare("own", ref, got, tol=tol, scale=scale, verbose=False).ok
    assert not compare("global", ref, got, tol=tol, verbose=False).ok
    got = ref.clone()
    got[5, 3] += 3 * float(scale[5, 3])  # far under the tensor-wide rms (set by the big row)
    assert compare("global", ref, got, tol=tol, verbose=False).ok
    r = compare("own", ref, got, tol=tol, scale=scale, verbose=False)
    assert not r.ok and r.n_over == 1 and r.max_abs_at == (5, 3)


def test_compare_zero_scale_admits_only_exact_values(gen):
    """An element whose error scale is 0 (nothing can round) must match exactly (rtol aside)."""
    tol = Tolerance(rel_rms=1.0, atol=1e-3, rtol=0.0)
    ref = _ref((8, 32), gen)
    scale = torch.ones_like(ref)
    scale[2, 0] = 0.0
    got = ref.clone()
    assert compare("exact", ref, got, tol=tol, scale=scale, verbose=False).ok
    got[2, 0] += 1e-9
    assert not compare("exact", ref, got, tol=tol, scale=scale, verbose=False).ok


def test_compare_fp16_store_of_a_subnormal_value_passes_and_twice_its_floor_fails(gen):
    """An fp16 output whose exact value is ~1e-9 (a causal key seen by one query, at a coordinate
    where q ~ 0) is stored as a multiple of 2^-24 whatever the kernel computed: the rounding of the
    exact value itself passes even with error scale 0; an error of two subnormal spacings fails."""
    from triforge.testing import storage_floor

    assert storage_floor(torch.float16) == 2.0**-25
    assert storage_floor(torch.bfloat16) < 1e-40 and storage_floor(torch.float64) == 0.0
    ref = torch.randn(4, 64, generator=gen, dtype=torch.float64)
    ref[:, :16] = torch.rand(4, 16, generator=gen, dtype=torch.float64) * 2.0**-20  # subnormal in fp16
    scale = torch.where(ref.abs() > 2.0**-14, ref.abs(), 0.0)  # error scale 0 at the tiny elements
    assert compare("stored", ref, ref.half(), dtype=torch.float16, scale=scale, verbose=False).ok
    got = ref.half()
    got[1, 7] += 2 * 2.0**-24  # a tiny element
    r = compare("off", ref, got, dtype=torch.float16, scale=scale, verbose=False)
    assert not r.ok and r.n_over == 1


def test_compare_dtype_argument_picks_the_tolerance(gen):
    """fp32 storage of a bf16-accurate result passes when told it came from bf16, fails as fp32."""
    ref = _ref((32, 32), gen)
    got = ref.to(torch.bfloat16).to(torch.float32)
    assert compare("as_bf16", ref, got, dtype=torch.bfloat16, verbose=False).ok
    assert not compare("as_fp32", ref, got, verbose=False).ok
    assert not compare("as_fp32", ref, got, dtype=torch.float32, verbose=False).ok


def test_tolerance_for_unknown_dtype():
    with pytest.raises(ValueError, match="int32"):
        tolerance_for(torch.int32)


# ----------------------------------------------------------------------------- compare: non-finite


def test_compare_single_nan_in_got_fails(gen):
    ref = _ref((20, 30), gen)
    got = ref.clone()
    got[3, 4] = float("nan")
    r = compare("nan", ref, got, verbose=False)
    assert not r.ok
    assert r.nan_got == 1 and r.nan_ref == 0
    assert "NaN" in r.reason
    assert r.row()["nan_inf_got"] == [1, 0]


def test_compare_nan_never_passes_even_where_ref_is_nan(gen):
    """Documented rule: non-finite values pass only where the reference holds the same infinity;
    NaN never passes, not even against a NaN in the reference."""
    ref = _ref((20, 30), gen)
    ref[1, 2] = float("nan")
    got = ref.clone()
    r = compare("nan_both", ref, got, verbose=False)
    assert not r.ok
    assert r.nan_ref == 1 and r.nan_got == 1
    assert r.row()["nan_inf_ref"] == [1, 0]


def test_compare_finite_got_where_ref_is_nonfinite_fails(gen):
    for bad in (float("nan"), float("inf")):
        ref = _ref((10, 10), gen)
        ref[0, 0] = bad
        got = ref.clone()
        got[0, 0] = 1.0
        r = compare("finite_vs_nonfinite", ref, got, verbose=False)
        assert not r.ok, bad
        assert "non-finite" in r.reason


@pytest.mark.parametrize("value", [float("inf"), -float("inf")], ids=["+inf", "-inf"])
def test_compare_inf_in_got_where_ref_finite_fails(value, gen):
    ref = _ref((10, 10), gen)
    got = ref.clone()
    got[9, 9] = value
    r = compare("inf", ref, got, verbose=False)
    assert not r.ok
    assert r.inf_got == 1 and r.nan_got == 0
    assert "non-finite" in r.reason
    assert r.n_over >= 1


def test_compare_same_infinity_passes_and_opposite_fails(gen):
    ref = _ref((10, 10), gen)
    ref[2, 3] = float("inf")
    ref[4, 5] = -float("inf")
    got = ref.clone()
    r = compare("same_inf", ref, got, verbose=False)
    assert r.ok, r.line()
    assert r.inf_ref == 2 and r.inf_got == 2
    got[2, 3] = -float("inf")
    r = compare("opposite_inf", ref, got, verbose=False)
    assert not r.ok and "non-finite" in r.reason


# ----------------------------------------------------------------------------- compare: shapes, rows


@pytest.mark.parametrize("got_shape", [(4, 5), (6, 4), (4, 1), (24,), (4, 6, 1), ()], ids=str)
def test_compare_shape_mismatch_fails(got_shape, gen):
    """Any shape other than the reference's fails, broadcastable or not, even with equal numel."""
    ref = _ref((4, 6), gen)
    got = ref.reshape(got_shape) if math.prod(got_shape) == ref.numel() else _ref(got_shape, gen)
    r = compare("shape", ref, got, verbose=False)
    assert not r.ok
    assert "shape mismatch" in r.reason
    assert r.row()["shape"] == list(got_shape)


def test_compare_row_fields(gen):
    ref = _ref((3, 4), gen)
    got = ref.clone()
    got[2, 1] += 1.0
    r = compare("row", ref, got, verbose=False)
    row = r.row()
    assert set(row) == ROW_FIELDS
    assert row["name"] == "row" and row["ok"] is False
    assert row["shape"] == [3, 4]
    assert row["max_abs_at"] == [2, 1]
    assert row["max_abs"] == pytest.approx(1.0)
    assert row["mean_abs"] == pytest.approx(1.0 / 12)
    assert row["n_over"] == 1
    assert row["nan_inf_ref"] == [0, 0] and row["nan_inf_got"] == [0, 0]
    assert row["reason"] == r.reason != ""
    json.dumps(row)  # rows go to JSON reports
    assert "FAIL" in r.line() and "reason" in r.line()
    assert compare("ok", ref, ref, verbose=False).line().startswith("PASS")


def test_compare_verbose_prints_the_line(gen, capsys):
    ref = _ref((3, 4), gen)
    r = compare("printed", ref, ref, verbose=True)
    assert capsys.readouterr().out.strip() == r.line()


def test_margin_log_records_how_close_each_check_came(tmp_path, monkeypatch):
    """TRIFORGE_MARGIN_LOG: one line per comparison; the element margin is |got - ref| / bound of the
    worst element, the rms margin rel_rms / its tolerance; merged runs keep each check's worst."""
    log = tmp_path / "m.jsonl"
    monkeypatch.setenv("TRIFORGE_MARGIN_LOG", str(log))
    tol = Tolerance(rel_rms=1.0, atol=0.0, rtol=0.1)
    ref = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    compare("a", ref, ref + torch.tensor([0.05, 0.0, 0.0], dtype=torch.float64), tol=tol, verbose=False)  # half its bound
    compare("a", ref, ref + torch.tensor([0.0, 0.3, 0.0], dtype=torch.float64), tol=tol, verbose=False)  # 1.5x: fails
    compare("b", ref, ref, tol=tol, verbose=False)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["name"] for r in rows] == ["a", "a", "b"] and [r["ok"] for r in rows] == [True, False, True]
    assert rows[0]["elem"] == pytest.approx(0.5) and rows[1]["elem"] == pytest.approx(1.5) and rows[2]["elem"] == 0
    assert rows[1]["rms"] == pytest.approx(0.3 / math.sqrt(21))  # rel_rms / 1.0
    assert rows[0]["test"].endswith("test_margin_log_records_how_close_each_check_came")
    # two runs of the same log: "a" fails in both (a planted error), "b" in neither
    ranked = rank_margins([log, log])
    assert [(r["name"], r["runs"], r["failed"]) for r in ranked] == [("a", 2, 2), ("b", 2, 0)]
    assert ranked[0]["elem"] == pytest.approx(0.5)  # the worst of its passing comparisons
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join(line + "\n" for line in log.read_text().splitlines() if '"ok": true' in line))
    flaky = rank_margins([clean, log])[0]  # "a" failed in one run and not in the other
    assert (flaky["name"], flaky["runs"], flaky["failed"]) == ("a", 2, 1)
    monkeypatch.delenv("TRIFORGE_MARGIN_LOG")
    compare("c", ref, ref, tol=tol, verbose=False)
    assert len(log.read_text().splitlines()) == 3  # unset: nothing written


# ----------------------------------------------------------------------------- poisoning


@pytest.mark.parametrize(
    "dtype,fill",
    [(torch.float32, "nan"), (torch.float16, "nan"), (torch.bfloat16, "nan"), (torch.int32, -1), (torch.int64, -1), (torch.int8, -1)],
)
def test_poisoned_new_output(dtype, fill):
    assert launch._POISON["on"] is False
    with poisoned():
        t = new_output((3, 5), dtype, "cpu")
    assert t.shape == (3, 5) and t.dtype == dtype
    if fill == "nan":
        assert t.isnan().all()
    else:
        assert (t == fill).all()
    assert launch._POISON["on"] is False


def test_poisoned_restores_after_exception_and_nests():
    with pytest.raises(RuntimeError):
        with poisoned():
            assert launch._POISON["on"] is True
            raise RuntimeError("boom")
    assert launch._POISON["on"] is False
    with poisoned():
        with poisoned(False):
            assert launch._POISON["on"] is False
            assert new_output((4,), torch.int64, "cpu").shape == (4,)
        assert launch._POISON["on"] is True
        assert new_output((4,), torch.float32, "cpu").isnan().all()
    assert launch._POISON["on"] is False


@triton.jit
def _copy_prefix_kernel(x_ptr, y_ptr, N, n_write, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = (o < N) & (o < n_write)
    tl.store(y_ptr + o, tl.load(x_ptr + o, mask=m, other=0.0), mask=m)


def _copy_launcher(x, n_write):
    """A launcher in the package's style: output from new_output, kernel writes n_write elements."""
    N = x.numel()
    y = new_output((N,), x.dtype, x.device)
    launch.launch("test_copy_prefix", _copy_prefix_kernel, (1,), x, y, N, n_write, BLOCK=triton.next_power_of_2(N))
    return y


def test_poisoning_catches_a_kernel_that_skips_half_its_output(gen):
    N = 100
    x = _ref((N,), gen).to(DEV, torch.float32)
    with poisoned():
        good = _copy_launcher(x, N)
        broken = _copy_launcher(x, N // 2)
    assert compare("full_copy", x.double(), good, verbose=False).ok
    r = compare("half_copy", x.double(), broken, verbose=False)
    assert not r.ok
    assert r.nan_got == N - N // 2
    assert torch.equal(broken[: N // 2], x[: N // 2])  # the written half is right: only poisoning catches it


# ----------------------------------------------------------------------------- compare_stages


def _stages(gen):
    return {"a": _ref((4, 5), gen), "b": _ref((4,), gen), "c": _ref((4, 5), gen)}


def test_compare_stages_all_pass(gen):
    ref = _stages(gen)
    got = {k: v.float() for k, v in ref.items()}
    results, failed = compare_stages(ref, got, dtype=torch.float32, prefix="fwd.", verbose=False)
    assert failed is None
    assert [r.name for r in results] == ["fwd.a", "fwd.b", "fwd.c"]
    assert all(r.ok for r in results)


def test_compare_stages_stops_at_first_failure(gen):
    ref = _stages(gen)
    got = {"a": ref["a"].float(), "b": ref["b"].float() * 1.1}  # "c" is absent: comparing it would raise
    results, failed = compare_stages(ref, got, dtype=torch.float32, verbose=False)
    assert failed == "b"
    assert [r.name for r in results] == ["a", "b"]
    assert results[0].ok and not results[1].ok


def test_compare_stages_follows_reference_order(gen):
    ref = _stages(gen)
    got = {"c": ref["c"] * 2, "b": ref["b"].clone(), "a": ref["a"] * 2}  # a and c both wrong
    results, failed = compare_stages(ref, got, dtype=torch.float32, verbose=False)
    assert failed == "a" and len(results) == 1


def test_compare_stages_missing_stage_raises(gen):
    ref = _stages(gen)
    got = {"a": ref["a"].clone(), "c": ref["c"].clone()}
    with pytest.raises(KeyError, match="'b'"):
        compare_stages(ref, got, dtype=torch.float32, verbose=False)


def test_compare_stages_per_stage_tolerance(gen):
    ref = _stages(gen)
    got = {k: v.clone() for k, v in ref.items()}
    got["b"] = got["b"] * 1.001
    loose = {"b": Tolerance(rel_rms=1e-2, atol=1e-2, rtol=1e-2)}
    _, failed = compare_stages(ref, got, dtype=torch.float32, verbose=False)
    assert failed == "b"
    results, failed = compare_stages(ref, got, dtype=torch.float32, tols=loose, verbose=False)
    assert failed is None and len(results) == 3
    assert results[1].tol == loose["b"] and results[0].tol == TOLERANCES[torch.float32]


# ----------------------------------------------------------------------------- dumps


def test_dump_load_roundtrip(tmp_path, gen):
    stages = {
        "h": _ref((3, 4), gen).to(torch.bfloat16),
        "rstd": _ref((3,), gen).float(),
        "d_x": _ref((3, 4), gen),  # a name with an underscore
        "y": _ref((2, 3, 4), gen).half(),
    }
    dump_stages(tmp_path / "d", stages)
    files = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert files == ["00_h.npy", "01_rstd.npy", "02_d_x.npy", "03_y.npy"]
    loaded = load_dump(tmp_path / "d")
    assert list(loaded) == list(stages)
    for k, t in stages.items():
        assert loaded[k].dtype == np.float64
        np.testing.assert_array_equal(loaded[k], t.double().numpy())


def test_compare_dumps_reports_worst_and_max(tmp_path, gen):
    ref = {"a": _ref((6, 7), gen), "b": _ref((5,), gen)}
    got = {k: v.clone() for k, v in ref.items()}
    bumps = {(1, 2): 0.5, (4, 6): -2.0, (0, 0): 1.0}  # |diff| order: (4,6), (0,0), (1,2)
    for idx, d in bumps.items():
        got["a"][idx] += d
    dump_stages(tmp_path / "ref", ref)
    dump_stages(tmp_path / "got", got)
    rows = compare_dumps(tmp_path / "ref", tmp_path / "got", worst=3)
    assert [r["stage"] for r in rows] == ["a", "b"]
    a, b = rows
    assert a["shape"] == [6, 7]
    assert a["max_diff"] == pytest.approx(2.0)
    assert a["mean_diff"] == pytest.approx(3.5 / 42)
    assert a["nan_got"] == 0
    assert [w["index"] for w in a["worst"]] == [[4, 6], [0, 0], [1, 2]]
    for w in a["worst"]:
        i = tuple(w["index"])
        assert w["ref"] == pytest.approx(float(ref["a"][i]))
        assert w["got"] == pytest.approx(float(got["a"][i]))
    assert b["max_diff"] == 0 and b["mean_diff"] == 0
    json.dumps(rows)


def test_compare_dumps_nan_missing_and_shape(tmp_path, gen):
    ref = {"a": _ref((4, 4), gen), "b": _ref((3,), gen), "c": _ref((2, 2), gen)}
    got = {"a": ref["a"].clone(), "c": _ref((4,), gen)}
    got["a"][3, 1] = float("nan")
    got["a"][0, 0] += 100.0
    dump_stages(tmp_path / "ref", ref)
    dump_stages(tmp_path / "got", got)
    rows = {r["stage"]: r for r in compare_dumps(tmp_path / "ref", tmp_path / "got", worst=2)}
    assert rows["a"]["nan_got"] == 1
    assert rows["a"]["max_diff"] == math.inf  # a NaN is the worst difference there is
    assert [w["index"] for w in rows["a"]["worst"]] == [[3, 1], [0, 0]]
    assert rows["b"] == {"stage": "b", "missing": True}
    assert rows["c"] == {"stage": "c", "shape_mismatch": [[2, 2], [4]]}


# ----------------------------------------------------------------------------- check_op


def _perturbed_stages(stage, factor):
    def stages(**inputs):
        out = rms_norm_stages(**inputs)
        out[stage] = out[stage] * factor
        return out

    return stages


def _seed(gen):
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


def test_check_op_passes_on_registered_rms_norm(gen):
    res = check_op(registry.get("rms_norm"), torch.float32, tier="tiny", seed=_seed(gen))
    assert res.ok and res.failed_stage is None and res.error is None
    assert [r.name for r in res.results] == ["fwd.rstd", "fwd.y", "bwd.dx", "bwd.dweight"]


def test_check_op_wrong_rstd_stops_there(gen):
    spec = dataclasses.replace(registry.get("rms_norm"), stages=_perturbed_stages("rstd", 1.01))
    res = check_op(spec, torch.float32, tier="tiny", seed=_seed(gen))
    assert not res.ok
    assert res.error is None
    assert res.failed_stage == "rstd"
    assert [r.name for r in res.results] == ["fwd.rstd"]  # y, and the gradients, never compared


def test_check_op_wrong_y_reports_y(gen):
    spec = dataclasses.replace(registry.get("rms_norm"), stages=_perturbed_stages("y", 1.01))
    res = check_op(spec, torch.float32, tier="tiny", seed=_seed(gen))
    assert not res.ok and res.failed_stage == "y"
    assert [r.name for r in res.results] == ["fwd.rstd", "fwd.y"]
    assert res.results[0].ok


def test_check_op_wrong_gradient_reports_first_bad_grad(gen):
    from triforge.ops.norm import rms_norm

    spec = dataclasses.replace(registry.get("rms_norm"), call=lambda x, weight, eps: (rms_norm(x, weight, eps) * 1.1,))
    res = check_op(spec, torch.float32, tier="tiny", seed=_seed(gen))
    assert not res.ok and res.error is None
    assert res.failed_stage == "dx"
    # forward stages passed; every gradient was still compared and reported
    assert [r.name for r in res.results] == ["fwd.rstd", "fwd.y", "bwd.dx", "bwd.dweight"]
    assert [r.ok for r in res.results] == [True, True, False, False]


def test_check_op_kernel_raising_is_an_error(gen):
    def boom(**inputs):
        raise RuntimeError("kernel exploded")

    spec = dataclasses.replace(registry.get("rms_norm"), stages=boom)
    res = check_op(spec, torch.float32, tier="tiny", seed=_seed(gen))
    assert res.ok is False
    assert res.error == "RuntimeError: kernel exploded"
    assert res.results == []


def test_check_op_unwritten_output_is_caught_by_poisoning(gen):
    """A stage buffer the 'kernel' never fills (new_output, as launchers allocate) fails the check."""
    def stages(**inputs):
        out = rms_norm_stages(**inputs)
        y = new_output(out["y"].shape, out["y"].dtype, out["y"].device)
        y[: y.shape[0] // 2] = out["y"][: y.shape[0] // 2]
        out["y"] = y
        return out

    spec = dataclasses.replace(registry.get("rms_norm"), stages=stages)
    res = check_op(spec, torch.float32, tier="tiny", seed=_seed(gen))
    assert not res.ok and res.failed_stage == "y"
    assert res.results[-1].nan_got > 0


def test_check_op_dump_dir(tmp_path, gen):
    res = check_op(registry.get("rms_norm"), torch.float32, tier="tiny", seed=_seed(gen), dump_dir=tmp_path)
    assert res.ok
    rows = compare_dumps(tmp_path / "rms_norm-float32" / "ref", tmp_path / "rms_norm-float32" / "got")
    assert [r["stage"] for r in rows] == ["rstd", "y"]
    assert all(r["max_diff"] < 1e-4 for r in rows)


# ----------------------------------------------------------------------------- tune


def test_grid_enumerates_the_product():
    g = tune.grid({"a": [1, 2], "b": ["x", "y", "z"]})
    assert g == [
        {"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 1, "b": "z"},
        {"a": 2, "b": "x"}, {"a": 2, "b": "y"}, {"a": 2, "b": "z"},
    ]
    assert tune.grid({"a": [3]}) == [{"a": 3}]
    assert tune.grid({}) == [{}]
    assert tune.grid({"a": [1, 2], "b": []}) == []
    assert len(tune.grid({"p": [1, 2, 3], "q": [1, 2], "r": [1, 2, 3, 4]})) == 24


def _fake_tunable(fail_p=3, calls=None):
    """p in 1..4, q in {10, 20}; 'time' = cost(cfg); configs with p == fail_p raise in run()."""
    last = {}
    seen = calls if calls is not None else []

    def setup(shape, dtype, device):
        seen.append(("setup", dict(shape), dtype, device))

        def run(cfg):
            cfg = cfg or {"p": 2, "q": 10}  # None: the launcher's own config
            if cfg["p"] == fail_p:
                raise ValueError(f"p={fail_p} exceeds resources\nsecond line of the message")
            last["cfg"] = dict(cfg)

        return run, f"fake-key-{shape['M']}"

    def timer(fn):
        last.pop("cfg", None)
        fn()
        cfg = last["cfg"]  # the config the timed function actually ran
        return cost(cfg)

    t = tune.Tunable(kernel="fake_kernel", space={"p": [1, 2, 3, 4], "q": [10, 20]}, setup=setup, shape_names=("M",))
    return t, timer


def cost(cfg):
    return abs(cfg["p"] - 2.4) * 10 + cfg["q"] / 10


def test_tune_picks_best_sorts_top_and_counts_failures():
    calls = []
    t, timer = _fake_tunable(calls=calls)
    res = tune.tune(t, {"M": 7}, torch.float16, top=3, timer=timer)
    expected = sorted(
        ({"config": c, "ms": cost(c), "spills": None} for c in tune.grid(t.space) if c["p"] != 3), key=lambda r: r["ms"]
    )  # (spills None: the fake launches no compiled kernel)
    assert res["best"] == expected[0] == {"config": {"p": 2, "q": 10}, "ms": cost({"p": 2, "q": 10}), "spills": None}
    assert res["top"] == expected[:3]
    assert [r["ms"] for r in res["top"]] == sorted(r["ms"] for r in res["top"])
    assert res["n_tried"] == 8 and res["n_failed"] == 2
    assert sorted(f["config"]["q"] for f in res["failed"]) == [10, 20]
    assert all(f["config"]["p"] == 3 for f in res["failed"])
    assert all(f["error"] == "ValueError: p=3 exceeds resources" for f in res["failed"])  # first line only
    assert res["key"] == "fake-key-7" and res["kernel"] == "fake_kernel"
    assert res["shape"] == {"M": 7} and res["dtype"] == "float16" and res["arch"] == _runtime.arch()
    assert calls == [("setup", {"M": 7}, torch.float16, _runtime.default_device())]


def test_tune_top_longer_than_results_and_all_failing():
    t, timer = _fake_tunable()
    res = tune.tune(t, {"M": 1}, torch.float32, top=100, timer=timer)
    assert len(res["top"]) == 6
    t_bad = dataclasses.replace(t, space={"p": [3], "q": [10, 20]})
    res = tune.tune(t_bad, {"M": 1}, torch.float32, timer=timer)
    assert res["best"] is None and res["top"] == [] and res["n_failed"] == 2 == res["n_tried"]
    with pytest.raises(ValueError, match="fake_kernel"):
        tune.write_config(res)


def test_tune_counts_timer_failures_and_calls_progress():
    t, timer = _fake_tunable(fail_p=None)
    ticks = []

    def flaky_timer(fn):
        ms = timer(fn)
        if ms > 15:
            raise RuntimeError("timeout")
        return ms

    res = tune.tune(t, {"M": 1}, torch.float32, timer=flaky_timer, progress=lambda: ticks.append(1))
    assert len(ticks) == 8
    assert res["n_failed"] == sum(cost(c) > 15 for c in tune.grid(t.space)) > 0
    assert all(r["ms"] <= 15 for r in res["top"])


def test_tune_budget_stops_starting_configs_and_keeps_the_best_tried(monkeypatch):
    t, timer = _fake_tunable(fail_p=None)
    clock = {"now": 100.0}
    monkeypatch.setattr(tune.time, "monotonic", lambda: clock["now"])

    def slow_timer(fn):  # each timed config takes 10 s of the fake clock
        clock["now"] += 10.0
        return timer(fn)

    configs = tune.grid(t.space)
    res = tune.tune(t, {"M": 1}, torch.float32, timer=slow_timer, budget_s=25.0)
    # the config in use is timed before the grid (10 s), then configs start at 10, 20 s: the third would start at 30
    assert res["n_tried"] == 2 and res["n_skipped"] == len(configs) - 2
    assert res["best"] == min(({"config": c, "ms": cost(c), "spills": None} for c in configs[:2]), key=lambda r: r["ms"])
    clock["now"] = 100.0
    full = tune.tune(t, {"M": 1}, torch.float32, timer=timer)  # no budget: every config, none skipped
    assert full["n_tried"] == len(configs) and full["n_skipped"] == 0
    clock["now"] = 100.0
    none = tune.tune(t, {"M": 1}, torch.float32, timer=slow_timer, budget_s=5.0)  # spent before the grid: one runs
    assert none["n_tried"] == 1 and none["n_skipped"] == len(configs) - 1 and none["best"]["config"] == configs[0]


def test_a_budget_cut_tune_keeps_even_the_fallback_when_it_was_as_fast(config_dir):
    """With no stored entry the launcher runs its fallback: a full grid's best is written (the fallback is one of the
    configs a full grid tries or beats, as before), but the best of a budget's corner of the grid only when it beat
    the fallback; a written cut-short entry says so in its provenance."""
    def result(n_skipped, best_ms, fallback_ms=1.0):
        return {"kernel": "fake_budget", "key": "k", "arch": "smx", "device": "dev", "shape": {"M": 1},
                "best": {"config": {"p": 1}, "ms": best_ms}, "in_use": {"config": None, "ms": fallback_ms},
                "n_tried": 3, "n_skipped": n_skipped}

    assert tune.write_config(result(5, 1.5)) is None  # cut short and slower than the fallback: kept
    assert tune.write_config(result(0, 1.5)) is not None  # a full grid: written as before
    path = tune.write_config(result(5, 0.5))  # cut short and faster: written, with its counts
    prov = json.loads(Path(path).read_text())["provenance"]["fake_budget[k]"]
    assert prov["n_tried"] == 3 and prov["n_skipped"] == 5


def test_tune_records_each_configs_spills_and_a_written_entry_keeps_them(config_dir, monkeypatch):
    """Each timed config carries the registers its launches spilled (summed over its kernels), read from the
    compiled kernels the run launched; written to the provenance of a stored entry that spills."""
    import types

    monkeypatch.setattr(launch, "_compiled", {})  # (the fake kernels stay out of the module's record)

    def fake_compiled(spills):
        return types.SimpleNamespace(n_regs=255, n_spills=spills,
                                     metadata=types.SimpleNamespace(shared=0, num_warps=4, num_stages=2))

    def setup(shape, dtype, device):
        def run(cfg):
            if cfg is not None:  # two kernels per config, named by it (an earlier config's record must not count)
                launch._compiled[f"k_main_{cfg['p']}"] = fake_compiled(cfg["p"] * 10)
                launch._compiled[f"k_tail_{cfg['p']}"] = fake_compiled(1)
            return torch.full((4,), 1.0)
        return run, "fake-key"

    t = tune.Tunable(kernel="fake_spills", space={"p": [0, 2]}, setup=setup, shape_names=("M",))
    res = tune.tune(t, {"M": 1}, torch.float32, timer=lambda fn: 1.0 if fn() is not None else 0.0)
    assert sorted((r["config"]["p"], r["spills"]) for r in res["top"]) == [(0, 1), (2, 21)]
    res["best"] = next(r for r in res["top"] if r["spills"] == 21)
    path = tune.write_config(res, arch="smx")
    prov = json.loads(Path(path).read_text())["provenance"]["fake_spills[fake-key]"]
    assert prov["spills"] == 21 and "timing" not in prov  # (a given timer: nothing said of graph timing)
    res["timing"] = "cuda_graph"  # a graph-timed tune's entry says so
    prov = json.loads(Path(tune.write_config(res, arch="smx", force=True)).read_text())["provenance"]
    assert prov["fake_spills[fake-key]"]["timing"] == "cuda_graph"


def test_tune_runs_the_grid_with_the_entrys_keys_outside_the_space_and_times_the_entry_twice(config_dir, monkeypatch):
    """A stored entry's key that the space does not vary (X) holds for every grid config the tune runs (like for
    like), and lands in the best config; the entry in use is timed before the grid and after it, keeping the faster
    (a first timing in a cold process read slow)."""
    arch = "sm_test_arch_fixed"
    _use_arch(monkeypatch, arch)
    (config_dir / f"{arch}.json").write_text(json.dumps(
        {"arch": arch, "kernels": {"fake_fixed": {"k": {"p": 2, "X": 7}}}}))
    launch.reload()
    ran = []

    def setup(shape, dtype, device):
        def run(cfg):
            cfg = cfg or launch.stored_config("fake_fixed", "k")
            ran.append(dict(cfg))
            return torch.full((2,), 1.0)
        return run, "k"

    entry_times = iter([9.0, 2.5])

    def timer(fn):
        fn()
        cfg = ran[-1]
        return next(entry_times) if cfg == {"p": 2, "X": 7} and len(ran) in (2, 9) else float(cfg["p"])

    t = tune.Tunable(kernel="fake_fixed", space={"p": [1, 2, 3]}, setup=setup, shape_names=("M",))
    res = tune.tune(t, {"M": 1}, torch.float32, timer=timer)
    assert all(c.get("X") == 7 for c in ran), ran  # every run: the entry's X
    assert res["best"]["config"] == {"p": 1, "X": 7} and res["best"]["ms"] == 1.0
    assert res["in_use"]["ms_runs"] == [9.0, 2.5] and res["in_use"]["ms"] == 2.5
    ran.clear()
    entry_times = iter([9.0, 2.5])
    t_off = dataclasses.replace(t, not_inherited=("X",))  # (the attention forward's GLUON: another kernel)
    res = tune.tune(t_off, {"M": 1}, torch.float32, timer=timer)
    no_x = [c for c in ran if "X" not in c]  # (each config runs for its outputs, then is timed)
    # the grid's 3 configs twice each, and the entry without X (its tiles, like for like): checked, timed twice
    assert sorted(c["p"] for c in no_x) == [1, 1, 2, 2, 2, 2, 2, 3, 3] and all(len(c) == 1 for c in no_x)
    assert len(ran) - len(no_x) == 1  # the entry as the launcher runs it, with X: the reference outputs only
    assert res["best"]["config"] == {"p": 1}
    assert res["in_use"]["timed_without"] == ["X"] and res["in_use"]["ms_runs"] == [2.0, 2.0]
    assert res["in_use"]["config"] == {"p": 2, "X": 7}  # (what the launcher runs, recorded whole)
    # the grid's best beat the entry's tiles: written, and the entry keeps its X
    path = tune.write_config(res, arch=arch)
    assert json.loads(Path(path).read_text())["kernels"]["fake_fixed"]["k"] == {"p": 1, "X": 7}
    # where the entry's tiles are the fastest, nothing is written (the X kernel's own time does not guard them)
    launch.reload()
    ran.clear()
    res = tune.tune(t_off, {"M": 1}, torch.float32, timer=lambda fn: (fn(), 0.5 if ran[-1] == {"p": 1} else 3.0)[1])
    assert res["in_use"]["ms"] == 0.5 and tune.write_config(res, arch=arch) is None


def test_tune_runs_each_canonical_launch_once():
    """A tunable's canonical form (the config as the launcher runs it) folds grid points that launch alike: each
    distinct launch runs once, and the best is reported in that form."""
    t, timer = _fake_tunable(fail_p=None)
    ran = []

    def canon(cfg):  # q is read only at p == 2
        return cfg if cfg["p"] == 2 else {"p": cfg["p"]}

    base = t.setup

    def setup(shape, dtype, device):
        run, key = base(shape, dtype, device)

        def run_q(cfg):
            if cfg is not None:
                ran.append(dict(cfg))
                cfg = {"q": 10, **cfg}
            return run(cfg)
        return run_q, key

    t2 = dataclasses.replace(t, setup=setup, canonical=canon)
    res = tune.tune(t2, {"M": 1}, torch.float32, timer=timer)
    tried = sorted(json.dumps(c, sort_keys=True) for c in ran)
    assert sorted(set(tried)) == sorted(json.dumps(c, sort_keys=True) for c in
                                        ({"p": 1}, {"p": 2, "q": 10}, {"p": 2, "q": 20}, {"p": 3}, {"p": 4}))
    assert res["n_tried"] == 5 and res["best"]["config"] == {"p": 2, "q": 10}


def test_a_rotating_run_checks_outputs_on_the_first_set_and_times_every_set():
    """tune.rotating: run(cfg) computes on set 0 (the outputs compared between configs), the timed calls step
    through all the sets in turn (so a timed call finds its inputs out of L2), for the grid and the entry alike."""
    ran = []

    def run_on(s, cfg):
        ran.append(s)
        return torch.full((3,), float(cfg["p"] if cfg else 2))

    def setup(shape, dtype, device):
        return tune.rotating(run_on, [0, 1, 2]), "key"

    timed_sets = []

    def timer(fn):
        ran.clear()
        for _ in range(4):
            fn()
        timed_sets.append(list(ran))
        return 1.0

    t = tune.Tunable(kernel="fake_rotating", space={"p": [2, 5]}, setup=setup, shape_names=("M",))
    res = tune.tune(t, {"M": 1}, torch.float32, timer=timer)
    assert setup(None, None, None)[0].n_sets == 3
    # the entry before the grid, p = 2 (p = 5's outputs disagree: refused untimed), the entry after the grid: each
    # timing walks the sets on from where the last one stopped
    assert timed_sets == [[0, 1, 2, 0], [1, 2, 0, 1], [2, 0, 1, 2]]
    assert res["n_mismatch"] == 1 and res["best"]["config"] == {"p": 2}
    assert res["timing"] == "given" and res["n_sets"] == 3  # (this test's timer, not a default one)


def test_a_graph_tunable_is_timed_by_graph_replays_of_twice_its_sets(monkeypatch):
    """Tunable(graph=True) on a GPU: the default timer is the bench's graph_time_ms over max(16, 2 x sets) calls
    (as the bench times a bench_graph op); other tunables, and any tunable without CUDA, keep per-call events."""
    from triforge import bench

    seen = []
    monkeypatch.setattr(bench, "graph_time_ms", lambda fn, calls: seen.append(("graph", calls)) or {"median_ms": 1.5})
    monkeypatch.setattr(bench, "time_ms", lambda fn, warmup, rep: seen.append(("events", rep)) or {"median_ms": 2.5})
    g = tune.Tunable(kernel="g", space={}, setup=None, shape_names=(), graph=True)
    plain = tune.Tunable(kernel="p", space={}, setup=None, shape_names=())
    monkeypatch.setattr(_runtime, "default_device", lambda: torch.device("cuda"))
    assert tune.default_timer(g, 20)(lambda: None) == 1.5 and tune.default_timer(g, 3)(lambda: None) == 1.5
    assert tune.default_timer(plain, 20)(lambda: None) == 2.5
    monkeypatch.setattr(_runtime, "default_device", lambda: torch.device("cpu"))  # (the interpreter, even on a GPU host)
    assert tune.default_timer(g, 20)(lambda: None) == 2.5
    assert seen == [("graph", 40), ("graph", 18), ("events", 60), ("events", 60)]


def test_graph_calls_are_whole_rotations_of_the_input_sets():
    """Each replay of a captured graph runs whole rotations (so no set runs twice in a row across two replays), at
    least 16 calls and each set twice."""
    from triforge import bench

    for n in range(1, 70):
        calls = bench.graph_calls(n)
        assert calls % n == 0 and calls >= max(16, 2 * n) and calls - n < max(16, 2 * n)
    assert [bench.graph_calls(n) for n in (1, 3, 5, 7, 13, 64)] == [16, 18, 20, 21, 26, 128]


def test_graph_us_over_times_whole_rotations_of_call_over_the_sets(monkeypatch):
    """The probes' timer: ``call(set)`` on the sets in turn (rotating_fn, as the bench's forward rows), captured as
    whole rotations (graph_calls) and reported in microseconds per call."""
    from triforge import bench

    seen = []
    run = bench.rotating_fn(seen.append, ["a", "b", "c"])
    for _ in range(7):
        run()
    assert seen == ["a", "b", "c", "a", "b", "c", "a"]
    captured = {}

    def fake_graph_time_ms(fn, *, calls, replays):
        captured.update(calls=calls, replays=replays)
        seen.clear()
        for _ in range(calls):
            fn()
        return {"median_ms": 0.0125}

    monkeypatch.setattr(bench, "graph_time_ms", fake_graph_time_ms)
    assert bench.graph_us_over(seen.append, [1, 2, 3]) == 12.5
    assert captured == {"calls": 18, "replays": 30} and seen == [1, 2, 3] * 6


def test_rotation_sets_exceed_the_l2_four_times_on_a_gpu_and_are_one_without(monkeypatch):
    from triforge import bench

    monkeypatch.setattr(bench, "l2_bytes", lambda: 50 * 2**20)
    assert tune.rotation_sets(16 * 2**20, "cpu") == 1  # (the interpreter: no L2 to defeat)
    assert tune.rotation_sets(16 * 2**20, "cuda") == 13  # ceil(200 / 16)
    assert tune.rotation_sets(300 * 2**20, torch.device("cuda", 0)) == 1
    assert tune.rotation_sets(1, "cuda") == bench.MAX_SETS


def test_tune_refuses_configs_whose_outputs_disagree_with_the_launchers():
    """A miscompiled config (its outputs off by 1 % of their RMS, or NaN in one element, or another
    shape) is refused like a failing one, even where it is the fastest; configs that differ only by
    fp32 summation order (1e-6) are timed. Fresh random outputs for every run."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    base = torch.randn(64, 33, generator=gen, dtype=torch.float64)

    def setup(shape, dtype, device):
        def run(cfg):
            p = (cfg or {"p": 2})["p"]
            y = base * (1 + 1e-6 * torch.randn(base.shape, generator=gen, dtype=torch.float64))
            y = y.to(dtype)
            if p == 1:
                y = y + 0.01 * base.norm() / base.numel() ** 0.5 * torch.randn(base.shape, generator=gen).to(dtype)
            if p == 3:
                y[int(torch.randint(0, 64, (), generator=gen)), 5] = float("nan")
            if p == 4:
                return y[:, :32], torch.arange(3)
            return y, torch.arange(3)

        return run, "k"

    t = tune.Tunable(kernel="fake_kernel", space={"p": [1, 2, 3, 4, 5]}, setup=setup, shape_names=("M",))
    res = tune.tune(t, {"M": 1}, torch.float32, timer=lambda fn: (fn(), 1.0)[1])
    assert res["checked"] and res["n_mismatch"] == 3 == res["n_failed"]
    assert sorted(r["config"]["p"] for r in res["top"]) == [2, 5]
    errors = {f["config"]["p"]: f["error"] for f in res["failed"]}
    assert "rel. RMS" in errors[1] and "NaN/Inf" in errors[3] and "(64, 32)" in errors[4]
    # the same 1 % at bf16 is inside bf16's rounding tolerance; the NaN is not
    res = tune.tune(t, {"M": 1}, torch.bfloat16, timer=lambda fn: 1.0)
    assert sorted(f["config"]["p"] for f in res["failed"]) == [3, 4]


def test_output_mismatch_rules():
    w = torch.randn(10, 7) + 2
    assert tune.output_mismatch([w], [w.clone()]) is None
    assert tune.output_mismatch([w], [w, w]).startswith("mismatch: 2 outputs")
    assert "dtype" not in (tune.output_mismatch([w], [w.double()]) or "") and tune.output_mismatch([w], [w.double()])
    inf_w = w.clone()
    inf_w[0, 0] = float("inf")
    assert tune.output_mismatch([inf_w], [inf_w.clone()]) is None  # infinite where the launcher's is too
    assert "NaN/Inf" in tune.output_mismatch([w], [inf_w])
    assert tune.output_mismatch([torch.zeros(3)], [torch.zeros(3)]) is None
    assert tune.output_mismatch([torch.zeros(3)], [torch.full((3,), 0.5)]) is not None
    assert tune.output_mismatch([torch.arange(4)], [torch.arange(4) * 2]) is not None
    assert tune.output_mismatch([torch.empty(0, 3)], [torch.empty(0, 3)]) is None
    assert tune._tensors({"a": w, "b": (None, [w, 1])}) == [w, w]


def _use_arch(monkeypatch, arch: str) -> None:
    """Configs looked up (and tune results labelled) as on ``arch``, with the device tag _runtime.device_tag gives
    (a test may patch it too)."""
    monkeypatch.setattr(_runtime, "arch", lambda: arch)
    monkeypatch.setattr(_runtime, "config_scope", lambda: (_runtime.arch(), _runtime.device_tag()))


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    d = tmp_path / "configs"
    d.mkdir()
    monkeypatch.setattr(launch, "CONFIG_DIR", d)
    launch.reload()
    yield d
    launch.reload()


def test_write_config_keeps_keys_outside_the_space(config_dir, monkeypatch):
    """A re-tune replaces an entry's tiles but keeps its keys outside the tuning space (the attention forward's GLUON
    and EMU) and their provenance notes."""
    arch = "sm_test_arch_g"
    _use_arch(monkeypatch, arch)
    (config_dir / f"{arch}.json").write_text(json.dumps({
        "arch": arch,
        "kernels": {"fake_kernel": {"fake-key-5": {"p": 9, "q": 9, "GLUON": {"BLOCK_N": 128}, "EMU": 1}}},
        "provenance": {"fake_kernel[fake-key-5]": {"ms": 1e9, "gluon": "why", "emu": "because"}}}))
    launch.reload()
    t, timer = _fake_tunable()
    res = tune.tune(t, {"M": 5}, torch.float32, timer=timer)
    assert tune.write_config(res, force=True)
    data = json.loads((config_dir / f"{arch}.json").read_text())
    assert data["kernels"]["fake_kernel"]["fake-key-5"] == {"p": 2, "q": 10, "GLUON": {"BLOCK_N": 128}, "EMU": 1}
    prov = data["provenance"]["fake_kernel[fake-key-5]"]
    assert prov["gluon"] == "why" and prov["emu"] == "because"



def test_device_configs_are_read_over_the_arch(config_dir, monkeypatch):
    """A device model's file (<arch>.<tag>.json, written by write_config(for_device=True)) is read over the arch's,
    field by field, on that model only; the arch's file is left as it was."""
    assert [_runtime.device_tag_of(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-16GB", "??")] \
        == ["h200", "h100-80gb-hbm3", "tesla-v100-sxm2-16gb", "unknown"]
    assert _runtime.config_scope() == (_runtime.arch(), _runtime.device_tag())  # one query, the same pair
    arch, tag = "sm_test_arch_d", {"now": "h200"}
    _use_arch(monkeypatch, arch)
    monkeypatch.setattr(_runtime, "device_tag", lambda: tag["now"])
    arch_text = json.dumps({"arch": arch, "kernels": {"fake_kernel": {
        "fake-key-5": {"p": 9, "q": 9, "GLUON": {"BLOCK_N": 128}}, "fake-key-7": {"p": 4, "q": 20}}}})
    (config_dir / f"{arch}.json").write_text(arch_text)
    launch.reload()
    t, timer = _fake_tunable()
    res = tune.tune(t, {"M": 5}, torch.float32, timer=timer)
    assert res["device_tag"] == "h200"
    path = tune.write_config(res, force=True, for_device=True)
    assert path == str(config_dir / f"{arch}.h200.json")
    assert (config_dir / f"{arch}.json").read_text() == arch_text
    data = json.loads(Path(path).read_text())
    # (the grid ran with the arch entry's GLUON, a key outside the space: it stays the arch file's)
    assert res["best"]["config"] == {"p": 2, "q": 10, "GLUON": {"BLOCK_N": 128}}
    assert data["kernels"] == {"fake_kernel": {"fake-key-5": {"p": 2, "q": 10}}} and data["device"] == res["device"]
    # on the H200: its tiles over the arch's entry, the arch's other fields kept; keys it lacks from the arch
    assert launch.stored_config("fake_kernel", "fake-key-5") == {"p": 2, "q": 10, "GLUON": {"BLOCK_N": 128}}
    assert launch.stored_config("fake_kernel", "fake-key-7") == {"p": 4, "q": 20}
    assert launch.config("fake_kernel", "fake-key-5", {"p": 0, "extra": 1}) == {"p": 2, "q": 10, "GLUON": {"BLOCK_N": 128},
                                                                             "extra": 1}
    assert launch.config_sources(arch, "h200") == [
        ("fake_kernel", "fake-key-5", {"p": 2, "q": 10, "GLUON": {"BLOCK_N": 128}}, f"{arch}.json + {arch}.h200.json",
         "? + " + res["device"]),  # (the arch file records no provenance)
        ("fake_kernel", "fake-key-7", {"p": 4, "q": 20}, f"{arch}.json", "?")]
    assert [r[3] for r in launch.config_sources(arch)] == [f"{arch}.json"] * 2
    tag["now"] = "h100-80gb-hbm3"  # another model of the arch reads the arch's file alone
    assert launch.stored_config("fake_kernel", "fake-key-5") == {"p": 9, "q": 9, "GLUON": {"BLOCK_N": 128}}
    with pytest.raises(ValueError, match="device_tag"):
        tune.write_config({k: v for k, v in res.items() if k != "device_tag"}, force=True, for_device=True)


def test_an_arch_write_on_a_device_with_its_own_file_keeps_the_device_keys_there(config_dir, monkeypatch):
    """The grid runs with the merged entry (device file over the arch's), but a key only the device file holds (DEV)
    is not written into the arch file, which other models of the arch read alone."""
    arch = "sm_test_arch_x"
    _use_arch(monkeypatch, arch)
    monkeypatch.setattr(_runtime, "device_tag", lambda: "h200")
    (config_dir / f"{arch}.json").write_text(json.dumps({"arch": arch, "kernels": {"fake_kernel": {
        "fake-key-5": {"p": 9, "q": 9}}}}))
    (config_dir / f"{arch}.h200.json").write_text(json.dumps({"arch": arch, "kernels": {"fake_kernel": {
        "fake-key-5": {"p": 1, "DEV": 5}}}}))
    launch.reload()
    t, timer = _fake_tunable()
    res = tune.tune(t, {"M": 5}, torch.float32, timer=timer)
    assert res["best"]["config"] == {"p": 2, "q": 10, "DEV": 5} and res["space_keys"] == ["p", "q"]
    tune.write_config(res, force=True)
    assert json.loads((config_dir / f"{arch}.json").read_text())["kernels"]["fake_kernel"]["fake-key-5"] == \
        {"p": 2, "q": 10}


def test_write_config_then_launch_config_returns_it(config_dir, monkeypatch):
    arch = "sm_test_arch_0"
    _use_arch(monkeypatch, arch)
    t, timer = _fake_tunable()
    res = tune.tune(t, {"M": 5}, torch.float32, timer=timer)
    assert res["arch"] == arch
    fallback = {"p": 99, "q": 99, "extra": "kept"}
    assert launch.config("fake_kernel", "fake-key-5", fallback) == fallback  # nothing written yet

    path = tune.write_config(res)
    assert path == str(config_dir / f"{arch}.json")
    data = json.loads((config_dir / f"{arch}.json").read_text())
    assert data["kernels"] == {"fake_kernel": {"fake-key-5": {"p": 2, "q": 10}}}
    assert data["provenance"]["fake_kernel[fake-key-5]"]["ms"] == res["best"]["ms"]

    # tuned values override the fallback, keys the file lacks come from the fallback
    assert launch.config("fake_kernel", "fake-key-5", fallback) == {"p": 2, "q": 10, "extra": "kept"}
    assert launch.config("fake_kernel", "other-key", fallback) == fallback
    assert launch.config("other_kernel", "fake-key-5", fallback) == fallback

    # a second write keeps the first entry
    res2 = tune.tune(t, {"M": 6}, torch.float32, timer=lambda fn: -timer(fn))  # now the worst is best
    tune.write_config(res2)
    assert launch.config("fake_kernel", "fake-key-5", {}) == {"p": 2, "q": 10}
    assert launch.config("fake_kernel", "fake-key-6", {}) == res2["best"]["config"]


def test_tune_times_the_config_in_use_and_write_keeps_a_faster_entry(config_dir, monkeypatch):
    """tune() times the launcher's own config beside the grid (the stored entry, else the fallback); write_config
    keeps a stored entry that measured at least as fast as the grid's best (an entry from a wider sweep that the
    grid lacks), replaces a slower one, and writes over it anyway with force."""
    _use_arch(monkeypatch, "sm_test_arch_1")
    last = {}

    def setup(shape, dtype, device):
        key = f"k{shape['M']}"

        def run(cfg):  # None: what the launcher would run (stored entry over the fallback)
            last["cfg"] = dict(cfg or launch.config("fake_kernel", key, {"p": 4, "q": 20}))

        return run, key

    def timer(fn):
        fn()
        return cost(last["cfg"])

    t = tune.Tunable(kernel="fake_kernel", space={"p": [1, 2, 3, 4], "q": [10, 20]}, setup=setup, shape_names=("M",))
    res = tune.tune(t, {"M": 1}, torch.float32, timer=timer)
    fb = cost({"p": 4, "q": 20})
    assert res["in_use"] == {"config": None, "ms": fb, "ms_runs": [fb, fb]}  # nothing stored: the fallback
    assert not tune.keeps_entry_in_use(res)
    assert tune.write_config(res) is not None and launch.stored_config("fake_kernel", "k1") == {"p": 2, "q": 10}

    faster = {"p": 2.4, "q": 0}  # off the grid, cost 0
    data = json.loads((config_dir / "sm_test_arch_1.json").read_text())
    data["kernels"]["fake_kernel"]["k1"] = faster
    (config_dir / "sm_test_arch_1.json").write_text(json.dumps(data))
    launch.reload()
    res = tune.tune(t, {"M": 1}, torch.float32, timer=timer)
    assert res["in_use"] == {"config": faster, "ms": 0.0, "ms_runs": [0.0, 0.0]}
    assert res["best"]["config"] == {"p": 2, "q": 10}
    assert tune.keeps_entry_in_use(res) and tune.write_config(res) is None
    assert launch.stored_config("fake_kernel", "k1") == faster
    assert tune.write_config(res, force=True) is not None
    assert launch.stored_config("fake_kernel", "k1") == {"p": 2, "q": 10}

    data["kernels"]["fake_kernel"]["k1"] = {"p": 1, "q": 20}  # on the grid and slower than its best
    (config_dir / "sm_test_arch_1.json").write_text(json.dumps(data))
    launch.reload()
    res = tune.tune(t, {"M": 1}, torch.float32, timer=timer)
    assert res["in_use"]["ms"] == cost({"p": 1, "q": 20}) > res["best"]["ms"]
    assert tune.write_config(res) is not None and launch.stored_config("fake_kernel", "k1") == {"p": 2, "q": 10}


def test_write_config_explicit_arch_is_not_this_arch(config_dir):
    t, timer = _fake_tunable()
    res = tune.tune(t, {"M": 5}, torch.float32, timer=timer)
    tune.write_config(res, arch="some_other_arch")
    assert (config_dir / "some_other_arch.json").exists()
    assert launch.config("fake_kernel", "fake-key-5", {"p": 0}) == {"p": 0}


def test_launch_config_falls_back_to_heuristic(config_dir):
    fallback = {"num_warps": 4, "ROWS": 8}
    got = launch.config("rms_norm_fwd", launch.config_key(block_n=512, dtype="fp32"), fallback)
    assert got == fallback
    got["num_warps"] = 1  # a copy: the caller's heuristic is not mutated
    assert fallback == {"num_warps": 4, "ROWS": 8}
    # a file for this arch that lacks the key also falls back
    (config_dir / f"{_runtime.arch()}.json").write_text(json.dumps({"kernels": {"rms_norm_fwd": {"block_n=1024,dtype=fp32": {"ROWS": 1}}}}))
    launch.reload()
    assert launch.config("rms_norm_fwd", "block_n=512,dtype=fp32", fallback) == fallback
    assert launch.config("rms_norm_fwd", "block_n=1024,dtype=fp32", fallback) == {"num_warps": 4, "ROWS": 1}


def test_config_key_is_sorted_and_stable():
    assert launch.config_key(dtype="bf16", block_n=4096) == "block_n=4096,dtype=bf16"
    assert launch.config_key(block_n=4096, dtype="bf16") == launch.config_key(dtype="bf16", block_n=4096)


def test_real_tunable_config_reaches_the_launcher(config_dir, monkeypatch):
    """Tune the registered rms_norm_fwd grid with a fake timer, write it, and see the launcher use it."""
    from triforge.ops.norm import rms_norm

    t = tune.get("rms_norm_fwd")
    t = dataclasses.replace(t, space={"num_warps": [1, 4], "ROWS": [1, 2, 4]})
    res = tune.tune(t, {"M": 5, "N": 40}, torch.float32, timer=lambda fn: (fn(), 1.0)[1])
    assert res["n_failed"] == 0 and res["n_tried"] == 6
    assert res["key"] == launch.config_key(block_n=64, dtype="fp32", residual=0)
    res["best"] = {"config": {"num_warps": 1, "ROWS": 2}, "ms": 1.0}
    tune.write_config(res)

    seen = []
    real_launch = launch.launch

    def spy(name, fn, grid, *args, **kwargs):
        seen.append((name, grid, kwargs))
        return real_launch(name, fn, grid, *args, **kwargs)

    monkeypatch.setattr(launch, "launch", spy)
    x, w = (torch.randn(5, 40) + 0.1).to(DEV), (torch.rand(40) + 0.5).to(DEV)
    with poisoned():
        y = rms_norm(x, w)
    assert seen[0][0] == "rms_norm_fwd"
    assert seen[0][2]["ROWS"] == 2 and seen[0][2]["num_warps"] == 1
    assert seen[0][1] == (3,)  # cdiv(M=5, ROWS=2) programs
    ref = x.double() * torch.rsqrt(x.double().square().mean(-1, keepdim=True) + 1e-6) * w.double()
    assert compare("y", ref, y, verbose=False).ok


def test_sm_clock_reads_torch_or_gives_none(monkeypatch):
    """bench.sm_clock_mhz (each bench row's sm_mhz): torch's reading as whole MHz, None where it cannot read one
    (no pynvml, no GPU) instead of failing the row."""
    from triforge import bench

    monkeypatch.setattr(torch.cuda, "clock_rate", lambda: 1980.6)
    assert bench.sm_clock_mhz() == 1980

    def unreadable():
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "clock_rate", unreadable)
    assert bench.sm_clock_mhz() is None


def test_time_limit_ends_a_hung_process_and_lets_a_quick_one_finish():
    """triforge.testing.time_limit (the test suite's TRIFORGE_TEST_TIMEOUT): a block that overruns ends its process
    with a stack dump within about the limit; one that finishes in time leaves the process running; 0: no limit."""
    import subprocess
    import sys
    import time

    prog = ("import sys, time\nfrom triforge.testing import time_limit\n"
            "with time_limit(float(sys.argv[1])):\n    time.sleep(float(sys.argv[2]))\nprint('after')\n")
    t0 = time.monotonic()
    hung = subprocess.run([sys.executable, "-c", prog, "1", "30"], capture_output=True, text=True, timeout=60)
    assert hung.returncode != 0 and "after" not in hung.stdout and "Timeout" in hung.stderr, hung
    assert time.monotonic() - t0 < 25
    for limit in ("5", "0"):
        quick = subprocess.run([sys.executable, "-c", prog, limit, "0.1"], capture_output=True, text=True, timeout=60)
        assert quick.returncode == 0 and quick.stdout.strip() == "after", quick


def test_a_tunable_stored_as_another_kernels_field_reads_and_writes_it_there(config_dir, monkeypatch):
    """Tunable.entry_of (kernel, field): the config in use is that field of the kernel's entry (the attention
    forward's GLUON), the best is written there whole, the entry's other keys and the field's provenance note beside
    the kernel's own stay; a device write holds the field alone and reads merged over the arch's entry; an entry in
    use that measured at least as fast is kept."""
    arch = "sm_test_arch_field"
    _use_arch(monkeypatch, arch)
    monkeypatch.setattr(_runtime, "device_tag", lambda: "h200")
    (config_dir / f"{arch}.json").write_text(json.dumps({
        "arch": arch, "kernels": {"fake_parent": {"k": {"tile": 64, "SUB": {"p": 3}}}},
        "provenance": {"fake_parent[k]": {"ms": 1.0}}}))
    launch.reload()
    ran = []

    def setup(shape, dtype, device):
        def run(cfg):
            ran.append(cfg if cfg is None else dict(cfg))
            return torch.full((2,), 1.0)
        return run, "k"

    def timer(fn):
        fn()
        cfg = ran[-1] or launch.stored_config("fake_parent", "k")["SUB"]
        return float(cfg["p"])

    t = tune.Tunable(kernel="fake_sub", space={"p": [1, 2, 4]}, setup=setup, shape_names=("M",),
                     entry_of=("fake_parent", "SUB"))
    assert tune.stored_entry(t, "k") == {"p": 3} and tune.stored_entry(t, "other") is None
    res = tune.tune(t, {"M": 1}, torch.float32, timer=timer)
    assert res["in_use"]["config"] == {"p": 3} and res["best"]["config"] == {"p": 1}
    assert res["entry_of"] == ["fake_parent", "SUB"]
    path = tune.write_config(res)
    data = json.loads((config_dir / f"{arch}.json").read_text())
    assert path == str(config_dir / f"{arch}.json")
    assert data["kernels"]["fake_parent"]["k"] == {"tile": 64, "SUB": {"p": 1}} and "fake_sub" not in data["kernels"]
    note = data["provenance"]["fake_parent[k]"]
    assert note["ms"] == 1.0 and note["sub"]["tuned_as"] == "fake_sub" and note["sub"]["ms"] == 1.0
    assert launch.stored_config("fake_parent", "k") == {"tile": 64, "SUB": {"p": 1}}

    res = tune.tune(dataclasses.replace(t, space={"p": [2, 4]}), {"M": 1}, torch.float32, timer=timer)
    assert res["in_use"]["ms"] == 1.0 and tune.write_config(res) is None  # the entry in use (p 1) is faster
    tune.write_config(res, force=True, for_device=True)
    dev = json.loads((config_dir / f"{arch}.h200.json").read_text())
    assert dev["kernels"] == {"fake_parent": {"k": {"SUB": {"p": 2}}}} and dev["device"] == res["device"]
    assert dev["provenance"]["fake_parent[k]"]["device"] == res["device"]
    assert launch.stored_config("fake_parent", "k") == {"tile": 64, "SUB": {"p": 2}}

    # no field stored at another key: the launcher runs another kernel there (config in use None); a grid that does
    # not beat it is not written, since writing the field would switch the launcher over to a slower kernel
    ran.clear()
    monkeypatch.setattr(launch, "stored_config", lambda kernel, key: {"tile": 64} if key == "k2" else None)

    def setup2(shape, dtype, device):
        def run(cfg):
            ran.append(cfg)
            return torch.full((2,), 1.0)
        return run, "k2"

    res = tune.tune(dataclasses.replace(t, setup=setup2), {"M": 1}, torch.float32,
                    timer=lambda fn: (fn(), 0.5 if ran[-1] is None else float(ran[-1]["p"]))[1])
    assert res["in_use"]["config"] is None and res["in_use"]["ms"] == 0.5 and res["best"]["ms"] == 1.0
    assert tune.keeps_entry_in_use(res) and tune.write_config(res) is None


def test_the_gluon_attention_tunable_grid():
    """flash_attn_fwd_gluon's grid: every config one the Gluon launcher accepts, XITEM only with PERSIST (48 distinct
    launches), stored as flash_attn_fwd's GLUON; where Gluon cannot run (here) each config fails with a clear error."""
    from triforge.ops.attention.forward_ws import _check_cfg

    t = tune.get("flash_attn_fwd_gluon")
    assert t.entry_of == ("flash_attn_fwd", "GLUON")
    g = tune.distinct_grid(t)
    assert len(g) == 48
    for c in g:
        _check_cfg(c)
        assert ("XITEM" in c) == bool(c["PERSIST"])
    if _runtime.INTERPRET:
        run, key = t.setup({"B": 1, "H": 2, "S": 40, "D": 64, "causal": 1}, torch.bfloat16, torch.device("cpu"))
        assert key == "causal=1,d=64,dtype=bf16"
        o, lse = run(None)  # the launcher's own choice: the Triton kernel here
        assert o.shape == (1, 40, 2, 64) and torch.isfinite(o).all()
        with pytest.raises(RuntimeError, match="sm90"):
            run(g[0])


def test_the_suites_time_limit_names_a_hung_test_under_pytests_capture(tmp_path):
    """tests/conftest.py under TRIFORGE_TEST_TIMEOUT: a hung test's process ends with its stack (file, line and test
    function) on the real stderr, though pytest captures the test's output (a dump to the captured stderr was lost)."""
    import subprocess
    import sys

    (tmp_path / "test_hang.py").write_text("import time\n\ndef test_quick():\n    pass\n\n"
                                           "def test_hangs_here():\n    time.sleep(60)\n")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRIFORGE_TEST_TIMEOUT="3", PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                          str(tmp_path / "test_hang.py")], capture_output=True, text=True, cwd=root, env=env,
                         timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "Timeout" in text and "in test_hangs_here" in text, text[-2000:]
