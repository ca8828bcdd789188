"""Redundant experts and rebalancing on one process: experts moved between slots leave the layer's output
unchanged bit for bit, replicas added or removed only by rounding (a relative difference within 2^-8, rows
almost all bit-equal); a token's choice reaches one replica (spread evenly, deterministically), the
balanced placement beats the greedy baseline on skewed traces, and what cannot move is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moe
from conformance.capability import build_scheme
from conformance.reference import relative_error
from hal import InvalidInput, SchemeTraits
from moe import ExpertPlacement, balanced_placement, greedy_placement
from moe.placement import PhysicalMap
from moe.routing_traces import RoutingTrace
from moe.schemes import Unquantized
from tests.support.moe_reference import random_weights

E, H, I = 64, 320, 96  # H not a multiple of 128


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("scheme", ["unquantized", "w8a8-int8", "w8a8-fp8-block", "w4a4-int4"])
def test_replicas_and_a_rebalance_leave_the_output_unchanged(scheme, top_k):
    w13, w2 = random_weights(E, H, I, 3)
    trace = RoutingTrace.parse("zipf:1.2")
    x = torch.randn(600, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    logits = trace.logits(600, E, seed=5)
    build = dict(scheme=build_scheme(scheme, input_amax=float(x.abs().max())), vendor="cpu", environ={})
    plain = moe.MoELayer.from_float(w13, w2, top_k, **build)
    layer = moe.MoELayer.from_float(w13, w2, top_k, redundant_experts=16, load_stats=moe.LoadStats(), **build)
    expected = plain(x, logits)
    replicated = layer(x, logits)
    assert relative_error(replicated, expected.double()) <= 2.0**-8
    assert (replicated != expected).any(dim=-1).float().mean() < 0.01  # almost every row is bit-equal
    placement = layer.rebalance()  # from the recorded load
    assert placement != ExpertPlacement.default(E, 16)
    rebalanced = layer(x, logits)
    assert relative_error(rebalanced, expected.double()) <= 2.0**-8
    swapped = list(placement.slots)  # the same replicas, two experts trading slots
    first, last = swapped.index(0), len(swapped) - 1 - swapped[::-1].index(E - 1)
    swapped[first], swapped[last] = swapped[last], swapped[first]
    layer.rebalance(ExpertPlacement(tuple(swapped), E))
    assert torch.equal(layer(x, logits), rebalanced)


def test_each_choice_goes_to_one_replica_spread_evenly():
    placement = balanced_placement([100.0] + [1.0] * 15, 24, 4)  # expert 0 gets the extra slots
    replicas = placement.replicas(0)
    assert len(replicas) == 9
    mapping = PhysicalMap(placement, "cpu")
    ids = RoutingTrace.parse("hot:1:0.5").topk_ids(4000, 16, 4, seed=1)
    physical = mapping.to_physical(ids)
    assert torch.equal(torch.tensor(placement.slots)[physical], ids)  # every pair lands on its own expert
    assert torch.equal(mapping.to_physical(ids), physical)  # deterministic
    per_replica = torch.bincount(physical.flatten(), minlength=24)[replicas].float()
    # by token position: equal shares on average (about 440 each here, a few percent of noise)
    assert per_replica.max() / per_replica.min() < 1.25, per_replica


@pytest.mark.parametrize("pattern", ["zipf:1.2", "zipf:0.8", "hot:4:0.5", "rank-skew:4", "uniform"])
def test_the_balanced_placement_beats_the_greedy_baseline(pattern):
    experts, ranks, redundant = 256, 8, 32
    ids = RoutingTrace.parse(pattern).topk_ids(4096 * ranks, experts, 8, seed=3, ranks=ranks)
    load = torch.bincount(ids.flatten(), minlength=experts).tolist()
    mean = sum(load) / ranks
    balanced = balanced_placement(load, experts + redundant, ranks)
    worst = max(balanced.rank_loads(load, ranks))
    bound = max(max(balanced.slot_loads(load)), mean)  # no placement of these replicas does better
    assert worst <= 1.02 * bound
    for other in (greedy_placement(load, experts + redundant, ranks), ExpertPlacement.default(experts, redundant)):
        assert worst <= max(other.rank_loads(load, ranks)) + 1e-9


def test_placements_are_checked():
    with pytest.raises(InvalidInput, match="missing"):
        ExpertPlacement((0, 1, 1), 3)
    with pytest.raises(InvalidInput, match="slots"):
        ExpertPlacement((0, 1, 5), 3)
    with pytest.raises(InvalidInput, match="divisible by the ranks"):
        balanced_placement([1.0, 2.0, 3.0], 5, 2)
    with pytest.raises(InvalidInput, match="load"):
        balanced_placement([1.0, float("nan")], 2, 1)
    layer = moe.MoELayer.from_float(*random_weights(4, 64, 32, 1), 2, vendor="cpu", environ={}, redundant_experts=2)
    with pytest.raises(InvalidInput, match="4 experts over 6 slots"):
        layer.rebalance(ExpertPlacement((0, 1, 2, 3), 4))
    with pytest.raises(InvalidInput, match="load_stats"):
        layer.rebalance()


def test_a_scheme_that_does_not_declare_movable_experts_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Pinned(Unquantized):
        traits = dataclasses.replace(Unquantized.traits, name="pinned", movable_experts=False)

    with pytest.raises(InvalidInput, match="does not declare movable_experts"):
        moe.MoELayer(64, 32, 4, 2, scheme=Pinned(), vendor="cpu", environ={}, redundant_experts=2)
    assert not SchemeTraits("custom", "bf16", {"bf16"}).movable_experts  # undeclared: not movable


@pytest.mark.parametrize("redundant, refused", [(4, False), (5, True), (10**6, True)])
def test_redundant_experts_are_bounded_by_one_more_copy_of_every_expert_per_rank(redundant, refused):
    if not refused:
        assert moe.MoELayer(64, 32, 4, 2, vendor="cpu", environ={}, redundant_experts=redundant).placement.slots
        return
    with pytest.raises(InvalidInput, match=rf"redundant_experts: expected at most .*got {redundant}$"):
        moe.MoELayer(64, 32, 4, 2, vendor="cpu", environ={}, redundant_experts=redundant)


def test_redundant_experts_must_split_over_the_ranks_and_state_round_trips():
    w13, w2 = random_weights(6, 64, 32, 2)
    layer = moe.MoELayer.from_float(w13, w2, 2, vendor="cpu", environ={}, redundant_experts=2)
    layer.rebalance(ExpertPlacement((5, 4, 3, 2, 1, 0, 0, 5), 6))
    twin = moe.MoELayer(64, 32, 6, 2, vendor="cpu", environ={}, redundant_experts=2)
    twin.load_state_dict(layer.state_dict())
    twin.apply_placement(layer.placement)
    x, logits = torch.randn(9, 64).to(torch.bfloat16), torch.randn(9, 6)
    assert torch.equal(twin(x, logits), layer(x, logits))
