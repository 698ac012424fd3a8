"""Every registered tunable at a tiny shape: its run returns the kernel's outputs (so ``tune`` can
check each config against the launcher's own, see ``tune.output_mismatch``), and the first and last
points of its grid agree with the launcher's config. Fresh random inputs (the setups draw them)."""

import pytest
import torch

from triforge import _runtime, tune

# tiny shapes per family (prefix of the kernel name, longest first): odd sizes where the kernels allow
_TINY = {
    "flash_attn": {"B": 1, "H": 2, "S": 24, "D": 32, "causal": 0},
    "flash_decode_split": {"B": 1, "S": 63, "H": 4, "Hkv": 2, "D": 32},
    "gated_delta_rule": {"B": 1, "T": 40, "H": 1, "HV": 2, "K": 32, "V": 32},
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
}


def _tiny(kernel):
    for prefix in sorted(_TINY, key=len, reverse=True):
        if kernel.startswith(prefix):
            return dict(_TINY[prefix])
    raise KeyError(f"no tiny shape for tunable {kernel!r}: add one to _TINY")


@pytest.mark.parametrize("kernel", tune.all_tunables())
def test_tunable_runs_return_outputs_that_agree_across_configs(kernel):
    t = tune.get(kernel)
    run, key = t.setup(_tiny(kernel), torch.float32, _runtime.default_device())
    assert isinstance(key, str) and key
    want = [w.clone() for w in tune._tensors(run(None))]
    assert want, f"{kernel}: run returns no tensors; the tuner could not check its configs"
    assert all(torch.isfinite(w).all() for w in want if w.is_floating_point())
    points = tune.grid(t.space)
    for cfg in (points[0], points[-1]):
        got = tune._tensors(run(cfg))
        assert tune.output_mismatch(want, got) is None, (kernel, cfg)
