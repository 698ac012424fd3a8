import os

import pytest
import torch

import triforge  # noqa: F401  (sets TRITON_INTERPRET on machines without CUDA)
from triforge import _runtime

try:
    from hypothesis import settings

    settings.register_profile("triforge", max_examples=15 if _runtime.INTERPRET else 60, deadline=None, derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "triforge"))
except ImportError:
    pass


def pytest_collection_modifyitems(config, items):
    if _runtime.HAS_CUDA and not _runtime.INTERPRET:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return _runtime.default_device()


@pytest.fixture
def gen():
    """A fresh generator per test, seeded from the OS: inputs differ on every run."""
    g = torch.Generator()
    g.seed()
    return g


def pytest_runtest_logreport(report):
    """With TRIFORGE_FAILLOG set, append each failure as it happens (a run cut off by its time limit
    on the lent GPU still leaves every failure's report behind)."""
    path = os.environ.get("TRIFORGE_FAILLOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # under xdist the controller writes each report once
    text = report.longreprtext
    out = "".join(content for name, content in report.sections if "stdout" in name)
    if out:
        text += "\n--- captured stdout (end) ---\n" + out[-3000:]
    if len(text) > 6000:
        text = text[:1500] + "\n...\n" + text[-4500:]
    with open(path, "a") as f:
        f.write(f"===== {report.when} FAILED {report.nodeid} ({report.duration:.1f}s)\n{text}\n")


_STDERR_FD = None  # a copy of the real stderr, taken while pytest's capture is suspended (pytest_configure)


def pytest_configure(config):
    global _STDERR_FD
    if float(os.environ.get("TRIFORGE_TEST_TIMEOUT", "0") or 0) > 0:
        _STDERR_FD = os.dup(2)


@pytest.fixture(autouse=True)
def _test_time_limit():
    """With TRIFORGE_TEST_TIMEOUT=SECONDS each test runs under triforge.testing.time_limit: a test that hangs (a GPU
    wait that never returns, which pytest cannot interrupt) ends its process with every thread's stack (the test's
    file, line and function among them) written to the real stderr (pytest's capture would lose them with the
    process); under xdist the controller also reports the test as crashed by name and starts a fresh worker, so one
    hang costs SECONDS rather than the whole run (session 53: a one-slot ring config hung the Gluon attention
    forward, unnamed, through two device calls' limits)."""
    from triforge.testing import time_limit

    with time_limit(float(os.environ.get("TRIFORGE_TEST_TIMEOUT", "0") or 0), file=_STDERR_FD):
        yield
