"""Reference quantization of expert weights `[E, K, N]` into hal's weight formats.

none: a cast; per-channel: int8, fp8 or int4 (`torch.quint4x2`, packed eight per int32
along N) with `scale[e, n] = max_k |w[e, k, n]| / qmax`; block-128x128: fp8 with one
scale per (partial) 128x128 tile of each expert; block-16: nvfp4 (two e2m1 codes per
byte along K) with an e4m3 scale per 16 k and n, under a per-expert fp32 global scale
`448 * 6 / amax(|w[e]|)`; block-32: mxfp4 (two e2m1 codes per byte along K) with an e8m0 scale per
32 k and n (`hal.reference.mxfp4`). Zero channels, tiles and blocks get scale 0 and data 0 (mxfp4: scale
byte 0).
"""

from __future__ import annotations

import math

import torch

from hal import checks
from hal.dtypes import FP8_GROUP_SIZE, FP8_MAX, INT4_MAX, INT8_MAX, MXFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE, ScaleLayout
from hal.errors import invalid
from hal.formats import QuantizedWeight
from hal.reference import e2m1, mxfp4
from hal.reference.int4 import pack_int4, unpack_int4
from hal.reference.quantize import refuse_non_finite, symmetric

#: The largest magnitude of each per-channel storage dtype (int4 is asked for as `torch.quint4x2`).
_QMAX = {torch.int8: INT8_MAX, torch.float8_e4m3fn: FP8_MAX, torch.quint4x2: float(INT4_MAX)}


def quantize_weight(w: torch.Tensor, layout: ScaleLayout | str, dtype: torch.dtype | None = None) -> QuantizedWeight:
    """Quantize float expert weights `[E, K, N]` into `layout` (see the module)."""
    parsed = checks.weight_layout(layout)
    checks.float_weights(w, parsed, dtype)
    return encode_weight(w, parsed, dtype)


def encode_weight(w: torch.Tensor, layout: ScaleLayout, dtype: torch.dtype | None) -> QuantizedWeight:
    """`quantize_weight` of arguments already checked; refuses non-finite weights."""
    refuse_non_finite("weight", w)  # errors name `weight`, the argument of `Vendor.quantize_weight`
    parsed = layout
    if parsed is ScaleLayout.NONE:
        return QuantizedWeight(w.to(w.dtype if dtype is None else dtype), parsed)
    wf = w.to(torch.float32)
    if parsed is ScaleLayout.BLOCK_16:
        return _nvfp4(wf)
    if parsed is ScaleLayout.BLOCK_32:
        return _mxfp4(wf)
    target = dtype or (torch.int8 if parsed is ScaleLayout.PER_CHANNEL else torch.float8_e4m3fn)
    qmax = _QMAX[target]
    if parsed is ScaleLayout.PER_CHANNEL:
        amax = wf.abs().amax(dim=1)  # [E, N]
        stored = torch.int8 if target == torch.quint4x2 else target
        data, scale = symmetric(wf, amax, amax.unsqueeze(1), qmax=qmax, target=stored, rounds=stored == torch.int8)
        return QuantizedWeight(pack_int4(data) if target == torch.quint4x2 else data, parsed, scale)
    amax = tile_amax(wf)
    data, scale = symmetric(
        wf, amax, expand_tiles(amax, wf.shape[1], wf.shape[2]), qmax=qmax, target=target, rounds=False
    )
    return QuantizedWeight(data, parsed, scale)


def dequantize_weight(weight: QuantizedWeight) -> torch.Tensor:
    """Invert `quantize_weight`: fp32 `[E, K, N]` (`data * scale`; nvfp4: `e2m1 * scale / global_scale[e]`,
    or `/ global_scale[e, n]` for a per-channel global scale; mxfp4: `e2m1 * 2**(scale - 127)`)."""
    if not isinstance(weight, QuantizedWeight):
        raise invalid("weight", "a QuantizedWeight", type(weight).__name__)
    if weight.layout is ScaleLayout.NONE:
        return weight.data.to(torch.float32)
    scale = weight.scale.to(torch.float32)  # type: ignore[union-attr]
    if weight.layout is ScaleLayout.PER_CHANNEL:
        data = unpack_int4(weight.data) if weight.is_int4 else weight.data
        return data.to(torch.float32) * scale.unsqueeze(1)
    if weight.layout is ScaleLayout.BLOCK_128X128:
        _, k, n = weight.data.shape
        return weight.data.to(torch.float32) * expand_tiles(scale, k, n)
    if weight.layout is ScaleLayout.BLOCK_32:
        return mxfp4.decode_blocks(weight.data, weight.scale, dim=1)  # type: ignore[arg-type]
    values = e2m1.decode(weight.data, dim=1)  # [E, K, N]
    gs = weight.global_scale.to(torch.float32)  # type: ignore[union-attr]
    gs = gs.unsqueeze(1) if gs.dim() == 2 else gs.reshape(-1, 1, 1)  # per channel [E, 1, N] or per expert
    return values * scale.repeat_interleave(NVFP4_BLOCK_SIZE, dim=1) / gs


def tile_amax(w: torch.Tensor) -> torch.Tensor:
    """Max |w| per expert and (partial) 128x128 tile: `[E, K, N] -> [E, ceil(K/128), ceil(N/128)]`."""
    e, k, n = w.shape
    kb, nb = math.ceil(k / FP8_GROUP_SIZE), math.ceil(n / FP8_GROUP_SIZE)
    padded = torch.nn.functional.pad(w.abs(), (0, nb * FP8_GROUP_SIZE - n, 0, kb * FP8_GROUP_SIZE - k))
    return padded.reshape(e, kb, FP8_GROUP_SIZE, nb, FP8_GROUP_SIZE).amax(dim=(2, 4))


def expand_tiles(scale: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """Broadcast `[E, Kb, Nb]` tile scales over their elements: `[E, K, N]`."""
    return scale.repeat_interleave(FP8_GROUP_SIZE, dim=-2).repeat_interleave(FP8_GROUP_SIZE, dim=-1)[..., :k, :n]


def _nvfp4(w: torch.Tensor) -> QuantizedWeight:
    """nvfp4 weights `[E, K, N]`: blocks of 16 along K, one global scale per expert."""
    e, k, _ = w.shape
    if k % NVFP4_BLOCK_SIZE:
        raise invalid("weight", f"K a multiple of {NVFP4_BLOCK_SIZE} for block-16 (nvfp4) weights", tuple(w.shape))
    amax = w.abs().amax(dim=(1, 2)) if w.numel() else w.new_zeros(e)
    gs = e2m1.scale_from_amax(amax)
    # Move K last, so that blocks and packing run along the last dimension as for activations.
    packed, scale = e2m1.encode_blocks(w.transpose(1, 2), gs.reshape(e, 1, 1))
    return QuantizedWeight(
        packed.transpose(1, 2).contiguous(), ScaleLayout.BLOCK_16, scale.transpose(1, 2).contiguous(), gs
    )


def _mxfp4(w: torch.Tensor) -> QuantizedWeight:
    """mxfp4 weights `[E, K, N]`: blocks of 32 along K, e8m0 scales."""
    if w.shape[1] % MXFP4_BLOCK_SIZE:
        raise invalid("weight", f"K a multiple of {MXFP4_BLOCK_SIZE} for block-32 (mxfp4) weights", tuple(w.shape))
    packed, scale = mxfp4.encode_blocks(w.transpose(1, 2))  # blocks and packing along the last dimension
    return QuantizedWeight(
        packed.transpose(1, 2).contiguous(), ScaleLayout.BLOCK_32, scale.transpose(1, 2).contiguous()
    )
