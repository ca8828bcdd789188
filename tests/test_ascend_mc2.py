"""The MC2 dispatcher (torch_npu's `npu_moe_distribute_dispatch` / `_combine`, EMULATED over gloo)
equals the single-rank layer on 2 and 4 ranks, for bf16 and int8 dispatch; the emulation is
as strict as the op's documented limits; the layer refuses it where it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import moe
from hal import DispatchConfig, InvalidInput, UnsupportedCapability, get_vendor
from tests.gloo_world import spawn_world
from tests.mc2_worker import CASES
from vendors.ascend.emulation.torch_npu_ops import EmulatedTorchNpu

WORKER = Path(__file__).with_name("mc2_worker.py")
#: The same rows, GEMMs and fp32 weighted sums as one rank. int8 (integer accumulation) agrees
#: to the last bit; bf16 to one bf16 rounding of an output (the emulated GEMM's fp32 accumulation
#: may block differently when a group holds rows from several ranks).
TOLERANCE = {"int8": 1e-6, "bf16": 2.0**-7}  # one bf16 ulp is at most 2^-7 of the value


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def world_results(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"mc2-{world}")
    return spawn_world(WORKER, world, out)


def test_mc2_layers_equal_the_single_rank_layer(world_results):
    for case in CASES:
        for rank, result in enumerate(world_results):
            err = result[case.name]
            assert not isinstance(err, str), f"{case.name} rank {rank}:\n{err}"
            assert err <= TOLERANCE[case.dtype], f"{case.name} rank {rank}: relative difference {err:.3g}"


def test_the_layer_refuses_mc2_where_it_cannot_run():
    with pytest.raises(UnsupportedCapability, match="mc2"):
        moe.MoELayer(256, 96, 8, 2, vendor=get_vendor("cpu"), dispatch=DispatchConfig(ep_dispatcher="mc2"))
    with pytest.raises(InvalidInput, match="process_group"):
        moe.MoELayer(256, 96, 8, 2, vendor=get_vendor("ascend-emulated"), dispatch=DispatchConfig(ep_dispatcher="mc2"))
    with pytest.raises(InvalidInput, match="ep_dispatcher"):
        DispatchConfig(ep_dispatcher="")


@pytest.mark.parametrize("soc, h, bs, k, match", [
    ("Ascend910_9392", 4096, 4, 2, "H must be 7168"), ("Ascend910B3", 100, 4, 2, "multiple of 32"),
    ("Ascend910B3", 256, 300, 2, "BS must be"), ("Ascend910B3", 256, 4, 9, "K "),
])
def test_the_emulated_ops_reject_what_the_docs_reject(soc, h, bs, k, match):
    npu = EmulatedTorchNpu(soc)
    with pytest.raises(RuntimeError, match=match):
        npu.npu_moe_distribute_dispatch(torch.zeros(bs, h, dtype=torch.bfloat16),
                                        torch.zeros(bs, k, dtype=torch.int32), "none", 2, 0, 8)


def test_unknown_arguments_and_groups_are_refused():
    npu = EmulatedTorchNpu("Ascend910B3")
    x, ids = torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(TypeError):
        npu.npu_moe_distribute_dispatch(x, ids, "g", 2, 0, 8, k=2)  # type: ignore[call-arg]
    with pytest.raises(RuntimeError, match="not a communicator"):
        npu.npu_moe_distribute_dispatch(x, ids, "g", 2, 0, 8)
