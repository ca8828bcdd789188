"""The layer's pipeline, chosen once: the fused op, or dispatch -> experts -> combine.

`choose_pipeline` decides at construction, from the layer's `hal.LayerSpec` and what the vendor
declares, whether the layer takes the vendor's `fused_deep_moe` or the unfused path, and for the unfused path
which expert runner serves (dispatch format, grouped-matmul kind, scheme). `PipelineChoice.build`
binds the choice to the loaded weights: the dispatch quantizer is made there, once. The
layer's `forward` routes and calls the built pipeline; it decides nothing per call.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hal import DispatchPlan, LayerSpec, Vendor
from moe.dispatch import DispatchFormat, Dispatcher, DispatchOutput
from moe.routing import Routing
from moe.runners import ExpertRunner, RunnerRegistry
from moe.schemes import ExpertWeights, QuantScheme, Quantizer


class Pipeline(abc.ABC):
    """What one forward runs after routing: `[T, H]` rows and their routing in, `[T, H]` out in x's dtype."""

    fused: bool

    @abc.abstractmethod
    def __call__(self, x: torch.Tensor, routing: Routing, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The MoE output of routed rows, in `out_dtype` (default: x's dtype)."""


@dataclass(frozen=True)
class FusedPipeline(Pipeline):
    """The vendor's one fused op (dispatch, both GEMMs, combine)."""

    vendor: Vendor
    scheme: str
    weights: ExpertWeights
    plan: DispatchPlan
    process_group: Any
    capacity: int | None
    fused = True

    def __call__(self, x: torch.Tensor, routing: Routing, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.vendor.fused_deep_moe(
            x,
            routing.topk_ids,
            routing.topk_weights,
            self.weights.w13,
            self.weights.w2,
            scheme=self.scheme,
            process_group=self.process_group,
            dispatch_dtype=self.plan.resolved,
            max_tokens_per_rank=self.capacity,
        ).to(out_dtype or x.dtype)


@dataclass(frozen=True)
class UnfusedPipeline(Pipeline):
    """route -> `dispatcher.dispatch` (quantized before it travels) -> the runner -> `dispatcher.combine`."""

    vendor: Vendor
    scheme: QuantScheme
    weights: ExpertWeights
    dispatcher: Dispatcher
    runner: ExpertRunner
    quantize: Quantizer
    #: the runner of each further format the dispatcher may hand over (a dispatcher that changes mode per call)
    other_runners: Mapping[DispatchFormat, ExpertRunner] = field(default_factory=dict)
    #: called with each dispatch's per-local-expert counts (load statistics), or None
    on_dispatch: Callable[[torch.Tensor], None] | None = None
    fused = False

    def __call__(self, x: torch.Tensor, routing: Routing, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        dispatched = self.dispatcher.dispatch(x, routing, self.quantize)
        if self.on_dispatch is not None:
            self.on_dispatch(dispatched.expert_counts)
        expert_output = self.experts(dispatched)
        return self.dispatcher.combine(expert_output, dispatched, out_dtype or x.dtype)

    def experts(self, dispatched: DispatchOutput) -> torch.Tensor:
        """The experts' output rows for a dispatch output (the runner of its format)."""
        runner = self.other_runners.get(dispatched.format, self.runner)
        return runner(self.vendor, self.scheme, self.weights, dispatched)


@dataclass(frozen=True)
class PipelineChoice:
    """The path a layer takes, decided at construction (before its weights exist)."""

    fused: bool
    runner: ExpertRunner | None  #: None on the fused path
    other_runners: Mapping[DispatchFormat, ExpertRunner] = field(default_factory=dict)

    def build(
        self,
        vendor: Vendor,
        scheme: QuantScheme,
        plan: DispatchPlan,
        dispatcher: Dispatcher,
        weights: ExpertWeights,
        process_group: Any,
        capacity: int | None,
        on_dispatch: Callable[[torch.Tensor], None] | None = None,
    ) -> Pipeline:
        """The pipeline over loaded weights (`on_dispatch`: see `UnfusedPipeline`)."""
        if self.fused:
            if capacity is not None:  # the one-kernel form runs on weights the vendor prepares now, at load
                vendor.prepare_fused(weights.w13, weights.w2, scheme=scheme.name, process_group=process_group)
            return FusedPipeline(vendor, scheme.name, weights, plan, process_group, capacity)
        quantize = scheme.dispatch_quantizer(vendor, plan, weights)
        return UnfusedPipeline(
            vendor,
            scheme,
            weights,
            dispatcher,
            self.runner,
            quantize,  # type: ignore[arg-type]
            self.other_runners,
            on_dispatch,
        )


def choose_pipeline(
    vendor: Vendor,
    scheme: QuantScheme,
    spec: LayerSpec,
    dispatcher: Dispatcher,
    runners: RunnerRegistry | None,
    *,
    environ: Mapping[str, str] | None = None,
) -> PipelineChoice:
    """Fused where `spec` takes the vendor's `fused_deep_moe` (`LayerSpec.takes_fused`), else the
    unfused path with the runner registered for its key (dispatch format, grouped-matmul kind,
    scheme). Without `runners`, the default registry reads its settings from `environ` (the
    process environment when None).

    Raises what `LayerSpec.check` raises for a spec this vendor cannot build.
    """
    caps = vendor.capabilities()
    spec.check(caps, vendor.name)
    if spec.takes_fused(caps):
        return PipelineChoice(True, None)
    kind = scheme.gemm_kind()
    registry = runners if runners is not None else RunnerRegistry.with_defaults(environ=environ)
    others = {
        fmt: registry.lookup(vendor.name, fmt, kind, scheme.name)
        for fmt in dispatcher.formats
        if fmt is not dispatcher.format
    }
    return PipelineChoice(False, registry.lookup(vendor.name, dispatcher.format, kind, scheme.name), others)
