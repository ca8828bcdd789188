"""Load statistics and redundant experts on the CUDA vendor: recording never synchronises with the host,
replicas change the output only by rounding, moving experts between slots not at all, and a replaying
layer counts its replays (GPU only)."""

from __future__ import annotations

import pytest
import torch

import moe
from conformance import reference
from conformance.reference import random_weights, relative_error, seed_of
from conformance.tolerances import layer_tolerance
from moe.routing_traces import RoutingTrace
from tests.support.paths import release_device_memory
from vendors.cuda import CudaVendor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

E, H, I, K, R = 128, 2048, 768, 8, 16


def _layers(scheme: str, **kwargs):
    release_device_memory()
    w13, w2 = random_weights(E, H, I, seed_of("expert-load", scheme))
    vendor = CudaVendor()
    plain = moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor=vendor)
    layer = moe.MoELayer.from_float(
        w13, w2, K, scheme=scheme, vendor=vendor, redundant_experts=R, load_stats=moe.LoadStats(), **kwargs
    )
    return plain, layer


def _inputs(tokens: int, seed: int):
    x = torch.randn(tokens, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    return x.to(torch.bfloat16), RoutingTrace.parse("zipf:1.2").logits(tokens, E, seed=seed, device="cuda")


@pytest.mark.parametrize("scheme", ["unquantized", "w8a8-fp8-block"])
def test_recording_never_synchronises_and_replicas_only_round(scheme):
    plain, layer = _layers(scheme)
    x, logits = _inputs(512, 1)
    layer(x, logits)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        replicated = layer(x, logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = plain(x, logits)
    # A replica changes the GEMMs' group sizes and so, on a tuned device, may change their kernel
    # configuration (the tables are keyed by the number of experts): bf16 results move by rounding; an
    # fp8 scheme re-quantizes the intermediate activation, where a rounding difference flips whole fp8
    # steps (2^-4 relative) on some elements. Each stays within its scheme's bound of float64.
    between = 2.0**-8 if scheme == "unquantized" else 2.0**-5
    assert relative_error(replicated, expected.double()) <= between
    ids, weights = reference.softmax_topk(logits[:32], K)
    exact = reference.moe(x[:32], ids, weights, *random_weights(E, H, I, seed_of("expert-load", scheme)))
    bound = layer_tolerance(scheme, layer.plan.resolved.value)
    assert relative_error(replicated[:32].cpu(), exact) <= bound
    snap = layer.expert_load.snapshot()
    assert snap.forwards == 2 and sum(snap.expert_total) == 2 * 512 * K
    placement = layer.rebalance()
    rebalanced = layer(x, logits)
    assert relative_error(rebalanced, expected.double()) <= between
    slots = list(placement.slots)  # the same replica counts, two experts trading slots
    a, b = slots.index(0), len(slots) - 1 - slots[::-1].index(E - 1)
    slots[a], slots[b] = slots[b], slots[a]
    layer.rebalance(moe.ExpertPlacement(tuple(slots), E))
    assert torch.equal(layer(x, logits), rebalanced)


def test_a_replaying_layer_counts_its_replays():
    _, layer = _layers("unquantized", graphs=moe.GraphConfig())
    x, logits = _inputs(8, 2)
    for _ in range(4):
        layer(x, logits)
    assert layer.graph_count == 1
    assert layer.expert_load.snapshot().forwards == 4
