"""One definition per op, shared by ``triforge check``, ``triforge bench`` and the tests.

An op registers:
- ``make_inputs(tier, dtype, device, gen)``: a dict of named inputs (tensors and scalars).
  Tiers: ``tiny`` (small odd shapes for the CPU interpreter) and ``real`` (LLM shapes for the GPU).
- ``reference(**inputs64)``: the golden float64 math, returning named stages in order; the last
  entries include every name in ``outputs``.
- ``stages(**inputs)``: the kernel's own values of the same stages (debug buffers it writes).
- ``call(**inputs)``: the public API, returning the tuple of ``outputs`` (used for autograd and timing).
- ``grad_inputs``: the inputs that get gradients (empty: forward only).
- ``flops(inputs, mode)`` / ``bytes(inputs, mode)``: the roofline model, mode in {fwd, bwd}.
- ``peers``: name -> builder(inputs) returning a callable with ``call``'s signature, or None
  when that peer is not installed.
- ``stage_tols``: per stage or gradient (``d<input>``), a Tolerance replacing the dtype's.
- ``magnitudes(inputs64, grads64, dtype)``: optional; per stage or gradient name, the float64 scale of each
  element's rounding error (the sum of its terms' absolute values; grads64 are the upstream
  gradients, None for the forward stages; dtype the op's input dtype) replacing the reference's rms
  (see testing.compare).
- ``bench_shapes``: the shapes ``triforge bench`` sweeps (dict tiers, as ``make_inputs`` takes them);
  empty: the real tier alone.
"""

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class OpSpec:
    name: str
    family: str
    make_inputs: Callable
    reference: Callable
    stages: Callable
    call: Callable
    outputs: tuple
    grad_inputs: tuple = ()
    flops: Callable = lambda inputs, mode: 0.0
    bytes: Callable = lambda inputs, mode: 0.0
    peers: dict = field(default_factory=dict)
    dtypes: tuple = (torch.float32, torch.float16, torch.bfloat16)
    stage_tols: dict = field(default_factory=dict)
    magnitudes: Callable | None = None
    describe: Callable = lambda inputs: ""
    bench_shapes: tuple = ()
    # forward timed as CUDA-graph replay (``bench.graph_time_ms``) instead of per call: for decode-sized
    # kernels (~5-50 us) that serving runs from graphs, where a launch's own overhead is not the kernel's
    bench_graph: bool = False
    # facts about our implementation's inputs after a timed run, merged into its bench rows (a dict; e.g. the
    # ternary weights' resident bytes)
    extras: Callable | None = None
    # every shape dimension ``triforge bench --NAME VALUE`` may set (the keys make_inputs reads from a dict tier,
    # optional ones included); empty: the op does not say, and the bench does not check the names
    shape_names: tuple = ()


_OPS: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    if spec.name in _OPS:
        raise ValueError(f"op {spec.name!r} is registered twice")
    _OPS[spec.name] = spec
    return spec


def _load_all() -> None:
    import triforge.ops  # noqa: F401  (registers every op)


def get(name: str) -> OpSpec:
    _load_all()
    if name not in _OPS:
        raise KeyError(f"unknown op {name!r}; known ops: {', '.join(sorted(_OPS))}")
    return _OPS[name]


def all_ops() -> list[OpSpec]:
    _load_all()
    return [_OPS[k] for k in sorted(_OPS)]


def select(names) -> list[OpSpec]:
    """Ops named in ``names`` (op names or family names); all ops when empty."""
    ops = all_ops()
    if not names:
        return ops
    chosen = [op for op in ops if op.name in names or op.family in names]
    unknown = [n for n in names if not any(n in (op.name, op.family) for op in ops)]
    if unknown:
        raise KeyError(f"unknown op(s) {unknown}; known ops: {', '.join(op.name for op in ops)}")
    return chosen
