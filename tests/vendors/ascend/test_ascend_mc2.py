"""The MC2 dispatcher (torch_npu's `npu_moe_distribute_dispatch` / `_combine`, EMULATED over gloo)
equals the single-rank layer on 2 and 4 ranks, for bf16 and int8 dispatch; the emulation is
as strict as the op's documented limits; the layer refuses it where it cannot run."""

from __future__ import annotations

import itertools

import pytest
import torch

import moe
from hal import DispatchConfig, InvalidInput, UnsupportedCapability, get_vendor
from tests.support.gloo_world import spawn_world
from tests.support.mc2_worker import CASES
from vendors.ascend.capabilities import generation_of
from vendors.ascend.emulation.torch_npu_ops import EmulatedTorchNpu
from vendors.ascend.mc2 import mc2_problems
from tests.support.paths import SUPPORT

WORKER = SUPPORT / "mc2_worker.py"
#: The same rows, GEMMs and fp32 weighted sums as one rank. int8 (integer accumulation) agrees
#: to the last bit; bf16 to one bf16 rounding of an output (the emulated GEMM's fp32 accumulation
#: may block differently when a group holds rows from several ranks).
TOLERANCE = {"int8": 1e-6, "bf16": 2.0**-7}  # one bf16 ulp is at most 2^-7 of the value


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def world_results(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"mc2-{world}")
    return spawn_world(WORKER, world, out)


@pytest.mark.slow
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


@pytest.mark.parametrize(
    "soc, h, bs, k, match",
    [
        ("Ascend910_9392", 4096, 4, 2, "H must be 7168"),
        ("Ascend910B3", 100, 4, 2, "multiple of 32"),
        ("Ascend910B3", 256, 300, 2, "BS must be"),
        ("Ascend910B3", 256, 4, 9, "K "),
    ],
)
def test_the_emulated_ops_reject_what_the_docs_reject(soc, h, bs, k, match):
    npu = EmulatedTorchNpu(soc)
    with pytest.raises(RuntimeError, match=match):
        npu.npu_moe_distribute_dispatch(
            torch.zeros(bs, h, dtype=torch.bfloat16), torch.zeros(bs, k, dtype=torch.int32), "none", 2, 0, 8
        )


def test_unknown_arguments_and_groups_are_refused():
    npu = EmulatedTorchNpu("Ascend910B3")
    x, ids = torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(TypeError):
        npu.npu_moe_distribute_dispatch(x, ids, "g", 2, 0, 8, k=2)  # type: ignore[call-arg]
    with pytest.raises(RuntimeError, match="not a communicator"):
        npu.npu_moe_distribute_dispatch(x, ids, "g", 2, 0, 8)


@pytest.mark.parametrize("soc", ["Ascend910_9392", "Ascend910B3"])
def test_the_vendor_refuses_exactly_the_shapes_the_op_rejects(soc):
    npu = EmulatedTorchNpu(soc)
    generation = generation_of(soc)
    for h, bs, k in itertools.product((32, 100, 256, 4096, 7168, 7200), (1, 256, 300, 512, 513), (1, 8, 9)):
        try:
            npu._check_shapes("npu_moe_distribute_dispatch", h, bs, k)
            rejected = False
        except RuntimeError:
            rejected = True
        assert bool(mc2_problems(generation, hidden=h, tokens=bs, top_k=k)) == rejected, (soc, h, bs, k)


def test_a_hidden_size_the_op_rejects_is_refused_when_the_layer_is_built():
    group = _single_rank_group()
    try:
        with pytest.raises(InvalidInput, match="hidden size 256.*7168 on Atlas A3"):
            moe.MoELayer(
                256,
                96,
                8,
                2,
                vendor=get_vendor("ascend-emulated"),
                process_group=group,
                dispatch=DispatchConfig(ep_dispatcher="mc2"),
            )
    finally:
        torch.distributed.destroy_process_group()


def _single_rank_group():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return torch.distributed.group.WORLD
