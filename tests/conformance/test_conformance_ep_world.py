"""The expert-parallel conformance world: making a fresh data group survives a failed connection attempt."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conformance.ep import world as world_module
from conformance.ep.world import DATA_GROUP_ATTEMPTS, Placement, World


@pytest.fixture()
def world(tmp_path):
    made = World(Placement(rank=0, world=1, local_rank=0), "gloo", f"file://{tmp_path / 'store'}", timeout_s=30)
    yield made
    made.close()


def _failing_new_group(monkeypatch, failures: int) -> list[int]:
    """Make `dist.new_group` raise as gloo does when a peer closes the connection, `failures` times."""
    calls: list[int] = []
    real = dist.new_group

    def new_group(*args, **kwargs):
        calls.append(1)
        if len(calls) <= failures:
            raise RuntimeError("Gloo connectFullMesh failed with ... Connection closed by peer")
        return real(*args, **kwargs)

    monkeypatch.setattr(world_module.dist, "new_group", new_group)
    return calls


def _usable(group) -> bool:
    value = torch.ones(3)
    dist.all_reduce(value, group=group)
    return bool(torch.equal(value, torch.ones(3)))


def test_a_failed_case_gets_a_fresh_data_group_even_when_the_first_connection_fails(world, monkeypatch):
    before = world.data
    calls = _failing_new_group(monkeypatch, failures=DATA_GROUP_ATTEMPTS - 1)
    outcomes = world.agree({"outcome": "failed", "message": "wrong values"})
    assert [o["dropped"] for o in outcomes] == [True]
    assert len(calls) == DATA_GROUP_ATTEMPTS
    assert world.data is not None and world.data is not before and _usable(world.data)


def test_a_data_group_that_never_connects_stops_the_run_with_the_reason(world, monkeypatch):
    calls = _failing_new_group(monkeypatch, failures=DATA_GROUP_ATTEMPTS)
    with pytest.raises(
        RuntimeError, match=rf"could not make a data group in {DATA_GROUP_ATTEMPTS} attempts.*closed by peer"
    ):
        world.agree({"outcome": "failed", "message": "wrong values"})
    assert len(calls) == DATA_GROUP_ATTEMPTS


def test_a_passed_case_keeps_its_data_group(world, monkeypatch):
    before = world.data
    calls = _failing_new_group(monkeypatch, failures=0)
    world.agree({"outcome": "passed", "message": ""})
    assert world.data is before and not calls
