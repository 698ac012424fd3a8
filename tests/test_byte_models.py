"""Every kernel launch carries its byte model (``launch.launch(..., nbytes=)``): ``triforge trace`` marks a kernel as
ours and rates it against the copy bandwidth only from that annotation, so a launch without one would drop out of a
profiled training step's accounting. Each registered op runs its tiny tier forward and backward here, and every
``launch.launch`` call in the package is read for an ``nbytes`` argument (the GPU-only launches included)."""

import ast
from pathlib import Path

import torch

from triforge import _runtime, launch, registry


def test_every_launch_call_in_the_source_passes_nbytes():
    root = Path(__file__).resolve().parent.parent / "triforge"
    calls, missing = 0, []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            f = getattr(node, "func", None)
            if isinstance(node, ast.Call) and isinstance(f, ast.Attribute) and f.attr == "launch" \
                    and isinstance(f.value, ast.Name) and f.value.id == "launch":
                calls += 1
                # nbytes=..., or **kwargs that may carry it (the launchers that forward a dict)
                if not any(k.arg in ("nbytes", None) for k in node.keywords):
                    missing.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert calls >= 40, calls
    assert not missing, missing


def test_every_launch_of_every_op_carries_bytes(monkeypatch):
    monkeypatch.delenv("TRIFORGE_DELTANET_BWD", raising=False)  # the Triton backward (torch would launch nothing)
    seen = {}
    real = launch.launch

    def spy(name, fn, grid, *args, nbytes=None, **kw):
        seen.setdefault(name, []).append(nbytes)
        return real(name, fn, grid, *args, nbytes=nbytes, **kw)

    monkeypatch.setattr(launch, "launch", spy)
    device = torch.device(_runtime.default_device())
    for spec in registry.select(None):
        dtype = torch.float32 if torch.float32 in spec.dtypes else spec.dtypes[0]
        inputs = spec.make_inputs("tiny", dtype, device, torch.Generator().manual_seed(0))
        leaves = {k: (v.detach().requires_grad_(True) if k in spec.grad_inputs else v) for k, v in inputs.items()}
        outs = spec.call(**leaves)
        if spec.grad_inputs:
            outs = [o for o in outs if o.requires_grad]
            wrt = [leaves[k] for k in spec.grad_inputs if leaves[k] is not None]
            torch.autograd.grad(outs, wrt, [torch.randn_like(o) for o in outs], allow_unused=True)
    assert len(seen) >= 30 and {"mhc_project_bwd_prologue", "rope_fwd", "rope_bwd"} <= set(seen), sorted(seen)
    missing = {name: sizes for name, sizes in seen.items() if any(b is None or b <= 0 for b in sizes)}
    assert not missing, f"launches without a byte model: {sorted(missing)}"
