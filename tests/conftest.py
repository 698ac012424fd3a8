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
