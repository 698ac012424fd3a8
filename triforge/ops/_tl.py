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


# ----------------------------------------------------------------------------- exp2 off the MUFU unit
# H100 runs ex2 on the MUFU unit at 16 results per clock per SM against 128 lanes of FP32 FMA. In the attention forward
# at head_dim 64 each score takes one exponential against 2 x 64 multiply-adds of matmul, and the MUFU time per tile
# equals the tensor-core time (FlashAttention-4 moves part of its exponentials to the FMA pipes for this reason).
# Emulated 2^x, for x <= 0 (finite; not -inf: it returns ~2^-125 there, see below):
#   x' = max(x, -125);  t = x' + 1.5 * 2^23 (rounds x' to the integer j in t's low mantissa bits);  j = t - 1.5 * 2^23
#   f = x' - j in [-1/2, 1/2];  p(f) ~ 2^f (degree 4, relative minimax, max relative error 2.7e-6 in fp32, against
#   ex2.approx's 2^-22 and the 16-bit P's rounding of 2^-9 / 2^-11);  2^x = p * 2^j: the bits of p plus j << 23 (t's
#   low bits are j's two's complement; the magic's own bits shift out). The clamp keeps the exponent field >= 1
#   (p >= 2^-1/2), so the result is a normal number, and -125 is 2^-125 ~ 2.4e-38 where 2^x is smaller.
# The four FMAs are FMA-pipe work; seven FP32 and two integer instructions against one MUFU instruction, so a kernel
# emulates a fraction of its exponentials (EMU of every 8, in the registers of each thread) to balance the two.
EXP2_POLY = (0.009570071473717690, 0.05591777339577675, 0.240247443318367, 0.6931218504905701, 0.9999992847442627)


def _f32_hex(v: float) -> str:
    import struct

    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


_PACK = 8  # exponentials per inline-PTX instance


def exp2_asm(n_emu: int) -> str:
    """PTX for 8 fp32 exponentials ($0..$7 outputs, $8..$15 inputs): the first ``n_emu`` emulated, the rest by
    ex2.approx.ftz.f32."""
    c4, c3, c2, c1, c0 = (_f32_hex(c) for c in EXP2_POLY)
    parts = []
    for i in range(_PACK):
        o, x = f"${i}", f"${i + _PACK}"
        if i >= n_emu:
            parts.append(f"ex2.approx.ftz.f32 {o}, {x};")
            continue
        parts.append(
            "{ .reg .f32 xc, t, j, f, p; .reg .b32 tb, pb; "
            f"max.f32 xc, {x}, 0fC2FA0000; add.rn.f32 t, xc, 0f4B400000; sub.rn.f32 j, t, 0f4B400000; "
            f"sub.rn.f32 f, xc, j; fma.rn.f32 p, f, {c4}, {c3}; fma.rn.f32 p, p, f, {c2}; fma.rn.f32 p, p, f, {c1}; "
            f"fma.rn.f32 p, p, f, {c0}; mov.b32 tb, t; mov.b32 pb, p; shl.b32 tb, tb, 23; add.s32 pb, pb, tb; "
            f"mov.b32 {o}, pb; }}")
    return " ".join(parts)


EXP2_PACK = tl.constexpr(_PACK)
EXP2_CONSTRAINTS = tl.constexpr(",".join(["=f"] * _PACK + ["f"] * _PACK))
EXP2_ASM = tl.constexpr(tuple(exp2_asm(n) for n in range(_PACK + 1)))  # by the number emulated of every 8


@triton.jit
def exp2_emu(x, EMU: tl.constexpr):
    """2^x of fp32 ``x`` (finite, <= 0 up to rounding) with EMU of every 8 exponentials on the FMA pipes (the scheme
    above) and the rest on MUFU; EMU = 0 is tl.exp2 (the only value the CPU interpreter runs: inline PTX). Each
    thread's elements go 8 at a time, so its element count must be a multiple of 8 when EMU > 0."""
    if EMU == 0:
        return tl.exp2(x)
    else:  # (an else, not code after the return: Triton compiles the statements after a constexpr-if's return)
        tl.static_assert(0 < EMU and EMU <= 8, "exp2_emu: EMU is 0-8 of every 8")
        return tl.inline_asm_elementwise(EXP2_ASM[EMU], EXP2_CONSTRAINTS, [x], dtype=tl.float32, is_pure=True,
                                         pack=EXP2_PACK)
