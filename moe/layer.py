"""`MoELayer`: route -> dispatch -> experts -> combine, the same code on every vendor.

Every device question goes to `hal`: the dispatch dtype comes from the layer's plan
(`hal.resolve_dispatch_plan`), what the experts can compute from the vendor's declared
capabilities, the fused path from `capabilities().fused_deep_moe`. The layer never looks
at a device type. The path is chosen once (`moe.pipeline`): at construction (fused or not,
the runner) and at weight load (the dispatch quantizer); `forward` routes and runs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hal import (
    DispatchConfig,
    DispatchPlan,
    InvalidInput,
    Vendor,
    get_vendor,
    invalid,
    positive_int,
    resolve_dispatch_plan,
)
from moe.dispatch import AllToAllDispatcher, Dispatcher, LocalDispatcher, LowLatencyDispatcher
from moe.dispatch.base import group_size_and_rank
from moe.pipeline import Pipeline, choose_pipeline
from moe.routing import Router, SoftmaxTopK
from moe.runners import ExpertRunner, RunnerRegistry
from moe.schemes import ExpertWeights, QuantScheme, check_float_weights, make_scheme

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class MoELayer(torch.nn.Module):
    """A Mixture-of-Experts feed-forward layer computed through `hal`.

    Expert e computes `swiglu(x @ w13[e]) @ w2[e]` with `w13` `[E, H, 2I]` (gate
    projection first, then up) and `w2` `[E, I, H]`; the layer returns each token's
    routing-weighted sum over its top-k experts, in the input's dtype and shape.

    With a `process_group` the experts are split evenly over its ranks (expert
    parallelism): every rank builds the layer with the same global weights (or calls
    `load_weights` with them) and keeps its own experts. `dispatch.max_dispatch_tokens_per_rank`
    selects the low-latency dispatcher (fixed capacity per rank); otherwise one rank uses
    the local dispatcher and several use all-to-all.

    `fused` chooses the path: None (the default) takes the vendor's `fused_deep_moe` where it
    declares one for the scheme, False always takes the unfused path (to compare, or to
    debug), True requires the fused op and raises `UnsupportedCapability` without it.

    The quantized expert weights (`expert_weights`) live on the vendor's device; they are
    inference weights, not `nn.Parameter`s, so `.to()` and `state_dict()` do not cover them.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        scheme: QuantScheme | str = "unquantized",
        dispatch: DispatchConfig | None = None,
        vendor: Vendor | str | None = None,
        process_group: Any = None,
        router: Router | None = None,
        runners: RunnerRegistry | None = None,
        environ: Mapping[str, str] | None = None,
        fused: bool | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = positive_int("hidden_size", hidden_size)
        self.intermediate_size = positive_int("intermediate_size", intermediate_size)
        self.num_experts = positive_int("num_experts", num_experts)
        self.top_k = positive_int("top_k", top_k)
        if top_k > num_experts:
            raise InvalidInput(f"top_k: expected at most num_experts ({num_experts}), got {top_k}")
        if dispatch is not None and not isinstance(dispatch, DispatchConfig):
            raise invalid("dispatch", "a hal.DispatchConfig or None", type(dispatch).__name__)
        self.dispatch_config = dispatch or DispatchConfig()
        self.vendor = vendor if isinstance(vendor, Vendor) else get_vendor(vendor)
        self.scheme = make_scheme(scheme)
        self.router = router if router is not None else SoftmaxTopK(num_experts, top_k)
        if not isinstance(self.router, Router):
            raise invalid("router", "a moe.Router", type(self.router).__name__)
        if (self.router.num_experts, self.router.top_k) != (num_experts, top_k):
            raise InvalidInput(
                f"router: expected one for {num_experts} experts and top-{top_k}, "
                f"got {self.router.num_experts} experts and top-{self.router.top_k}"
            )
        self.process_group = process_group
        world, _ = group_size_and_rank(process_group)
        if num_experts % world:
            raise InvalidInput(
                f"num_experts: expected a multiple of the expert-parallel ranks ({world}), got {num_experts}"
            )

        self.plan: DispatchPlan = resolve_dispatch_plan(
            self.vendor, hidden_size, config=self.dispatch_config, scheme=self.scheme.traits, environ=environ
        )
        self.dispatcher = self._make_dispatcher()
        choice = choose_pipeline(self.vendor, self.scheme, self.dispatcher, runners, fused)
        self._choice = choice
        self.fused: bool = choice.fused
        self.runner: ExpertRunner | None = choice.runner
        self.expert_weights: ExpertWeights | None = None
        self._pipeline: Pipeline | None = None

    def _make_dispatcher(self) -> Dispatcher:
        capacity = self.dispatch_config.max_dispatch_tokens_per_rank
        if capacity is not None:
            return LowLatencyDispatcher(self.plan, self.num_experts, capacity, self.process_group, vendor=self.vendor)
        if self.process_group is not None:
            return AllToAllDispatcher(self.plan, self.num_experts, self.process_group, vendor=self.vendor)
        return LocalDispatcher(self.plan, self.num_experts, vendor=self.vendor)

    @classmethod
    def from_float(cls, w13: torch.Tensor, w2: torch.Tensor, top_k: int, **kwargs: Any) -> MoELayer:
        """A layer sized from float weights (`w13` `[E, H, 2I]`, `w2` `[E, I, H]`, all experts),
        quantized through the scheme; keyword arguments are those of the constructor."""
        check_float_weights(w13, w2)
        e, h, two_i = w13.shape
        return cls(h, two_i // 2, e, top_k, **kwargs).load_weights(w13, w2)

    @property
    def local_experts(self) -> range:
        """The global ids of the experts this rank holds."""
        first = self.dispatcher.first_expert
        return range(first, first + self.dispatcher.num_local_experts)

    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> MoELayer:
        """Quantize float weights of all experts through the scheme; keep this rank's experts."""
        check_float_weights(w13, w2)
        want = ((self.num_experts, self.hidden_size, 2 * self.intermediate_size),
                (self.num_experts, self.intermediate_size, self.hidden_size))
        if (tuple(w13.shape), tuple(w2.shape)) != want:
            raise invalid("w13, w2", f"shapes {want[0]} and {want[1]}",
                          f"{tuple(w13.shape)} and {tuple(w2.shape)}")
        mine = slice(self.local_experts.start, self.local_experts.stop)
        device = self.vendor.device
        weights = self.scheme.quantize_weights(self.vendor, w13[mine].to(device), w2[mine].to(device))
        self._pipeline = self._choice.build(self.vendor, self.scheme, self.plan, self.dispatcher, weights,
                                            self.process_group, self.dispatch_config.max_dispatch_tokens_per_rank)
        self.expert_weights = weights
        return self

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """The MoE output for `hidden_states` `[..., H]` routed by `router_logits` `[..., E]`."""
        x, logits = self._check_inputs(hidden_states, router_logits)
        pipeline = self._pipeline
        if pipeline is None:
            raise InvalidInput("MoELayer: expected weights; call load_weights() or build it with from_float()")
        return pipeline(x, self.router(logits)).view(hidden_states.shape)

    def _check_inputs(self, hidden_states: object, router_logits: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(hidden_states, torch.Tensor):
            raise invalid("hidden_states", "a torch.Tensor", type(hidden_states).__name__)
        if not isinstance(router_logits, torch.Tensor):
            raise invalid("router_logits", "a torch.Tensor", type(router_logits).__name__)
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden_size:
            raise invalid("hidden_states", f"shape [..., {self.hidden_size}]", tuple(hidden_states.shape))
        if hidden_states.dtype not in _INPUT_DTYPES:
            raise invalid("hidden_states", "a bf16, fp16 or fp32 tensor", hidden_states.dtype)
        lead = tuple(hidden_states.shape[:-1])
        if tuple(router_logits.shape) != (*lead, self.num_experts):
            raise invalid("router_logits", f"shape {(*lead, self.num_experts)}", tuple(router_logits.shape))
        x = hidden_states.reshape(-1, self.hidden_size)
        return x, router_logits.reshape(-1, self.num_experts)

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, experts={self.num_experts}, "
            f"top_k={self.top_k}, scheme={self.scheme!r}, vendor={self.vendor.name!r}, "
            f"dispatch={self.plan.resolved} ({self.plan.source}), dispatcher={self.dispatcher!r}, "
            f"fused={self.fused}"
        )
