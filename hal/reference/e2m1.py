"""nvfp4's two-level microscaling in torch: e2m1 codes, e4m3 block scales, an fp32 global scale.

Blocks of 16 values along the last dimension share an e4m3 scale `amax_block / 6 * gs`
(gs the global scale, `448 * 6 / amax` unless given); each value is the e2m1 code nearest
to `x / (scale / gs)` (ties to the even code, saturating at 6); two codes per byte, the
first in the low nibble; a block whose scale is 0 (or underflows) holds code 0.
"""

from __future__ import annotations

import torch

from hal.dtypes import E2M1_VALUES, FP4_MAX, FP8_MAX, NVFP4_BLOCK_SIZE
from hal.errors import invalid

# Midpoint between code i and i+1, and whether a tie there goes up (the even code is i+1).
_MIDPOINTS = tuple(((a + b) / 2, (i + 1) % 2 == 0) for i, (a, b) in enumerate(zip(E2M1_VALUES, E2M1_VALUES[1:])))


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """`448 * 6 / amax` elementwise in fp32; 1 where amax is 0."""
    amax = amax.to(torch.float64)
    gs = torch.where(amax > 0, FP8_MAX * FP4_MAX / amax, torch.ones_like(amax))
    # A subnormal amax would overflow fp32; the largest finite scale keeps everything finite.
    return gs.clamp(max=torch.finfo(torch.float32).max).to(torch.float32)


def tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """The global scale of a whole tensor as an fp32 scalar tensor; 1 for an all-zero (or empty) tensor."""
    if x.numel() == 0:
        return torch.ones((), dtype=torch.float32, device=x.device)
    return scale_from_amax(x.abs().amax())


def checked_scale(global_scale: torch.Tensor) -> torch.Tensor:
    """A given one-element global scale as a scalar, refused unless finite and positive (reads the value)."""
    gs = global_scale.reshape(())
    if not bool(torch.isfinite(gs) & (gs > 0)):
        raise invalid("global_scale", "a finite positive value", float(gs))
    return gs


def encode_blocks(x: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 16 along the last dimension of fp32 `x` `[..., H]`: packed codes uint8 `[..., H/2]`
    and e4m3 block scales `[..., H/16]`; `gs` broadcasts against the block scales."""
    h = x.shape[-1]
    blocks = x.reshape(*x.shape[:-1], h // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    block_amax = blocks.abs().amax(dim=-1)
    scale = (block_amax / FP4_MAX * gs).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    step = (scale.to(torch.float32) / gs).unsqueeze(-1)
    usable = step > 0  # blocks whose scale is 0 (or underflows) get code 0
    ratio = blocks / torch.where(usable, step, torch.ones_like(step))
    codes = torch.where(usable, encode(ratio), torch.zeros_like(ratio, dtype=torch.uint8))
    codes = codes.reshape(*x.shape[:-1], h // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4), scale


def decode_blocks(packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """fp32 values of packed codes `[..., H/2]` with block scales `[..., H/16]` and a global scale."""
    values = decode(packed)
    expanded = scale.to(torch.float32).repeat_interleave(NVFP4_BLOCK_SIZE, dim=-1)
    return values * expanded / gs.to(torch.float32).reshape(())


def encode(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (ties to the even code, saturating at 6): 4-bit codes, uint8."""
    mag = v.abs()
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for midpoint, tie_up in _MIDPOINTS:
        code += (mag >= midpoint if tie_up else mag > midpoint).to(torch.uint8)
    sign = ((v < 0) & (code > 0)).to(torch.uint8) << 3  # zero is always code 0, never -0
    return code | sign


def decode(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Unpack uint8 codes (two per byte, low nibble first, along `dim`) into fp32 e2m1 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    table = torch.cat([table, -table])
    last = packed.movedim(dim, -1)
    codes = torch.stack([last & 0xF, last >> 4], dim=-1)
    codes = codes.reshape(*last.shape[:-1], last.shape[-1] * 2)
    return table[codes.long()].movedim(-1, dim)
