"""Routing: router logits in, the top-k experts of every token and their weights out.

Two routers cover the common model families:

- `SoftmaxTopK`: softmax over all experts, keep the k largest, optionally renormalize
  the kept weights to sum to one (Mixtral, Qwen-MoE).
- `GroupedSigmoidTopK`: sigmoid scores plus a per-expert correction bias used only for
  *choosing* experts; experts are split into groups, a group scores the sum of its two
  best biased scores, only the best `topk_groups` groups stay eligible, and the k best
  eligible experts are kept. Their weights are the unbiased sigmoid scores, optionally
  renormalized, times a scaling factor (DeepSeek-V3).

Routers are plain objects holding their settings; they keep no state between calls.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from hal import InvalidInput, invalid, positive_int

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Routing:
    """The experts chosen for each token: `topk_ids` int64 `[T, k]`, `topk_weights` fp32 `[T, k]`."""

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """T, the number of routed tokens."""
        return self.topk_ids.shape[0]

    @property
    def top_k(self) -> int:
        """k, the experts per token."""
        return self.topk_ids.shape[1]


class Router(abc.ABC):
    """Turns router logits `[T, num_experts]` into a `Routing`."""

    def __init__(self, num_experts: int, top_k: int) -> None:
        self.num_experts = positive_int("num_experts", num_experts)
        self.top_k = positive_int("top_k", top_k)
        if top_k > num_experts:
            raise InvalidInput(f"top_k: expected at most num_experts ({num_experts}), got {top_k}")

    def __call__(self, router_logits: torch.Tensor) -> Routing:
        """Route every token; raises `InvalidInput` for logits of the wrong shape or dtype."""
        self._check_logits(router_logits)
        if router_logits.shape[0] == 0:
            empty = router_logits.new_zeros((0, self.top_k), dtype=torch.int64)
            return Routing(empty, empty.to(torch.float32))
        ids, weights = self._route(router_logits.to(torch.float32))
        return Routing(ids.to(torch.int64), weights.to(torch.float32))

    @abc.abstractmethod
    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute (ids, weights) from fp32 logits `[T, E]` with T > 0."""

    def _check_logits(self, logits: object) -> None:
        if not isinstance(logits, torch.Tensor):
            raise invalid("router_logits", "a torch.Tensor", type(logits).__name__)
        if logits.dim() != 2 or logits.shape[1] != self.num_experts:
            raise invalid("router_logits", f"shape [tokens, {self.num_experts}]", tuple(logits.shape))
        if logits.dtype not in _FLOAT_DTYPES:
            raise invalid("router_logits", "a floating-point tensor", logits.dtype)


class SoftmaxTopK(Router):
    """Softmax over all experts, the k largest kept, optionally renormalized to sum to one."""

    def __init__(self, num_experts: int, top_k: int, *, renormalize: bool = True) -> None:
        super().__init__(num_experts, top_k)
        self.renormalize = bool(renormalize)

    def __repr__(self) -> str:
        return f"SoftmaxTopK(num_experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize})"

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights


class GroupedSigmoidTopK(Router):
    """DeepSeek-V3 routing: sigmoid scores, correction bias for selection, grouped top-k.

    `num_groups` must divide the experts and `topk_groups` is how many groups stay
    eligible; each group needs at least two experts (a group scores its two best).
    `correction_bias` (`[num_experts]`) shifts scores for selection only.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        *,
        num_groups: int = 1,
        topk_groups: int = 1,
        correction_bias: torch.Tensor | None = None,
        renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
    ) -> None:
        super().__init__(num_experts, top_k)
        self.num_groups = positive_int("num_groups", num_groups)
        self.topk_groups = positive_int("topk_groups", topk_groups)
        if num_experts % num_groups:
            raise InvalidInput(f"num_groups: expected a divisor of num_experts ({num_experts}), got {num_groups}")
        if topk_groups > num_groups:
            raise InvalidInput(f"topk_groups: expected at most num_groups ({num_groups}), got {topk_groups}")
        per_group = num_experts // num_groups
        if num_groups > 1 and per_group < 2:
            raise InvalidInput(
                f"num_groups: expected groups of at least 2 experts (a group scores its best two), "
                f"got {per_group} expert(s) per group"
            )
        if top_k > topk_groups * per_group:
            raise InvalidInput(
                f"top_k: expected at most the experts in the kept groups ({topk_groups * per_group}), got {top_k}"
            )
        if correction_bias is not None:
            if not isinstance(correction_bias, torch.Tensor) or tuple(correction_bias.shape) != (num_experts,):
                shape = tuple(correction_bias.shape) if isinstance(correction_bias, torch.Tensor) else correction_bias
                raise invalid("correction_bias", f"a tensor of shape ({num_experts},)", shape)
            if not torch.is_floating_point(correction_bias):
                raise invalid("correction_bias", "a floating-point tensor", correction_bias.dtype)
        self.correction_bias = correction_bias
        self.renormalize = bool(renormalize)
        if not isinstance(routed_scaling_factor, (int, float)) or not routed_scaling_factor > 0:
            raise invalid("routed_scaling_factor", "a positive number", routed_scaling_factor)
        self.routed_scaling_factor = float(routed_scaling_factor)

    def __repr__(self) -> str:
        return (
            f"GroupedSigmoidTopK(num_experts={self.num_experts}, top_k={self.top_k}, "
            f"num_groups={self.num_groups}, topk_groups={self.topk_groups}, "
            f"bias={'yes' if self.correction_bias is not None else 'no'}, renormalize={self.renormalize}, "
            f"routed_scaling_factor={self.routed_scaling_factor})"
        )

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(logits)
        choice = scores
        if self.correction_bias is not None:
            choice = scores + self.correction_bias.to(device=logits.device, dtype=torch.float32)
        if self.num_groups > 1:
            tokens = logits.shape[0]
            grouped = choice.view(tokens, self.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            kept = group_scores.topk(self.topk_groups, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            eligible = mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, -1)
            choice = choice.masked_fill(~eligible, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return ids, weights * self.routed_scaling_factor
