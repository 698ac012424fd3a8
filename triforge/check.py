"""``triforge check``: every registered op's stages and gradients against its float64 reference."""

from dataclasses import dataclass, field

import torch

from triforge import _runtime
from triforge.launch import poisoned
from triforge.testing import compare, compare_stages, dump_stages, tolerance_for


@dataclass
class OpCheck:
    op: str
    dtype: str
    shape: str
    results: list = field(default_factory=list)
    failed_stage: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.failed_stage is None and all(r.ok for r in self.results)


def _to64(v):
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        return v.detach().to(torch.float64)
    return v


def _grad_leaf(v):
    return v.detach().clone().requires_grad_(True)


def check_op(spec, dtype, *, tier=None, seed=0, dump_dir=None, verbose=False) -> OpCheck:
    """Forward stages (stopping at the first failing one), then each input gradient."""
    tier = tier or ("tiny" if _runtime.INTERPRET else "real")
    device = _runtime.default_device()
    gen = torch.Generator().manual_seed(seed)
    inputs = spec.make_inputs(tier, dtype, device, gen)
    tag = str(dtype).replace("torch.", "")
    out = OpCheck(spec.name, tag, spec.describe(inputs))
    try:
        inputs64 = {k: _to64(v) for k, v in inputs.items()}
        ref_stages = spec.reference(**inputs64)
        with poisoned():
            got_stages = spec.stages(**inputs)
        scales = spec.magnitudes(inputs64, None, dtype) if spec.magnitudes else None
        results, failed = compare_stages(
            ref_stages, got_stages, dtype=dtype, tols=spec.stage_tols, scales=scales, prefix="fwd.", verbose=verbose,
        )
        out.results += results
        out.failed_stage = failed
        if dump_dir is not None:
            dump_stages(f"{dump_dir}/{spec.name}-{tag}/ref", ref_stages)
            dump_stages(f"{dump_dir}/{spec.name}-{tag}/got", got_stages)
        if failed or not spec.grad_inputs:
            return out
        ref_in = {k: (_grad_leaf(_to64(v)) if k in spec.grad_inputs else _to64(v)) for k, v in inputs.items()}
        got_in = {k: (_grad_leaf(v) if k in spec.grad_inputs else v) for k, v in inputs.items()}
        with poisoned():
            got_outs = spec.call(**got_in)
        # both sides get the same upstream gradient: drawn in float64, rounded to each output's dtype
        gen_g = torch.Generator().manual_seed(seed + 1)
        grads_out = [torch.randn(o.shape, generator=gen_g, dtype=torch.float64).to(o.device, o.dtype) for o in got_outs]
        ref_stages = spec.reference(**ref_in)
        ref_outs = [ref_stages[n] for n in spec.outputs]
        ref_grads = torch.autograd.grad(ref_outs, [ref_in[k] for k in spec.grad_inputs], [g.double() for g in grads_out])
        with poisoned():
            got_grads = torch.autograd.grad(got_outs, [got_in[k] for k in spec.grad_inputs], grads_out)
        tol = tolerance_for(dtype)
        scales = spec.magnitudes(inputs64, [g.double() for g in grads_out], dtype) if spec.magnitudes else {}
        for k, rg, gg in zip(spec.grad_inputs, ref_grads, got_grads):
            res = compare(f"bwd.d{k}", rg, gg, dtype=dtype, tol=spec.stage_tols.get(f"d{k}", tol),
                          scale=scales.get(f"d{k}"), verbose=verbose)
            out.results.append(res)
            if not res.ok and out.failed_stage is None:
                out.failed_stage = f"d{k}"
    except Exception as e:  # a crash is a failed check, reported with its message
        out.error = f"{type(e).__name__}: {e}"
    return out
