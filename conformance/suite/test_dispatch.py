"""Dispatch / combine round trips on moe's single-rank dispatchers, with the vendor's quantizer:
each expert scales its rows by (expert + 1), so a row sent to the wrong expert, lost or
duplicated shows; the rows each expert receives are checked against the routing."""

from __future__ import annotations

import pytest
import torch

from conformance.capability import dispatch_label, mark, require_dispatch
from conformance.reference import generator, worst
from conformance.tolerances import OUTPUT_ROUNDING, quantize_bound
from hal import DispatchConfig, DispatchDtype, QuantizedTensor, ScaleLayout, SchemeTraits, resolve_dispatch_plan
from hal.reference import activation_value
from moe import DispatchFormat, LocalDispatcher, LowLatencyDispatcher, Routing

EXPERTS, TOP_K, HIDDEN = 8, 3, 256
FORMATS = [(d, layout) for d in DispatchDtype.concrete() for layout in d.scale_layouts()]
DISPATCHERS = ["local", "low-latency"]
TOKENS = {"37-tokens": 37, "one-token": 1, "no-tokens": 0}


def _routing(tokens: int, gen: torch.Generator, device: torch.device) -> Routing:
    ids = (
        torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
        if tokens
        else torch.zeros((0, TOP_K), dtype=torch.int64)
    )
    weights = torch.rand(tokens, TOP_K, generator=gen) + 0.1
    return Routing(ids.to(device), (weights / weights.sum(-1, keepdim=True)).to(device))


def _dispatcher(kind: str, vendor, dtype: DispatchDtype, layout: ScaleLayout):
    # The plan decides the layout: a scheme asking for exactly this dtype in this layout.
    scheme = SchemeTraits(f"{dtype}-{layout}", dtype, frozenset({dtype}), scale_layouts={dtype: layout})
    plan = resolve_dispatch_plan(vendor, HIDDEN, config=DispatchConfig(dtype=dtype), scheme=scheme, environ={})
    assert (plan.resolved, plan.scale_layout) == (dtype, layout)
    if kind == "local":
        return LocalDispatcher(plan, EXPERTS), plan
    return LowLatencyDispatcher(plan, EXPERTS, capacity=64), plan


@pytest.mark.parametrize(
    "dtype, layout, dispatcher, tokens",
    [
        pytest.param(d, layout, kind, count, id=f"{d}-{layout}-{kind}-{name}", marks=mark(dispatch_label(d)))
        for d, layout in FORMATS
        for kind in DISPATCHERS
        for name, count in TOKENS.items()
    ],
)
def test_round_trip_through_scaling_experts(hal_vendor, dtype, layout, dispatcher, tokens):
    require_dispatch(hal_vendor, dtype)
    device = hal_vendor.device
    gen = generator("dispatch", dtype, layout, dispatcher, tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    routing = _routing(tokens, gen, device)
    engine, plan = _dispatcher(dispatcher, hal_vendor, dtype, layout)

    def quantize(rows: torch.Tensor) -> QuantizedTensor:
        return hal_vendor.quantize(rows, plan.resolved, layout=plan.scale_layout)

    out = engine.dispatch(x.to(device), routing, quantize)
    ids = routing.topk_ids.cpu()
    expected_counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
    assert torch.equal(out.expert_counts.cpu(), expected_counts), "per-expert counts disagree with the routing"
    assert (out.payload.dtype, out.payload.layout) == (dtype, layout)

    rows = activation_value(out.payload)  # [R, H] or [E, slots, H]
    own = activation_value(quantize(x.to(device)))  # each token quantized on its own
    if out.format is DispatchFormat.EP_LOW_LATENCY:
        by_expert = [rows[e, : int(expected_counts[e])] for e in range(EXPERTS)]
        padding = [rows[e, int(expected_counts[e]) :] for e in range(EXPERTS)]
        assert all(bool((p == 0).all()) for p in padding), "the masked payload's unused slots are not zero"
    else:
        ends = expected_counts.cumsum(0).tolist()
        by_expert = [rows[a:b] for a, b in zip([0, *ends], ends)]
    for e in range(EXPERTS):
        tokens_of_e = (ids == e).any(dim=1).nonzero().flatten()
        assert torch.equal(by_expert[e], own[tokens_of_e]), f"expert {e} received other rows than routed to it"

    # Expert e returns its rows times (e + 1), as bf16.
    scale = torch.arange(1, EXPERTS + 1, dtype=torch.float32, device=device)
    values = hal_vendor.dequantize(out.payload, torch.float32)
    if out.format is DispatchFormat.EP_LOW_LATENCY:
        expert_out = values * scale.view(-1, 1, 1)
    else:
        expert_of_row = torch.repeat_interleave(torch.arange(EXPERTS, device=device), out.expert_counts)
        expert_out = values * scale[expert_of_row].unsqueeze(-1)
    y = engine.combine(expert_out.to(torch.bfloat16), out, torch.bfloat16)
    assert tuple(y.shape) == (tokens, HIDDEN) and y.dtype == torch.bfloat16

    factor = (routing.topk_weights.cpu().double() * (ids + 1).double()).sum(dim=1, keepdim=True)
    ref = x.double() * factor
    error = (y.double().cpu() - ref).abs()
    bound = (
        quantize_bound(dtype.value, layout.value, x.double()) * factor * (1 + 2.0**-7)
        + OUTPUT_ROUNDING[torch.bfloat16] * 2 * ref.abs()
    )
    assert bool((error <= bound).all()), worst(error, bound)
