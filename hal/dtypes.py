"""Dispatch dtypes and scale layouts, with the one table that says what each dtype is.

Every dispatch dtype is one row of `DTYPES` (a `DtypeSpec`): its payload storage, how
many values share a storage element, the activation scale layouts it can be carried with,
its scale dtype, how it is quantized (`Codec`), its names. Bytes per token, the scale shape
of a layout, the GEMM kinds that consume it: everything else is computed from the row.
Code asks the row (`DispatchDtype.FP8.spec`) instead of testing which dtype it holds.

The numeric constants of the formats (`INT8_MAX`, `FP8_MAX`, `E2M1_VALUES`, ...) live here
too, so that every implementation reads the same ones.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from hal.errors import InvalidInput, positive_int

#: Channels that share one fp32 scale in the block-scaled fp8 layout.
FP8_GROUP_SIZE = 128
#: Values that share one e4m3 scale in nvfp4.
NVFP4_BLOCK_SIZE = 16
#: Values along K that share one e8m0 scale in mxfp4 weights (OCP microscaling).
MXFP4_BLOCK_SIZE = 32
#: The bias of an e8m0 scale byte: byte s means 2**(s - 127); 255 is NaN.
E8M0_BIAS = 127
#: The e8m0 byte that encodes NaN (no finite scale).
E8M0_NAN = 255
#: Largest int8 magnitude of symmetric quantization.
INT8_MAX = 127.0
#: Largest finite float8_e4m3fn.
FP8_MAX = 448.0
#: Largest e2m1 (fp4) magnitude.
FP4_MAX = 6.0
#: Largest int4 magnitude used by symmetric quantization (the range is [-7, 7]).
INT4_MAX = 7
#: Int4 values packed into one int32 word.
INT4_PER_WORD = 8
#: The float dtypes of activations and unscaled weights.
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: The host, where conversions that every device's torch can compute run (weights converted once at load:
#: fp8 values are decoded there even where the accelerator has no fp8 dtype).
HOST_DEVICE = torch.device("cpu")
#: e2m1 magnitude of each 3-bit code (exponent << 1 | mantissa); bit 3 of a code is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class ScaleLayout(str, enum.Enum):
    """How scales are laid out beside quantized data."""

    NONE = "none"  #: unquantized (bf16, fp16, fp32): no scales
    PER_TOKEN = "per-token"  #: one fp32 scale per row
    GROUP_128 = "per-token-group-128"  #: one fp32 scale per row and 128 channels
    BLOCK_16 = "block-16"  #: nvfp4: one e4m3 scale per 16 values plus a per-tensor fp32 scale
    PER_CHANNEL = "per-channel"  #: weights: one fp32 scale per output channel and expert
    BLOCK_128X128 = "block-128x128"  #: weights: one fp32 scale per 128x128 tile and expert
    BLOCK_32 = "block-32"  #: mxfp4 weights: one e8m0 scale (a uint8 biased exponent) per 32 values along K

    def __str__(self) -> str:
        return self.value

    @property
    def group_size(self) -> int | None:
        """Channels one activation scale covers: None for the whole row (per token), 0 for no scale."""
        return _GROUP_SIZE.get(self, 0)

    @property
    def whole_groups(self) -> bool:
        """Whether a row must hold whole scale groups (nvfp4 blocks); fp8 groups may end partial."""
        return self is ScaleLayout.BLOCK_16

    def scales_per_token(self, hidden_size: int) -> int:
        """Activation scales one token of `hidden_size` channels carries in this layout."""
        size = self.group_size
        if size is None:
            return 1
        return 0 if size == 0 else math.ceil(hidden_size / size)


_GROUP_SIZE: dict[ScaleLayout, int | None] = {
    ScaleLayout.NONE: 0,
    ScaleLayout.PER_TOKEN: None,
    ScaleLayout.GROUP_128: FP8_GROUP_SIZE,
    ScaleLayout.BLOCK_16: NVFP4_BLOCK_SIZE,
}

#: The layouts of expert weights (activations use the others).
WEIGHT_LAYOUTS = (
    ScaleLayout.NONE,
    ScaleLayout.PER_CHANNEL,
    ScaleLayout.BLOCK_128X128,
    ScaleLayout.BLOCK_16,
    ScaleLayout.BLOCK_32,
)
#: The weight layouts of e2m1 codes packed two per byte along K, by the values one block scale covers.
E2M1_WEIGHT_BLOCKS: dict[ScaleLayout, int] = {
    ScaleLayout.BLOCK_16: NVFP4_BLOCK_SIZE,
    ScaleLayout.BLOCK_32: MXFP4_BLOCK_SIZE,
}
#: Other names of weight layouts (`quantize_weight(w, "mxfp4")`).
WEIGHT_LAYOUT_ALIASES: dict[str, ScaleLayout] = {"mxfp4": ScaleLayout.BLOCK_32, "nvfp4": ScaleLayout.BLOCK_16}


class Codec(str, enum.Enum):
    """How values of a dtype are made from floats (the reference implements each once)."""

    CAST = "cast"  #: a plain cast to the storage dtype, no scale
    SYMMETRIC = "symmetric"  #: scale = amax / qmax per scale group; values x / scale, saturated (rounded for ints)
    E2M1_BLOCKS = "e2m1-blocks"  #: nvfp4: fp32 global scale, e4m3 block scales, e2m1 codes two per byte


class DispatchDtype(str, enum.Enum):
    """A dtype the token dispatcher can carry; `AUTO` is a request meaning "let hal decide"."""

    BF16 = "bf16"
    FP8 = "fp8"  #: float8 e4m3
    INT8 = "int8"
    NVFP4 = "nvfp4"
    FP16 = "fp16"  #: float16, a plain cast (fp16 models)
    FP32 = "fp32"  #: float32, a plain cast (fp32 models)
    AUTO = "auto"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: DispatchDtype | str) -> DispatchDtype:
        """Parse a user string case-insensitively (`"BF16"`, `"fp8_e4m3"`, ...).

        Raises `InvalidInput` listing the valid names when the value is unknown.
        """
        if isinstance(value, DispatchDtype):
            return value
        found = _ALIASES.get(value.strip().lower().replace("-", "_")) if isinstance(value, str) else None
        if found is None:
            raise InvalidInput(f"dispatch dtype: expected one of {', '.join(cls.names())}, got {value!r}")
        return found

    @classmethod
    def names(cls) -> list[str]:
        """The canonical names, `auto` included."""
        return [d.value for d in cls]

    @classmethod
    def concrete(cls) -> list[DispatchDtype]:
        """Every dtype a dispatcher can actually carry (all but `AUTO`)."""
        return [d for d in cls if d is not cls.AUTO]

    @classmethod
    def cast_of(cls, dtype: torch.dtype) -> DispatchDtype | None:
        """The dtype whose rows are a plain cast to the torch float `dtype` (`torch.float32` -> fp32),
        read from the table; None when no cast row stores that dtype."""
        return next((s.dtype for s in DTYPES.values() if s.codec is Codec.CAST and s.storage == dtype), None)

    @property
    def spec(self) -> DtypeSpec:
        """This dtype's row of the table (`InvalidInput` for `AUTO`)."""
        found = DTYPES.get(self)
        if found is None:
            raise InvalidInput("dispatch dtype: expected a concrete dtype, got 'auto'")
        return found

    @property
    def default_scale_layout(self) -> ScaleLayout:
        """The activation scale layout this dtype uses unless told otherwise."""
        return self.spec.default_layout

    def scale_layouts(self) -> tuple[ScaleLayout, ...]:
        """The activation scale layouts this dtype can be carried with."""
        return self.spec.layouts

    def bytes_per_token(self, hidden_size: int, layout: ScaleLayout | None = None) -> int:
        """Bytes one token of `hidden_size` channels occupies in a dispatch buffer, scales included
        (payload plus per-token scales; a per-tensor global scale is not per token)."""
        if self is DispatchDtype.AUTO:
            raise InvalidInput("dispatch dtype: expected a concrete dtype to size a buffer, got 'auto'")
        return self.spec.bytes_per_token(hidden_size, layout)


