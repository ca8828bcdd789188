"""Placement tables, loads, transfer plans, load statistics and expert-/tensor-parallel groups a user
gets wrong are refused with `hal.InvalidInput` naming the argument, not a raw Python or torch error
deep inside, a hang, or a silently wrong layer.

The gloo cases run this file as the worker of a two-rank world (`tests.support.gloo_world`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import moe
from hal import InvalidInput
from moe.migration import transfer_plan

PLACEMENT = moe.ExpertPlacement((0, 1, 2, 3, 0, 1), 4)


@pytest.mark.parametrize(
    "slots", [None, 5, {0: 1, 1: 0, 2: 2, 3: 3}, {0, 1, 2, 3}], ids=["none", "int", "dict-slot-to-expert", "set"]
)
def test_placement_slots_must_be_a_sequence(slots):
    with pytest.raises(InvalidInput, match=r"^slots: expected a sequence of logical expert ids"):
        moe.ExpertPlacement(slots, 4)


def test_replicas_of_an_unknown_expert_refused():
    with pytest.raises(InvalidInput, match=r"^expert: expected a logical expert id in \[0, 4\), got 7"):
        PLACEMENT.replicas(7)


@pytest.mark.parametrize("device", ["nodevice", 3.5])
def test_replica_tables_refuse_what_is_no_device(device):
    with pytest.raises(InvalidInput, match=r"^device: expected a torch.device"):
        moe.ExpertPlacement.default(4, 2).tables(device)


@pytest.mark.parametrize(
    "load",
    [[1.0, 1.0], [1.0] * 6, [float("nan"), 1, 1, 1], [-5, 1, 1, 1], "abcd", None, torch.ones(4, 2)],
    ids=["short", "long", "nan", "negative", "str", "none", "2d-tensor"],
)
def test_rank_and_slot_loads_check_the_load(load):
    with pytest.raises(InvalidInput, match=r"^load: expected 4 finite, non-negative per-expert loads"):
        PLACEMENT.rank_loads(load, 2)
    with pytest.raises(InvalidInput, match=r"^load: expected 4 finite, non-negative per-expert loads"):
        PLACEMENT.slot_loads(load)


PLACERS = [moe.balanced_placement, moe.greedy_placement]


@pytest.mark.parametrize("place", PLACERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "load",
    [
        [],
        [True, False, True, True],
        ["1", "2", "3", "4"],
        "1234",
        {0: 1.0, 1: 2.0},
        None,
        4,
        torch.ones(2, 2),
        torch.tensor(3.0),
        torch.ones(4, device="meta"),
        [1j, 1, 1, 1],
        [10**400, 1, 1, 1],
    ],
    ids=["empty", "bools", "strs", "str", "dict", "none", "int", "2d", "0d", "meta", "complex", "huge"],
)
def test_placers_refuse_loads_that_are_not_per_expert_numbers(place, load):
    with pytest.raises(InvalidInput, match=r"^load: expected"):
        place(load, 6, 2)


@pytest.mark.parametrize("place", PLACERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("slots", [6.0, None, "6"], ids=["float", "none", "str"])
def test_placers_refuse_a_slot_count_that_is_not_an_int(place, slots):
    with pytest.raises(InvalidInput, match=r"^num_physical: expected a positive int"):
        place([5, 1, 1, 1], slots, 2)


def test_transfer_plan_checks_its_placements_and_ranks():
    old = moe.ExpertPlacement((0, 1, 2, 3), 4)
    with pytest.raises(InvalidInput, match=r"^ranks: expected a positive int, got 0"):
        transfer_plan(old, old, 0)
    with pytest.raises(InvalidInput, match=r"^placement: expected 4 experts over 4 slots"):
        transfer_plan(old, PLACEMENT, 2)
    with pytest.raises(InvalidInput, match=r"^placement: expected 4 experts over 6 slots"):
        transfer_plan(PLACEMENT, moe.ExpertPlacement((0, 1, 2, 3, 4, 5), 6), 2)
    with pytest.raises(InvalidInput, match=r"^new: expected a moe.ExpertPlacement, got 'list'"):
        transfer_plan(old, [0, 1, 2, 3], 2)


def _layer(**kwargs: object) -> moe.MoELayer:
    from tests.support.moe_reference import random_weights

    w13, w2 = random_weights(4, 32, 16, 7)
    return moe.MoELayer.from_float(w13, w2, 2, vendor="cpu", environ={}, check_routing=False, scheme="fp32", **kwargs)


def test_a_load_window_too_large_for_memory_is_refused_naming_it():
    with pytest.raises(InvalidInput, match=r"^load_stats.window: expected a window whose .* fit in cpu memory"):
        _layer(load_stats=moe.LoadStats(window=10**15))


def test_snapshot_refuses_an_object_that_is_no_process_group():
    layer = _layer(load_stats=moe.LoadStats(window=2))
    with pytest.raises(InvalidInput, match=r"^process_group: expected"):
        layer.expert_load.snapshot("world")


@pytest.mark.parametrize("layers", [5, "layer"], ids=["int", "str"])
def test_dump_expert_load_refuses_what_is_not_named_layers(layers):
    with pytest.raises(InvalidInput, match=r"^layers: expected a mapping or iterable of \(name, module\) pairs"):
        moe.dump_expert_load(layers)


def test_dump_expert_load_refuses_bare_layers_without_names():
    with pytest.raises(InvalidInput, match=r"^layers: expected .*, got 'an item of type MoELayer'"):
        moe.dump_expert_load([_layer(load_stats=moe.LoadStats(window=2))])


def test_summarize_refuses_a_rank_imbalance_that_is_no_number():
    document = {"layers": {"a": {"expert_window": [1, 2], "forwards": 1, "rank_imbalance": "x"}}}
    with pytest.raises(InvalidInput, match=r"^expert load document: layer 'a' is malformed"):
        moe.expert_load.summarize(document)


# --- two gloo ranks ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One group mistake, run on every rank; the result is the error's type and message (or 'accepted')."""

    name: str


