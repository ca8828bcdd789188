"""Decoding packed e2m1 (4-bit float) weights with their block scales into bf16, inside Triton kernels.

Two decodes: inline PTX, four bytes at a time (a byte-permute table lookup per four codes, bf16x2 scaling
by MXFP4's e8m0 scales), or Triton operations on each value (through fp16's bit layout, scaled in fp32,
the result times `2**-14`, which the caller applies back to its fp32 accumulators).
"""

from __future__ import annotations

import triton
import triton.language as tl

# The magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 of the e2m1 codes 0-7 as bf16 (0x0000, 0x3F00, 0x3F80, 0x3FC0,
# 0x4000, 0x4040, 0x4080, 0x40C0): their low bytes in la:lb and high bytes in ha:hb, looked up by `prmt`
# with the codes as byte selectors, four at a time. A code's sign (its bit 3) is the top bit of its byte
# once shifted there, replicated into a byte by `prmt`'s sign mode and masked into the bf16's sign bit.
# Four bytes in (`$4`: eight codes of four elements), four bf16 pairs out: `$0`/`$1` the low nibbles'
# values of elements 0-1 / 2-3, `$2`/`$3` the high nibbles'. MX: times the e8m0 scales of `$5`, whose
# bytes shifted into bf16 exponent fields are the scales exactly, by one bf16x2 multiply per pair.
# The inputs are copied first: an output may share an input's register.
_ASM_HEAD = """
{
.reg .b32 w, la, lb, ha, hb, sel, l8, h8, sg, t, m, s, z;
mov.b32 w, $4;
"""
_E2M1_ASM = """
mov.b32 la, 0xC0800000;
mov.b32 lb, 0xC0804000;
mov.b32 ha, 0x3F3F3F00;
mov.b32 hb, 0x40404040;
mov.b32 m, 0x80008000;
and.b32 sel, w, 0x7777;
prmt.b32 l8, la, lb, sel;
prmt.b32 h8, ha, hb, sel;
prmt.b32 $0, l8, h8, 0x6240;
prmt.b32 $2, l8, h8, 0x7351;
shr.b32 sel, w, 16;
and.b32 sel, sel, 0x7777;
prmt.b32 l8, la, lb, sel;
prmt.b32 h8, ha, hb, sel;
prmt.b32 $1, l8, h8, 0x6240;
prmt.b32 $3, l8, h8, 0x7351;
shl.b32 sg, w, 4;
prmt.b32 t, sg, sg, 0x9080;
lop3.b32 $0, $0, t, m, 0xF8;
prmt.b32 t, sg, sg, 0xB0A0;
lop3.b32 $1, $1, t, m, 0xF8;
prmt.b32 t, w, w, 0x9080;
lop3.b32 $2, $2, t, m, 0xF8;
prmt.b32 t, w, w, 0xB0A0;
lop3.b32 $3, $3, t, m, 0xF8;
"""
_E8M0_SCALE_ASM = """
mov.b32 z, 0;
prmt.b32 t, s, z, 0x4140;
shl.b32 t, t, 7;
fma.rn.bf16x2 $0, $0, t, m;
fma.rn.bf16x2 $2, $2, t, m;
prmt.b32 t, s, z, 0x4342;
shl.b32 t, t, 7;
fma.rn.bf16x2 $1, $1, t, m;
fma.rn.bf16x2 $3, $3, t, m;
"""


# Kernels read module globals only as constexprs.
_MX_ASM = tl.constexpr(_ASM_HEAD + "mov.b32 s, $5;" + _E2M1_ASM + _E8M0_SCALE_ASM + "}")
_NV_ASM = tl.constexpr(_ASM_HEAD + _E2M1_ASM + "}")


@triton.jit
def _scale_f32(scale, MX: tl.constexpr):
    """fp32 block scales of loaded scale bytes (e8m0 exponents, or e4m3)."""
    if MX:
        return (scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return scale.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _decode_f16(codes, scale):
    """bf16 values of 4-bit codes (int32, 0..15) times `2**-14` times their fp32 block scales: a code's
    exponent and mantissa bits are an fp16's (subnormal for the smallest codes, which the conversion to
    fp32 keeps exact); the `2**14` is applied to the accumulators."""
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    return (bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * scale).to(tl.bfloat16)


@triton.jit
def dequantize_nibbles(packed, scale, MX: tl.constexpr, ASM: tl.constexpr):
    """The bf16 values of the low and high nibbles of `packed` (uint8) times their block scales (`scale`,
    bytes); through the Triton decode, times `2**-14` (see `_decode_f16`)."""
    if ASM:
        if MX:
            lo, hi = tl.inline_asm_elementwise(
                _MX_ASM, "=r,=r,=r,=r,r,r", [packed, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
            )
        else:
            lo, hi = tl.inline_asm_elementwise(
                _NV_ASM, "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
            )
            s = scale.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            lo = lo * s
            hi = hi * s
    else:
        codes = packed.to(tl.int32)
        s32 = _scale_f32(scale, MX)
        lo = _decode_f16(codes & 15, s32)
        hi = _decode_f16(codes >> 4, s32)
    return lo, hi
