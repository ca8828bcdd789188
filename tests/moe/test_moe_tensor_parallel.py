"""Tensor parallelism of the experts (and ep x tp) on gloo equals the single-process layer.

Each world (2 and 4 ranks) is spawned once (`tests/support/tp_worker.py`); every rank compares its
parallel layer with the single-process layer built from the same global weights on its
own tokens (the `ckpt-*` cases load each rank's experts and intermediate shard through
`moe.checkpoint` from one synthetic FP8 block-128 checkpoint). fp32 layers must agree to
1e-5 relative (only the summation order differs); bf16 and quantized layers to their
rounding (the partial sums are added in fp32, so the only difference is where the
bf16/quantized rounding happens: the quantized grouped GEMMs give bf16 outputs, rounded per
shard before the sum).
"""

from __future__ import annotations


import pytest

from tests.support.gloo_world import spawn_world
from tests.support.tp_worker import cases
from tests.support.paths import SUPPORT

pytestmark = pytest.mark.slow  # subprocesses / multi-process worlds

WORKER = SUPPORT / "tp_worker.py"
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2, "w8a8-fp8-block": 1e-2, "w8a8-int8": 3e-2}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def world_results(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"tp{world}")
    return world, spawn_world(WORKER, world, out)


def test_every_case_equals_the_single_process_layer(world_results):
    world, results = world_results
    names = [c.name for c in cases(world)]
    assert names and all(set(r) == set(names) for r in results)
    for case in cases(world):
        for rank, result in enumerate(results):
            err = result[case.name]
            assert not isinstance(err, str), f"{case.name} rank {rank}:\n{err}"
            tol = TOLERANCE[case.scheme]
            assert err <= tol, f"{case.name} rank {rank}: relative difference {err:.3g} > {tol}"