def cases(world: int) -> list[Case]:
    names = ("not-a-member", "tp-is-ep", "snapshot-not-a-member", "divergent-placements", "wrong-size-on-one-rank")
    return [Case(n) for n in names]


def run(case: Case, rank: int, world: int) -> str:
    import torch.distributed as dist

    only_rank0 = dist.new_group([0])  # collective: every rank creates it, in every case
    try:
        if case.name == "not-a-member":
            _layer(process_group=only_rank0)
        elif case.name == "tp-is-ep":
            _layer(process_group=dist.group.WORLD, tp_group=dist.group.WORLD)
        elif case.name == "snapshot-not-a-member":
            layer = _layer(process_group=dist.group.WORLD, load_stats=moe.LoadStats(window=2))
            if rank != 0:  # rank 0 belongs to the group: its snapshot is fine
                layer.expert_load.snapshot(only_rank0)
        elif case.name == "divergent-placements":
            layer = _layer(process_group=dist.group.WORLD, redundant_experts=2)
            slots = (0, 1, 2, 3, 0, 1) if rank == 0 else (1, 0, 2, 3, 3, 2)
            layer.rebalance(moe.ExpertPlacement(slots, 4))
        else:  # rank 1's placement has too few slots: rank 0 must not wait for it in a collective
            layer = _layer(process_group=dist.group.WORLD, redundant_experts=2)
            slots = (0, 1, 2, 3, 0, 1) if rank == 0 else (1, 0, 2, 3)
            layer.rebalance(moe.ExpertPlacement(slots, 4))
    except Exception as exc:  # noqa: BLE001 - recorded for the test to check
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


@pytest.mark.slow  # a multi-process world
def test_wrong_groups_and_divergent_placements_are_refused_on_gloo(tmp_path):
    from tests.support.gloo_world import spawn_world

    results = spawn_world(Path(__file__), 2, tmp_path, timeout_s=240)
    member = "InvalidInput: process_group: expected a torch.distributed process group this process belongs to"
    assert results[1]["not-a-member"].startswith(member), results[1]["not-a-member"]
    assert results[1]["snapshot-not-a-member"].startswith(member), results[1]["snapshot-not-a-member"]
    for rank, result in enumerate(results):
        assert result["tp-is-ep"].startswith("InvalidInput: tp_group: expected a tensor-parallel group"), (rank, result)
        assert result["divergent-placements"].startswith(
            "InvalidInput: placement: expected the same placement on every rank"
        ), (rank, result)
    assert results[0]["wrong-size-on-one-rank"].startswith(
        "InvalidInput: placement: expected a valid placement on every rank, got an invalid one on rank(s) [1]"
    ), results[0]
    assert results[1]["wrong-size-on-one-rank"].startswith(
        "InvalidInput: placement: expected 4 experts over 6 slots"
    ) and results[1]["wrong-size-on-one-rank"].endswith("(refused on every rank of the process group)"), results[1]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.support.gloo_world import worker_main

    raise SystemExit(worker_main(cases, run))
