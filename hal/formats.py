"""Quantized tensor formats exchanged between hal ops: activations and expert weights.

These are plain, validated containers; vendors produce and consume them. The layouts:

| dtype | layout | data | scale |
|---|---|---|---|
| bf16 | none | `[..., H]` bf16 | none |
| int8 | per-token | `[..., H]` int8 | `[...]` fp32 |
| fp8 | per-token | `[..., H]` float8_e4m3fn | `[...]` fp32 |
| fp8 | per-token-group-128 | `[..., H]` float8_e4m3fn | `[..., ceil(H/128)]` fp32 |
| nvfp4 | block-16 | `[..., H/2]` uint8 (two e2m1 codes, low nibble first) | `[..., H/16]` float8_e4m3fn, plus `global_scale` fp32 scalar |

Dequantization: `x = data * scale` (scale broadcast over its channels); nvfp4:
`x = e2m1(code) * scale / global_scale`.

Int4 activations are a compute format, never a dispatch dtype (no dispatcher carries
them): `PackedInt4Tensor`, values in [-7, 7] per token, eight packed per int32 along the
last dimension (value j of a word in bits 4j..4j+3, two's complement), fp32 scale `[...]`.

Expert weights are `[E, K, N]` (the activation `[M, K]` times one expert's `[K, N]`):

| layout | data | scale |
|---|---|---|
| none | `[E, K, N]` bf16/fp16/fp32 | none |
| per-channel | `[E, K, N]` int8 or float8_e4m3fn | `[E, N]` fp32 |
| per-channel (int4) | `[E, K, N/8]` int32, eight int4 per word along N (as activations) | `[E, N]` fp32 |
| block-128x128 | `[E, K, N]` float8_e4m3fn | `[E, ceil(K/128), ceil(N/128)]` fp32 |
| block-16 (nvfp4) | `[E, K/2, N]` uint8, two e2m1 codes along K (k even in the low nibble) | `[E, K/16, N]` float8_e4m3fn, plus `global_scale` fp32 `[E]` |

Dequantized weights: `w = data * scale`; nvfp4: `w = e2m1(code) * scale / global_scale[e]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hal.capabilities import GemmKind
from hal.dtypes import FP8_GROUP_SIZE, NVFP4_BLOCK_SIZE, DispatchDtype, ScaleLayout
from hal.errors import InvalidInput

#: Int4 values packed into one int32 word.
INT4_PER_WORD = 8
#: Largest int4 magnitude used by symmetric quantization (the range is [-7, 7]).
INT4_MAX = 7

#: The torch storage dtype of each dispatch dtype's payload.
STORAGE_DTYPE: dict[DispatchDtype, torch.dtype] = {
    DispatchDtype.BF16: torch.bfloat16,
    DispatchDtype.FP8: torch.float8_e4m3fn,
    DispatchDtype.INT8: torch.int8,
    DispatchDtype.NVFP4: torch.uint8,
}

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class QuantizedTensor:
    """Activations in a dispatch dtype, with their scales carried beside."""

    data: torch.Tensor
    dtype: DispatchDtype
    layout: ScaleLayout
    scale: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        dtype = DispatchDtype.parse(self.dtype)
        layout = ScaleLayout(self.layout)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "layout", layout)
        if dtype is DispatchDtype.AUTO:
            raise InvalidInput("QuantizedTensor.dtype: expected a concrete dtype, got 'auto'")
        if layout not in dtype.scale_layouts():
            raise InvalidInput(
                f"QuantizedTensor.layout: expected one of "
                f"{', '.join(map(str, dtype.scale_layouts()))} for {dtype}, got {layout.value!r}"
            )
        if self.data.dtype != STORAGE_DTYPE[dtype]:
            raise InvalidInput(
                f"QuantizedTensor.data: expected {STORAGE_DTYPE[dtype]} for {dtype}, got {self.data.dtype}"
            )
        if self.data.dim() < 1:
            raise InvalidInput("QuantizedTensor.data: expected at least 1 dimension, got a scalar")
        if dtype is DispatchDtype.NVFP4 and self.hidden_size % NVFP4_BLOCK_SIZE:
            raise InvalidInput(
                f"QuantizedTensor.data: expected nvfp4 data of a multiple of {NVFP4_BLOCK_SIZE} channels "
                f"({NVFP4_BLOCK_SIZE // 2} bytes), got {self.hidden_size} channels"
            )
        for name, extra in (("scale", self.scale), ("global_scale", self.global_scale)):
            if extra is not None and extra.device != self.data.device:
                raise InvalidInput(
                    f"QuantizedTensor.{name}: expected a tensor on {self.data.device} (the data's device), "
                    f"got {extra.device}"
                )
        expected = self.expected_scale_shape()
        if expected is None:
            if self.scale is not None:
                raise InvalidInput(f"QuantizedTensor.scale: expected None for {dtype}, got a tensor")
        else:
            want_dtype = torch.float8_e4m3fn if dtype is DispatchDtype.NVFP4 else torch.float32
            if self.scale is None:
                raise InvalidInput(f"QuantizedTensor.scale: expected {want_dtype} {expected}, got None")
            if tuple(self.scale.shape) != expected or self.scale.dtype != want_dtype:
                raise InvalidInput(
                    f"QuantizedTensor.scale: expected {want_dtype} of shape {expected}, "
                    f"got {self.scale.dtype} of shape {tuple(self.scale.shape)}"
                )
        if dtype is DispatchDtype.NVFP4:
            gs = self.global_scale
            if gs is None or gs.numel() != 1 or gs.dtype != torch.float32:
                raise InvalidInput(
                    "QuantizedTensor.global_scale: expected a one-element fp32 tensor for nvfp4, "
                    f"got {None if gs is None else f'{gs.dtype} of shape {tuple(gs.shape)}'}"
                )
        elif self.global_scale is not None:
            raise InvalidInput(f"QuantizedTensor.global_scale: expected None for {dtype}, got a tensor")

    @property
    def hidden_size(self) -> int:
        """Logical channels per token (nvfp4 packs two per byte)."""
        last = self.data.shape[-1]
        return last * 2 if self.dtype is DispatchDtype.NVFP4 else last

    @property
    def shape(self) -> torch.Size:
        """The logical (unpacked) shape."""
        return torch.Size((*self.data.shape[:-1], self.hidden_size))

    def expected_scale_shape(self) -> tuple[int, ...] | None:
        """The scale shape this layout requires for the data, or None when there is no scale."""
        lead = tuple(self.data.shape[:-1])
        if self.layout is ScaleLayout.NONE:
            return None
        if self.layout is ScaleLayout.PER_TOKEN:
            return lead
        if self.layout is ScaleLayout.GROUP_128:
            return (*lead, math.ceil(self.data.shape[-1] / FP8_GROUP_SIZE))
        return (*lead, self.hidden_size // NVFP4_BLOCK_SIZE)

    def nbytes(self) -> int:
        """Bytes of payload plus per-token scales (the per-tensor global scale excluded)."""
        total = self.data.numel() * self.data.element_size()
        if self.scale is not None:
            total += self.scale.numel() * self.scale.element_size()
        return total


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


@dataclass(frozen=True)
class QuantizedWeight:
    """Expert weights `[E, K, N]`: float, per-channel int8/fp8/int4, block-128 fp8 or nvfp4."""

    data: torch.Tensor
    layout: ScaleLayout = ScaleLayout.NONE
    scale: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None  #: nvfp4 only: fp32 `[E]`

    def __post_init__(self) -> None:
        layout = ScaleLayout(self.layout)
        object.__setattr__(self, "layout", layout)
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
        if layout is ScaleLayout.PER_CHANNEL:
            allowed, shape = (torch.int8, torch.float8_e4m3fn, torch.int32), (e, n)
        elif layout is ScaleLayout.BLOCK_128X128:
            allowed = (torch.float8_e4m3fn,)
            shape = (e, math.ceil(k / FP8_GROUP_SIZE), math.ceil(n / FP8_GROUP_SIZE))
        elif layout is ScaleLayout.BLOCK_16:
            allowed, shape, scale_dtype = (torch.uint8,), (e, k // NVFP4_BLOCK_SIZE, n), torch.float8_e4m3fn
            if k % NVFP4_BLOCK_SIZE:
                raise InvalidInput(
                    f"QuantizedWeight.data: expected K a multiple of {NVFP4_BLOCK_SIZE} for nvfp4, got K={k}"
                )
            gs = self.global_scale
            if gs is None or gs.dtype != torch.float32 or tuple(gs.shape) != (e,) or gs.device != self.data.device:
                got = None if gs is None else f"{gs.dtype} {tuple(gs.shape)} on {gs.device}"
                raise InvalidInput(
                    f"QuantizedWeight.global_scale: expected float32 of shape {(e,)} on {self.data.device} "
                    f"for nvfp4 weights, got {got}"
                )
        else:
            raise InvalidInput(
                "QuantizedWeight.layout: expected none, per-channel, block-128x128 or block-16, "
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
        return k * 2 if self.layout is ScaleLayout.BLOCK_16 else k

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


def gemm_kind_of(x: torch.Tensor | QuantizedTensor | PackedInt4Tensor, weight: QuantizedWeight) -> GemmKind:
    """The grouped-matmul kind an (activation, weight) pair asks for; `InvalidInput` if none."""
    if isinstance(x, PackedInt4Tensor):
        if weight.layout is ScaleLayout.PER_CHANNEL and weight.is_int4:
            return GemmKind.INT4
        return _no_kind("int4 per-token activations", weight)
    if isinstance(x, torch.Tensor):
        if weight.layout is ScaleLayout.NONE and x.dtype == weight.data.dtype:
            return {torch.bfloat16: GemmKind.BF16, torch.float16: GemmKind.FP16,
                    torch.float32: GemmKind.FP32}[x.dtype]
        return _no_kind(f"{x.dtype} activations", weight)
    if x.dtype is DispatchDtype.BF16 and weight.layout is ScaleLayout.NONE and weight.data.dtype == torch.bfloat16:
        return GemmKind.BF16
    if x.dtype is DispatchDtype.INT8 and weight.layout is ScaleLayout.PER_CHANNEL and weight.data.dtype == torch.int8:
        return GemmKind.INT8
    if x.dtype is DispatchDtype.FP8 and weight.data.dtype == torch.float8_e4m3fn:
        if x.layout is ScaleLayout.PER_TOKEN and weight.layout is ScaleLayout.PER_CHANNEL:
            return GemmKind.FP8_ROWWISE
        if x.layout is ScaleLayout.GROUP_128 and weight.layout is ScaleLayout.BLOCK_128X128:
            return GemmKind.FP8_BLOCK128
    if x.dtype is DispatchDtype.NVFP4 and weight.layout is ScaleLayout.BLOCK_16:
        return GemmKind.NVFP4
    return _no_kind(f"{x.dtype} {x.layout} activations", weight)


def _no_kind(activation: str, weight: QuantizedWeight) -> GemmKind:
    raise InvalidInput(
        "grouped_matmul operands: expected a supported pairing (bf16/fp16/fp32 with the same "
        "float weights; int8 per-token with int8 per-channel; fp8 per-token with fp8 per-channel; "
        "fp8 per-token-group-128 with fp8 block-128x128; int4 per-token with int4 per-channel; "
        "nvfp4 with nvfp4 block-16), "
        f"got {activation} with {weight.data.dtype} {weight.layout} weights"
    )
