"""mxfp4 (OCP microscaling) in torch: e2m1 codes under one e8m0 scale per 32 values.

Blocks of 32 values along the last dimension share a power-of-two scale `2**e`, stored as the
biased exponent byte `e + 127` (e8m0). The reference picks the smallest `e` with
`amax_block / 2**e <= 6` (no value saturates), clamped to e8m0's range [-127, 127]; each value is
the e2m1 code nearest to `x / 2**e` (ties to the even code); two codes per byte, the first in the
low nibble. An all-zero block gets byte 0 and code 0.
"""

from __future__ import annotations

import torch

from hal.dtypes import E8M0_BIAS, E8M0_NAN, FP4_MAX, MXFP4_BLOCK_SIZE
from hal.errors import InvalidInput
from hal.reference import e2m1


def block_exponents(amax: torch.Tensor) -> torch.Tensor:
    """The unbiased exponent `e` of each block (int32): the smallest with `amax / 2**e <= 6`."""
    a = amax.to(torch.float64)
    positive = a > 0
    safe = torch.where(positive, a, torch.ones_like(a))
    e = torch.ceil(torch.log2(safe / FP4_MAX))
    # log2 of a double is exact enough to be off by one at most: settle the boundary exactly.
    e = torch.where(safe / torch.exp2(e) > FP4_MAX, e + 1, e)
    e = torch.where(safe / torch.exp2(e - 1) <= FP4_MAX, e - 1, e)
    e = torch.where(positive, e, torch.full_like(e, -E8M0_BIAS))
    return e.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def encode_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 32 along the last dimension of fp32 `x` `[..., K]`: packed codes uint8 `[..., K/2]` and
    e8m0 scale bytes uint8 `[..., K/32]`."""
    k = x.shape[-1]
    blocks = x.to(torch.float64).reshape(*x.shape[:-1], k // MXFP4_BLOCK_SIZE, MXFP4_BLOCK_SIZE)
    e = block_exponents(blocks.abs().amax(dim=-1))
    codes = e2m1.encode(blocks / torch.exp2(e.to(torch.float64)).unsqueeze(-1)).reshape(*x.shape[:-1], k // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4), (e + E8M0_BIAS).to(torch.uint8)


def scale_values(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The value `2**(s - 127)` of e8m0 bytes, in `dtype`; `InvalidInput` for a NaN byte (255)."""
    nan = int((scale == E8M0_NAN).sum())
    if nan:
        raise InvalidInput(f"mxfp4 scale: expected e8m0 bytes 0..254, got {nan} NaN byte(s) (255)")
    return torch.exp2(scale.to(dtype) - E8M0_BIAS)


def decode_blocks(packed: torch.Tensor, scale: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """fp32 values of codes packed along `dim` (`[..., K/2]` there) under e8m0 bytes (`[..., K/32]` there)."""
    values = e2m1.decode(packed, dim=dim)
    return values * scale_values(scale).repeat_interleave(MXFP4_BLOCK_SIZE, dim=dim)
