"""Synthetic routing for benchmarks and tests: who picks which experts, uniform or skewed.

`RoutingTrace` names a pattern; `topk_ids` draws a `[T, k]` choice of distinct experts per token
from it, reproducibly from a seed (drawn on the host, then moved to `device`):

- `uniform`: every expert equally likely.
- `zipf:S`: expert popularity ~ 1 / rank^S over a fixed random ranking of the experts (S = 1.2 is
  a typical skew of real traffic; larger is more skewed).
- `hot:N:F`: N hot experts take a fraction F of the choices, the rest share the remainder.
- `rank-skew:F`: under expert parallelism over R ranks, the experts of rank 0 are F times as
  likely as the others (one overloaded rank).

`logits` returns router logits whose softmax top-k follows the same pattern (log-popularity plus
Gumbel noise), for layers that route themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hal import InvalidInput, invalid, positive_int

PATTERNS = ("uniform", "zipf", "hot", "rank-skew")


@dataclass(frozen=True)
class RoutingTrace:
    """A routing pattern (see the module), parsed from text such as `"zipf:1.2"` by `parse`."""

    pattern: str = "uniform"
    skew: float = 1.2  #: zipf's exponent, hot's fraction, rank-skew's factor
    hot: int = 1  #: hot experts (pattern `hot`)

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise invalid("routing pattern", f"one of {', '.join(PATTERNS)}", self.pattern)
        if not math.isfinite(self.skew) or self.skew <= 0 or (self.pattern == "hot" and self.skew >= 1):
            raise invalid(f"{self.pattern} parameter", "a positive number (hot: a fraction below 1)", self.skew)
        positive_int("hot experts", self.hot)

    @classmethod
    def parse(cls, text: str) -> RoutingTrace:
        """`uniform`, `zipf:S`, `hot:N:F` or `rank-skew:F`."""
        parts = str(text).split(":")
        try:
            if parts[0] == "uniform" and len(parts) == 1:
                return cls("uniform")
            if parts[0] in ("zipf", "rank-skew") and len(parts) <= 2:
                return cls(parts[0], float(parts[1]) if len(parts) == 2 else (1.2 if parts[0] == "zipf" else 4.0))
            if parts[0] == "hot" and len(parts) == 3:
                return cls("hot", float(parts[2]), int(parts[1]))
        except ValueError:
            pass
        raise invalid("routing trace", "uniform, zipf:S, hot:N:F or rank-skew:F", text)

    def popularity(self, num_experts: int, ranks: int = 1, seed: int = 0) -> torch.Tensor:
        """Each expert's probability of being chosen (fp64 `[E]`, summing to 1)."""
        positive_int("num_experts", num_experts)
        e = num_experts
        if self.pattern == "uniform":
            weights = torch.ones(e, dtype=torch.float64)
        elif self.pattern == "zipf":
            order = torch.randperm(e, generator=torch.Generator().manual_seed(seed))
            weights = torch.empty(e, dtype=torch.float64)
            weights[order] = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** self.skew
        elif self.pattern == "hot":
            if self.hot >= e:
                raise InvalidInput(f"hot experts: expected fewer than the {e} experts, got {self.hot}")
            weights = torch.full((e,), (1.0 - self.skew) / (e - self.hot), dtype=torch.float64)
            weights[: self.hot] = self.skew / self.hot
        else:
            positive_int("ranks", ranks)
            if e % ranks:
                raise InvalidInput(f"rank-skew: expected experts ({e}) divisible by the ranks ({ranks})")
            weights = torch.ones(e, dtype=torch.float64)
            weights[: e // ranks] = self.skew
        return weights / weights.sum()

    def topk_ids(
        self,
        tokens: int,
        num_experts: int,
        top_k: int,
        *,
        seed: int = 0,
        ranks: int = 1,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """`[T, k]` int64 distinct experts per token, drawn from `popularity` (seed-reproducible)."""
        if top_k > num_experts:
            raise InvalidInput(f"top_k: expected at most num_experts ({num_experts}), got {top_k}")
        probs = self.popularity(num_experts, ranks, seed).to(torch.float32)
        g = torch.Generator().manual_seed(seed + 1)
        ids = torch.multinomial(probs.expand(tokens, -1), top_k, replacement=False, generator=g)
        return ids if device is None else ids.to(device)

    def logits(
        self, tokens: int, num_experts: int, *, seed: int = 0, ranks: int = 1, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Router logits `[T, E]` (fp32) whose top-k follows the pattern: log-popularity plus Gumbel noise."""
        probs = self.popularity(num_experts, ranks, seed)
        g = torch.Generator().manual_seed(seed + 2)
        gumbel = -torch.log(
            -torch.log(torch.rand(tokens, num_experts, generator=g, dtype=torch.float64).clamp_min(1e-12))
        )
        logits = (probs.log() + gumbel).to(torch.float32)
        return logits if device is None else logits.to(device)


__all__ = ["PATTERNS", "RoutingTrace"]
