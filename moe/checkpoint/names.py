"""Checkpoint tensor names of MoE experts: which expert, which projection, which tensor.

Three naming families are recognised, each under any module prefix (`model.layers.3.mlp`):

| family | examples |
|---|---|
| per expert, HF | `<prefix>.experts.7.gate_proj.weight`, `.up_proj.weight_scale_inv`, `.down_proj.input_scale` |
| per expert, Mixtral | `<prefix>.experts.7.w1.weight` (gate), `.w3.weight` (up), `.w2.weight` (down) |
| fused, all experts | `<prefix>.experts.gate_up_proj`, `.experts.down_proj`, `.experts.gate_up_proj_bias` |

A per-expert `gate_up_proj` (both projections in one tensor) is recognised too. The tensor
kinds are `weight`, `bias`, `weight_scale`, `weight_scale_inv`, `weight_scale_2` and
`input_scale`, and mxfp4's `blocks` and `scales` (after a dot per expert; after a dot or an underscore
on fused tensors: `gate_up_proj_bias`, `gate_up_proj_blocks`). `shared_experts.*` / `shared_expert.*` are not routed experts and never match.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from hal import invalid


class Projection(str, enum.Enum):
    """Which expert projection a tensor belongs to."""

    GATE = "gate"
    UP = "up"
    DOWN = "down"
    GATE_UP = "gate_up"  #: gate and up in one tensor (concatenated, or interleaved in gpt-oss)

    def __str__(self) -> str:
        return self.value


class TensorKind(str, enum.Enum):
    """What a tensor of a projection holds."""

    WEIGHT = "weight"
    BIAS = "bias"
    WEIGHT_SCALE = "weight_scale"  #: fp8/int8 per-tensor or per-channel scale; nvfp4 e4m3 block scales
    WEIGHT_SCALE_INV = "weight_scale_inv"  #: fp8 128x128 block scales (DeepSeek-V3 naming)
    WEIGHT_SCALE_2 = "weight_scale_2"  #: nvfp4 per-tensor fp32 scale
    INPUT_SCALE = "input_scale"  #: static activation scale (fp8, nvfp4)
    BLOCKS = "blocks"  #: mxfp4 e2m1 codes, `[N, K/32, 16]` bytes (gpt-oss `*_blocks`)
    SCALES = "scales"  #: mxfp4 e8m0 block scales, `[N, K/32]` bytes (gpt-oss `*_scales`)

    def __str__(self) -> str:
        return self.value


class NameStyle(str, enum.Enum):
    """The naming family a name came in (missing tensors are named in the same family)."""

    HF = "hf"
    MIXTRAL = "mixtral"
    FUSED = "fused"


_PROJECTIONS = {
    "gate_proj": Projection.GATE,
    "up_proj": Projection.UP,
    "down_proj": Projection.DOWN,
    "gate_up_proj": Projection.GATE_UP,
    "w1": Projection.GATE,
    "w3": Projection.UP,
    "w2": Projection.DOWN,
}
_MIXTRAL = {"w1", "w2", "w3"}
_KINDS = "|".join(sorted((k.value for k in TensorKind), key=len, reverse=True))
_PER_EXPERT = re.compile(
    rf"^(?:(?P<prefix>.+)\.)?experts\.(?P<expert>\d+)\.(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj|w1|w2|w3)"
    rf"\.(?P<kind>{_KINDS})$"
)
_FUSED = re.compile(
    rf"^(?:(?P<prefix>.+)\.)?experts\.(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)(?:[._](?P<kind>{_KINDS}))?$"
)

#: A tensor of an expert's projection whatever its kind: what `unknown_expert_tensor` tells apart.
_ANY_PER_EXPERT = re.compile(
    r"^(?:(?P<prefix>.+)\.)?experts\.\d+\.(?:gate_up_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<kind>[\w.]+)$"
)
_ANY_FUSED = re.compile(
    r"^(?:(?P<prefix>.+)\.)?experts\.(?:gate_up_proj|gate_proj|up_proj|down_proj)[._](?P<kind>[\w.]+)$"
)
#: A tensor of an expert's projection whatever its expert id: what `malformed_expert_id` tells apart.
_ANY_EXPERT_ID = re.compile(
    r"^(?:(?P<prefix>.+)\.)?experts\.(?P<expert>[^.]+)\.(?:gate_up_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.[\w.]+$"
)


@dataclass(frozen=True)
class ExpertTensorName:
    """A parsed expert tensor name.

    `prefix` is the module path before `experts` (`""` when there is none); `expert` the
    expert id, or None for a fused tensor holding every expert (leading dimension E).
    """

    prefix: str
    expert: int | None
    projection: Projection
    kind: TensorKind
    style: NameStyle

    @property
    def fused(self) -> bool:
        """Whether the tensor holds every expert (no expert id in its name)."""
        return self.expert is None


def normalize_prefix(prefix: str) -> str:
    """A layer prefix as names are compared: no trailing dot, no trailing `.experts`."""
    if not isinstance(prefix, str):
        raise invalid("prefix", "a module path such as 'model.layers.3.mlp'", prefix)
    stripped = prefix.strip().rstrip(".")
    return stripped.removesuffix(".experts") if stripped != "experts" else ""


def parse_expert_name(name: str, prefix: str | None = None) -> ExpertTensorName | None:
    """Parse a checkpoint tensor name; None if it is no routed-expert tensor (or not under `prefix`).

    `prefix`, when given, is the MoE block's module path (`"model.layers.3.mlp"`, with or
    without a trailing `.experts`); it must equal the name's path before `experts` exactly,
    so layer 3 never matches layer 13.
    """
    if not isinstance(name, str):
        raise invalid("name", "a tensor name (str)", type(name).__name__)
    found = _PER_EXPERT.match(name)
    if found is not None:
        proj = found["proj"]
        style = NameStyle.MIXTRAL if proj in _MIXTRAL else NameStyle.HF
        parsed = ExpertTensorName(
            found["prefix"] or "", int(found["expert"]), _PROJECTIONS[proj], TensorKind(found["kind"]), style
        )
    else:
        found = _FUSED.match(name)
        if found is None:
            return None
        parsed = ExpertTensorName(
            found["prefix"] or "",
            None,
            _PROJECTIONS[found["proj"]],
            TensorKind(found["kind"] or TensorKind.WEIGHT),
            NameStyle.FUSED,
        )
    if prefix is not None and parsed.prefix != normalize_prefix(prefix):
        return None
    return parsed


def unknown_expert_tensor(name: str, prefix: str | None = None) -> tuple[str, str] | None:
    """`(prefix, kind)` of a tensor of an expert's projection whose kind is none of `TensorKind` (an int8
    zero point, an AWQ `qweight`, a GPTQ `g_idx`): what no format understands. None for every other name,
    recognised ones included (and names not under `prefix`, when given)."""
    if not isinstance(name, str) or parse_expert_name(name) is not None:
        return None
    found = _ANY_PER_EXPERT.match(name) or _ANY_FUSED.match(name)
    if found is None or (prefix is not None and (found["prefix"] or "") != normalize_prefix(prefix)):
        return None
    return found["prefix"] or "", found["kind"]


def malformed_expert_id(name: str, prefix: str | None = None) -> tuple[str, str] | None:
    """`(prefix, id)` of a tensor of an expert's projection whose expert id is no whole number (`experts.-1.`,
    `experts.x.`): skipped, a checkpoint of other experts would load as this one. None for every other name
    (and names not under `prefix`, when given)."""
    found = _ANY_EXPERT_ID.match(name) if isinstance(name, str) else None
    if found is None or re.fullmatch(r"\d+", found["expert"]):
        return None
    if prefix is not None and (found["prefix"] or "") != normalize_prefix(prefix):
        return None
    return found["prefix"] or "", found["expert"]


_HF_NAMES = {
    Projection.GATE: "gate_proj",
    Projection.UP: "up_proj",
    Projection.DOWN: "down_proj",
    Projection.GATE_UP: "gate_up_proj",
}
_MIXTRAL_NAMES = {Projection.GATE: "w1", Projection.UP: "w3", Projection.DOWN: "w2"}


def expert_tensor_name(
    prefix: str, expert: int | None, projection: Projection, kind: TensorKind, style: NameStyle = NameStyle.HF
) -> str:
    """The checkpoint name of one tensor (the inverse of `parse_expert_name`)."""
    head = f"{prefix}.experts" if prefix else "experts"
    if expert is None or style is NameStyle.FUSED:
        suffix = "" if kind is TensorKind.WEIGHT else f"_{kind.value}"
        return f"{head}.{_HF_NAMES[projection]}{suffix}"
    names = _MIXTRAL_NAMES if style is NameStyle.MIXTRAL and projection in _MIXTRAL_NAMES else _HF_NAMES
    return f"{head}.{expert}.{names[projection]}.{kind.value}"
