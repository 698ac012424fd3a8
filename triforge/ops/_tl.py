"""Triton helpers shared by the kernel families."""

import triton
import triton.language as tl


@triton.jit
def rne_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even) by bit arithmetic, kept in fp32. Triton 3.6's
    CPU interpreter truncates fp32 -> bf16 casts where compiled kernels round to nearest; kernels that
    must match a rounded reference in both call this under a constexpr RNE flag."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def cast(x, dtype: tl.constexpr, RNE: tl.constexpr):
    """fp32 x in ``dtype``; RNE (and a bf16 ``dtype``) rounds to the nearest bf16 first (the value is
    then exact in bf16); other dtypes convert as compiled kernels do."""
    if RNE and dtype == tl.bfloat16:
        return rne_bf16(x).to(dtype)
    return x.to(dtype)


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask L2 for the lines at ``ptrs`` where ``mask`` (``prefetch.global.L2``: no register result, nothing waits
    on it). Safe before griddepcontrol.wait even on memory the previous kernel writes: L2 is the point of coherence,
    so a prefetch only moves a line in early, and loads made after the wait still see the final data. Compiled
    kernels only (inline PTX); returns a dummy int32 tensor that callers drop. Used before the wait by flash-decoding's
    split kernel and by decode_oproj."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
