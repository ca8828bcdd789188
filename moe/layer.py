"""`MoELayer`: route -> dispatch -> experts -> combine, the same code on every vendor.

Every device question goes to `hal`: the dispatch dtype comes from the layer's plan
(`hal.resolve_layer_plan`), what the experts can compute (activation, biases, grouped
matmul kind; a scheme fallback, `moe.scheme_conversion`) from the vendor's declared capabilities, the fused path from
`capabilities().fused_deep_moe`. The layer never looks at a device type. The path is chosen
once (`moe.pipeline`): at construction (fused or not, the runner) and whenever the weights
change (the dispatch quantizer); `forward` routes and runs it, or `start` / `run_experts` /
`finish` run it in stages an engine interleaves across micro-batches (`moe.stages`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hal import (
    LayerSpec,
    Activation,
    ActivationKind,
    DispatchConfig,
    DispatchPlan,
    InvalidInput,
    Vendor,
    invalid,
    resolve_layer_plan,
)
from moe.arguments import check_environ, choose_vendor
from moe.compiled import moe_forward, register_layer
from moe.dispatch import (
    AllToAllDispatcher,
    AutoDispatcher,
    Dispatcher,
    LocalDispatcher,
    LowLatencyDispatcher,
    VendorEpDispatcher,
)
from moe.dispatch.base import group_size_and_rank, tensor_group_size_and_rank
from moe.graphs import DEFAULT_LAUNCH_PLANS, GraphConfig, LaunchPlans, ReplayedForward, check_replay_configs
from moe.migration import Rebalancing
from moe.layer_inputs import check_hidden_states, route, routing_inputs
from moe.loading import ExpertLoading, TransactionalState
from moe.pipeline import Pipeline, choose_pipeline
from moe.expert_load import ExpertLoad, LoadStats
from moe.explain import LayerExplanation, dispatcher_kind, explain_layer
from moe.placement import ExpertPlacement, PhysicalMap
from moe.routing import Router, Routing, SoftmaxTopK
from moe.runners import ExpertRunner, RunnerRegistry
from moe.schemes import ExpertWeights, QuantScheme, check_float_weights, make_scheme
from moe.scheme_conversion import running_scheme
from moe.shared import SharedExperts, SharedExpertsBlock
from moe.sharding import TensorShard
from moe.stages import StagedForward
from moe.weight_store import OwnerCallback, WeightStore, weight_form


class MoELayer(ExpertLoading, TransactionalState, StagedForward, Rebalancing, ReplayedForward, torch.nn.Module):
    """A Mixture-of-Experts feed-forward layer computed through `hal`.

    Expert e computes `act(x @ w13[e] + b13[e]) @ w2[e] + b2[e]` with `w13` `[E, H, 2I]`
    (gate projection first, then up; `[E, H, I]` for a plain activation), `w2` `[E, I, H]`,
    the optional biases `b13` `[E, 2I]`, `b2` `[E, H]` and `activation` (SiLU-GLU by default,
    see `hal.ActivationKind`). The layer returns each token's routing-weighted sum over its
    top-k experts plus the shared experts' output, in the input's dtype and shape.

    - `process_group`: expert parallelism; the experts are split evenly over its ranks
      (every rank loads the same global weights and keeps its own experts).
      `dispatch.max_dispatch_tokens_per_rank` selects the low-latency dispatcher.
    - `tp_group`: tensor parallelism of the experts; each rank keeps `I / tp` of every local
      expert's intermediate dimension and the partial outputs are summed by one all-reduce
      (`moe.sharding`). Composes with `process_group` (ep x tp ranks).
    - `shared_experts`: always-on experts (`moe.SharedExperts`), loaded with `load_shared_experts`.
    - `fused`: None takes the vendor's `fused_deep_moe` where it declares one for the scheme
      (and the experts are plain SiLU-GLU without biases), False always takes the unfused
      path, True requires the fused op.
    - `graphs`: a `moe.GraphConfig` makes the layer capture its forward per token count and replay
      it (`moe.graphs`: eager callers get graph speed); needs the vendor's `graph_capture`, a
      dispatcher that never reads counts back and `check_routing` off (its default with graphs).
    - `launch_plans`: without `graphs`, eager calls replay the kernel launches recorded per input signature
      where the vendor has launch plans (`moe.LaunchPlans`, the default; bit-equal; see `moe.graphs`). None: off.
    - `redundant_experts`: R extra physical expert slots replicating busy experts (`moe.placement`);
      each chosen expert is served by one of its replicas, and `rebalance` moves the experts to the
      placement recorded loads call for, in place, leaving the output unchanged.
    - `load_stats`: a `moe.LoadStats` makes the layer count each expert's load on the device, with no
      host synchronisation (`layer.expert_load`, `moe.expert_load`).
    - `check_routing`: whether each forward checks that router logits (and precomputed
      weights) are finite and precomputed ids in range, raising `InvalidInput`; None checks
      where the vendor declares `host_synchronous` (reading values back costs no stall).
      Unchecked, a token with non-finite logits gets a non-finite output row; no other row
      changes.
    - `vendor`: a `hal.Vendor`, its name, or None for `HAL_VENDOR` of `environ`, else the
      highest-priority available vendor; `environ` (a mapping of str to str, default the process
      environment, only read) also carries `HAL_DISPATCH_DTYPE`, the legacy dispatch variables
      and, without `runners`, the default registry's `MOE_RUNNER_REPLACEMENTS`.

    Weights and scales are registered buffers (`experts.*`, `shared_experts.*`): `state_dict()`
    and `load_state_dict()` round-trip them, `.to(device)` moves them, and loading copies the
    caller's tensors. Under `torch.compile` the layer is one custom op (`moe.compiled`).

    Stages (eager, unfused path): `start` routes and starts the dispatch, `run_experts` computes the
    experts, `finish` starts the combine; together they equal `forward` bit for bit, and two
    micro-batches interleaved overlap one's communication with the other's experts (`moe.stages`).

    Threads: a loaded layer may be called from several threads at once; each call allocates
    its own working tensors (the low-latency dispatch buffers included) and every result equals
    the single-threaded one bit for bit. Layers may be built concurrently; each gets the plan a
    serial build gives. Loading weights, `load_state_dict()` or `.to()` must not overlap a call,
    and a layer with a process or tensor-parallel group (collectives, ordered alike on every rank)
    is called from one thread per rank.
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
        activation: Activation | ActivationKind | str = ActivationKind.SILU_GLU,
        bias: bool = False,
        shared_experts: SharedExperts | None = None,
        tp_group: Any = None,
        check_routing: bool | None = None,
        graphs: GraphConfig | None = None,
        launch_plans: LaunchPlans | None = DEFAULT_LAUNCH_PLANS,
        redundant_experts: int = 0,
        load_stats: LoadStats | None = None,
    ) -> None:
        super().__init__()
        if dispatch is not None and not isinstance(dispatch, DispatchConfig):
            raise invalid("dispatch", "a hal.DispatchConfig or None", type(dispatch).__name__)
        if check_routing is not None and not isinstance(check_routing, bool):
            raise invalid("check_routing", "True or False or None", check_routing)
        if shared_experts is not None and not isinstance(shared_experts, SharedExperts):
            raise invalid("shared_experts", "a moe.SharedExperts or None", type(shared_experts).__name__)
        if runners is not None and not isinstance(runners, RunnerRegistry):
            raise invalid("runners", "a moe.RunnerRegistry or None", type(runners).__name__)
        if load_stats is not None and not isinstance(load_stats, LoadStats):
            raise invalid("load_stats", "a moe.LoadStats or None", type(load_stats).__name__)
        check_replay_configs(graphs, launch_plans)
        environ = check_environ(environ)
        self.dispatch_config = dispatch or DispatchConfig()
        self.vendor = choose_vendor(vendor, environ)
        requested = make_scheme(scheme)
        tp_size, tp_rank = tensor_group_size_and_rank(tp_group, process_group)
        self.spec = LayerSpec(
            hidden_size,
            intermediate_size,
            num_experts,
            top_k,
            scheme=requested.traits,
            activation=activation,
            bias=bias,
            fused=fused,
            ep_ranks=group_size_and_rank(process_group)[0],
            tp_ranks=tp_size,
            expert_parallel=process_group is not None,
            ep_dispatcher=self.dispatch_config.ep_dispatcher,
            graphs=graphs is not None,
            redundant_experts=redundant_experts,
        )
        caps = self.vendor.capabilities()
        self.spec.check(caps, self.vendor.name)
        #: the scheme the experts compute with: the one asked for, or the vendor's declared fallback for it,
        #: in which case `source_scheme` is the one asked for and loading converts its weights once
        self.scheme, self.scheme_choice = running_scheme(caps, requested)
        self.source_scheme: QuantScheme | None = requested if self.scheme_choice.converted else None
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        #: where the experts live: `num_physical_experts` slots, logical expert ids per slot (`moe.placement`)
        self.placement = ExpertPlacement.default(num_experts, redundant_experts)
        self.num_physical_experts = self.placement.num_physical
        self.activation = self.spec.parsed_activation
        self.bias = bias
        # a replayed forward reads nothing back: unchecked unless asked for (and then refused below)
        self.check_routing = caps.host_synchronous and graphs is None if check_routing is None else check_routing
        self.router = router if router is not None else SoftmaxTopK(num_experts, top_k)
        if not isinstance(self.router, Router):
            raise invalid("router", "a moe.Router", type(self.router).__name__)
        if (self.router.num_experts, self.router.top_k) != (num_experts, top_k):
            raise InvalidInput(
                f"router: expected one for {num_experts} experts and top-{top_k}, "
                f"got {self.router.num_experts} experts and top-{self.router.top_k}"
            )
        self.router.to(self.vendor.device)  # its tensors (a correction bias) live beside the weights
        self._physical = PhysicalMap(self.placement, self.vendor.device) if redundant_experts else None
        self.process_group = process_group
        self.tp_group = tp_group
        self.tensor_shard = TensorShard(tp_rank, tp_size)
        self.local_intermediate_size = self.tensor_shard.local_size(intermediate_size)

        self.plan: DispatchPlan = resolve_layer_plan(
            self.vendor, hidden_size, self.scheme_choice, config=self.dispatch_config, environ=environ
        )
        self._runners, self._environ = runners, environ
        self.dispatcher = self._make_dispatcher()
        choice = choose_pipeline(self.vendor, self.scheme, self.spec, self.dispatcher, runners, environ=environ)
        self._choice = choice
        self.fused: bool = choice.fused
        self.runner: ExpertRunner | None = choice.runner
        layout = self.scheme.gemm_kind().spec.weight_layout
        self.experts = WeightStore((layout, layout), self.activation, self.vendor.device)
        self.experts.form = weight_form(self.scheme, self.source_scheme)
        self.experts.on_change = OwnerCallback(self._rebuild)
        self.experts.prepare = self.vendor.prepare_weight
        self.shared_experts = (
            None
            if shared_experts is None
            else SharedExpertsBlock(shared_experts, (layout, layout), self.activation, self.vendor.device)
        )
        if self.shared_experts is not None:
            self.shared_experts.store.prepare = self.vendor.prepare_weight
        self._pipeline: Pipeline | None = None
        self.expert_load = (
            None
            if load_stats is None
            else ExpertLoad(load_stats, num_experts, self.dispatcher.num_local_experts, self.vendor)
        )
        self.graph_config = graphs
        self.launch_plans = launch_plans
        self._graphs = self._make_graphs()
        if self.shared_experts is not None:
            self.shared_experts.store.on_change = OwnerCallback(self._drop_graphs)
        self._handle = register_layer(self)

    def _make_dispatcher(self) -> Dispatcher:
        config = self.dispatch_config
        capacity, native, mode = config.max_dispatch_tokens_per_rank, config.ep_dispatcher, config.mode
        kind = dispatcher_kind(config, self.process_group is not None)
        if native is not None:  # declared and given a process group: `LayerSpec` checked both
            return VendorEpDispatcher(
                self.plan,
                self.num_physical_experts,
                self.process_group,
                vendor=self.vendor,
                name=native,
                mode=mode,
                capacity=capacity,
            )
        if kind == "auto":
            return AutoDispatcher(
                self.plan,
                self.num_physical_experts,
                capacity,
                self.process_group,  # type: ignore[arg-type]
                vendor=self.vendor,
            )
        if kind == "low-latency":
            return LowLatencyDispatcher(
                self.plan, self.num_physical_experts, capacity, self.process_group, vendor=self.vendor
            )
        if kind == "all-to-all":
            return AllToAllDispatcher(self.plan, self.num_physical_experts, self.process_group, vendor=self.vendor)
        return LocalDispatcher(self.plan, self.num_physical_experts, vendor=self.vendor)

    @classmethod
    def from_float(
        cls,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        *,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> MoELayer:
        """A layer sized from float weights of all experts (`w13` `[E, H, 2I]`, or `[E, H, I]` for a
        plain activation; `w2` `[E, I, H]`; optional biases), quantized through the scheme;
        other keyword arguments are those of the constructor (`bias` follows the biases given)."""
        gated = Activation.parse(kwargs.get("activation", ActivationKind.SILU_GLU)).gated
        check_float_weights(w13, w2, gated=gated)
        e, h, _ = w13.shape
        kwargs.setdefault("bias", w13_bias is not None or w2_bias is not None)
        layer = cls(h, w2.shape[1], e, top_k, **kwargs)
        return layer.load_weights(w13, w2, w13_bias=w13_bias, w2_bias=w2_bias)

    @property
    def local_experts(self) -> range:
        """The physical slots this rank holds (the global ids of its experts without redundant experts)."""
        first = self.dispatcher.first_expert
        return range(first, first + self.dispatcher.num_local_experts)

    @property
    def explanation(self) -> LayerExplanation:
        """Why this layer runs the way it does: its dispatch dtype, pipeline, dispatcher and expert runner,
        and for each alternative the reason it was not taken (`moe.explain`; `.text()` to log it)."""
        return explain_layer(
            self.vendor, self.spec, dispatch=self.dispatch_config, runners=self._runners, environ=self._environ
        ).with_eager(self.eager_calls)

    @property
    def expert_weights(self) -> ExpertWeights | None:
        """This rank's expert weights as stored (None before loading)."""
        return self.experts.weights

    def _rebuild(self) -> None:
        self._drop_graphs()
        weights = self.experts.weights
        self._pipeline = (
            None
            if weights is None
            else self._choice.build(
                self.vendor,
                self.scheme,
                self.plan,
                self.dispatcher,
                weights,
                self.process_group,
                self.dispatch_config.max_dispatch_tokens_per_rank
                if self.dispatch_config.mode == "low-latency"
                else None,
                on_dispatch=None if self.expert_load is None else self.expert_load.record_received,
            )
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        *,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The MoE output for `hidden_states` `[..., H]`, routed by `router_logits` `[..., E]` through the
        layer's router, or by precomputed `topk_ids` / `topk_weights` `[..., k]` (engines that route
        elsewhere; the weights are used as given)."""
        device = self.vendor.device
        x = check_hidden_states(hidden_states, self.hidden_size, device)
        logits, ids, weights = routing_inputs(self, hidden_states, router_logits, topk_ids, topk_weights, device)
        if torch.compiler.is_compiling():  # one opaque op: compiled and eager compute the same way
            out = moe_forward(x, logits, ids, weights, self._handle)
        elif self._graphs is not None and self._pipeline is not None:
            out = self._graphs.call(x, logits, ids, weights)
        else:
            out = self._run(x, logits, ids, weights)
        return out if out.shape == hidden_states.shape else out.view(hidden_states.shape)

    def _run(
        self, x: torch.Tensor, logits: torch.Tensor | None, ids: torch.Tensor | None, weights: torch.Tensor | None
    ) -> torch.Tensor:
        """Routing, dispatch, experts, combine, shared experts and the tensor-parallel sum for rows `[T, H]`
        (checked inputs: `routing_inputs`).

        With a routing whose `weights_on_input` is set (Llama-4) the routed experts take each row
        scaled by its (top-1) weight and are combined with weight 1; the shared experts take the
        rows as they are.
        """
        pipeline = self._loaded_pipeline()
        routed_x, routing = self._routed_rows(x, logits, ids, weights)
        partial = self.tensor_shard.size > 1
        if self.shared_experts is None and not partial:
            return pipeline(routed_x, routing)
        shared = self.shared_experts
        if shared is not None:  # beside the routed experts where the vendor can overlap them
            shared_output = self.vendor.overlap(lambda: shared(self.vendor, self.scheme, x))
        out = pipeline(routed_x, routing, torch.float32)
        if shared is not None:
            out = out + shared_output()
        return (self._tensor_parallel_sum(out) if partial else out).to(x.dtype)

    def _loaded_pipeline(self) -> Pipeline:
        pipeline = self._pipeline
        if pipeline is None:
            raise InvalidInput("MoELayer: expected weights; call load_weights() or build it with from_float()")
        return pipeline

    def _routed_rows(
        self, x: torch.Tensor, logits: torch.Tensor | None, ids: torch.Tensor | None, weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, Routing]:
        """The rows the routed experts take and their routing (Llama-4: rows scaled by the weight, weight 1)."""
        routed = route(self, x, logits, ids, weights)
        topk_ids, topk_weights = routed.topk_ids, routed.topk_weights
        if self.expert_load is not None:
            self.expert_load.record_routing(topk_ids)
        if self._physical is not None:  # each logical choice to one of its replicas
            topk_ids = self._physical.to_physical(topk_ids)
        if not routed.weights_on_input:
            return x, routed if topk_ids is routed.topk_ids else Routing(topk_ids, topk_weights)
        return (x.to(torch.float32) * topk_weights).to(x.dtype), Routing(topk_ids, torch.ones_like(topk_weights))

    def _tensor_parallel_sum(self, out: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(out, group=self.tp_group)
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._graphs = self._make_graphs()  # a copy captures its own forward, over its own weights
        self._handle = register_layer(self)  # a copy (copy.deepcopy) is a layer of its own for the custom op

    def _apply(self, fn: Any, recurse: bool = True) -> MoELayer:
        super()._apply(fn, recurse)
        self._drop_graphs()
        stored = self.experts.weights
        if stored is not None:  # the router follows the weights (moved, never cast)
            self.router.to(stored.w13.data.device)
        return self

    def extra_repr(self) -> str:
        shared = "" if self.shared_experts is None else f", shared={self.shared_experts.config}"
        redundant = f", redundant={self.placement.redundant}" if self.placement.redundant else ""
        converted = "" if self.source_scheme is None else f" (converted at load from {self.source_scheme.name})"
        tp = "" if self.tensor_shard.size == 1 else f", tp={self.tensor_shard.rank}/{self.tensor_shard.size}"
        return (
            f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, experts={self.num_experts}, "
            f"top_k={self.top_k}{redundant}, scheme={self.scheme!r}{converted}, activation={self.activation}, "
            f"bias={self.bias}, vendor={self.vendor.name!r}, dispatch={self.plan.resolved} ({self.plan.source}), "
            f"dispatcher={self.dispatcher!r}, fused={self.fused}{tp}{shared}"
        )
