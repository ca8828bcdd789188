"""The CUDA vendor's kernels keep the MoE layer on the device: no host synchronisation in a
forward, and a forward captured in a CUDA graph replays to the eager result (GPU only)."""

from __future__ import annotations

import warnings

import pytest
import torch

import moe
from conformance.reference import random_weights, seed_of
from hal import DispatchConfig
from tests.support.cuda_graph import capture
from vendors.cuda import CudaVendor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

E, H, I, K = 16, 512, 256, 4
SCHEMES = ["unquantized", "w8a8-fp8-block", "w8a8-int8"]


def _layer(scheme: str, capacity: int | None = None) -> moe.MoELayer:
    w13, w2 = random_weights(E, H, I, seed_of("graphs", scheme))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the declared int8 -> fp8 fallback warns once
        return moe.MoELayer.from_float(
            w13,
            w2,
            K,
            scheme=scheme,
            vendor=CudaVendor(),
            dispatch=DispatchConfig(max_dispatch_tokens_per_rank=capacity),
        )


def _inputs(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, H, device="cuda", generator=g).to(torch.bfloat16)
    return x, torch.randn(tokens, E, device="cuda", generator=g)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_forward_never_synchronises_with_the_host(scheme):
    layer = _layer(scheme)
    x, logits = _inputs(64, 1)
    layer(x, logits)  # compile the kernels first (compilation may synchronise)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x, logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("tokens", [1, 37, 512])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_graph_replay_equals_eager(scheme, tokens):
    layer = _layer(scheme)
    static_x, static_logits = _inputs(tokens, 2)
    graph, static_y = capture(lambda: layer(static_x, static_logits))
    for seed in (3, 4, 5):  # new inputs each replay: the graph must not have baked in the routing
        x, logits = _inputs(tokens, seed)
        static_x.copy_(x)
        static_logits.copy_(logits)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, layer(x, logits)), seed
