"""The checkpoint formats the loader reads, one row each: what every tensor of a projection must be.

A projection's weight is stored `[N, K]` (out, in), as `torch.nn.Linear` keeps it. By format:

- `bf16`, `fp16`, `fp32`
  - `weight`: that dtype `[N, K]`
  - scales: none
  - hal weights built: none, same dtype
- `fp8-block128`
  - `weight`: e4m3 `[N, K]`
  - scales: `weight_scale_inv` fp32 `[ceil(N/128), ceil(K/128)]`
  - hal weights built: block-128x128
- `fp8`
  - `weight`: e4m3 `[N, K]`
  - scales: `weight_scale` fp32 `[]`, `[1]`, `[N]` or `[N, 1]`; optional `input_scale` `[]`
  - hal weights built: per-channel fp8
- `int8`
  - `weight`: int8 `[N, K]`
  - scales: `weight_scale` fp32 `[]`, `[1]`, `[N]` or `[N, 1]`
  - hal weights built: per-channel int8
- `nvfp4`
  - `weight`: uint8 `[N, K/2]`
  - scales: `weight_scale` e4m3 `[N, K/16]`, `weight_scale_2` fp32 `[]`, `input_scale` fp32 `[]`
  - hal weights built: block-16
- `mxfp4` (gpt-oss)
  - `blocks`: uint8 `[N, K/32, 16]`, two e2m1 codes per byte along K (the even k in the low nibble)
  - `scales`: uint8 `[N, K/32]`, e8m0 biased exponents (`2**(s - 127)`)
  - hal weights built: block-32

Scales may also come in bf16 or fp16 (widened to fp32, exactly). Every format takes an
optional fp32/bf16/fp16 `bias` `[N]` per projection.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from hal import FLOAT_DTYPES, FP8_GROUP_SIZE, MXFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE, ScaleLayout, invalid
from moe.checkpoint.names import TensorKind


class CheckpointFormat(str, enum.Enum):
    """How a checkpoint stores its expert weights."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8_BLOCK128 = "fp8-block128"  #: DeepSeek-V3 / Qwen3-FP8: e4m3 with 128x128 block `weight_scale_inv`
    FP8 = "fp8"  #: e4m3 with a per-tensor or per-channel `weight_scale`, optional static `input_scale`
    INT8 = "int8"  #: W8A8-INT8: int8 with a per-channel `weight_scale`, dynamic per-token activations
    NVFP4 = "nvfp4"  #: NVIDIA ModelOpt NVFP4
    MXFP4 = "mxfp4"  #: OCP MXFP4 as gpt-oss stores it (`*_blocks`, `*_scales`)

    def __str__(self) -> str:
        return self.value

    @property
    def spec(self) -> FormatSpec:
        """This format's row of `FORMATS`."""
        return FORMATS[self]

    @staticmethod
    def parse(value: CheckpointFormat | str) -> CheckpointFormat:
        """A format by name or alias (`"w8a8-fp8-block"`, `"modelopt-nvfp4"`, `"bfloat16"`, ...)."""
        if isinstance(value, CheckpointFormat):
            return value
        key = str(value).strip().lower().replace("_", "-")
        found = _ALIASES.get(key)
        if found is None:
            raise invalid("format", f"one of {', '.join(f.value for f in CheckpointFormat)}", value)
        return found


class FusedLayout(str, enum.Enum):
    """How fused (all-experts) weight tensors are oriented.

    `out-in`: `gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]` (transformers 5's
    Qwen3-MoE, Mixtral, DeepSeek, OLMoE modules); `in-out`: `gate_up_proj` `[E, H, 2I]`,
    `down_proj` `[E, I, H]` (Llama-4 and gpt-oss checkpoints).
    """

    OUT_IN = "out-in"
    IN_OUT = "in-out"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TensorRule:
    """What one stored tensor of a projection `[N, K]` (out, in) may be: its shapes and dtypes."""

    shapes: Callable[[int, int], list[tuple[int, ...]]]
    dtypes: tuple[torch.dtype, ...]


