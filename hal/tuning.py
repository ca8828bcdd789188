"""What `hal tune` asks a vendor to tune: grouped-matmul problems at a list of token counts.

A vendor that can tune its kernels implements `VendorOps.tune` and returns its own table
(JSON-able); `hal` neither reads nor interprets the table, the vendor loads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hal.activations import ActivationKind
from hal.errors import invalid
from hal.gemm_kinds import GemmKind


@dataclass(frozen=True)
class GemmProblem:
    """One grouped matmul of a model's MoE layer: `kind`, `experts` groups, `[K] x [K, N]` per row,
    rows routed top-`top_k` out of the experts, timed at each of `tokens`. `activation`: the
    experts' activation applied by the same call (the gate/up projection, as the MoE layer
    calls it: `Vendor.grouped_matmul(..., activation=...)`), or None."""

    kind: GemmKind
    experts: int
    k: int
    n: int
    top_k: int
    tokens: tuple[int, ...]
    activation: ActivationKind | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", GemmKind(self.kind))
        if self.activation is not None:
            try:
                object.__setattr__(self, "activation", ActivationKind(self.activation))
            except ValueError:
                raise invalid(
                    "activation", f"None or one of {', '.join(a.value for a in ActivationKind)}", self.activation
                ) from None
        for name in ("experts", "k", "n", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise invalid(name, "a positive int", value)
        if self.top_k > self.experts:
            raise invalid("top_k", f"at most experts ({self.experts})", self.top_k)
        tokens = tuple(self.tokens)
        if not tokens or any(isinstance(t, bool) or not isinstance(t, int) or t <= 0 for t in tokens):
            raise invalid("tokens", "a non-empty sequence of positive ints", self.tokens)
        object.__setattr__(self, "tokens", tokens)
