"""Every registered tunable at a tiny shape: its run returns the kernel's outputs (so ``tune`` can
check each config against the launcher's own, see ``tune.output_mismatch``), and the first and last
points of its grid agree with the launcher's config. Fresh random inputs (the setups draw them).

Compiled, a grid point can exceed the device's resources (shared memory: wide tiles times pipeline
stages; mhc_project_bwd at BLOCK_T = BLOCK_K = 128, 8 warps, 3 stages needs 262144 bytes in fp32, sm90
has 232448); ``tune.tune`` skips and counts such configs, so here the first and the last point that fit
the device are checked instead. Only OutOfResources is passed over: any other error fails the test, and
a config that runs must agree."""

import pytest
import torch
from triton.runtime.errors import OutOfResources

from triforge import _runtime, tune
from triforge.ops.deltanet.chunk import padded_dims

# compiled Gated DeltaNet kernels take head dims >= chunk.PAD_MIN (chunk_fwd / chunk_bwd pad smaller
# ones, the tunables' setups refuse them): 32 through the interpreter, 64 when compiled
_DN_K, _DN_V = padded_dims(32, 32)

# tiny shapes per family (prefix of the kernel name, longest first): odd sizes where the kernels allow
_TINY = {
    "flash_attn_fwd_gluon": {"B": 1, "H": 2, "S": 200, "D": 64, "causal": 0},
    "flash_attn": {"B": 1, "H": 2, "S": 24, "D": 32, "causal": 0},
    "flash_decode_split": {"B": 1, "S": 63, "H": 4, "Hkv": 2, "D": 32},
    "gated_delta_rule": {"B": 1, "T": 40, "H": 1, "HV": 2, "K": _DN_K, "V": _DN_V},
    "gemv_qkv_rope": {"M": 1, "N": 128, "K": 64, "D": 32, "Hkv": 1},
    "gemv_gate_up": {"M": 1, "N": 128, "K": 64},
    "gemv": {"M": 1, "N": 64, "K": 96},
    "mhc": {"T": 17, "C": 64},
    "softmax_fwd_looped": {"M": 2, "N": 300},
    "softmax_bwd_looped": {"M": 2, "N": 300},
    "softmax": {"M": 5, "N": 40},
    "rms_norm": {"M": 5, "N": 40},
    "swiglu": {"M": 5, "N": 40},
    "rope": {"B": 1, "T": 5, "HQ": 2, "HK": 1, "D": 32},
    "ternary_gemv": {"M": 1, "N": 24, "K": 200},
    "ternary_tc": {"M": 3, "N": 70, "K": 300},
}


def _tiny(kernel):
    for prefix in sorted(_TINY, key=len, reverse=True):
        if kernel.startswith(prefix):
            return dict(_TINY[prefix])
    raise KeyError(f"no tiny shape for tunable {kernel!r}: add one to _TINY")


def _outputs(run, cfg):
    """run(cfg)'s output tensors, or None where the compiled config exceeds the device's resources
    (``tune.tune`` skips and counts those). Through the interpreter nothing is out of resources."""
    try:
        return tune._tensors(run(cfg))
    except OutOfResources:
        if _runtime.INTERPRET:
            raise
        return None


# the Gluon attention forward: 16-bit inputs on a compiled sm90 GPU only (Gluon has no interpreter)
_GLUON = {"flash_attn_fwd_gluon"}


@pytest.mark.parametrize("kernel", tune.all_tunables())
def test_tunable_runs_return_outputs_that_agree_across_configs(kernel):
    t = tune.get(kernel)
    dtype = torch.float32
    if kernel in _GLUON:
        if _runtime.INTERPRET or not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the Gluon forward needs a compiled sm90 GPU")
        dtype = torch.bfloat16
    run, key = t.setup(_tiny(kernel), dtype, _runtime.default_device())
    assert isinstance(key, str) and key
    want = [w.clone() for w in tune._tensors(run(None))]
    assert want, f"{kernel}: run returns no tensors; the tuner could not check its configs"
    assert all(torch.isfinite(w).all() for w in want if w.is_floating_point())
    points = tune.grid(t.space)
    for order in (points, points[::-1]):  # the first, then the last, grid point that fits the device
        for cfg in order:
            got = _outputs(run, cfg)
            if got is not None:
                assert tune.output_mismatch(want, got) is None, (kernel, cfg)
                break
        else:
            pytest.fail(f"{kernel}: no point of its grid fits the device at {_tiny(kernel)}")