@dataclass(frozen=True)
class FormatSpec:
    """One checkpoint format: weight storage, the tensor kinds it has, the hal weights it becomes.

    `scales` describes every tensor kind beside the `weight` and the bias (mxfp4's `blocks` included; shapes
    and dtypes per projection): with `required` and `optional`, the whole of what the loader understands of the
    format; any other tensor of an expert is refused by name. A new format is one row of `FORMATS`.
    """

    format: CheckpointFormat
    storage: torch.dtype
    layout: ScaleLayout
    required: tuple[TensorKind, ...]
    optional: tuple[TensorKind, ...] = ()
    values_per_byte: int = 1  #: weight values per stored element along K (nvfp4, mxfp4: two)
    scales: Mapping[TensorKind, TensorRule] = field(default_factory=dict)

    @property
    def data_kind(self) -> TensorKind:
        """The tensor kind holding the weights' values (`blocks` for mxfp4, else `weight`)."""
        return TensorKind.BLOCKS if self.layout is ScaleLayout.BLOCK_32 else TensorKind.WEIGHT

    @property
    def block(self) -> int:
        """Channels along K one block scale covers (0: no block scales along K)."""
        return {ScaleLayout.BLOCK_16: NVFP4_BLOCK_SIZE, ScaleLayout.BLOCK_32: MXFP4_BLOCK_SIZE}.get(self.layout, 0)

    @property
    def quantized(self) -> bool:
        """Whether weights come with scales."""
        return self.layout is not ScaleLayout.NONE

    def kinds(self) -> tuple[TensorKind, ...]:
        """Every tensor kind this format may have per projection (bias included)."""
        return (*self.required, *self.optional, TensorKind.BIAS)

    def rule(self, kind: TensorKind) -> TensorRule:
        """The shapes and dtypes a tensor of `kind` may have."""
        if kind is TensorKind.WEIGHT:
            return TensorRule(lambda n, k: [(n, k // self.values_per_byte)], (self.storage,))
        if kind is TensorKind.BIAS:
            return TensorRule(lambda n, k: [(n,)], FLOAT_DTYPES)
        return self.scales[kind]


_W, _S, _INV, _S2, _IN, _BLOCKS, _SCALES = (
    TensorKind.WEIGHT,
    TensorKind.WEIGHT_SCALE,
    TensorKind.WEIGHT_SCALE_INV,
    TensorKind.WEIGHT_SCALE_2,
    TensorKind.INPUT_SCALE,
    TensorKind.BLOCKS,
    TensorKind.SCALES,
)
#: Dtypes a scale may be stored in (all widen to fp32 exactly).
SCALE_DTYPES = FLOAT_DTYPES
#: Shapes of a one-value (per-tensor) scale.
SCALAR_SHAPES: tuple[tuple[int, ...], ...] = ((), (1,))

_ONE_VALUE = TensorRule(lambda n, k: list(SCALAR_SHAPES), SCALE_DTYPES)
_PER_CHANNEL = TensorRule(lambda n, k: [*SCALAR_SHAPES, (n,), (n, 1)], SCALE_DTYPES)
_BLOCK_128 = TensorRule(lambda n, k: [(math.ceil(n / FP8_GROUP_SIZE), math.ceil(k / FP8_GROUP_SIZE))], SCALE_DTYPES)
_BLOCK_16 = TensorRule(lambda n, k: [(n, k // NVFP4_BLOCK_SIZE)], (torch.float8_e4m3fn,))
#: mxfp4: e8m0 bytes, one per 32 values along K; its data `[N, K/32, 16]`, 32 codes of a block in 16 bytes.
_BLOCK_32 = TensorRule(lambda n, k: [(n, k // MXFP4_BLOCK_SIZE)], (torch.uint8,))
_MXFP4_BLOCKS = TensorRule(lambda n, k: [(n, k // MXFP4_BLOCK_SIZE, MXFP4_BLOCK_SIZE // 2)], (torch.uint8,))

#: The checkpoint formats, one row each.
FORMATS: dict[CheckpointFormat, FormatSpec] = {
    spec.format: spec
    for spec in (
        FormatSpec(CheckpointFormat.BF16, torch.bfloat16, ScaleLayout.NONE, (_W,)),
        FormatSpec(CheckpointFormat.FP16, torch.float16, ScaleLayout.NONE, (_W,)),
        FormatSpec(CheckpointFormat.FP32, torch.float32, ScaleLayout.NONE, (_W,)),
        FormatSpec(
            CheckpointFormat.FP8_BLOCK128,
            torch.float8_e4m3fn,
            ScaleLayout.BLOCK_128X128,
            (_W, _INV),
            scales={_INV: _BLOCK_128},
        ),
        FormatSpec(
            CheckpointFormat.FP8,
            torch.float8_e4m3fn,
            ScaleLayout.PER_CHANNEL,
            (_W, _S),
            (_IN,),
            scales={_S: _PER_CHANNEL, _IN: _ONE_VALUE},
        ),
        FormatSpec(CheckpointFormat.INT8, torch.int8, ScaleLayout.PER_CHANNEL, (_W, _S), scales={_S: _PER_CHANNEL}),
        FormatSpec(
            CheckpointFormat.NVFP4,
            torch.uint8,
            ScaleLayout.BLOCK_16,
            (_W, _S, _S2, _IN),
            values_per_byte=2,
            scales={_S: _BLOCK_16, _S2: _ONE_VALUE, _IN: _ONE_VALUE},
        ),
        FormatSpec(
            CheckpointFormat.MXFP4,
            torch.uint8,
            ScaleLayout.BLOCK_32,
            (_BLOCKS, _SCALES),
            values_per_byte=2,
            scales={_BLOCKS: _MXFP4_BLOCKS, _SCALES: _BLOCK_32},
        ),
    )
}

_ALIASES: dict[str, CheckpointFormat] = {
    **{f.value: f for f in CheckpointFormat},
    "bfloat16": CheckpointFormat.BF16,
    "float16": CheckpointFormat.FP16,
    "half": CheckpointFormat.FP16,
    "float32": CheckpointFormat.FP32,
    "float": CheckpointFormat.FP32,
    "fp8-block": CheckpointFormat.FP8_BLOCK128,
    "w8a8-fp8-block": CheckpointFormat.FP8_BLOCK128,
    "w8a8-fp8": CheckpointFormat.FP8,
    "fp8-per-tensor": CheckpointFormat.FP8,
    "fp8-per-channel": CheckpointFormat.FP8,
    "w8a8-int8": CheckpointFormat.INT8,
    "modelopt-nvfp4": CheckpointFormat.NVFP4,
    "gpt-oss-mxfp4": CheckpointFormat.MXFP4,
    "w4a16-mxfp4": CheckpointFormat.MXFP4,
}


def expected_tensor(
    spec: FormatSpec, kind: TensorKind, n: int, k: int
) -> tuple[list[tuple[int, ...]], tuple[torch.dtype, ...]]:
    """The shapes and dtypes a tensor of `kind` may have for a projection of `[N, K]` (out, in)."""
    rule = spec.rule(kind)
    return rule.shapes(n, k), rule.dtypes


def dtype_name(dtype: torch.dtype) -> str:
    """`float8_e4m3fn` for `torch.float8_e4m3fn` (messages)."""
    return str(dtype).removeprefix("torch.")
