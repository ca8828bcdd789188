"""What the suite expects of every dispatch dtype, restated from the design, independently of `hal.DTYPES`.

One row per dtype: the payload's storage dtype and packing, the scale dtype, whether a
per-tensor scale comes with it, and the error one quantization round trip may have. The
suite checks what a vendor (and hal's own table) does against these rows, so a mistake
in hal's table is caught rather than copied. A dtype added to hal gets its row here too;
the suite's tests are parametrized over `hal.DispatchDtype` and pick it up from there.

The bound on `|dequantize(quantize(x)) - x|` per element, by dtype:

- bf16: `2^-8 * |x|` (half a bf16 step; 0 for bf16 input)
- fp16: `2^-11 * |x| + 2^-25` (round to nearest: half an fp16 step; half the smallest subnormal)
- fp32: `2^-24 * |x|` (half an fp32 step; 0 for fp32, fp16 or bf16 input)
- int8, per token: `rowmax|x| / 254` (half a step of `rowmax/127`)
- fp8 e4m3 (per token or per 128 channels): `2^-4 * |x| + 2^-16 * amax` of the scale group (half
  an e4m3 step; subnormals)
- nvfp4 (16-value blocks): `1.13 * max(|x|, amax_block / 6) / 4` (half an e2m1 step at \\|x\\|,
  e4m3-rounded block scale)
- int4, per token (a compute format): `rowmax|x| / 14` (half a step of `rowmax/7`)

Every bound also allows `2^-20 * rowmax` for fp32 scale arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: fp32 arithmetic on scales, relative to the largest magnitude involved.
SLACK = 2.0**-20
INT8_HALF_STEP = 1 / 254
INT4_HALF_STEP = 1 / 14
BF16_HALF_STEP = 2.0**-8
FP16_HALF_STEP = 2.0**-11
FP16_SUBNORMAL = 2.0**-25
FP32_HALF_STEP = 2.0**-24
FP8_RELATIVE = 2.0**-4
FP8_SUBNORMAL = 2.0**-16
NVFP4_SCALE_ROUNDING = 1.13

#: Channels one scale covers in each activation layout (None: the whole row; 0: no scale).
LAYOUT_GROUP = {"none": 0, "per-token": None, "per-token-group-128": 128, "block-16": 16}

Bound = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]  # (|x|, rowmax, layout) -> bound


@dataclass(frozen=True)
class DtypeFacts:
    """One dispatch dtype as the design defines it."""

    storage: torch.dtype
    values_per_element: int
    scale_dtype: torch.dtype | None
    global_scale: bool
    bound: Bound
    #: `||y - ref|| / ||ref||` an unquantized MoE layer may have with this dtype carried (bf16 outputs included)
    layer_error: float
    whole_groups: bool = False  #: rows hold whole scale groups (nvfp4 blocks)


def _group_amax(ax: torch.Tensor, size: int | None) -> torch.Tensor:
    """The amax of each element's scale group: the whole row (`None`) or `size` channels."""
    if ax.numel() == 0:
        return ax
    if size is None:
        return ax.amax(dim=-1, keepdim=True).expand_as(ax)
    h = ax.shape[-1]
    padded = torch.nn.functional.pad(ax, (0, (-h) % size))
    groups = padded.view(*ax.shape[:-1], -1, size).amax(dim=-1, keepdim=True)
    return groups.expand(*groups.shape[:-1], size).reshape(padded.shape)[..., :h]


FACTS: dict[str, DtypeFacts] = {
    "bf16": DtypeFacts(torch.bfloat16, 1, None, False, lambda ax, rowmax, layout: ax * BF16_HALF_STEP, 0.02),
    "fp8": DtypeFacts(
        torch.float8_e4m3fn,
        1,
        torch.float32,
        False,
        lambda ax, rowmax, layout: ax * FP8_RELATIVE + _group_amax(ax, LAYOUT_GROUP[layout]) * FP8_SUBNORMAL,
        0.06,
    ),
    "int8": DtypeFacts(torch.int8, 1, torch.float32, False, lambda ax, rowmax, layout: rowmax * INT8_HALF_STEP, 0.03),
    "nvfp4": DtypeFacts(
        torch.uint8,
        2,
        torch.float8_e4m3fn,
        True,
        lambda ax, rowmax, layout: torch.maximum(ax, _group_amax(ax, 16) / 6) / 4 * NVFP4_SCALE_ROUNDING,
        0.30,
        whole_groups=True,
    ),
    # The suite's layer has bf16 weights and bf16 outputs: an exact carrier still errs like bf16 there.
    "fp16": DtypeFacts(
        torch.float16, 1, None, False, lambda ax, rowmax, layout: ax * FP16_HALF_STEP + FP16_SUBNORMAL, 0.02
    ),
    "fp32": DtypeFacts(torch.float32, 1, None, False, lambda ax, rowmax, layout: ax * FP32_HALF_STEP, 0.02),
}
#: int4 activations: a compute format (never dispatched), with a bound of its own.
INT4_BOUND: Bound = lambda ax, rowmax, layout: rowmax * INT4_HALF_STEP  # noqa: E731


def facts(dtype: object) -> DtypeFacts:
    """The row of a dtype (by name or enum value)."""
    return FACTS[str(getattr(dtype, "value", dtype))]


def scale_shape(dtype: object, layout: object, lead: tuple[int, ...], hidden: int) -> tuple[int, ...] | None:
    """The scale shape of rows `[*lead, hidden]` (None: no scales)."""
    group = LAYOUT_GROUP[str(getattr(layout, "value", layout))]
    if facts(dtype).scale_dtype is None or group == 0:
        return None
    return lead if group is None else (*lead, math.ceil(hidden / group))


def bytes_per_token(dtype: object, layout: object, hidden: int) -> int:
    """Payload plus per-token scales of one token: what a dispatch buffer must hold."""
    row = facts(dtype)
    shape = scale_shape(dtype, layout, (), hidden)
    scales = 0 if shape is None else math.prod(shape)
    scale_bytes = row.scale_dtype.itemsize if row.scale_dtype is not None else 0
    return hidden * row.storage.itemsize // row.values_per_element + scales * scale_bytes


def channel_multiple(dtype: object, layout: object) -> int:
    """What a row's channels must be a multiple of."""
    row = facts(dtype)
    group = LAYOUT_GROUP[str(getattr(layout, "value", layout))] if row.whole_groups else 1
    return math.lcm(group or 1, row.values_per_element)


def quantize_bound(dtype: str, layout: str, x: torch.Tensor) -> torch.Tensor:
    """The per-element bound on `|dequantize(quantize(x)) - x|` for float64 `x` `[T, H]` (dtype: a
    dispatch dtype's name, or "int4")."""
    ax = x.abs()
    rowmax = ax.amax(dim=-1, keepdim=True) if x.numel() else ax
    if dtype == "int4":
        bound = INT4_BOUND(ax, rowmax, layout)
    elif dtype in FACTS:
        bound = FACTS[dtype].bound(ax, rowmax, layout)
    else:
        raise ValueError(f"dtype: expected one of {', '.join(FACTS)} or int4, got {dtype!r}")
    return (bound + rowmax * SLACK).expand_as(x)
