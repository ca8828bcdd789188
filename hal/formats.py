"""Quantized tensor formats exchanged between hal ops: activations and expert weights.

These are plain, validated containers; vendors produce and consume them. The layouts
(dtype, layout: data; scale):

- bf16, none: data `[..., H]` bf16; scale none
- int8, per-token: data `[..., H]` int8; scale `[...]` fp32
- fp8, per-token: data `[..., H]` float8_e4m3fn; scale `[...]` fp32
- fp8, per-token-group-128: data `[..., H]` float8_e4m3fn; scale `[..., ceil(H/128)]` fp32
- nvfp4, block-16: data `[..., H/2]` uint8 (two e2m1 codes, low nibble first); scale `[..., H/16]`
  float8_e4m3fn, plus `global_scale` fp32 scalar

Dequantization: `x = data * scale` (scale broadcast over its channels); nvfp4:
`x = e2m1(code) * scale / global_scale`.

Int4 activations are a compute format, never a dispatch dtype (no dispatcher carries
them): `PackedInt4Tensor`, values in [-7, 7] per token, eight packed per int32 along the
last dimension (value j of a word in bits 4j..4j+3, two's complement), fp32 scale `[...]`.

Expert weights are `[E, K, N]` (the activation `[M, K]` times one expert's `[K, N]`), by
layout (layout: data; scale):

- none: data `[E, K, N]` bf16/fp16/fp32; scale none
- per-channel: data `[E, K, N]` int8 or float8_e4m3fn; scale `[E, N]` fp32
- per-channel (int4): data `[E, K, N/8]` int32, eight int4 per word along N (as activations);
  scale `[E, N]` fp32
- block-128x128: data `[E, K, N]` float8_e4m3fn; scale `[E, ceil(K/128), ceil(N/128)]` fp32
- block-16 (nvfp4): data `[E, K/2, N]` uint8, two e2m1 codes along K (k even in the low nibble);
  scale `[E, K/16, N]` float8_e4m3fn, plus `global_scale` fp32 `[E]` or `[E, N]`
- block-32 (mxfp4): data `[E, K/2, N]` uint8, two e2m1 codes along K (as nvfp4); scale `[E, K/32, N]`
  uint8, e8m0 biased exponents (byte s means `2**(s - 127)`; 255, NaN, is refused where values are read)

Dequantized weights: `w = data * scale`; nvfp4: `w = e2m1(code) * scale / global_scale[e]`, or
`/ global_scale[e, n]` where the global scale is per output channel (a checkpoint whose gate and
up projections have different global scales keeps both, exactly); mxfp4: `w = e2m1(code) * 2**(s - 127)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hal.dtypes import (
    E2M1_WEIGHT_BLOCKS,
    FLOAT_DTYPES,
    FP8_GROUP_SIZE,
    INT4_MAX,
    INT4_PER_WORD,
    MXFP4_BLOCK_SIZE,
    NVFP4_BLOCK_SIZE,
    DispatchDtype,
    ScaleLayout,
)
from hal.errors import InvalidInput, invalid
from hal.gemm_kinds import GEMM_KINDS

__all__ = [
    "FLOAT_DTYPES",
    "INT4_MAX",
    "INT4_PER_WORD",
    "PackedInt4Tensor",
    "QuantizedTensor",
    "QuantizedWeight",
    "RowTake",
    "take_rows",
]


@dataclass(frozen=True)
class QuantizedTensor:
    """Activations in a dispatch dtype, with their scales carried beside (the row of `hal.DTYPES`
    for `dtype` says what `data`, `scale` and `global_scale` must be)."""

    data: torch.Tensor
    dtype: DispatchDtype
    layout: ScaleLayout
    scale: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # Built on every forward (each quantization, each view of rows): members already parsed skip the parse.
        dtype = self.dtype if type(self.dtype) is DispatchDtype else DispatchDtype.parse(self.dtype)
        if dtype is DispatchDtype.AUTO:
            raise InvalidInput("QuantizedTensor.dtype: expected a concrete dtype, got 'auto'")
        spec = dtype.spec
        layout = self.layout if type(self.layout) is ScaleLayout else ScaleLayout(self.layout)
        if dtype is not self.dtype:
            object.__setattr__(self, "dtype", dtype)
        if layout is not self.layout:
            object.__setattr__(self, "layout", layout)
        if layout not in spec.layouts:
            raise InvalidInput(
                f"QuantizedTensor.layout: expected one of "
                f"{', '.join(map(str, spec.layouts))} for {dtype}, got {layout.value!r}"
            )
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != spec.storage:
            raise InvalidInput(
                f"QuantizedTensor.data: expected {spec.storage} for {dtype}, "
                f"got {getattr(self.data, 'dtype', type(self.data).__name__)}"
            )
        shape = self.data.shape
        if not shape:
            raise InvalidInput("QuantizedTensor.data: expected at least 1 dimension, got a scalar")
        hidden = shape[-1] * spec.values_per_element
        whole = spec.channel_multiple(layout)
        if hidden % whole:
            raise InvalidInput(
                f"QuantizedTensor.data: expected {dtype} data of a multiple of {whole} channels, got {hidden} channels"
            )
        for name, extra in (("scale", self.scale), ("global_scale", self.global_scale)):
            if extra is not None and (not isinstance(extra, torch.Tensor) or extra.device != self.data.device):
                raise InvalidInput(
                    f"QuantizedTensor.{name}: expected a tensor on {self.data.device} (the data's device), "
                    f"got {getattr(extra, 'device', type(extra).__name__)}"
                )
        expected = spec.scale_shape(tuple(shape[:-1]), hidden, layout)
        if expected is None:
            if self.scale is not None:
                raise InvalidInput(f"QuantizedTensor.scale: expected None for {dtype}, got a tensor")
        else:
            if self.scale is None:
                raise InvalidInput(f"QuantizedTensor.scale: expected {spec.scale_dtype} {expected}, got None")
            if tuple(self.scale.shape) != expected or self.scale.dtype != spec.scale_dtype:
                raise InvalidInput(
                    f"QuantizedTensor.scale: expected {spec.scale_dtype} of shape {expected}, "
                    f"got {self.scale.dtype} of shape {tuple(self.scale.shape)}"
                )
        if spec.global_scale:
            gs = self.global_scale
            if gs is None or gs.numel() != 1 or gs.dtype != torch.float32:
                raise InvalidInput(
                    f"QuantizedTensor.global_scale: expected a one-element fp32 tensor for {dtype}, "
                    f"got {None if gs is None else f'{gs.dtype} of shape {tuple(gs.shape)}'}"
                )
        elif self.global_scale is not None:
            raise InvalidInput(f"QuantizedTensor.global_scale: expected None for {dtype}, got a tensor")

    @property
    def hidden_size(self) -> int:
        """Logical channels per token (nvfp4 packs two per byte)."""
        return self.data.shape[-1] * self.dtype.spec.values_per_element

    @property
    def shape(self) -> torch.Size:
        """The logical (unpacked) shape."""
        return torch.Size((*self.data.shape[:-1], self.hidden_size))

    def expected_scale_shape(self) -> tuple[int, ...] | None:
        """The scale shape this layout requires for the data, or None when there is no scale."""
        return self.dtype.spec.scale_shape(tuple(self.data.shape[:-1]), self.hidden_size, self.layout)

    def nbytes(self) -> int:
        """Bytes of payload plus per-token scales (the per-tensor global scale excluded)."""
        total = self.data.numel() * self.data.element_size()
        if self.scale is not None:
            total += self.scale.numel() * self.scale.element_size()
        return total

    def rows(self, index: torch.Tensor | slice, take: RowTake | None = None) -> QuantizedTensor:
        """The rows `index` of `[N, H]` activations (scales follow their rows); `take(t, index)`, when given,
        copies each tensor's rows (a vendor's gather) instead of indexing."""
        pick = _indexing if take is None else take
        return QuantizedTensor(
            pick(self.data, index),
            self.dtype,
            self.layout,
            None if self.scale is None else pick(self.scale, index),
            self.global_scale,
        )


@dataclass(frozen=True)
class PackedInt4Tensor:
    """Per-token int4 activations, eight values packed per int32 word (see the module table)."""

    data: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.data.dtype != torch.int32 or self.data.dim() < 1:
            raise InvalidInput(
                f"PackedInt4Tensor.data: expected int32 with at least 1 dimension, "
                f"got {self.data.dtype} of shape {tuple(self.data.shape)}"
            )
        lead = tuple(self.data.shape[:-1])
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != lead:
            raise InvalidInput(
                f"PackedInt4Tensor.scale: expected float32 of shape {lead}, "
                f"got {self.scale.dtype} of shape {tuple(self.scale.shape)}"
            )
        if self.scale.device != self.data.device:
            raise InvalidInput(
                f"PackedInt4Tensor.scale: expected a tensor on {self.data.device} (the data's device), "
                f"got {self.scale.device}"
            )

    @property
    def hidden_size(self) -> int:
        """Logical channels per token (eight per int32 word)."""
        return self.data.shape[-1] * INT4_PER_WORD

    @property
    def shape(self) -> torch.Size:
        """The logical (unpacked) shape."""
        return torch.Size((*self.data.shape[:-1], self.hidden_size))

    def rows(self, index: torch.Tensor | slice, take: RowTake | None = None) -> PackedInt4Tensor:
        """The rows `index` of `[N, H]` activations (scales follow their rows; `take` as `QuantizedTensor.rows`)."""
        pick = _indexing if take is None else take
        return PackedInt4Tensor(pick(self.data, index), pick(self.scale, index))


#: Copies the rows `index` of a tensor (`t[index]`, or a vendor's own gather of a 1-D int index).
RowTake = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _indexing(t: torch.Tensor, index: torch.Tensor | slice) -> torch.Tensor:
    return t[index]


def take_rows(
    x: torch.Tensor | QuantizedTensor | PackedInt4Tensor, index: torch.Tensor, take: RowTake | None = None
) -> torch.Tensor | QuantizedTensor | PackedInt4Tensor:
    """The rows `index` (1-D int) of activations `[N, H]` in any activation format (scales follow), copied by
    `take(tensor, index)` where given (a vendor's gather kernel), else by torch's indexing."""
    if isinstance(x, torch.Tensor):
        return x.index_select(0, index) if take is None else take(x, index)
    return x.rows(index, take)


@dataclass(frozen=True)
class QuantizedWeight:
    """Expert weights `[E, K, N]`: float, per-channel int8/fp8/int4, block-128 fp8, nvfp4 or mxfp4."""

    data: torch.Tensor
    layout: ScaleLayout = ScaleLayout.NONE
    scale: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None  #: nvfp4 only: fp32 `[E]`, or `[E, N]` per output channel

    def __post_init__(self) -> None:
        try:
            layout = ScaleLayout(self.layout)
        except ValueError:
            raise invalid("QuantizedWeight.layout", f"one of {[str(v) for v in ScaleLayout]}", self.layout) from None
        object.__setattr__(self, "layout", layout)
        for name in ("data", "scale", "global_scale"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) and (name == "data" or value is not None):
                raise invalid(
                    f"QuantizedWeight.{name}",
                    "a torch.Tensor" + ("" if name == "data" else " or None"),
                    type(value).__name__,
                )
        if self.data.dim() != 3:
            raise InvalidInput(
                f"QuantizedWeight.data: expected 3 dimensions [experts, K, N], got shape {tuple(self.data.shape)}"
            )
        if layout is not ScaleLayout.BLOCK_16 and self.global_scale is not None:
            raise InvalidInput(f"QuantizedWeight.global_scale: expected None for {layout} weights, got a tensor")
        if layout is ScaleLayout.NONE:
            if self.data.dtype not in FLOAT_DTYPES:
                raise InvalidInput(
                    f"QuantizedWeight.data: expected bf16/fp16/fp32 for unscaled weights, got {self.data.dtype}"
                )
            if self.scale is not None:
                raise InvalidInput("QuantizedWeight.scale: expected None for unscaled weights, got a tensor")
            return
        e, k, n = self.num_experts, self.in_features, self.out_features
        scale_dtype = torch.float32
        allowed = tuple(dict.fromkeys(s.weight_storage for s in GEMM_KINDS.values() if s.weight_layout is layout))
        if layout is ScaleLayout.PER_CHANNEL:
            shape = (e, n)
        elif layout is ScaleLayout.BLOCK_128X128:
            shape = (e, math.ceil(k / FP8_GROUP_SIZE), math.ceil(n / FP8_GROUP_SIZE))
        elif layout is ScaleLayout.BLOCK_32:
            shape, scale_dtype = (e, k // MXFP4_BLOCK_SIZE, n), torch.uint8
            if k % MXFP4_BLOCK_SIZE:
                raise InvalidInput(
                    f"QuantizedWeight.data: expected K a multiple of {MXFP4_BLOCK_SIZE} for mxfp4, got K={k}"
                )
        elif layout is ScaleLayout.BLOCK_16:
            shape, scale_dtype = (e, k // NVFP4_BLOCK_SIZE, n), torch.float8_e4m3fn
            if k % NVFP4_BLOCK_SIZE:
                raise InvalidInput(
                    f"QuantizedWeight.data: expected K a multiple of {NVFP4_BLOCK_SIZE} for nvfp4, got K={k}"
                )
            gs = self.global_scale
            if (
                gs is None
                or gs.dtype != torch.float32
                or tuple(gs.shape) not in ((e,), (e, n))
                or gs.device != self.data.device
            ):
                got = None if gs is None else f"{gs.dtype} {tuple(gs.shape)} on {gs.device}"
                raise InvalidInput(
                    f"QuantizedWeight.global_scale: expected float32 of shape {(e,)} or {(e, n)} on "
                    f"{self.data.device} for nvfp4 weights, got {got}"
                )
        else:
            raise InvalidInput(
                f"QuantizedWeight.layout: expected none, per-channel, block-128x128, block-16 or block-32, "
                f"got {layout.value!r}"
            )
        if self.data.dtype not in allowed:
            raise InvalidInput(
                f"QuantizedWeight.data: expected {' or '.join(map(str, allowed))} for {layout}, got {self.data.dtype}"
            )
        if self.scale is None or tuple(self.scale.shape) != shape or self.scale.dtype != scale_dtype:
            got = None if self.scale is None else f"{self.scale.dtype} {tuple(self.scale.shape)}"
            want = str(scale_dtype).removeprefix("torch.")
            raise InvalidInput(f"QuantizedWeight.scale: expected {want} of shape {shape}, got {got}")
        if self.scale.device != self.data.device:
            raise InvalidInput(
                f"QuantizedWeight.scale: expected a tensor on {self.data.device} (the data's device), "
                f"got {self.scale.device}"
            )

    @property
    def num_experts(self) -> int:
        """Number of experts (groups)."""
        return self.data.shape[0]

    @property
    def in_features(self) -> int:
        """K: the activation channels each expert consumes (logical, unpacked)."""
        k = self.data.shape[1]
        return k * 2 if self.layout in E2M1_WEIGHT_BLOCKS else k

    @property
    def out_features(self) -> int:
        """N: the channels each expert produces (logical, unpacked)."""
        n = self.data.shape[2]
        return n * INT4_PER_WORD if self.is_int4 else n

    @property
    def is_int4(self) -> bool:
        """Whether the data is int4 packed eight per int32 word."""
        return self.data.dtype == torch.int32

    def select(self, experts: slice) -> QuantizedWeight:
        """The weights of a contiguous range of experts (e.g. this rank's local experts)."""
        return QuantizedWeight(
            self.data[experts],
            self.layout,
            None if self.scale is None else self.scale[experts],
            None if self.global_scale is None else self.global_scale[experts],
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that make up these weights, by field name (None fields left out)."""
        fields = {"data": self.data, "scale": self.scale, "global_scale": self.global_scale}
        return {name: t for name, t in fields.items() if t is not None}
