"""What dispatch-dtype resolution needs to know about a quantization scheme.

The schemes themselves (weight formats, expert computation) live in `moe/`; each
exposes a `SchemeTraits` so that `hal` can resolve its dispatch dtype without
importing anything above it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch

from hal.dtypes import Codec, DispatchDtype, ScaleLayout
from hal.errors import InvalidInput
from hal.gemm_kinds import GemmKind


@dataclass(frozen=True)
class SchemeTraits:
    """A quant scheme's dispatch-relevant facts.

    `dispatch_dtype` is the dtype the scheme wants carried (design.md section 4, step 3);
    `input_global_scale` marks NVFP4-style checkpoints, which always ask for nvfp4;
    `accepts` lists every dtype the scheme can consume after dispatch (it re-quantizes or
    dequantizes where the carried dtype differs from what its GEMM needs). `scale_layouts`
    names the layout a dtype with several is carried in for this scheme (`fp8_layout` is
    fp8's entry); the vendor's declared layout applies otherwise.

    `follows_model_dtype` marks a scheme that computes in the model's own float dtype (the
    unquantized scheme); `model_dtype`, set through `with_model_dtype`, is that dtype where it
    is not the scheme's `dispatch_dtype` (fp16 or fp32 weights): the scheme then asks for it
    (the "model dtype" step of resolution, above the scheme's declared dtype).
    """

    def __deepcopy__(self, memo: dict[int, object]) -> SchemeTraits:
        """Itself: the object is immutable, so a deep copy (of a layer, of a model) shares it."""
        return self

    name: str
    dispatch_dtype: DispatchDtype
    accepts: frozenset[DispatchDtype]
    input_global_scale: bool = False
    fp8_layout: ScaleLayout | None = None  #: activation scale layout when fp8 is carried
    scale_layouts: Mapping[DispatchDtype, ScaleLayout] = field(default_factory=dict)
    follows_model_dtype: bool = False  #: computes in the model's float dtype (unquantized)
    model_dtype: DispatchDtype | None = None  #: the model's float dtype, where the scheme asks for it
    gemm_kind: GemmKind | None = None  #: the grouped-matmul kind its experts run (None: unknown to hal)
    #: its experts can be replicated and moved between slots and ranks (redundant experts, rebalancing):
    #: every per-expert tensor has the expert dimension first and nothing per expert lives elsewhere
    #: (activation scales are per token, or one per layer shared by all experts)
    movable_experts: bool = False

    def __post_init__(self) -> None:
        layouts = {DispatchDtype.parse(k): ScaleLayout(v) for k, v in dict(self.scale_layouts).items()}
        if self.fp8_layout is not None:
            layouts[DispatchDtype.FP8] = ScaleLayout(self.fp8_layout)
        for dtype, layout in layouts.items():
            if layout not in dtype.scale_layouts():
                raise InvalidInput(
                    f"scheme {self.name!r}: scale layout {layout} is not one of {dtype}'s "
                    f"({', '.join(map(str, dtype.scale_layouts()))})"
                )
        object.__setattr__(self, "scale_layouts", MappingProxyType(layouts))
        object.__setattr__(self, "dispatch_dtype", DispatchDtype.parse(self.dispatch_dtype))
        accepts = frozenset(DispatchDtype.parse(d) for d in self.accepts)
        object.__setattr__(self, "accepts", accepts)
        if self.model_dtype is not None:
            model = DispatchDtype.parse(self.model_dtype)
            object.__setattr__(self, "model_dtype", model)
            if not self.follows_model_dtype or model is DispatchDtype.AUTO or model.spec.codec is not Codec.CAST:
                raise InvalidInput(
                    f"scheme {self.name!r}: model_dtype expected a float (cast) dtype of a scheme "
                    f"that follows the model dtype, got {model}"
                )
        wanted = self.preferred_dtype
        if wanted not in accepts:
            raise InvalidInput(
                f"scheme {self.name!r}: expected its own dispatch dtype {wanted} among accepted "
                f"dtypes, got {sorted(d.value for d in accepts)}"
            )

    def __hash__(self) -> int:
        return hash((self.name, self.dispatch_dtype, self.accepts, self.input_global_scale, self.model_dtype))

    def layout_for(self, dtype: DispatchDtype) -> ScaleLayout | None:
        """The layout this scheme carries `dtype` in, or None to leave it to the vendor."""
        return self.scale_layouts.get(dtype)

    @property
    def preferred_dtype(self) -> DispatchDtype:
        """The dtype this scheme asks for: nvfp4 when it has an input global scale, else its model
        dtype where it has one, else its declared dtype."""
        if self.input_global_scale:
            return DispatchDtype.NVFP4
        return self.model_dtype or self.dispatch_dtype

    @property
    def compute_kind(self) -> GemmKind | None:
        """The grouped-matmul kind the experts run: the model dtype's float kind for a scheme that
        follows the model dtype, else `gemm_kind`."""
        if self.follows_model_dtype and self.model_dtype is not None:
            return GemmKind(self.model_dtype.value)
        return self.gemm_kind

    def with_model_dtype(self, dtype: DispatchDtype | str | torch.dtype | None) -> SchemeTraits:
        """These traits for a model whose weights are in `dtype` (`torch.float32`, `"fp32"`, ...).

        A scheme that follows the model dtype asks for it unless it is its declared dtype (bf16
        stays the default for bf16); None gives the traits without a model dtype. Raises
        `InvalidInput` for a dtype that is no float cast, or for a scheme that quantizes its
        activations (its dispatch dtype does not depend on the model's).
        """
        if dtype is None:
            return replace(self, model_dtype=None)
        parsed = DispatchDtype.cast_of(dtype) if isinstance(dtype, torch.dtype) else DispatchDtype.parse(dtype)
        if parsed is None or parsed is DispatchDtype.AUTO or parsed.spec.codec is not Codec.CAST:
            raise InvalidInput(f"model dtype: expected a float dtype ({', '.join(_float_names())}), got {dtype!r}")
        if not self.follows_model_dtype:
            followers = ", ".join(n for n, t in KNOWN_SCHEMES.items() if t.follows_model_dtype)
            raise InvalidInput(
                f"model dtype: expected a scheme that computes in the model dtype ({followers}), "
                f"got scheme {self.name!r}, which quantizes its activations (the model dtype "
                f"{parsed} does not choose its dispatch dtype)"
            )
        return replace(self, model_dtype=None if parsed is self.dispatch_dtype else parsed)


def _float_names() -> list[str]:
    """The dispatch dtypes that are a plain cast to a float (the possible model dtypes)."""
    return [d.value for d in DispatchDtype.concrete() if d.spec.codec is Codec.CAST]


_ALL = frozenset(DispatchDtype.concrete())
#: Weight-only schemes compute with bf16 activations; rows carried as fp8 or int8 are dequantized to bf16.
_WEIGHT_ONLY = frozenset({DispatchDtype.BF16, DispatchDtype.FP8, DispatchDtype.INT8})

#: The schemes moe-hal knows by name (the CLI's `--scheme` choices).
KNOWN_SCHEMES: dict[str, SchemeTraits] = {
    t.name: t
    for t in (
        SchemeTraits(
            "unquantized",
            DispatchDtype.BF16,
            _ALL,
            follows_model_dtype=True,
            gemm_kind=GemmKind.BF16,
            movable_experts=True,
        ),
        SchemeTraits(
            "w8a8-int8",
            DispatchDtype.INT8,
            frozenset({DispatchDtype.INT8, DispatchDtype.FP8, DispatchDtype.BF16}),
            fp8_layout=ScaleLayout.PER_TOKEN,
            gemm_kind=GemmKind.INT8,
            movable_experts=True,
        ),
        SchemeTraits(
            "w8a8-fp8-block",
            DispatchDtype.FP8,
            frozenset({DispatchDtype.FP8, DispatchDtype.INT8, DispatchDtype.BF16}),
            fp8_layout=ScaleLayout.GROUP_128,
            gemm_kind=GemmKind.FP8_BLOCK128,
            movable_experts=True,
        ),
        SchemeTraits(
            "w8a8-fp8",
            DispatchDtype.FP8,
            frozenset({DispatchDtype.FP8, DispatchDtype.INT8, DispatchDtype.BF16}),
            fp8_layout=ScaleLayout.PER_TOKEN,
            gemm_kind=GemmKind.FP8_ROWWISE,
            movable_experts=True,
        ),
        SchemeTraits(
            "w4a4-int4",
            DispatchDtype.BF16,
            frozenset({DispatchDtype.BF16}),
            gemm_kind=GemmKind.INT4,
            movable_experts=True,
        ),
        SchemeTraits(
            "w4a16-mxfp4", DispatchDtype.BF16, _WEIGHT_ONLY, gemm_kind=GemmKind.BF16_MXFP4, movable_experts=True
        ),
        SchemeTraits(
            "w4a16-nvfp4", DispatchDtype.BF16, _WEIGHT_ONLY, gemm_kind=GemmKind.BF16_NVFP4, movable_experts=True
        ),
        SchemeTraits(
            "nvfp4",
            DispatchDtype.NVFP4,
            frozenset({DispatchDtype.NVFP4, DispatchDtype.BF16}),
            input_global_scale=True,
            gemm_kind=GemmKind.NVFP4,
            movable_experts=True,
        ),
    )
}

_SCHEME_ALIASES = {
    "none": "unquantized",
    "bf16": "unquantized",
    "int8": "w8a8-int8",
    "fp8": "w8a8-fp8-block",
    "int4": "w4a4-int4",
    "fp8-rowwise": "w8a8-fp8",
    "mxfp4": "w4a16-mxfp4",
}


def parse_scheme(value: SchemeTraits | str) -> SchemeTraits:
    """A known scheme by (case-insensitive) name, or the traits given. A float dtype's name
    (`"fp16"`, `"float32"`, ...) means the unquantized scheme over weights of that dtype."""
    if isinstance(value, SchemeTraits):
        return value
    key = str(value).strip().lower().replace("_", "-")
    key = _SCHEME_ALIASES.get(key, key)
    if key not in KNOWN_SCHEMES:
        model = _model_dtype_alias(key)
        if model is not None:
            return KNOWN_SCHEMES["unquantized"].with_model_dtype(model)
        raise InvalidInput(
            f"scheme: expected one of {', '.join(KNOWN_SCHEMES)} (or a float dtype: "
            f"{', '.join(_float_names())}), got {value!r}"
        )
    return KNOWN_SCHEMES[key]


def _model_dtype_alias(key: str) -> DispatchDtype | None:
    """The float (cast) dispatch dtype named `key`, or None."""
    try:
        parsed = DispatchDtype.parse(key)
    except InvalidInput:
        return None
    return parsed if parsed is not DispatchDtype.AUTO and parsed.spec.codec is Codec.CAST else None
