"""A layer built with `moe.GraphConfig` captures its forward per input signature and replays it: which
calls are replayed, when captures are dropped, and what is refused (on the CPU, through a vendor whose
captures are emulated: tests/support/replay_vendor.py; real CUDA graphs: tests/vendors/cuda)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import moe
from hal import InvalidInput, UnsupportedCapability
from tests.support.moe_reference import random_weights
from tests.support.replay_vendor import ReplayingCpu

E, H, I, K = 16, 160, 48, 4


def _layers(graphs: moe.GraphConfig, seed: int = 1, **kwargs) -> tuple[moe.MoELayer, moe.MoELayer, ReplayingCpu]:
    """A graphed layer and a plain one over the same weights."""
    w13, w2 = random_weights(E, H, I, seed)
    vendor = ReplayingCpu()
    graphed = moe.MoELayer.from_float(w13, w2, K, vendor=vendor, graphs=graphs, environ={}, **kwargs)
    plain = moe.MoELayer.from_float(w13, w2, K, vendor="cpu", check_routing=False, environ={}, **kwargs)
    return graphed, plain, vendor


def _inputs(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, H, generator=g).to(torch.bfloat16), torch.randn(tokens, E, generator=g)


def _replays(vendor: ReplayingCpu) -> int:
    return sum(s.replayed for s in vendor.ops.sets)


def test_a_graphed_layer_equals_the_plain_one_and_replays_after_the_first_call():
    graphed, plain, vendor = _layers(moe.GraphConfig(max_tokens=64))
    for tokens in (1, 7, 64, 7, 1):
        x, logits = _inputs(tokens, tokens)
        assert torch.equal(graphed(x, logits), plain(x, logits))
    assert graphed.graph_count == 3
    assert _replays(vendor) == 5  # every call, the first of a signature right after its capture


def test_precomputed_routing_is_captured_apart_from_logits():
    graphed, plain, vendor = _layers(moe.GraphConfig())
    x, logits = _inputs(9, 3)
    ids = torch.randint(0, E, (9, K), generator=torch.Generator().manual_seed(4))
    weights = torch.rand(9, K, generator=torch.Generator().manual_seed(5))
    assert torch.equal(graphed(x, logits), plain(x, logits))
    assert torch.equal(graphed(x, topk_ids=ids, topk_weights=weights), plain(x, topk_ids=ids, topk_weights=weights))
    assert graphed.graph_count == 2


def test_large_batches_and_signatures_past_the_budget_run_the_plain_forward():
    graphed, plain, vendor = _layers(moe.GraphConfig(max_tokens=16, max_graphs=2))
    for tokens in (40, 1, 2, 3, 3):
        x, logits = _inputs(tokens, 10 + tokens)
        assert torch.equal(graphed(x, logits), plain(x, logits))
    assert graphed.graph_count == 2  # 40 is above max_tokens, 3 came after the budget was spent
    assert _replays(vendor) == 2


def test_new_weights_drop_the_captures():
    graphed, _, _ = _layers(moe.GraphConfig(), seed=1)
    x, logits = _inputs(5, 6)
    graphed(x, logits)
    assert graphed.graph_count == 1
    w13, w2 = random_weights(E, H, I, 2)
    graphed.load_weights(w13, w2)
    assert graphed.graph_count == 0
    fresh = moe.MoELayer.from_float(w13, w2, K, vendor="cpu", check_routing=False, environ={})
    assert torch.equal(graphed(x, logits), fresh(x, logits))
    state = fresh.state_dict()
    graphed.load_state_dict(state)
    assert graphed.graph_count == 0


def test_a_copy_captures_its_own_forward():
    graphed, plain, _ = _layers(moe.GraphConfig())
    x, logits = _inputs(4, 7)
    graphed(x, logits)
    twin = copy.deepcopy(graphed)
    assert twin.graph_count == 0
    assert torch.equal(twin(x, logits), plain(x, logits)) and twin.graph_count == 1


def test_shared_experts_reloaded_drop_the_captures():
    shared = moe.SharedExperts(intermediate_size=32)
    graphed, _, _ = _layers(moe.GraphConfig(), shared_experts=shared)
    g = torch.Generator().manual_seed(8)
    graphed.load_shared_experts(torch.randn(H, 64, generator=g) / H**0.5, torch.randn(32, H, generator=g) / 32**0.5)
    x, logits = _inputs(3, 9)
    graphed(x, logits)
    assert graphed.graph_count == 1
    graphed.load_shared_experts(torch.randn(H, 64, generator=g) / H**0.5, torch.randn(32, H, generator=g) / 32**0.5)
    assert graphed.graph_count == 0


def test_threads_calling_a_graphed_layer_each_get_their_own_result():
    graphed, plain, _ = _layers(moe.GraphConfig(max_tokens=32))
    cases = [_inputs(t, 20 + t) for t in (1, 2, 3, 1, 2, 3, 8, 8)]
    expected = [plain(x, lg) for x, lg in cases]
    results: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        for _ in range(3):
            results[i] = graphed(*cases[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(results[i], expected[i]) for i in range(len(cases)))
    assert graphed.graph_count == 4


def test_graphs_are_refused_where_a_forward_cannot_be_replayed():
    w13, w2 = random_weights(E, H, I, 1)
    with pytest.raises(UnsupportedCapability, match="graph_capture"):
        moe.MoELayer.from_float(w13, w2, K, vendor="cpu", graphs=moe.GraphConfig(), environ={})
    with pytest.raises(InvalidInput, match="check_routing=False"):
        moe.MoELayer(H, I, E, K, vendor=ReplayingCpu(), graphs=moe.GraphConfig(), check_routing=True, environ={})
    with pytest.raises(InvalidInput, match="graphs: expected a moe.GraphConfig"):
        moe.MoELayer(H, I, E, K, vendor=ReplayingCpu(), graphs=True, environ={})
    for bad in ({"max_tokens": 0}, {"max_graphs": -1}, {"max_tokens": 2.5}):
        with pytest.raises(InvalidInput, match="GraphConfig"):
            moe.GraphConfig(**bad)


def test_bad_input_to_a_graphed_layer_is_refused_as_before():
    graphed, _, _ = _layers(moe.GraphConfig())
    x, logits = _inputs(4, 11)
    with pytest.raises(InvalidInput, match="router_logits"):
        graphed(x, logits[:, :-1])
    with pytest.raises(InvalidInput, match="hidden_states"):
        graphed(x[:, :-1], logits)
    assert graphed.graph_count == 0
