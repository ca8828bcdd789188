"""Graph replay owned by the layer: eager callers get a captured forward without an engine.

A layer built with `GraphConfig` captures its forward once per distinct input signature
(token count, dtypes, routing by logits or precomputed) through its vendor's `hal.GraphSet`,
and replays it from then on: one copy in, one replay, one copy out instead of every op issued
from the host. Signatures are captured as they are first seen, up to `max_graphs`; calls with
more than `max_tokens` tokens, or seen after the budget is spent, run the plain forward. Each
capture is of the plain forward at exactly that token count, so a replay equals the plain
forward bit for bit (the vendor's deterministic ops permitting). New weights (`load_weights`,
`load_state_dict`, `.to()`) drop every capture; the next calls capture again.

Without a `GraphConfig`, an eager layer replays its forward through the vendor's launch plans where it
has them (`LaunchPlans`, `hal.Vendor.launch_plan_set`): a signature seen twice is recorded (its kernel
launches and allocations) and later calls issue those launches again with the caller's tensors, skipping
the host work that chose them. Same signatures, budget and dropping as graphs; no copies and no memory
kept between calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hal import CapturedCall, GraphSet, InvalidInput, invalid, positive_int

#: (tokens, hidden dtype, logits dtype or None, precomputed-routing dtypes or None)
Signature = tuple[int, torch.dtype, torch.dtype | None, tuple[torch.dtype, torch.dtype] | None]
#: the plain forward over flattened, checked inputs: (rows, logits, ids, weights) -> output rows
Forward = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class GraphConfig:
    """How a layer replays its forward (`MoELayer(graphs=GraphConfig())`).

    - `max_tokens`: calls with more tokens run the plain forward (prefill is bound by its
      kernels, not by the host, and every distinct large batch would cost a capture).
    - `max_graphs`: how many signatures are captured; later new ones run the plain forward.
      Each capture keeps its inputs and output; intermediates share one memory pool per layer.
    """

    max_tokens: int = 512
    max_graphs: int = 16

    def __post_init__(self) -> None:
        positive_int("GraphConfig.max_tokens", self.max_tokens)
        positive_int("GraphConfig.max_graphs", self.max_graphs)


@dataclass(frozen=True)
class LaunchPlans:
    """How an eager layer replays its kernel launches (`MoELayer(launch_plans=LaunchPlans())`, the default;
    None turns it off). Used where the vendor has launch plans (`hal.Vendor.launch_plan_set`) and the layer
    has no `GraphConfig`.

    - `max_tokens`: calls with more tokens run the plain forward.
    - `max_plans`: how many signatures are recorded; later new ones run the plain forward. A signature
      is recorded at its second call (one-off batch sizes spend none of the budget).
    """

    max_tokens: int = 512
    max_plans: int = 32

    def __post_init__(self) -> None:
        positive_int("LaunchPlans.max_tokens", self.max_tokens)
        positive_int("LaunchPlans.max_plans", self.max_plans)

    @property
    def max_graphs(self) -> int:
        """The budget under the name `LayerGraphs` reads."""
        return self.max_plans


#: the layer's default: launch plans on, where the vendor has them
DEFAULT_LAUNCH_PLANS = LaunchPlans()


def check_replay_configs(graphs: object, launch_plans: object) -> None:
    """Raise `InvalidInput` unless `graphs` is a `GraphConfig` or None and `launch_plans` a `LaunchPlans` or None."""
    if graphs is not None and not isinstance(graphs, GraphConfig):
        raise invalid("graphs", "a moe.GraphConfig or None", type(graphs).__name__)
    if launch_plans is not None and not isinstance(launch_plans, LaunchPlans):
        raise invalid("launch_plans", "a moe.LaunchPlans or None", type(launch_plans).__name__)


class LayerGraphs:
    """A layer's captures, keyed by `Signature`; `call` replays one or runs the plain forward."""

    def __init__(
        self,
        config: GraphConfig | LaunchPlans,
        make_set: Callable[[], GraphSet | None],
        forward: Forward,
        keep_state: Callable[[], Callable[[], None]] | None = None,
    ) -> None:
        self.config = config
        #: a signature is captured at its second call (launch plans), else at its first
        self._seen: set[Signature] | None = set() if isinstance(config, LaunchPlans) else None
        self._make_set = make_set
        self._forward = forward
        #: saves state the forward updates (load statistics) and returns its restore, around a capture
        self._keep_state = keep_state
        self._lock = threading.Lock()
        self._graphs: dict[Signature, CapturedCall] = {}
        self._set: GraphSet | None = None
        self.captures = 0  #: captures made since the layer was built (a new set of weights captures again)

    def __deepcopy__(self, memo: dict[int, object]) -> LayerGraphs:
        """No captures: they read the original's tensors (the copy's layer makes its own set)."""
        return LayerGraphs(self.config, self._make_set, self._forward, self._keep_state)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._graphs)

    def refusals(self) -> dict[str, int]:
        """Why captures were refused, counted, where the set reports it (launch plans), else empty."""
        return dict(getattr(self._set, "refusals", {}))

    def clear(self) -> None:
        """Drop every capture (the weights they read are gone)."""
        with self._lock:
            self._graphs = {}
            self._set = None
            if self._seen is not None:
                self._seen.clear()

    def call(
        self, x: torch.Tensor, logits: torch.Tensor | None, ids: torch.Tensor | None, weights: torch.Tensor | None
    ) -> torch.Tensor:
        """The forward of checked, flattened inputs, replayed where a capture serves them."""
        captured = self._captured(x, logits, ids, weights)
        if captured is None:
            return self._forward(x, logits, ids, weights)
        return captured(x, logits) if logits is not None else captured(x, ids, weights)

    def _captured(
        self, x: torch.Tensor, logits: torch.Tensor | None, ids: torch.Tensor | None, weights: torch.Tensor | None
    ) -> CapturedCall | None:
        tokens = x.shape[0]
        if tokens == 0 or tokens > self.config.max_tokens:
            return None
        key: Signature = (
            tokens,
            x.dtype,
            None if logits is None else logits.dtype,
            None if ids is None or weights is None else (ids.dtype, weights.dtype),
        )
        found = self._graphs.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._graphs.get(key)
            if found is not None or len(self._graphs) >= self.config.max_graphs:
                return found
            if self._seen is not None and key not in self._seen:
                if len(self._seen) >= 4 * self.config.max_graphs:
                    self._seen.clear()
                self._seen.add(key)
                return None
            if self._set is None:
                self._set = self._make_set()
                if self._set is None:
                    return None
            if not self._set.can_capture():
                return None
            forward = self._forward
            restore = None if self._keep_state is None else self._keep_state()
            if logits is not None:
                found = self._set.capture(lambda rows, lg: forward(rows, lg, None, None), (x, logits))
            elif ids is not None and weights is not None:
                found = self._set.capture(lambda rows, i, w: forward(rows, None, i, w), (x, ids, weights))
            else:
                raise InvalidInput("forward: expected router_logits, or both topk_ids and topk_weights")
            if restore is not None:
                restore()
            self._graphs = {**self._graphs, key: found}  # readers outside the lock see a complete dict
            self.captures += 1
            return found


