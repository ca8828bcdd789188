"""The experts' activation functions: one table of kinds, and the object a layer carries.

A gated kind takes the first projection's output `[..., 2I]` as `[gate | up]` (gate first,
the two halves concatenated) and returns `[..., I]`; a plain kind maps `[..., I]` to
`[..., I]`. `swiglu-oai` is gpt-oss's clamped form: `gate` clamped above at `limit`, `up`
clamped to `[-limit, limit]`, then `(up + 1) * gate * sigmoid(alpha * gate)`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hal.errors import InvalidInput, positive_fp32


class ActivationKind(str, enum.Enum):
    """An activation function of the experts' intermediate result."""

    SILU_GLU = "silu-glu"  #: silu(gate) * up (SwiGLU: Mixtral, Qwen, DeepSeek, Llama-4)
    GELU_GLU = "gelu-glu"  #: gelu(gate) * up, exact erf GELU
    GELU_TANH_GLU = "gelu-tanh-glu"  #: gelu(gate) * up, tanh approximation
    SWIGLU_OAI = "swiglu-oai"  #: gpt-oss: clamped, `(up + 1) * gate * sigmoid(alpha * gate)`
    SILU = "silu"  #: plain (not gated)
    GELU = "gelu"
    GELU_TANH = "gelu-tanh"
    RELU = "relu"

    def __str__(self) -> str:
        return self.value

    @property
    def gated(self) -> bool:
        """True when the input is `[gate | up]` (twice the output width)."""
        return self in _GATED


_GATED = frozenset(
    {ActivationKind.SILU_GLU, ActivationKind.GELU_GLU, ActivationKind.GELU_TANH_GLU, ActivationKind.SWIGLU_OAI}
)
_ALIASES = {
    "swiglu": ActivationKind.SILU_GLU,
    "silu_glu": ActivationKind.SILU_GLU,
    "geglu": ActivationKind.GELU_GLU,
    "gelu_glu": ActivationKind.GELU_GLU,
    "gelu_tanh_glu": ActivationKind.GELU_TANH_GLU,
    "gelu_pytorch_tanh_glu": ActivationKind.GELU_TANH_GLU,
    "swiglu_oai": ActivationKind.SWIGLU_OAI,
    "clamped_swiglu": ActivationKind.SWIGLU_OAI,
    "swigluoai": ActivationKind.SWIGLU_OAI,
    # the names engines give their fused "activation and multiply" kernels
    "silu_and_mul": ActivationKind.SILU_GLU,
    "gelu_and_mul": ActivationKind.GELU_GLU,
    "gelu_tanh_and_mul": ActivationKind.GELU_TANH_GLU,
    "gelu_tanh": ActivationKind.GELU_TANH,
    "gelu_pytorch_tanh": ActivationKind.GELU_TANH,
}


@dataclass(frozen=True)
class Activation:
    """An activation kind with its parameters (`alpha`, `limit`: `swiglu-oai` only)."""

    kind: ActivationKind = ActivationKind.SILU_GLU
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _parse_kind(self.kind))
        for name in ("alpha", "limit"):
            object.__setattr__(self, name, positive_fp32(f"activation {name}", getattr(self, name)))

    @classmethod
    def parse(cls, value: Activation | ActivationKind | str) -> Activation:
        """An activation from its object, kind or (case-insensitive) name (`"swiglu"`, `"gelu-tanh-glu"`)."""
        if isinstance(value, Activation):
            return value
        return cls(_parse_kind(value))

    @property
    def gated(self) -> bool:
        """True when the input is `[gate | up]` (twice the output width)."""
        return self.kind.gated

    def input_width(self, intermediate_size: int) -> int:
        """The first projection's output width for an intermediate size I: 2I gated, I plain."""
        return 2 * intermediate_size if self.gated else intermediate_size

    def __str__(self) -> str:
        if self.kind is ActivationKind.SWIGLU_OAI:
            return f"{self.kind}(alpha={self.alpha:g}, limit={self.limit:g})"
        return str(self.kind)


def _parse_kind(value: object) -> ActivationKind:
    if isinstance(value, ActivationKind):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        for candidate in (key, key.replace("_", "-")):
            try:
                return ActivationKind(candidate)
            except ValueError:
                pass
        found = _ALIASES.get(key.replace("-", "_"))
        if found is not None:
            return found
    raise InvalidInput(f"activation: expected one of {', '.join(k.value for k in ActivationKind)}, got {value!r}")