@dataclass(frozen=True)
class DtypeSpec:
    """One dispatch dtype: what its payload and scales are, and how it is quantized.

    `storage` is the torch dtype of the payload, `values_per_element` how many logical
    values one storage element holds (nvfp4 packs two); `layouts` are the activation
    scale layouts it can be carried with, the first being the default; `scale_dtype` the
    dtype of its scales (None: unscaled); `qmax` the largest magnitude of its values;
    `rounds` whether quantization rounds to integers before the cast; `global_scale`
    whether a per-tensor fp32 scale comes with it.
    """

    dtype: DispatchDtype
    storage: torch.dtype
    layouts: tuple[ScaleLayout, ...]
    codec: Codec
    description: str
    values_per_element: int = 1
    scale_dtype: torch.dtype | None = None
    qmax: float | None = None
    rounds: bool = False
    global_scale: bool = False
    aliases: tuple[str, ...] = ()

    @property
    def default_layout(self) -> ScaleLayout:
        """The layout used unless a plan or a vendor says otherwise."""
        return self.layouts[0]

    def layout(self, layout: ScaleLayout | str | None) -> ScaleLayout:
        """`layout` parsed and checked against this dtype (None: the default)."""
        if layout is None:
            return self.default_layout
        try:
            parsed = ScaleLayout(layout)
        except ValueError:
            parsed = None
        if parsed not in self.layouts:
            raise InvalidInput(
                f"scale layout: expected one of {', '.join(map(str, self.layouts))} for "
                f"{self.dtype.value}, got {getattr(layout, 'value', layout)!r}"
            )
        return parsed

    def channel_multiple(self, layout: ScaleLayout) -> int:
        """What the channels of a row must be a multiple of (whole nvfp4 blocks; else whole storage elements)."""
        return math.lcm(layout.group_size if layout.whole_groups else 1, self.values_per_element)

    def check_hidden(self, argument: str, hidden_size: int, layout: ScaleLayout) -> None:
        """Raise `InvalidInput` unless rows of `hidden_size` channels fit the layout."""
        whole = self.channel_multiple(layout)
        if hidden_size % whole:
            raise InvalidInput(f"{argument}: expected a multiple of {whole} for {self.dtype.value}, got {hidden_size}")

    def payload_bytes(self, hidden_size: int) -> int:
        """Bytes of one token's values (without scales)."""
        return hidden_size * self.storage.itemsize // self.values_per_element

    def scale_shape(self, lead: tuple[int, ...], hidden_size: int, layout: ScaleLayout) -> tuple[int, ...] | None:
        """The shape of the scales of rows `[*lead, hidden_size]` (None: no scales)."""
        if self.scale_dtype is None or layout is ScaleLayout.NONE:
            return None
        if layout.group_size is None:
            return lead
        return (*lead, layout.scales_per_token(hidden_size))

    def bytes_per_token(self, hidden_size: int, layout: ScaleLayout | str | None = None) -> int:
        """Payload plus per-token scales of one token, in bytes."""
        positive_int("hidden_size", hidden_size)
        chosen = self.layout(layout)
        self.check_hidden("hidden_size", hidden_size, chosen)
        scale_bytes = self.scale_dtype.itemsize if self.scale_dtype is not None else 0
        return self.payload_bytes(hidden_size) + chosen.scales_per_token(hidden_size) * scale_bytes


