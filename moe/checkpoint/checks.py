"""Checks of one checkpoint tensor as it arrives, and what the loader holds back until a tensor passed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hal import InvalidInput
from moe.checkpoint.formats import FormatSpec, dtype_name
from moe.checkpoint.names import Projection, TensorKind, malformed_expert_id, unknown_expert_tensor

#: Kinds no format reads, with what they would have meant (the reason given when one is refused).
_MEANINGS = {"zero_point": "asymmetric (zero-point) weights, which hal's formats do not represent"}


def check_tensor(name: str, t: torch.Tensor, shapes: list[tuple[int, ...]], dtypes: tuple[torch.dtype, ...]) -> None:
    """`InvalidInput` naming the tensor and the expected vs found dtype and shape, unless one of them fits."""
    if tuple(t.shape) not in shapes or t.dtype not in dtypes:
        want = " or ".join(str(list(s)) for s in shapes)
        kinds = "/".join(dtype_name(d) for d in dtypes)
        raise InvalidInput(
            f"{name}: expected {kinds} of shape {want}, got {dtype_name(t.dtype)} of shape {list(t.shape)}"
        )


def refuse_unknown(name: str, prefix: str | None, spec: FormatSpec, num_experts: int) -> None:
    """`InvalidInput` for a tensor of an expert's projection whose kind no format understands, or whose expert
    id is no whole number: skipped, it would leave the layer computing something else than the checkpoint."""
    malformed = malformed_expert_id(name, prefix)
    if malformed is not None:
        raise InvalidInput(
            f"{name}: expected an expert id in [0, {num_experts}) (num_experts={num_experts}), got {malformed[1]!r}"
        )
    unknown = unknown_expert_tensor(name, prefix)
    if unknown is None:
        return
    kind = unknown[1]
    meaning = next((m for key, m in _MEANINGS.items() if kind.endswith(key)), None)
    raise InvalidInput(
        f"{name}: expected one of the {spec.format} tensors of an expert "
        f"({', '.join(k.value for k in spec.kinds())}), got {kind!r}, which no checkpoint format of "
        "moe.checkpoint reads" + (f" ({meaning})" if meaning else "")
    )


@dataclass
class Staged:
    """The parts of one tensor checked so far, kept only once the whole tensor passed."""

    #: (local expert, projection, kind) -> (name, tensor, whether a view may be kept)
    parts: dict[tuple[int, Projection, TensorKind], tuple[str, torch.Tensor, bool]] = field(default_factory=dict)
    input_scales: dict[tuple[int, Projection], float] = field(default_factory=dict)
    kept: bool = False
