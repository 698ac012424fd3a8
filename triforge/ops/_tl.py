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
def l2_prefetch(ptr, nbytes, PIECES: tl.constexpr):
    """Ask L2 to fetch this program's share of the bytes [ptr, ptr + nbytes) (sm90+:
    ``cp.async.bulk.prefetch.L2``; nothing waits for it, nothing is read into registers). The span is
    cut evenly over every program of the grid, PIECES bulk prefetches per program. ptr 16-byte aligned,
    nbytes a multiple of 16. Compiled kernels only (the interpreter has no inline assembly)."""
    pid = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    nprog = tl.num_programs(0) * tl.num_programs(1)
    piece = tl.cdiv(tl.cdiv(nbytes, nprog * PIECES), 16) * 16
    start = (pid * PIECES + tl.arange(0, PIECES)).to(tl.int64) * piece
    size = tl.maximum(tl.minimum(nbytes - start, piece), 0).to(tl.int32)
    addr = ptr.to(tl.pointer_type(tl.int8)) + start
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1,
    )