#: The dispatch dtypes, one row each. A new dtype is a new row (and an enum member above).
DTYPES: dict[DispatchDtype, DtypeSpec] = {
    spec.dtype: spec
    for spec in (
        DtypeSpec(
            DispatchDtype.BF16,
            torch.bfloat16,
            (ScaleLayout.NONE,),
            Codec.CAST,
            "bf16, a plain cast",
            aliases=("bfloat16",),
        ),
        DtypeSpec(
            DispatchDtype.FP8,
            torch.float8_e4m3fn,
            (ScaleLayout.GROUP_128, ScaleLayout.PER_TOKEN),
            Codec.SYMMETRIC,
            "float8 e4m3, fp32 scales per 128 channels or per token",
            scale_dtype=torch.float32,
            qmax=FP8_MAX,
            aliases=("fp8_e4m3", "e4m3", "float8_e4m3fn"),
        ),
        DtypeSpec(
            DispatchDtype.INT8,
            torch.int8,
            (ScaleLayout.PER_TOKEN,),
            Codec.SYMMETRIC,
            "int8, an fp32 scale per token",
            scale_dtype=torch.float32,
            qmax=INT8_MAX,
            rounds=True,
        ),
        DtypeSpec(
            DispatchDtype.NVFP4,
            torch.uint8,
            (ScaleLayout.BLOCK_16,),
            Codec.E2M1_BLOCKS,
            "e2m1 two per byte, an e4m3 scale per 16 values, an fp32 scale per tensor",
            values_per_element=2,
            scale_dtype=torch.float8_e4m3fn,
            qmax=FP4_MAX,
            global_scale=True,
        ),
        DtypeSpec(
            DispatchDtype.FP16,
            torch.float16,
            (ScaleLayout.NONE,),
            Codec.CAST,
            "fp16, a plain cast (values beyond +-65504 become inf, as any fp16 cast)",
            aliases=("float16", "half"),
        ),
        DtypeSpec(
            DispatchDtype.FP32,
            torch.float32,
            (ScaleLayout.NONE,),
            Codec.CAST,
            "fp32, a plain cast",
            aliases=("float32", "float"),
        ),
    )
}

_ALIASES: dict[str, DispatchDtype] = {
    **{alias: spec.dtype for spec in DTYPES.values() for alias in (spec.dtype.value, *spec.aliases)},
    "auto": DispatchDtype.AUTO,
}
