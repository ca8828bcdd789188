"""The checks of a forward's inputs and its routing: by the layer's router, or precomputed."""

from __future__ import annotations

from typing import Any

import torch

from hal import FP32_MAX, InvalidInput, invalid
from moe.arguments import on_device
from moe.routing import Routing

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_WEIGHT_DTYPES = (*_INPUT_DTYPES, torch.float64)
_INT_DTYPES = (torch.int32, torch.int64)


def check_hidden_states(hidden_states: object, hidden_size: int, device: torch.device) -> torch.Tensor:
    """`hidden_states` `[..., H]` (bf16, fp16 or fp32, on the layer's `device`) as `[T, H]` rows."""
    if not isinstance(hidden_states, torch.Tensor):
        raise invalid("hidden_states", "a torch.Tensor", type(hidden_states).__name__)
    on_device("hidden_states", hidden_states, device)
    if hidden_states.dim() < 1 or hidden_states.shape[-1] != hidden_size:
        raise invalid("hidden_states", f"shape [..., {hidden_size}]", tuple(hidden_states.shape))
    if hidden_states.dtype not in _INPUT_DTYPES:
        raise invalid("hidden_states", "a bf16, fp16 or fp32 tensor", hidden_states.dtype)
    return hidden_states if hidden_states.dim() == 2 else hidden_states.reshape(-1, hidden_size)


def routing_inputs(
    layer: Any,
    hidden_states: torch.Tensor,
    router_logits: object,
    topk_ids: object,
    topk_weights: object,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """A forward's routing inputs checked (types, devices, shapes, dtypes: nothing read from the device)
    and flattened: `(logits [T, E], None, None)` or `(None, ids int64 [T, k], weights fp32 [T, k])`."""
    lead = tuple(hidden_states.shape[:-1])
    if router_logits is not None:
        if topk_ids is not None or topk_weights is not None:
            raise InvalidInput("forward: expected router_logits or precomputed topk_ids/topk_weights, got both")
        if not isinstance(router_logits, torch.Tensor):
            raise invalid("router_logits", "a torch.Tensor", type(router_logits).__name__)
        on_device("router_logits", router_logits, device)
        if tuple(router_logits.shape) != (*lead, layer.num_experts):
            raise invalid("router_logits", f"shape {(*lead, layer.num_experts)}", tuple(router_logits.shape))
        flat = router_logits if router_logits.dim() == 2 else router_logits.reshape(-1, layer.num_experts)
        return flat, None, None
    if topk_ids is None or topk_weights is None:
        raise InvalidInput(
            "forward: expected router_logits, or both topk_ids and topk_weights; got "
            + ("neither" if topk_ids is None and topk_weights is None else "only one of the two")
        )
    want = (*lead, layer.top_k)
    for name, t, kinds, what in (
        ("topk_ids", topk_ids, _INT_DTYPES, "int32/int64"),
        ("topk_weights", topk_weights, _WEIGHT_DTYPES, "floating-point"),
    ):
        if not isinstance(t, torch.Tensor):
            raise invalid(name, "a torch.Tensor", type(t).__name__)
        on_device(name, t, device)
        if tuple(t.shape) != want or t.dtype not in kinds:
            raise invalid(name, f"a {what} tensor of shape {want}", f"{t.dtype} of shape {tuple(t.shape)}")
    ids = topk_ids.reshape(-1, layer.top_k).to(torch.int64)  # type: ignore[union-attr]
    return None, ids, topk_weights.reshape(-1, layer.top_k).to(torch.float32)  # type: ignore[union-attr]


def route(
    layer: Any, x: torch.Tensor, logits: torch.Tensor | None, ids: torch.Tensor | None, weights: torch.Tensor | None
) -> Routing:
    """The routing of checked inputs (`routing_inputs`): `layer.router` over the logits, or the precomputed
    ids and weights. With `layer.check_routing`, non-finite hidden states, logits or weights and out-of-range
    ids raise `InvalidInput` (host reads of a few flags)."""
    check = layer.check_routing
    if check:
        bad = ~torch.isfinite(x).all(dim=-1)
        if bool(bad.any()):
            rows = bad.nonzero().flatten()
            raise InvalidInput(
                f"hidden_states: expected finite values, got inf or NaN in {rows.numel()} token(s) "
                f"(first: token {int(rows[0])})"
            )
    if logits is not None:
        if check and torch.is_floating_point(logits):
            _require_finite("router_logits", logits)
        return layer.router(logits, layer.vendor)
    if ids is None or weights is None:
        raise InvalidInput("forward: expected router_logits, or both topk_ids and topk_weights; got neither")
    if check:
        _require_finite("topk_weights", weights)
        if ids.numel() and bool(((ids < 0) | (ids >= layer.num_experts)).any()):
            bad = ids[(ids < 0) | (ids >= layer.num_experts)]
            raise InvalidInput(
                f"topk_ids: expected expert ids in [0, {layer.num_experts}), "
                f"got {bad.numel()} outside (e.g. {int(bad[0])})"
            )
    return Routing(ids, weights)


def _require_finite(name: str, t: torch.Tensor) -> None:
    """Finite values, and for float64 within the fp32 range (routing computes in fp32)."""
    if t.element_size() == 1:  # fp8 has no isfinite kernel; its refusal by dtype comes after this check
        t = t.float()
    finite = torch.isfinite(t) if t.dtype != torch.float64 else t.abs() <= FP32_MAX
    bad_rows = ~finite.all(dim=-1)
    if bool(bad_rows.any()):
        rows = bad_rows.nonzero().flatten()
        raise InvalidInput(
            f"{name}: expected finite values (at most {FP32_MAX:.6g} in magnitude: routing computes in fp32), "
            f"got non-finite or larger values in {rows.numel()} token(s) "
            f"(first: token {int(rows[0])})"
        )
