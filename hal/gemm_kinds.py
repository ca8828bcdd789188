"""Grouped-matmul kinds: one row per kind, naming the activation and weight formats it pairs.

`gemm_kind_of(x, weight)` looks the pairing up in `GEMM_KINDS`; what a kind consumes,
produces by default and how the reference accumulates it are read from its row, never
from a chain of tests on dtypes.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hal.dtypes import DispatchDtype, ScaleLayout
from hal.errors import InvalidInput

if TYPE_CHECKING:
    from hal.formats import PackedInt4Tensor, QuantizedTensor, QuantizedWeight


class GemmKind(str, enum.Enum):
    """A grouped-matmul kind: the activation format times the weight format."""

    BF16 = "bf16"  #: bf16 x bf16
    FP16 = "fp16"  #: fp16 x fp16
    FP32 = "fp32"  #: fp32 x fp32
    INT8 = "int8"  #: int8 per-token activations x int8 per-channel weights
    FP8_ROWWISE = "fp8-rowwise"  #: fp8 per-token activations x fp8 per-channel weights
    FP8_BLOCK128 = "fp8-block128"  #: fp8 per-token-group-128 x fp8 128x128 block weights
    INT4 = "int4"  #: int4 per-token activations x int4 per-channel weights (8 values per int32)
    NVFP4 = "nvfp4"  #: nvfp4 activations x nvfp4 block-16 weights (e4m3 block scales, fp32 global)
    BF16_MXFP4 = "bf16-mxfp4"  #: weight-only: bf16 activations x mxfp4 block-32 weights (e8m0 block scales)
    BF16_NVFP4 = "bf16-nvfp4"  #: weight-only: bf16 activations x nvfp4 block-16 weights (as the nvfp4 kind's)

    def __str__(self) -> str:
        return self.value

    @property
    def spec(self) -> GemmSpec:
        """This kind's row of `GEMM_KINDS`."""
        return GEMM_KINDS[self]


@dataclass(frozen=True)
class ActivationFormat:
    """One activation operand format: a float tensor, a `QuantizedTensor` of one dtype and
    layout, or per-token int4 packed in a `PackedInt4Tensor`."""

    float_dtype: torch.dtype | None = None
    dtype: DispatchDtype | None = None
    layout: ScaleLayout | None = None
    int4: bool = False

    def __str__(self) -> str:
        if self.float_dtype is not None:
            return _FLOAT_NAMES[self.float_dtype]
        if self.int4:
            return "int4 per-token"
        if (
            self.layout is self.dtype.spec.default_layout  # type: ignore[union-attr]
            and len(self.dtype.spec.layouts) == 1  # type: ignore[union-attr]
        ):
            return str(self.dtype)
        return f"{self.dtype} {self.layout}"

    @staticmethod
    def of(x: object) -> ActivationFormat | None:
        """The format of an operand (None: not an activation operand at all)."""
        from hal.formats import PackedInt4Tensor, QuantizedTensor

        if isinstance(x, PackedInt4Tensor):
            return INT4_PACKED
        if isinstance(x, QuantizedTensor):
            return ActivationFormat(dtype=x.dtype, layout=x.layout)
        if isinstance(x, torch.Tensor):
            return ActivationFormat(float_dtype=x.dtype)
        return None


INT4_PACKED = ActivationFormat(int4=True)
_FLOAT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_STORAGE_NAMES = {**_FLOAT_NAMES, torch.int8: "int8", torch.float8_e4m3fn: "fp8", torch.int32: "int4"}
#: e2m1 weights (uint8 storage) are named by their block layout.
_E2M1_NAMES = {ScaleLayout.BLOCK_16: "nvfp4", ScaleLayout.BLOCK_32: "mxfp4"}


