"""How a layer's experts are split: expert parallelism over experts, tensor parallelism over I.

With `ep` expert-parallel ranks, rank r keeps experts `[r * E/ep, (r + 1) * E/ep)`. With `tp`
tensor-parallel ranks, rank t keeps columns `[t * I/tp, (t + 1) * I/tp)` of the
intermediate dimension of every kept expert: those columns of the gate and of the up
projection, those rows of the down projection. The activation works column by column, so
each rank's down projection gives a partial sum of the output and one all-reduce over the
tensor-parallel group adds them up. The down projection's bias is kept by tensor rank 0
only (the others hold zeros), so the sum counts it once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hal import InvalidInput, invalid, positive_int


@dataclass(frozen=True)
class TensorShard:
    """This rank's share of the intermediate dimension: rank `rank` of `size`."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        positive_int("size", self.size)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise invalid("rank", f"an int in [0, {self.size})", self.rank)

    def local_size(self, intermediate_size: int, what: str = "intermediate_size") -> int:
        """I / tp, or `InvalidInput` when tp does not divide I."""
        if intermediate_size % self.size:
            raise InvalidInput(
                f"{what}: expected a multiple of the tensor-parallel ranks ({self.size}), got {intermediate_size}"
            )
        return intermediate_size // self.size

    def columns(self, intermediate_size: int) -> slice:
        """This rank's columns of I."""
        local = self.local_size(intermediate_size)
        return slice(self.rank * local, (self.rank + 1) * local)

    def first_projection(self, t: torch.Tensor, intermediate_size: int, gated: bool) -> torch.Tensor:
        """This rank's part of the last dimension of a `[..., 2I]` (`[gate | up]`) or `[..., I]` tensor."""
        cols = self.columns(intermediate_size)
        if not gated:
            return t[..., cols]
        up = slice(intermediate_size + cols.start, intermediate_size + cols.stop)
        return torch.cat([t[..., cols], t[..., up]], dim=-1)

    def second_projection(self, t: torch.Tensor, intermediate_size: int) -> torch.Tensor:
        """This rank's rows of a `[..., I, H]` down projection."""
        return t[..., self.columns(intermediate_size), :]

    def down_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """The down projection's bias as this rank holds it (zeros except on rank 0)."""
        if bias is None or self.rank == 0:
            return bias
        return torch.zeros_like(bias)
