"""What dispatch-dtype resolution needs to know about a quantization scheme.

The schemes themselves (weight formats, expert computation) live in `moe/`; each
exposes a `SchemeTraits` so that `hal` can resolve its dispatch dtype without
importing anything above it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from hal.dtypes import DispatchDtype, ScaleLayout
from hal.errors import InvalidInput


@dataclass(frozen=True)
class SchemeTraits:
    """A quant scheme's dispatch-relevant facts.

    `dispatch_dtype` is the dtype the scheme wants carried (design.md section 4, step 3);
    `input_global_scale` marks NVFP4-style checkpoints, which always ask for nvfp4;
    `accepts` lists every dtype the scheme can consume after dispatch (it re-quantizes or
    dequantizes where the carried dtype differs from what its GEMM needs). `scale_layouts`
    names the layout a dtype with several is carried in for this scheme (`fp8_layout` is
    fp8's entry); the vendor's declared layout applies otherwise.
    """

    name: str
    dispatch_dtype: DispatchDtype
    accepts: frozenset[DispatchDtype]
    input_global_scale: bool = False
    fp8_layout: ScaleLayout | None = None  #: activation scale layout when fp8 is carried
    scale_layouts: Mapping[DispatchDtype, ScaleLayout] = field(default_factory=dict)

    def __post_init__(self) -> None:
        layouts = {DispatchDtype.parse(k): ScaleLayout(v) for k, v in dict(self.scale_layouts).items()}
        if self.fp8_layout is not None:
            layouts[DispatchDtype.FP8] = ScaleLayout(self.fp8_layout)
        for dtype, layout in layouts.items():
            if layout not in dtype.scale_layouts():
                raise InvalidInput(f"scheme {self.name!r}: scale layout {layout} is not one of {dtype}'s "
                                   f"({', '.join(map(str, dtype.scale_layouts()))})")
        object.__setattr__(self, "scale_layouts", MappingProxyType(layouts))
        object.__setattr__(self, "dispatch_dtype", DispatchDtype.parse(self.dispatch_dtype))
        accepts = frozenset(DispatchDtype.parse(d) for d in self.accepts)
        object.__setattr__(self, "accepts", accepts)
        wanted = DispatchDtype.NVFP4 if self.input_global_scale else self.dispatch_dtype
        if wanted not in accepts:
            raise InvalidInput(
                f"scheme {self.name!r}: expected its own dispatch dtype {wanted} among accepted "
                f"dtypes, got {sorted(d.value for d in accepts)}"
            )

    def __hash__(self) -> int:
        return hash((self.name, self.dispatch_dtype, self.accepts, self.input_global_scale))

    def layout_for(self, dtype: DispatchDtype) -> ScaleLayout | None:
        """The layout this scheme carries `dtype` in, or None to leave it to the vendor."""
        return self.scale_layouts.get(dtype)

    @property
    def preferred_dtype(self) -> DispatchDtype:
        """The dtype this scheme asks for: nvfp4 when it has an input global scale."""
        return DispatchDtype.NVFP4 if self.input_global_scale else self.dispatch_dtype


_ALL = frozenset(DispatchDtype.concrete())

#: The schemes moe-hal knows by name (the CLI's `--scheme` choices).
KNOWN_SCHEMES: dict[str, SchemeTraits] = {
    t.name: t
    for t in (
        SchemeTraits("unquantized", DispatchDtype.BF16, _ALL),
        SchemeTraits(
            "w8a8-int8",
            DispatchDtype.INT8,
            frozenset({DispatchDtype.INT8, DispatchDtype.FP8, DispatchDtype.BF16}),
            fp8_layout=ScaleLayout.PER_TOKEN,
        ),
        SchemeTraits(
            "w8a8-fp8-block",
            DispatchDtype.FP8,
            frozenset({DispatchDtype.FP8, DispatchDtype.INT8, DispatchDtype.BF16}),
            fp8_layout=ScaleLayout.GROUP_128,
        ),
        SchemeTraits("w4a4-int4", DispatchDtype.BF16, frozenset({DispatchDtype.BF16})),
        SchemeTraits(
            "nvfp4",
            DispatchDtype.NVFP4,
            frozenset({DispatchDtype.NVFP4, DispatchDtype.BF16}),
            input_global_scale=True,
        ),
    )
}

_SCHEME_ALIASES = {"none": "unquantized", "bf16": "unquantized", "fp16": "unquantized",
                   "int8": "w8a8-int8", "fp8": "w8a8-fp8-block", "int4": "w4a4-int4"}


def parse_scheme(value: SchemeTraits | str) -> SchemeTraits:
    """A known scheme by (case-insensitive) name, or the traits given."""
    if isinstance(value, SchemeTraits):
        return value
    key = str(value).strip().lower().replace("_", "-")
    key = _SCHEME_ALIASES.get(key, key)
    if key not in KNOWN_SCHEMES:
        raise InvalidInput(f"scheme: expected one of {', '.join(KNOWN_SCHEMES)}, got {value!r}")
    return KNOWN_SCHEMES[key]
