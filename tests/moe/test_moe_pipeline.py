"""The layer's pipeline is chosen once: the path and the runner at construction, the dispatch quantizer
at weight load; `forward` only routes and runs it."""

from __future__ import annotations

import pytest
import torch

from hal import InvalidInput, UnsupportedCapability
from moe import MoELayer, RunnerRegistry, W8A8Int8
from moe.pipeline import FusedPipeline, UnfusedPipeline
from moe.runners import run_grouped_experts
from vendors.ascend.emulation.vendor import EmulatedAscendVendor
from vendors.cpu import CpuVendor


class CountingInt8(W8A8Int8):
    """W8A8-INT8 that counts how often a dispatch quantizer is made for it."""

    def __init__(self) -> None:
        self.quantizers_made = 0

    def dispatch_quantizer(self, vendor, plan, weights):  # type: ignore[no-untyped-def]
        self.quantizers_made += 1
        return super().dispatch_quantizer(vendor, plan, weights)


def _weights(experts: int = 8, hidden: int = 64, intermediate: int = 32):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(experts, hidden, 2 * intermediate, generator=g) / 8,
        torch.randn(experts, intermediate, hidden, generator=g) / 6,
    )


def test_the_dispatch_quantizer_is_made_at_load_not_per_forward():
    scheme = CountingInt8()
    layer = MoELayer.from_float(*_weights(), top_k=2, scheme=scheme, vendor=CpuVendor(), environ={})
    x, logits = torch.randn(5, 64).to(torch.bfloat16), torch.randn(5, 8)
    first = layer(x, logits)
    for _ in range(3):
        assert torch.equal(layer(x, logits), first)
    assert scheme.quantizers_made == 1
    layer.load_weights(*_weights())  # new weights: a new pipeline, made once again
    layer(x, logits)
    assert scheme.quantizers_made == 2


def test_the_runner_is_looked_up_once_at_construction():
    looked_up = []

    class Recording(RunnerRegistry):
        def lookup(self, vendor, format, kernel, scheme):  # type: ignore[no-untyped-def]
            looked_up.append((format, kernel, scheme))
            return super().lookup(vendor, format, kernel, scheme)

    registry = Recording.with_defaults(plugins=False)
    layer = MoELayer.from_float(*_weights(), top_k=2, vendor=CpuVendor(), runners=registry, environ={})
    assert len(looked_up) == 1 and layer.runner is run_grouped_experts
    for _ in range(3):
        layer(torch.randn(4, 64).to(torch.bfloat16), torch.randn(4, 8))
    assert len(looked_up) == 1


def test_the_path_is_decided_before_weights_exist():
    vendor = EmulatedAscendVendor()
    fused = MoELayer(64, 32, 8, 2, scheme="w8a8-int8", vendor=vendor, environ={})
    unfused = MoELayer(64, 32, 8, 2, scheme="w8a8-int8", vendor=vendor, environ={}, fused=False)
    assert fused.fused and fused.runner is None
    assert not unfused.fused and unfused.runner is not None
    w13, w2 = _weights()
    assert isinstance(fused.load_weights(w13, w2)._pipeline, FusedPipeline)
    assert isinstance(unfused.load_weights(w13, w2)._pipeline, UnfusedPipeline)
    with pytest.raises(UnsupportedCapability, match="int4"):  # refused before its dispatch plan is resolved
        MoELayer(64, 32, 8, 2, scheme="w4a4-int4", vendor=vendor, environ={})  # no weights needed to refuse


def test_a_layer_without_weights_says_so_and_builds_nothing():
    layer = MoELayer(64, 32, 8, 2, vendor=CpuVendor(), environ={})
    with pytest.raises(InvalidInput, match="load_weights"):
        layer(torch.randn(2, 64).to(torch.bfloat16), torch.randn(2, 8))