class ReplayedForward:
    """The `MoELayer` methods that manage its captures (`graphs=GraphConfig(...)`)."""

    graph_config: GraphConfig | None
    launch_plans: LaunchPlans | None
    _graphs: LayerGraphs | None

    def _make_graphs(self: Any) -> LayerGraphs | None:
        """The layer's captures (`moe.graphs`): graphs with a `GraphConfig`, else launch plans where they may
        serve, else None."""
        config = self.graph_config
        if config is None:
            return self._make_launch_plans()
        if self.check_routing:
            raise InvalidInput(
                "graphs: expected check_routing=False (checking routing reads values back on the host, "
                "which a replayed forward cannot)"
            )
        if not self.dispatcher.capturable:
            raise InvalidInput(
                f"graphs: the dispatcher {self.dispatcher!r} reads counts back on the host every call, so its "
                "forward cannot be replayed; use a low-latency dispatch (max_dispatch_tokens_per_rank) or no graphs"
            )
        load = self.expert_load
        return LayerGraphs(config, self.vendor.graph_set, self._run, None if load is None else load.saved)

    def _make_launch_plans(self: Any) -> LayerGraphs | None:
        if self._without_launch_plans() is not None:
            return None
        load = self.expert_load
        return LayerGraphs(
            self.launch_plans, self.vendor.launch_plan_set, self._run, None if load is None else load.saved
        )

    def _without_launch_plans(self: Any) -> str | None:
        """Why this layer's eager calls take no launch plans (None: they do)."""
        # collectives and host reads are device work a recorder cannot see: those layers run plainly
        if self.graph_config is not None:
            return "it replays CUDA graphs (graphs=GraphConfig)"
        if self.launch_plans is None:
            return "launch_plans=None"
        if self.vendor.launch_plan_set() is None:
            return f"vendor {self.vendor.name!r} records no launch plans"
        if self.check_routing:
            return "check_routing reads the routing back on the host"
        if not self.dispatcher.capturable:
            return f"the dispatcher {self.dispatcher!r} reads counts back on the host"
        if self.process_group is not None or self.tp_group is not None:
            return "its collectives (process_group / tp_group) are not kernel launches a recorder sees"
        return None

    @property
    def eager_calls(self) -> str:
        """How an eager call runs: graph replay, launch plans (with what was recorded and refused so far) or
        the plain forward, and why (`explanation` shows it too)."""
        if self.graph_config is not None:
            c = self.graph_config
            return f"CUDA-graph replay up to {c.max_tokens} tokens, {c.max_graphs} signatures ({self.graph_count} held)"
        why = self._without_launch_plans()
        if why is not None:
            return f"the plain forward: {why}"
        c = self.launch_plans
        refused = self.launch_plan_refusals
        text = (
            f"launch plans up to {c.max_tokens} tokens, {c.max_plans} signatures, each recorded at its second call "
            f"({self.launch_plan_count} recorded"
        )
        return text + (f"; refused: {refused})" if refused else ")")

    def _op_forward(
        self: Any, x: torch.Tensor, logits: torch.Tensor | None, ids: torch.Tensor | None, weights: torch.Tensor | None
    ) -> torch.Tensor:
        """The forward of the compiled layer's custom op (`moe.compiled`): through the launch plans where the
        layer has them (the op runs eagerly inside a compiled model), else the plain forward."""
        graphs = self._graphs
        if graphs is not None and self.graph_config is None and self._pipeline is not None:
            return graphs.call(x, logits, ids, weights)
        return self._run(x, logits, ids, weights)

    def _drop_graphs(self) -> None:
        if self._graphs is not None:
            self._graphs.clear()

    @property
    def graph_count(self) -> int:
        """How many forward signatures the layer holds captured (0 without a `GraphConfig`)."""
        return 0 if self._graphs is None or self.graph_config is None else len(self._graphs)

    @property
    def launch_plan_count(self) -> int:
        """How many forward signatures the layer has recorded as launch plans (each a plan, or the plain
        forward where its recording was refused; 0 with a `GraphConfig` or without plans)."""
        return 0 if self._graphs is None or self.graph_config is not None else len(self._graphs)

    @property
    def launch_plan_refusals(self) -> dict[str, int]:
        """Why signatures got no launch plan (each reason with its count; also logged once at INFO level, by
        `vendors.cuda.launch_plans` on CUDA): those signatures run the plain forward. Empty without plans."""
        if self._graphs is None or self.graph_config is not None:
            return {}
        return self._graphs.refusals()


__all__ = ["GraphConfig", "LaunchPlans", "LayerGraphs", "ReplayedForward", "check_replay_configs"]
