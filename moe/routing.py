"""Routing: router logits in, the top-k experts of every token and their weights out.

Four routers cover the common model families:

- `SoftmaxTopK`: softmax over all experts, the k largest kept, optionally renormalized to
  sum to one, times a scaling factor (Mixtral, Qwen-MoE, OLMoE, gpt-oss).
- `SigmoidTopK`: the k largest logits (or sigmoid scores plus a correction bias), weighted
  by their sigmoid scores (Llama-4 top-1 with the weight applied on the input, MiniMax-M2).
- `GroupedTopK`: softmax or sigmoid scores, an optional correction bias used only for
  *choosing*, experts split into groups of which only the best `topk_groups` stay eligible
  (DeepSeek-V2: softmax, a group scores its best expert; DeepSeek-V3: sigmoid, a group
  scores the sum of its two best biased scores). `GroupedSigmoidTopK` is the V3 preset.

Routers are plain objects holding their settings; they keep no state between calls. The
routing math runs in fp32 whatever the logits' float dtype, without host synchronisation
or data-dependent Python control flow, so it traces under `torch.compile(fullgraph=True)`.
Every token is routed from its own row only: a row of non-finite logits gets valid,
distinct expert ids (its weights may be NaN) and never changes another row's result.
Rejecting non-finite logits is the layer's job, not the router's.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from hal import InvalidInput, Vendor, invalid, positive_fp32, positive_int
from hal.reference import softmax_topk
from moe.arguments import as_device, with_data

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

#: How `GroupedTopK` turns logits into per-expert scores.
SCORINGS = ("softmax", "sigmoid")
#: How `GroupedTopK` scores a group from its experts' (biased) scores.
GROUP_SCORES = ("max", "top2-sum")

#: Smallest renormalization denominator (a row whose kept scores all underflow keeps zero weights).
_MIN_DENOMINATOR = 1e-20


@dataclass(frozen=True)
class Routing:
    """The experts chosen for each token: `topk_ids` int64 `[T, k]`, `topk_weights` fp32 `[T, k]`.

    `weights_on_input` (Llama-4's `apply_router_weight_on_input`): the layer scales each
    token's input by its weight before the experts and combines the expert outputs with
    weight 1. Only meaningful with top-1 routing, so it requires `k == 1`.
    """

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    weights_on_input: bool = False

    def __post_init__(self) -> None:
        for name in ("topk_ids", "topk_weights"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise invalid(name, "a 2-D tensor [tokens, k]", got)
        if self.topk_ids.shape != self.topk_weights.shape:
            raise invalid(
                "topk_weights", f"the shape of topk_ids {tuple(self.topk_ids.shape)}", tuple(self.topk_weights.shape)
            )
        if not isinstance(self.weights_on_input, bool):
            raise invalid("weights_on_input", "a bool", self.weights_on_input)
        if self.weights_on_input and self.topk_ids.shape[-1] != 1:
            raise invalid(
                "weights_on_input", "top-1 routing (topk_ids of shape [tokens, 1])", tuple(self.topk_ids.shape)
            )

    @property
    def num_tokens(self) -> int:
        """T, the number of routed tokens."""
        return self.topk_ids.shape[0]

    @property
    def top_k(self) -> int:
        """k, the experts per token."""
        return self.topk_ids.shape[1]


def _flag(argument: str, value: object) -> bool:
    """Return `value` if it is a real bool (not a truthy string or number), else raise `InvalidInput`."""
    if not isinstance(value, bool):
        raise invalid(argument, "a bool", value)
    return value


def _scaling_factor(value: object) -> float:
    """Return `routed_scaling_factor` as a float if it is a positive number in the fp32 range (the
    weights it scales are fp32: a larger factor makes them inf, a smaller one flushes them to zero)."""
    return positive_fp32("routed_scaling_factor", value)


def _choice(value: object, argument: str, allowed: tuple[str, ...]) -> str:
    """Return `value` if it is one of the `allowed` names, else raise `InvalidInput`."""
    if not isinstance(value, str) or value not in allowed:
        raise invalid(argument, "one of " + ", ".join(repr(a) for a in allowed), value)
    return value


def _correction_bias(value: object, num_experts: int) -> torch.Tensor | None:
    """Validate a `[num_experts]` finite float bias and return an fp32 copy of it (never the caller's tensor)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != (num_experts,):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else value
        raise invalid("correction_bias", f"a tensor of shape ({num_experts},)", shape)
    if not torch.is_floating_point(value):
        raise invalid("correction_bias", "a floating-point tensor", value.dtype)
    with_data("correction_bias", value)
    bias = value.detach().to(torch.float32, copy=True)
    if not bool(torch.isfinite(bias).all()):
        raise invalid("correction_bias", "finite values", "a non-finite value")
    return bias


def _scaled(weights: torch.Tensor, factor: float) -> torch.Tensor:
    """`weights * factor`, without a kernel launch for the common factor 1 (decode latency)."""
    return weights if factor == 1.0 else weights * factor


def _renormalized(weights: torch.Tensor) -> torch.Tensor:
    """The weights divided by their row sum (at least 1e-20: scores that all underflow stay zeros, not NaN)."""
    return weights / weights.sum(dim=-1, keepdim=True).clamp_min(_MIN_DENOMINATOR)


class Router(abc.ABC):
    """Turns router logits `[T, num_experts]` into a `Routing`.

    `weights_on_input` says whether the routings it returns ask the layer to apply the
    weight on the input (see `Routing`); only `SigmoidTopK` can set it. `correction_bias` is
    the router's only tensor (fp32 `[num_experts]`, or None); `to(device)` moves it.
    """

    weights_on_input: bool = False
    correction_bias: torch.Tensor | None = None

    def __init__(self, num_experts: int, top_k: int) -> None:
        self.num_experts = positive_int("num_experts", num_experts)
        self.top_k = positive_int("top_k", top_k)
        if top_k > num_experts:
            raise InvalidInput(f"top_k: expected at most num_experts ({num_experts}), got {top_k}")

    def __call__(self, router_logits: torch.Tensor, vendor: Vendor | None = None) -> Routing:
        """Route every token; raises `InvalidInput` for logits of the wrong type, shape or dtype. With a
        `vendor`, routers whose rule is a hal op (`SoftmaxTopK`: `Vendor.softmax_topk`) take the vendor's
        kernel; the others compute in torch on the logits' device."""
        self._check_logits(router_logits)
        if router_logits.shape[0] == 0:
            empty = router_logits.new_zeros((0, self.top_k), dtype=torch.int64)
            return Routing(empty, empty.to(torch.float32), self.weights_on_input)
        routed = self._route_on(vendor, router_logits) if vendor is not None else None
        ids, weights = routed if routed is not None else self._route(_as(router_logits, torch.float32))
        return Routing(_as(ids, torch.int64), _as(weights, torch.float32), self.weights_on_input)

    def _route_on(self, vendor: Vendor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids, weights) through the vendor's ops, or None where this router has no hal op (the default)."""
        return None

    def to(self, device: torch.device | str) -> Router:
        """Move the router's tensors to `device`, in place, and return the router (as `nn.Module.to`
        does): routing logits on that device then copies nothing, e.g. inside a captured CUDA graph."""
        device = as_device("device", device)
        if self.correction_bias is not None:
            self.correction_bias = self.correction_bias.to(device)
        return self

    @abc.abstractmethod
    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute (ids, weights) from fp32 logits `[T, E]` with T > 0."""

    def _check_logits(self, logits: object) -> None:
        if not isinstance(logits, torch.Tensor):
            raise invalid("router_logits", "a torch.Tensor", type(logits).__name__)
        if logits.dim() != 2 or logits.shape[1] != self.num_experts:
            raise invalid("router_logits", f"shape [tokens, {self.num_experts}]", tuple(logits.shape))
        if logits.dtype not in _FLOAT_DTYPES:
            raise invalid("router_logits", "a floating-point tensor (bf16, fp16, fp32 or fp64)", logits.dtype)

    @staticmethod
    def _bias_repr(bias: torch.Tensor | None) -> str:
        return "None" if bias is None else f"Tensor[{bias.shape[0]}]"


class SoftmaxTopK(Router):
    """Softmax over all experts, the k largest kept, optionally renormalized to sum to one,
    then multiplied by `routed_scaling_factor` (Mixtral, Qwen2/3-MoE, OLMoE; gpt-oss is the
    renormalized form, since the softmax of the k largest logits equals it)."""

    def __init__(
        self, num_experts: int, top_k: int, *, renormalize: bool = True, routed_scaling_factor: float = 1.0
    ) -> None:
        super().__init__(num_experts, top_k)
        self.renormalize = _flag("renormalize", renormalize)
        self.routed_scaling_factor = _scaling_factor(routed_scaling_factor)

    def __repr__(self) -> str:
        return (
            f"SoftmaxTopK(num_experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}, "
            f"routed_scaling_factor={self.routed_scaling_factor})"
        )

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = softmax_topk(logits, self.top_k, self.renormalize)
        return ids, _scaled(weights, self.routed_scaling_factor)

    def _route_on(self, vendor: Vendor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = vendor.softmax_topk(logits, self.top_k, renormalize=self.renormalize)
        return ids, _scaled(weights, self.routed_scaling_factor)


class SigmoidTopK(Router):
    """The k best experts weighted by the sigmoid of their logits (Llama-4, MiniMax-M2).

    Without `correction_bias` the k largest logits are kept (Llama-4: exact even where fp32
    sigmoids saturate to 1); with it (`[num_experts]`, MiniMax-M2) the k largest
    `sigmoid(logit) + bias`, the bias steering the choice only. The weights are the chosen
    experts' sigmoid scores, optionally renormalized, times `routed_scaling_factor`.
    `weights_on_input=True` (Llama-4, top-1 only) returns routings that ask the layer to
    scale the token's input by the weight and combine with weight 1.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        *,
        correction_bias: torch.Tensor | None = None,
        renormalize: bool = False,
        routed_scaling_factor: float = 1.0,
        weights_on_input: bool = False,
    ) -> None:
        super().__init__(num_experts, top_k)
        self.correction_bias = _correction_bias(correction_bias, num_experts)
        self.renormalize = _flag("renormalize", renormalize)
        self.routed_scaling_factor = _scaling_factor(routed_scaling_factor)
        self.weights_on_input = _flag("weights_on_input", weights_on_input)
        if weights_on_input and top_k != 1:
            raise invalid("top_k", "1 with weights_on_input=True (the weight scales the token's input)", top_k)

    def __repr__(self) -> str:
        return (
            f"SigmoidTopK(num_experts={self.num_experts}, top_k={self.top_k}, "
            f"correction_bias={self._bias_repr(self.correction_bias)}, renormalize={self.renormalize}, "
            f"routed_scaling_factor={self.routed_scaling_factor}, weights_on_input={self.weights_on_input})"
        )

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.correction_bias is None:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.sigmoid(top)
        else:
            scores = torch.sigmoid(logits)
            ids = torch.topk(scores + self.correction_bias.to(logits.device), self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        if self.renormalize:
            weights = _renormalized(weights)
        return ids, _scaled(weights, self.routed_scaling_factor)


class GroupedTopK(Router):
    """Grouped top-k routing (DeepSeek-V2 and V3).

    Scores are `softmax` or `sigmoid` of the logits; `correction_bias` (`[num_experts]`) is
    added to them for choosing only. The experts form `num_groups` equal groups (dividing
    the experts); each group scores its best biased score (`group_score="max"`, V2) or the
    sum of its two best (`"top2-sum"`, V3, which needs groups of at least two experts); the
    experts of the best `topk_groups` groups stay eligible and the k best eligible ones are
    kept. Their weights are their unbiased scores, optionally renormalized to sum to one
    (`norm_topk_prob`), times `routed_scaling_factor`.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        *,
        num_groups: int = 1,
        topk_groups: int = 1,
        scoring: str = "softmax",
        group_score: str = "max",
        correction_bias: torch.Tensor | None = None,
        renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
    ) -> None:
        super().__init__(num_experts, top_k)
        self.num_groups = positive_int("num_groups", num_groups)
        self.topk_groups = positive_int("topk_groups", topk_groups)
        self.scoring = _choice(scoring, "scoring", SCORINGS)
        self.group_score = _choice(group_score, "group_score", GROUP_SCORES)
        if num_experts % num_groups:
            raise InvalidInput(f"num_groups: expected a divisor of num_experts ({num_experts}), got {num_groups}")
        if topk_groups > num_groups:
            raise InvalidInput(f"topk_groups: expected at most num_groups ({num_groups}), got {topk_groups}")
        self.experts_per_group = num_experts // num_groups
        if num_groups > 1 and group_score == "top2-sum" and self.experts_per_group < 2:
            raise InvalidInput(
                f"num_groups: expected groups of at least 2 experts (group_score='top2-sum' sums the best two), "
                f"got {self.experts_per_group} expert(s) per group"
            )
        if top_k > topk_groups * self.experts_per_group:
            raise InvalidInput(
                f"top_k: expected at most the experts in the kept groups ({topk_groups * self.experts_per_group}), "
                f"got {top_k}"
            )
        self.correction_bias = _correction_bias(correction_bias, num_experts)
        self.renormalize = _flag("renormalize", renormalize)
        self.routed_scaling_factor = _scaling_factor(routed_scaling_factor)

    def _settings(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, num_groups={self.num_groups}, "
            f"topk_groups={self.topk_groups}"
        )

    def _tail(self) -> str:
        return (
            f"correction_bias={self._bias_repr(self.correction_bias)}, renormalize={self.renormalize}, "
            f"routed_scaling_factor={self.routed_scaling_factor}"
        )

    def __repr__(self) -> str:
        return (
            f"GroupedTopK({self._settings()}, scoring={self.scoring!r}, group_score={self.group_score!r}, "
            f"{self._tail()})"
        )

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.softmax(logits, dim=-1) if self.scoring == "softmax" else torch.sigmoid(logits)
        choice = scores if self.correction_bias is None else scores + self.correction_bias.to(logits.device)
        if self.topk_groups < self.num_groups:  # keeping every group restricts nothing
            grouped = choice.reshape(logits.shape[0], self.num_groups, self.experts_per_group)
            if self.group_score == "max":
                group_scores = grouped.amax(dim=-1)
            else:
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            kept = group_scores.topk(self.topk_groups, dim=-1).indices
            kept_groups = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            eligible = kept_groups.unsqueeze(-1).expand_as(grouped).reshape(logits.shape)
            choice = choice.masked_fill(~eligible, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = _renormalized(weights)
        return ids, _scaled(weights, self.routed_scaling_factor)


class GroupedSigmoidTopK(GroupedTopK):
    """DeepSeek-V3 routing: `GroupedTopK` with sigmoid scores and groups scored by their two best.

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
        super().__init__(
            num_experts,
            top_k,
            num_groups=num_groups,
            topk_groups=topk_groups,
            scoring="sigmoid",
            group_score="top2-sum",
            correction_bias=correction_bias,
            renormalize=renormalize,
            routed_scaling_factor=routed_scaling_factor,
        )

    def __repr__(self) -> str:
        return f"GroupedSigmoidTopK({self._settings()}, {self._tail()})"


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`, without a dispatcher call when it already is (a decode step's host time is
    mostly such calls)."""
    return t if t.dtype == dtype else t.to(dtype)
