"""The layer as one custom op, so `torch.compile(fullgraph=True)` traces a model through it.

Under compilation the layer checks its inputs' shapes in traced code and hands the rest
(routing and its value checks, dispatch, grouped matmuls whose group sizes depend on the
data, combine, shared experts, the tensor-parallel all-reduce) to
`torch.ops.moe_hal.moe_forward`, whose fake implementation only states the output's shape
and dtype. Compiled and eager layers therefore compute bit for bit alike; the op's calls go through the
layer's launch plans where it has them (`moe.LaunchPlans`), as eager calls do. The op finds its
layer through an integer handle: torch custom ops take tensors and plain values, not Python
objects. The handle table holds weak references only (a layer that is gone is gone from it);
it is an identity table, not configuration, and nothing reads it but the op. A lock guards
it: layers are built, copied and called from several threads.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import torch

from hal import InvalidInput, invalid

_LAYERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)
_LOCK = threading.Lock()


def register_layer(layer: Any) -> int:
    """A new handle for `layer` (which must have `_run(x, router_logits, topk_ids, topk_weights)`)."""
    if not callable(getattr(layer, "_run", None)):
        raise invalid("layer", "a moe.MoELayer (an object with _run)", type(layer).__name__)
    with _LOCK:
        handle = next(_HANDLES)
        _LAYERS[handle] = layer
    return handle


# Registered through `torch.library.Library` rather than `torch.library.custom_op`: the latter wraps every
# call in Python autograd and dispatch layers (measured: about 80 µs more per call on a 2-core host, 200 µs
# more under torch.compile); the op has no autograd formula either way (the layer is for inference).
_LIBRARY = torch.library.Library("moe_hal", "DEF")
_LIBRARY.define(
    "moe_forward(Tensor x, Tensor? router_logits, Tensor? topk_ids, Tensor? topk_weights, int handle) -> Tensor"
)


def _moe_forward(
    x: torch.Tensor,
    router_logits: torch.Tensor | None,
    topk_ids: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    handle: int,
) -> torch.Tensor:
    """The MoE output `[T, H]` (x's dtype) of rows `x` `[T, H]`, routed by `router_logits` `[T, E]` or by
    precomputed `topk_ids` / `topk_weights` `[T, k]`, computed by layer `handle`."""
    with _LOCK:
        layer = _LAYERS.get(handle)
    if layer is None:
        raise InvalidInput(f"moe_hal::moe_forward: expected a live MoELayer for handle {handle}, got none")
    run = getattr(layer, "_op_forward", layer._run)  # a layer's launch plans serve the op's eager calls too
    return run(x, router_logits, topk_ids, topk_weights)


def _moe_forward_fake(
    x: torch.Tensor,
    router_logits: torch.Tensor | None,
    topk_ids: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    handle: int,
) -> torch.Tensor:
    return torch.empty_like(x)


_LIBRARY.impl("moe_forward", _moe_forward, "CompositeExplicitAutograd")
torch.library.register_fake("moe_hal::moe_forward", _moe_forward_fake, lib=_LIBRARY)

#: `torch.ops.moe_hal.moe_forward`: the op the compiled layer calls
moe_forward = torch.ops.moe_hal.moe_forward.default
