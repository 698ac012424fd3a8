"""quantize_model: replace the nn.Linear layers of any module tree with TernaryLinear."""

import math

import torch
from torch import nn

from triforge.nn.ternary import TernaryLinear
from triforge.ops.ternary.quantize import METHODS
from triforge.ops.ternary.tensor import CHUNK_COLS


def _fp16_bytes(linear: nn.Linear) -> int:
    return linear.weight.numel() * 2


def quantize_model(model: nn.Module, skip=("lm_head", "embed"), method: str = "absmean", per_row: bool = True,
                   verbose: bool = True, compact: bool = False) -> dict:
    """Replace, in place, every nn.Linear whose qualified name contains none of the ``skip`` substrings.

    Norms, embeddings and other modules are left alone, as are Linears owned by nn.MultiheadAttention (it reads
    their weights directly). Returns a report: ``replaced`` (count), ``names``, ``bytes_before`` (the replaced
    weights at fp16, 2 bytes each), ``bytes_after`` (what the new layers hold: planes + scales, or with
    ``compact`` the 2-bit tc codes + scales; a planes layer also caches the codes on its first fp16/bf16 call,
    4 bits per weight in all: ``bytes_after_half_call`` / ``ratio_after_half_call`` state that, equal to
    ``bytes_after`` with ``compact``), ``bytes_after_base3`` (the 1.6-bit checkpoint form + scales) and the ratios
    ``ratio`` / ``ratio_base3`` (before / after). ``compact``: each TernaryLinear keeps only the codes
    (TernaryLinear.compact). Biases are unchanged and counted in neither. Printed as a table with rich when
    ``verbose``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(skip, str):
        skip = (skip,)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if isinstance(model, nn.Linear):
        raise TypeError("model is itself an nn.Linear (it cannot be replaced in place): use TernaryLinear.from_linear")
    targets = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or any(s in name for s in skip):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(parent, nn.MultiheadAttention):
            continue
        targets.append((name, parent, child))
    before = after = after_b3 = after_half = 0
    names = []
    for name, parent, child in targets:
        linear = getattr(parent, child)
        new = TernaryLinear.from_linear(linear, method=method, per_row=per_row)
        if compact:
            new.compact()
        tt = new.ternary
        held = tt.nbytes("resident")
        before += _fp16_bytes(linear)
        after += held
        after_b3 += tt.nbytes("base3")
        after_half += held
        if not compact:  # a planes layer's first fp16/bf16 call caches the tc codes beside the planes (scales shared),
            # after its dispatch has built the sparsity metadata (an int64 bitmap and an int32 flag per row and chunk)
            meta = tt.out_features * math.ceil(tt.in_features / CHUNK_COLS) * (8 + 4)
            after_half += tt.nbytes("codes") - tt.scales.numel() * 4 + meta
        setattr(parent, child, new)
        names.append(name)
    report = {
        "method": method,
        "per_row": per_row,
        "compact": compact,
        "replaced": len(names),
        "names": names,
        "bytes_before": before,
        "bytes_after": after,
        "bytes_after_base3": after_b3,
        "ratio": before / after if after else float("nan"),
        "ratio_base3": before / after_b3 if after_b3 else float("nan"),
        "bytes_after_half_call": after_half,
        "ratio_after_half_call": before / after_half if after_half else float("nan"),
    }
    if verbose:
        _print_report(report)
    return report


def _print_report(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"quantize_model ({r['method']}, {'per-row' if r['per_row'] else 'per-tensor'} scales)")
    t.add_column("replaced Linears", justify="right")
    t.add_column("fp16 weights", justify="right")
    t.add_column("ternary planes", justify="right")
    t.add_column("ratio", justify="right")
    t.add_column("base-3 form", justify="right")
    t.add_column("ratio", justify="right")
    mib = lambda b: f"{b / 2**20:.3f} MiB"  # noqa: E731
    t.add_row(str(r["replaced"]), mib(r["bytes_before"]), mib(r["bytes_after"]), f"{r['ratio']:.2f}x",
              mib(r["bytes_after_base3"]), f"{r['ratio_base3']:.2f}x")
    console = Console()
    console.print(t)
    if r["bytes_after_half_call"] != r["bytes_after"]:
        console.print(f"after a first fp16/bf16 call the layers also hold the tensor-core codes: "
                      f"{mib(r['bytes_after_half_call'])} ({r['ratio_after_half_call']:.2f}x smaller than fp16); "
                      "quantize_model(..., compact=True) keeps the codes alone, 2 bits per weight")


__all__ = ["quantize_model"]
