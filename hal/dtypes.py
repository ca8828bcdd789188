"""Dispatch dtypes: what the token dispatcher carries, and how many bytes a token costs."""

from __future__ import annotations

import enum
import math

from hal.errors import InvalidInput, positive_int

#: Channels that share one fp32 scale in the block-scaled fp8 layout.
FP8_GROUP_SIZE = 128
#: Values that share one e4m3 scale in nvfp4.
NVFP4_BLOCK_SIZE = 16


class ScaleLayout(str, enum.Enum):
    """How scales are laid out beside quantized data."""

    NONE = "none"  #: unquantized (bf16): no scales
    PER_TOKEN = "per-token"  #: one fp32 scale per row
    GROUP_128 = "per-token-group-128"  #: one fp32 scale per row and 128 channels
    BLOCK_16 = "block-16"  #: nvfp4: one e4m3 scale per 16 values plus a per-tensor fp32 scale
    PER_CHANNEL = "per-channel"  #: weights: one fp32 scale per output channel and expert
    BLOCK_128X128 = "block-128x128"  #: weights: one fp32 scale per 128x128 tile and expert

    def __str__(self) -> str:
        return self.value


class DispatchDtype(str, enum.Enum):
    """A dtype the token dispatcher can carry; `AUTO` is a request meaning "let hal decide"."""

    BF16 = "bf16"
    FP8 = "fp8"  #: float8 e4m3
    INT8 = "int8"
    NVFP4 = "nvfp4"
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
        if not isinstance(value, str):
            raise InvalidInput(
                f"dispatch dtype: expected one of {', '.join(cls.names())}, got {value!r}"
            )
        key = value.strip().lower().replace("-", "_")
        found = _ALIASES.get(key)
        if found is None:
            raise InvalidInput(
                f"dispatch dtype: expected one of {', '.join(cls.names())}, got {value!r}"
            )
        return found

    @classmethod
    def names(cls) -> list[str]:
        """The canonical names, `auto` included."""
        return [d.value for d in cls]

    @classmethod
    def concrete(cls) -> list[DispatchDtype]:
        """Every dtype a dispatcher can actually carry (all but `AUTO`)."""
        return [d for d in cls if d is not cls.AUTO]

    @property
    def default_scale_layout(self) -> ScaleLayout:
        """The activation scale layout this dtype uses unless told otherwise."""
        return _DEFAULT_LAYOUT[self]

    def scale_layouts(self) -> tuple[ScaleLayout, ...]:
        """The activation scale layouts this dtype can be carried with."""
        return _LAYOUTS[self]

    def bytes_per_token(self, hidden_size: int, layout: ScaleLayout | None = None) -> int:
        """Bytes one token of `hidden_size` channels occupies in a dispatch buffer, scales included.

        bf16: 2H. fp8: H + 4 per fp32 scale (one per 128 channels when group-scaled,
        one per token when per-token). int8 per-token: H + 4. nvfp4: H/2 + H/16 (one
        e4m3 scale per 16 values; the fp32 global scale is per tensor, not per token).
        """
        if self is DispatchDtype.AUTO:
            raise InvalidInput(
                "dispatch dtype: expected a concrete dtype to size a buffer, got 'auto'"
            )
        positive_int("hidden_size", hidden_size)
        layout = self.default_scale_layout if layout is None else ScaleLayout(layout)
        if layout not in self.scale_layouts():
            raise InvalidInput(
                f"scale layout: expected one of {', '.join(map(str, self.scale_layouts()))} "
                f"for {self.value}, got {layout.value!r}"
            )
        if self is DispatchDtype.BF16:
            return 2 * hidden_size
        if self is DispatchDtype.INT8:
            return hidden_size + 4
        if self is DispatchDtype.FP8:
            scales = math.ceil(hidden_size / FP8_GROUP_SIZE) if layout is ScaleLayout.GROUP_128 else 1
            return hidden_size + 4 * scales
        if hidden_size % NVFP4_BLOCK_SIZE:
            raise InvalidInput(
                f"hidden_size: expected a multiple of {NVFP4_BLOCK_SIZE} for nvfp4, got {hidden_size}"
            )
        return hidden_size // 2 + hidden_size // NVFP4_BLOCK_SIZE


_ALIASES: dict[str, DispatchDtype] = {
    "bf16": DispatchDtype.BF16,
    "bfloat16": DispatchDtype.BF16,
    "fp8": DispatchDtype.FP8,
    "fp8_e4m3": DispatchDtype.FP8,
    "e4m3": DispatchDtype.FP8,
    "float8_e4m3fn": DispatchDtype.FP8,
    "int8": DispatchDtype.INT8,
    "nvfp4": DispatchDtype.NVFP4,
    "auto": DispatchDtype.AUTO,
}

_DEFAULT_LAYOUT: dict[DispatchDtype, ScaleLayout] = {
    DispatchDtype.BF16: ScaleLayout.NONE,
    DispatchDtype.FP8: ScaleLayout.GROUP_128,
    DispatchDtype.INT8: ScaleLayout.PER_TOKEN,
    DispatchDtype.NVFP4: ScaleLayout.BLOCK_16,
}

_LAYOUTS: dict[DispatchDtype, tuple[ScaleLayout, ...]] = {
    DispatchDtype.BF16: (ScaleLayout.NONE,),
    DispatchDtype.FP8: (ScaleLayout.GROUP_128, ScaleLayout.PER_TOKEN),
    DispatchDtype.INT8: (ScaleLayout.PER_TOKEN,),
    DispatchDtype.NVFP4: (ScaleLayout.BLOCK_16,),
}
