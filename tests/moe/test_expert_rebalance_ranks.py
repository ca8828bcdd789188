"""Redundant experts, load statistics and rebalancing under expert parallelism on gloo (2 and 4 ranks):
the layer equals the single-process one before and after a rebalance, the gathered statistics equal the
routing, every slot counted what it received, all ranks take the same placement, migrated buffers hold
exactly their expert's tensors, and the busiest rank's share drops."""

from __future__ import annotations

import pytest

from tests.support.eplb_worker import cases
from tests.support.gloo_world import spawn_world
from tests.support.paths import SUPPORT

pytestmark = pytest.mark.slow  # multi-process worlds

WORKER = SUPPORT / "eplb_worker.py"
TOLERANCE = {"fp32": 1e-6, "w8a8-int8": 1e-2, "w8a8-fp8-block": 1e-2}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def world_results(request, tmp_path_factory):
    world = request.param
    return world, spawn_world(WORKER, world, tmp_path_factory.mktemp(f"eplb{world}"))


def test_rebalancing_across_ranks_keeps_the_output_and_balances_the_ranks(world_results):
    world, results = world_results
    for case in cases(world):
        for rank, result in enumerate(results):
            got = result[case.name]
            assert not isinstance(got, str), f"{case.name} rank {rank}:\n{got}"
            tol = TOLERANCE[case.scheme]
            assert got["before"] <= tol and got["after"] <= tol, (case.name, rank, got)
            for check in ("stats_equal", "received_equal", "same_placement", "moved", "buffers_equal"):
                assert got[check], (case.name, rank, check, got)
            assert got["rank_balance_after"] <= got["rank_balance_before"], (case.name, rank, got)