@dataclass(frozen=True)
class GemmSpec:
    """One grouped-matmul kind.

    `activation` is the format the kind takes (`also_accepts`: other spellings of the same
    values, e.g. bf16 rows still wrapped as they were dispatched); `weight_layout` and
    `weight_storage` the weights' (`weight_dtype` is the `dtype` argument of
    `quantize_weight` that makes them); `exact_integer` says the operands are integers
    whose products the reference accumulates exactly before applying the scales; `k_multiple`
    what K must be a multiple of (int4 packs 8 values per word, nvfp4 scales blocks of 16, mxfp4
    blocks of 32). A kind whose activations are float but whose weights are scaled is weight-only
    (`weight_only`): the weights are dequantized inside the GEMM, the activations stay as they are.
    """

    kind: GemmKind
    activation: ActivationFormat
    weight_layout: ScaleLayout
    weight_storage: torch.dtype
    weight_dtype: torch.dtype
    exact_integer: bool = False
    also_accepts: tuple[ActivationFormat, ...] = ()
    k_multiple: int = 1  #: channels packed or scaled together along K (K must be a multiple)

    @property
    def is_float(self) -> bool:
        """Float activations (the weights are unscaled floats too unless the kind is `weight_only`)."""
        return self.activation.float_dtype is not None

    @property
    def weight_only(self) -> bool:
        """Float activations times scaled (quantized) weights: only the weights are quantized."""
        return self.is_float and self.weight_layout is not ScaleLayout.NONE

    @property
    def default_out_dtype(self) -> torch.dtype:
        """The output dtype unless asked: the activation dtype of float kinds, bf16 otherwise."""
        return self.activation.float_dtype or torch.bfloat16

    def accepts(self, fmt: ActivationFormat | None) -> bool:
        """Whether activations of `fmt` are this kind's operand."""
        return fmt == self.activation or fmt in self.also_accepts

    def pairs_with(self, weight: QuantizedWeight) -> bool:
        """Whether `weight` is in this kind's weight format."""
        return weight.layout is self.weight_layout and weight.data.dtype == self.weight_storage

    def pairing(self) -> str:
        """The pairing in words, for messages."""
        layout = "" if self.weight_layout is ScaleLayout.NONE else f" {self.weight_layout}"
        name = _E2M1_NAMES.get(self.weight_layout) or _STORAGE_NAMES[self.weight_storage]
        return f"{self.activation} with {name}{layout} weights"


_BF16_CARRIED = (ActivationFormat(dtype=DispatchDtype.BF16, layout=ScaleLayout.NONE),)


def _float(kind: GemmKind, dtype: torch.dtype) -> GemmSpec:
    also = _BF16_CARRIED if dtype == torch.bfloat16 else ()
    return GemmSpec(kind, ActivationFormat(float_dtype=dtype), ScaleLayout.NONE, dtype, dtype, also_accepts=also)


def _bf16_weight_only(kind: GemmKind, layout: ScaleLayout, k_multiple: int) -> GemmSpec:
    """bf16 activations times e2m1 weights packed two per byte along K (uint8) in block layout `layout`."""
    bf16 = ActivationFormat(float_dtype=torch.bfloat16)
    return GemmSpec(kind, bf16, layout, torch.uint8, torch.uint8, also_accepts=_BF16_CARRIED, k_multiple=k_multiple)


