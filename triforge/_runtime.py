"""Where kernels run: compiled on a CUDA GPU, or through Triton's CPU interpreter.

Imported first by ``triforge/__init__.py`` so that TRITON_INTERPRET is set before any
``@triton.jit`` function in the package is defined.
"""

import functools
import os
import re

import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") is None:
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

if INTERPRET:
    from triforge import _interp

    _interp.install()  # device-function calls patch the language once per launch (see _interp)


def default_device() -> torch.device:
    """The device triforge kernels run on in this process."""
    return torch.device("cuda") if HAS_CUDA and not INTERPRET else torch.device("cpu")


def device_name() -> str:
    """A stable name for the device, used to key measured ceilings and results."""
    if HAS_CUDA and not INTERPRET:
        return torch.cuda.get_device_name()
    return "cpu-interpreter"


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple[str, int, str]:
    props = torch.cuda.get_device_properties(index)
    return f"sm{props.major}{props.minor}", props.multi_processor_count, device_tag_of(props.name)


def device_tag_of(name: str) -> str:
    """A device name as a file-name tag: lower case, the vendor dropped, runs of other characters as one '-'
    ('NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3')."""
    low = name.lower()
    low = low[len("nvidia"):] if low.startswith("nvidia") else low
    return re.sub(r"[^a-z0-9]+", "-", low).strip("-") or "unknown"


def arch() -> str:
    """Config key for the tuned launch-config file: 'sm90' on Hopper, 'interpreter' on the CPU.
    (Of the current device; cached per device: launchers ask on every call.)"""
    if HAS_CUDA and not INTERPRET:
        return _device_facts(torch.cuda.current_device())[0]
    return "interpreter"


def device_tag() -> str:
    """The current device's model as a tag (:func:`device_tag_of`; 'cpu-interpreter' under the interpreter): the
    per-device configs file ``<arch>.<tag>.json`` is read before the arch's. Cached per device."""
    if HAS_CUDA and not INTERPRET:
        return _device_facts(torch.cuda.current_device())[2]
    return "cpu-interpreter"


def config_scope() -> tuple[str, str]:
    """(:func:`arch`, :func:`device_tag`) with one device query: the key launchers look their tuned configs up by,
    on every call."""
    if HAS_CUDA and not INTERPRET:
        facts = _device_facts(torch.cuda.current_device())
        return facts[0], facts[2]
    return "interpreter", "cpu-interpreter"


def num_sms() -> int:
    """Streaming multiprocessors of the current device (4 under the interpreter); cached per device."""
    if HAS_CUDA and not INTERPRET:
        return _device_facts(torch.cuda.current_device())[1]
    return 4


class GPURequiredError(RuntimeError):
    """A command that only makes sense on a GPU ran without one."""


def require_gpu(what: str) -> None:
    """Raise a clear error for commands that only make sense on a GPU."""
    if not (HAS_CUDA and not INTERPRET):
        raise GPURequiredError(
            f"{what} needs a CUDA GPU; this process has none (kernels run through "
            "Triton's CPU interpreter here, whose timings mean nothing)"
        )
