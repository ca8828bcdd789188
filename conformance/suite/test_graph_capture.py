"""Graph capture, where a vendor declares it (`graph_capture`): a captured call replayed with new inputs
returns what the plain call returns for them, and a layer that replays its forward (`moe.GraphConfig`)
equals the plain layer call after call, at every captured token count. A vendor whose replays hand back
the captured call's output, or run with the capture's inputs, fails here. Equality is bit for bit, or
within `conformance.checks.NON_DETERMINISTIC_RELATIVE` where the vendor declares `deterministic=False`.
"""

from __future__ import annotations

import torch

import moe
from conformance.capability import GRAPH_CAPTURE, mark, require_graph_capture
from conformance.checks import same_result
from conformance.reference import generator
from hal import Groups, ScaleLayout, Vendor

pytestmark = mark(GRAPH_CAPTURE)

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 16, 200, 72, 4


def _rows(vendor: Vendor, gen: torch.Generator, tokens: int) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).to(vendor.device)


def test_a_captured_call_replays_new_inputs_like_the_plain_call(hal_vendor):
    require_graph_capture(hal_vendor)
    gen, device = generator("graph capture", "op"), hal_vendor.device
    w = hal_vendor.quantize_weight(
        (torch.randn(EXPERTS, HIDDEN, 2 * INTERMEDIATE, generator=gen) / 16).to(device),
        ScaleLayout.NONE,
        torch.bfloat16,
    )
    tokens = 150
    counts = torch.bincount(torch.randint(0, EXPERTS, (tokens,), generator=gen), minlength=EXPERTS)
    groups = Groups.from_counts(counts.to(device))

    def call(x: torch.Tensor) -> torch.Tensor:
        return hal_vendor.grouped_matmul(x, w, groups, activation="silu-glu")

    inputs = [_rows(hal_vendor, gen, tokens) for _ in range(4)]
    replay = hal_vendor.graph_set().capture(call, [inputs[0].clone()])
    for number, x in enumerate(inputs[1:] + inputs[:1], 1):
        got = replay(x).clone()
        assert same_result(hal_vendor, got, call(x)), f"replay {number}: differs from the plain call on its inputs"


def test_a_graphed_layer_equals_the_plain_layer_call_after_call(hal_vendor):
    require_graph_capture(hal_vendor)
    gen = generator("graph capture", "layer")
    w13 = torch.randn(EXPERTS, HIDDEN, 2 * INTERMEDIATE, generator=gen) / 16
    w2 = torch.randn(EXPERTS, INTERMEDIATE, HIDDEN, generator=gen) / 16
    build = dict(vendor=hal_vendor, check_routing=False, environ={})
    graphed = moe.MoELayer.from_float(w13, w2, TOP_K, graphs=moe.GraphConfig(max_tokens=64), **build)
    plain = moe.MoELayer.from_float(w13, w2, TOP_K, launch_plans=None, **build)
    with torch.no_grad():
        for tokens in (1, 33, 64, 33, 1):
            for call in range(2):
                x = _rows(hal_vendor, gen, tokens)
                logits = torch.randn(tokens, EXPERTS, generator=gen).to(hal_vendor.device)
                assert same_result(hal_vendor, graphed(x, logits), plain(x, logits)), (
                    f"{tokens} tokens, call {call}: the graphed layer differs from the plain one"
                )
    assert graphed.graph_count == 3, "one capture per token count"
