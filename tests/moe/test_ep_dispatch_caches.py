"""What the torch.distributed dispatchers keep between calls never goes stale: their constants
(`moe.dispatch.tokens.Constants`: per dispatcher, keyed by device and size) and, in low-latency mode,
the buffer sets and their views. On 2 ranks (gloo), a dispatcher called with batches that grow, shrink,
go empty and change top-k, beside another layer's, gives what a fresh dispatcher gives, bit for bit."""

from __future__ import annotations


import pytest
import torch

from moe.dispatch.tokens import Constants
from tests.support.ep_cache_worker import CASES
from tests.support.gloo_world import spawn_world
from tests.support.paths import SUPPORT

pytestmark = pytest.mark.slow  # subprocesses / multi-process worlds

WORKER = SUPPORT / "ep_cache_worker.py"


@pytest.fixture(scope="module")
def world_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn_world(WORKER, 2, tmp_path_factory.mktemp("ep-caches"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_long_lived_dispatcher_gives_what_a_fresh_one_gives(world_results, case):
    for rank, results in enumerate(world_results):
        differ = results[case.name]
        assert not isinstance(differ, str), f"rank {rank} raised:\n{differ}"
        assert differ == [], f"rank {rank}: {differ}"


@pytest.mark.parametrize("sizes", [(5, 3, 9, 0, 9), (1, 64, 2)])
def test_constants_are_right_for_every_size_asked_in_any_order(sizes):
    constants = Constants()
    for n in sizes:
        assert torch.equal(constants.arange(n, torch.device("cpu")), torch.arange(n))
        ones = constants.ones(n, torch.device("cpu"))
        assert ones.dtype == torch.float32 and ones.is_contiguous() and torch.equal(ones, torch.ones(n))


def test_constants_are_kept_per_device_and_per_dispatcher():
    first, second = Constants(), Constants()
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert first.arange(4, meta).device == meta and first.arange(4, cpu).device == cpu
    assert first.get(("t", cpu, 2), lambda: torch.zeros(2)) is first.get(("t", cpu, 2), lambda: torch.ones(2))
    assert torch.equal(second.get(("t", cpu, 2), lambda: torch.ones(2)), torch.ones(2))  # nothing shared


def test_the_sort_follows_the_vendor(cpu):
    constants = Constants()
    assert constants.sort(None) is None
    sort = constants.sort(cpu)
    ids = torch.tensor([[1, 0], [2, 1]])
    assert len(sort(ids, 3)) == 4  # the CPU vendor's sort takes tokens=True: the token of each row comes with it
    assert constants.sort(cpu) is sort and constants.sort(None) is None
