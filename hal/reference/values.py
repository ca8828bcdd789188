"""Float64 values of hal's formats, computed from their definitions in `hal.formats`.

These decoders are the formats' specification in executable form: references (`hal
doctor`, the conformance suite) use them to know what quantized operands mean,
independently of any vendor's dequantize (and of the reference quantizers). Everything
returns float64 CPU tensors.
"""

from __future__ import annotations

import torch

from hal.dtypes import (
    E2M1_VALUES,
    E8M0_BIAS,
    E8M0_NAN,
    FP8_GROUP_SIZE,
    INT4_PER_WORD,
    MXFP4_BLOCK_SIZE,
    NVFP4_BLOCK_SIZE,
    Codec,
    ScaleLayout,
)
from hal.errors import invalid
from hal.formats import PackedInt4Tensor, QuantizedTensor, QuantizedWeight


def decode_int4(words: torch.Tensor) -> torch.Tensor:
    """int32 words `[..., m]` -> float64 int4 values `[..., 8m]` (value j in bits 4j..4j+3)."""
    shifts = torch.arange(0, 4 * INT4_PER_WORD, 4, dtype=torch.int64)
    nibbles = (words.cpu().to(torch.int64).unsqueeze(-1) >> shifts) & 0xF
    values = torch.where(nibbles >= 8, nibbles - 16, nibbles)
    return values.reshape(*words.shape[:-1], words.shape[-1] * INT4_PER_WORD).double()


def decode_e2m1(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 codes, two per byte along `dim` (low nibble first) -> float64 e2m1 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    table = torch.cat([table, -table])
    last = packed.cpu().movedim(dim, -1).long()
    codes = torch.stack([last & 0xF, last >> 4], dim=-1).reshape(*last.shape[:-1], last.shape[-1] * 2)
    return table[codes].movedim(-1, dim)


def activation_value(x: torch.Tensor | QuantizedTensor | PackedInt4Tensor) -> torch.Tensor:
    """The float64 value of activations: a float tensor, a `QuantizedTensor` or int4 words."""
    if isinstance(x, PackedInt4Tensor):
        return decode_int4(x.data) * x.scale.cpu().double().unsqueeze(-1)
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().double()
    if not isinstance(x, QuantizedTensor):
        raise invalid("x", "a torch.Tensor, a QuantizedTensor or a PackedInt4Tensor", type(x).__name__)
    if x.dtype.spec.codec is Codec.E2M1_BLOCKS:
        scale = x.scale.cpu().double().repeat_interleave(NVFP4_BLOCK_SIZE, dim=-1)  # type: ignore[union-attr]
        gs = float(x.global_scale.cpu().double().reshape(()))  # type: ignore[union-attr]
        return decode_e2m1(x.data, -1) * scale / gs
    data = x.data.cpu().double()
    if x.layout is ScaleLayout.NONE:
        return data
    scale = x.scale.cpu().double()  # type: ignore[union-attr]
    group = x.layout.group_size
    if group is None:
        return data * scale.unsqueeze(-1)
    return data * scale.repeat_interleave(group, dim=-1)[..., : data.shape[-1]]


def weight_value(weight: QuantizedWeight) -> torch.Tensor:
    """The float64 value of expert weights `[E, K, N]` (nvfp4: a global scale per expert or per channel;
    mxfp4: e8m0 bytes, NaN (255) where the byte is 255)."""
    if not isinstance(weight, QuantizedWeight):
        raise invalid("weight", "a QuantizedWeight", type(weight).__name__)
    if weight.layout is ScaleLayout.NONE:
        return weight.data.cpu().double()
    if weight.layout is ScaleLayout.BLOCK_32:
        byte = weight.scale.cpu().to(torch.int64)  # type: ignore[union-attr]
        power = torch.where(byte == E8M0_NAN, torch.nan, 2.0 ** (byte - E8M0_BIAS).double())
        return decode_e2m1(weight.data, 1) * power.repeat_interleave(MXFP4_BLOCK_SIZE, 1)
    scale = weight.scale.cpu().double()  # type: ignore[union-attr]
    if weight.layout is ScaleLayout.BLOCK_16:
        gs = weight.global_scale.cpu().double()  # type: ignore[union-attr]
        gs = gs[:, None, :] if gs.dim() == 2 else gs[:, None, None]  # per output channel, or per expert
        values = decode_e2m1(weight.data, 1)
        return values * scale.repeat_interleave(NVFP4_BLOCK_SIZE, 1) / gs
    data = decode_int4(weight.data) if weight.is_int4 else weight.data.cpu().double()
    if weight.layout is ScaleLayout.PER_CHANNEL:
        return data * scale[:, None, :]
    _, k, n = data.shape
    tiles = scale.repeat_interleave(FP8_GROUP_SIZE, 1)[:, :k].repeat_interleave(FP8_GROUP_SIZE, 2)[:, :, :n]
    return data * tiles