#: The grouped-matmul kinds, one row each.
GEMM_KINDS: dict[GemmKind, GemmSpec] = {
    spec.kind: spec
    for spec in (
        _float(GemmKind.BF16, torch.bfloat16),
        _float(GemmKind.FP16, torch.float16),
        _float(GemmKind.FP32, torch.float32),
        GemmSpec(
            GemmKind.INT8,
            ActivationFormat(dtype=DispatchDtype.INT8, layout=ScaleLayout.PER_TOKEN),
            ScaleLayout.PER_CHANNEL,
            torch.int8,
            torch.int8,
            exact_integer=True,
        ),
        GemmSpec(
            GemmKind.FP8_ROWWISE,
            ActivationFormat(dtype=DispatchDtype.FP8, layout=ScaleLayout.PER_TOKEN),
            ScaleLayout.PER_CHANNEL,
            torch.float8_e4m3fn,
            torch.float8_e4m3fn,
        ),
        GemmSpec(
            GemmKind.FP8_BLOCK128,
            ActivationFormat(dtype=DispatchDtype.FP8, layout=ScaleLayout.GROUP_128),
            ScaleLayout.BLOCK_128X128,
            torch.float8_e4m3fn,
            torch.float8_e4m3fn,
        ),
        GemmSpec(
            GemmKind.INT4,
            INT4_PACKED,
            ScaleLayout.PER_CHANNEL,
            torch.int32,
            torch.quint4x2,
            exact_integer=True,
            k_multiple=8,
        ),
        GemmSpec(
            GemmKind.NVFP4,
            ActivationFormat(dtype=DispatchDtype.NVFP4, layout=ScaleLayout.BLOCK_16),
            ScaleLayout.BLOCK_16,
            torch.uint8,
            torch.uint8,
            k_multiple=16,
        ),
        _bf16_weight_only(GemmKind.BF16_MXFP4, ScaleLayout.BLOCK_32, 32),
        _bf16_weight_only(GemmKind.BF16_NVFP4, ScaleLayout.BLOCK_16, 16),
    )
}


@functools.lru_cache(maxsize=None)  # a pure function of a small, fixed set of formats
def _kind_of_formats(key: object, storage: torch.dtype, layout: ScaleLayout) -> GemmKind | None:
    """The kind whose activation format is `key` (a float dtype, or a (dispatch dtype, layout) pair) and
    whose weights are stored as `storage` in `layout`, or None."""
    if isinstance(key, tuple):
        fmt = ActivationFormat(dtype=key[0], layout=key[1])
    else:
        fmt = ActivationFormat(float_dtype=key)  # type: ignore[arg-type]
    for spec in GEMM_KINDS.values():
        if spec.accepts(fmt) and spec.weight_layout is layout and spec.weight_storage == storage:
            return spec.kind
    return None


def gemm_kinds_consuming(dtype: DispatchDtype) -> tuple[GemmKind, ...]:
    """The kinds whose activation operand is a `QuantizedTensor` of `dtype`."""
    return tuple(s.kind for s in GEMM_KINDS.values() if any(f.dtype is dtype for f in (s.activation, *s.also_accepts)))


def gemm_kind_of(x: torch.Tensor | QuantizedTensor | PackedInt4Tensor, weight: QuantizedWeight) -> GemmKind:
    """The grouped-matmul kind an (activation, weight) pair asks for; `InvalidInput` if none."""
    # Looked up once per (operand format, weight format): this runs twice per forward.
    if isinstance(x, torch.Tensor):
        key: object = x.dtype
    else:  # a QuantizedTensor's (dispatch dtype, layout); other operands take the general path below
        dtype, layout = getattr(x, "dtype", None), getattr(x, "layout", None)
        key = (dtype, layout) if isinstance(dtype, DispatchDtype) and isinstance(layout, ScaleLayout) else None
    found = _kind_of_formats(key, weight.data.dtype, weight.layout) if key is not None else None
    if found is not None:
        return found
    fmt = ActivationFormat.of(x)
    for spec in GEMM_KINDS.values():
        if spec.accepts(fmt) and spec.pairs_with(weight):
            return spec.kind
    if fmt is not None and fmt.dtype is not None:
        activation = f"{fmt.dtype} {fmt.layout} activations"
    else:
        activation = f"{fmt} activations" if fmt is not None and fmt.int4 else f"{getattr(x, 'dtype', x)} activations"
    pairings = "; ".join(s.pairing() for s in GEMM_KINDS.values())
    raise InvalidInput(
        f"grouped_matmul operands: expected a supported pairing ({pairings}), "
        f"got {activation} with {weight.data.dtype} {weight.layout} weights"
    )
