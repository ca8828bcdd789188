"""Re-views of one projection's checkpoint tensors: split `gate_up` into gate and up, keep this
rank's tensor-parallel shard of the intermediate dimension.

Tensors are in checkpoint orientation, `[N, K]` (out, in). The intermediate dimension I is
N of the gate and up projections (rows) and K of the down projection (columns); each rank
keeps `[offset, offset + size)` of it. Scales follow their channels: per-channel scales
and biases of gate/up by row, block scales by 128 rows or columns, nvfp4 block scales by
16 columns, mxfp4 block scales by 32 columns; per-tensor scales are kept whole. mxfp4 `blocks`
arrive here as `[N, K/2]` bytes (the loader views `[N, K/32, 16]` so). Nothing is computed: every result is a view
of the bytes given (the loader copies views of larger tensors so as not to keep the rest).
"""

from __future__ import annotations

import torch

from hal import FP8_GROUP_SIZE, InvalidInput
from moe.checkpoint.formats import SCALAR_SHAPES, FormatSpec
from moe.checkpoint.names import Projection, TensorKind

#: Kinds that are one value per projection.
SCALAR_KINDS = (TensorKind.WEIGHT_SCALE_2, TensorKind.INPUT_SCALE)


def is_per_tensor(kind: TensorKind, t: torch.Tensor) -> bool:
    """Whether `t` is one value for the whole projection (kept whole by every split and shard)."""
    return kind in SCALAR_KINDS or (kind is TensorKind.WEIGHT_SCALE and tuple(t.shape) in SCALAR_SHAPES)


def split_gate_up(
    name: str, spec: FormatSpec, kind: TensorKind, t: torch.Tensor, intermediate: int, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up parts of a `gate_up` tensor whose N is `2 * intermediate`: the first and the
    second half of the rows, or the even and the odd rows where `interleaved` (gpt-oss)."""
    if is_per_tensor(kind, t):
        return t, t
    if kind is TensorKind.WEIGHT_SCALE_INV:
        if interleaved:
            raise InvalidInput(
                f"{name}: 128x128 block scales of an interleaved gate_up projection cannot be "
                "split into gate and up (a block holds rows of both)"
            )
        if intermediate % FP8_GROUP_SIZE:
            raise InvalidInput(
                f"{name}: splitting gate_up block scales needs I a multiple of {FP8_GROUP_SIZE} "
                f"(the up rows start inside a block otherwise), got I={intermediate}"
            )
        blocks = intermediate // FP8_GROUP_SIZE
        return t[:blocks], t[blocks:]
    if interleaved:
        return t[0::2], t[1::2]
    return t[:intermediate], t[intermediate:]


def shard(
    name: str,
    spec: FormatSpec,
    projection: Projection,
    kind: TensorKind,
    t: torch.Tensor,
    offset: int,
    size: int,
    full: int,
) -> torch.Tensor:
    """This rank's shard `[offset, offset + size)` of the intermediate dimension (`full` channels)."""
    if size == full or is_per_tensor(kind, t):
        return t
    if projection is Projection.DOWN:
        if kind is TensorKind.BIAS or (kind is TensorKind.WEIGHT_SCALE and not spec.block):
            return t  # per output channel (H): the same on every rank
        if kind in (TensorKind.WEIGHT, TensorKind.BLOCKS):
            step = spec.values_per_byte
            return t[:, offset // step : (offset + size) // step]
        return t[:, _blocks(name, kind, spec, offset, size, full)]
    if kind is TensorKind.WEIGHT_SCALE_INV:
        return t[_blocks(name, kind, spec, offset, size, full)]
    return t[offset : offset + size]  # gate/up rows: weights, biases, per-channel and nvfp4/mxfp4 block scales


def _blocks(name: str, kind: TensorKind, spec: FormatSpec, offset: int, size: int, full: int) -> slice:
    """The block indices of channels `[offset, offset + size)`; refused unless the shard starts and
    ends on a block boundary (or at the end of the dimension)."""
    block = FP8_GROUP_SIZE if kind is TensorKind.WEIGHT_SCALE_INV else spec.block
    end = offset + size
    if offset % block or (end % block and end != full):
        raise InvalidInput(
            f"{name}: the tensor-parallel shard [{offset}, {end}) of the intermediate dimension (I={full}) must "
            f"start and end on a {block}-channel block boundary of its {kind} ({spec.format} scales), "
            f"got a shard of {size} channels; choose tp_size so that I / tp_size is a multiple of {block}"
        )
    return slice(offset // block, -(-end // block))
