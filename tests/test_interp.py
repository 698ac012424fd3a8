"""triforge._interp: the interpreter patches the language once per launch, and still restores it after."""

import pytest
import torch
import triton
import triton.language as tl

import triforge  # noqa: F401  (sets TRITON_INTERPRET before the kernels below are defined)
from triforge import _interp, _runtime

pytestmark = pytest.mark.skipif(not _runtime.INTERPRET, reason="Triton's CPU interpreter only")


@triton.jit
def _twice(x):
    return x * 2.0


@triton.jit
def _plus_one(x):
    return _twice(x) * 0.5 + 1.0  # (a device function calling another)


@triton.jit
def _device_calls_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    for _ in range(3):  # the same device functions called again and again within one launch
        x = _plus_one(_twice(x))
    tl.store(y_ptr + offs, x, mask=mask)


def _language_state():
    """Every attribute the interpreter patches: triton.language's and its core's names, the tensor class's."""
    mods = (tl, tl.core, tl.math, tl.core.tensor)
    return [{name: getattr(m, name) for name in dir(m)} for m in mods]


def test_installed_under_the_interpreter():
    from triton.runtime import interpreter

    assert _interp.install() and interpreter._triforge_patch_once
    assert interpreter._patch_lang is not interpreter._triforge_original_patch_lang


def test_device_function_calls_compute_and_the_language_is_restored_after_each_launch(gen):
    before = _language_state()
    for n in (1, 63, 300):  # several launches, grids of 1 to 5 programs
        x = torch.randn(n, generator=gen)
        y = torch.full_like(x, float("nan"))
        _device_calls_kernel[(triton.cdiv(n, 64),)](x, y, n, BLOCK=64)
        torch.testing.assert_close(y.double(), _reference(x.double()), rtol=1e-6, atol=1e-6)
        _assert_restored(before)


def _reference(x):
    for _ in range(3):
        x = (2 * x) * 2 * 0.5 + 1.0  # _plus_one(_twice(x))
    return x


def _assert_restored(before):
    """Every attribute a launch wrapped (builtins, the tensor class's __index__ / __bool__ / T ...) is the original."""
    for b, a in zip(before, _language_state()):
        assert set(a) == set(b)
        changed = sorted(k for k in b if a[k] != b[k])  # (== : getattr makes a fresh __dict__ proxy)
        assert not changed, changed


def test_a_failing_launch_still_restores_the_language(gen):
    """A launch that raises (a store to no tensor): the language is restored, the next launch patches afresh."""
    before = _language_state()
    with pytest.raises(Exception):
        _device_calls_kernel[(1,)](torch.randn(8, generator=gen), None, 8, BLOCK=64)
    _assert_restored(before)
    x = torch.randn(40, generator=gen)
    y = torch.full_like(x, float("nan"))
    _device_calls_kernel[(1,)](x, y, 40, BLOCK=64)
    torch.testing.assert_close(y.double(), _reference(x.double()), rtol=1e-6, atol=1e-6)
