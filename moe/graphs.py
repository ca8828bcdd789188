"""Graph replay owned by the layer: eager callers get a captured forward without an engine.

A layer built with `GraphConfig` captures its forward once per distinct input signature
(token count, dtypes, routing by logits or precomputed) through its vendor's `hal.GraphSet`,
and replays it from then on: one copy in, one replay, one copy out instead of every op issued
from the host. Signatures are captured as they are first seen, up to `max_graphs`; calls with
more than `max_tokens` tokens, or seen after the budget is spent, run the plain forward. Each
capture is of the plain forward at exactly that token count, so a replay equals the plain
forward bit for bit (the vendor's deterministic ops permitting). New weights (`load_weights`,
`load_state_dict`, `.to()`) drop every capture; the next calls capture again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hal import CapturedCall, GraphSet, InvalidInput, positive_int

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


class LayerGraphs:
    """A layer's captures, keyed by `Signature`; `call` replays one or runs the plain forward."""

    def __init__(self, config: GraphConfig, make_set: Callable[[], GraphSet], forward: Forward) -> None:
        self.config = config
        self._make_set = make_set
        self._forward = forward
        self._lock = threading.Lock()
        self._graphs: dict[Signature, CapturedCall] = {}
        self._set: GraphSet | None = None
        self.captures = 0  #: captures made since the layer was built (a new set of weights captures again)

    def __deepcopy__(self, memo: dict[int, object]) -> LayerGraphs:
        """No captures: they read the original's tensors (the copy's layer makes its own set)."""
        return LayerGraphs(self.config, self._make_set, self._forward)

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every capture (the weights they read are gone)."""
        with self._lock:
            self._graphs = {}
            self._set = None

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
            if self._set is None:
                self._set = self._make_set()
            forward = self._forward
            if logits is not None:
                found = self._set.capture(lambda rows, lg: forward(rows, lg, None, None), (x, logits))
            elif ids is not None and weights is not None:
                found = self._set.capture(lambda rows, i, w: forward(rows, None, i, w), (x, ids, weights))
            else:
                raise InvalidInput("forward: expected router_logits, or both topk_ids and topk_weights")
            self._graphs = {**self._graphs, key: found}  # readers outside the lock see a complete dict
            self.captures += 1
            return found


__all__ = ["GraphConfig", "LayerGraphs"]
