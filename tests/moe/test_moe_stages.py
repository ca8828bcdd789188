"""`MoELayer.start` / `run_experts` / `finish`: one forward in stages equals `layer(...)` bit for bit.

A 2-rank gloo world (`tests/support/stages_worker.py`) runs each dispatch mode (normal, low-latency, auto
taking both modes in one interleaved pair), quantized dispatch, shared experts, tensor parallelism,
Llama-4 weights-on-input routing and precomputed routing: every rank's two micro-batches, staged one
by one and interleaved, equal the forward. On one rank (no group) the same in process; the stages
check their inputs as `forward` does and refuse the fused path clearly. `examples/ep_overlap.py` runs
under torchrun with tiny shapes and reports equal results.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moe
from hal import DispatchConfig, InvalidInput, UnsupportedCapability
from tests.support.gloo_world import spawn_world
from tests.support.stages_worker import cases
from tests.moe.test_moe_layer_paths import FusedInt8
from tests.support.paths import REPO, SUPPORT

pytestmark = pytest.mark.slow  # subprocesses / multi-process worlds

ROOT = REPO
WORKER = SUPPORT / "stages_worker.py"
E, H, I, K = 8, 64, 32, 2


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    return spawn_world(WORKER, 2, tmp_path_factory.mktemp("stages"), timeout_s=120)


@pytest.mark.parametrize("name", [c.name for c in cases(2)])
def test_two_ranks_staged_and_interleaved_equal_the_forward(world, name):
    for rank, results in enumerate(world):
        result = results[name]
        assert not isinstance(result, str), f"rank {rank}:\n{result}"
        assert result["equal"] and result["shapes"], f"rank {rank}: {result}"


def test_each_case_took_the_mode_it_asks_for(world):
    modes = {name: result["modes"] for name, result in world[0].items()}
    assert modes["normal"] == ["normal", "normal"] and modes["low-latency"] == ["low-latency"] * 2
    assert modes["auto-mixed"] == ["low-latency", "normal"]  # the pair in flight holds one of each
    assert modes["tp-shared"] == ["local", "local"]


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, H, 2 * I, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / I**0.5


def _layer(top_k: int = K, **kwargs) -> moe.MoELayer:
    w13, w2 = _weights()
    layer = moe.MoELayer.from_float(w13, w2, top_k, vendor="cpu", **kwargs)
    shared = kwargs.get("shared_experts")
    if shared is not None:
        g = torch.Generator().manual_seed(1)
        layer.load_shared_experts(
            torch.randn(H, 2 * 16, generator=g) / 8,
            torch.randn(16, H, generator=g) / 4,
            torch.randn(H, generator=g) if shared.gated else None,
        )
    return layer


def _staged(layer: moe.MoELayer, batches: list[tuple[tuple, dict]]) -> list[torch.Tensor]:
    """The two micro-batches interleaved through the stages."""
    (a_args, a_kwargs), (b_args, b_kwargs) = batches
    a, b = layer.start(*a_args, **a_kwargs), layer.start(*b_args, **b_kwargs)
    done_a = layer.finish(layer.run_experts(a.wait()), a)
    done_b = layer.finish(layer.run_experts(b.wait()), b)
    return [done_a.wait(), done_b.wait()]


SINGLE_RANK = {
    "local": {},
    "low-latency": {"dispatch": DispatchConfig(max_dispatch_tokens_per_rank=16)},
    "int8": {"scheme": "w8a8-int8"},
    "shared": {"shared_experts": moe.SharedExperts(16, gated=True)},
    "llama4": {
        "top_k": 1,
        "router": moe.SigmoidTopK(E, 1, weights_on_input=True),
        "shared_experts": moe.SharedExperts(16),
    },
}


@pytest.mark.parametrize("name", sorted(SINGLE_RANK))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_one_rank_stages_equal_the_forward(name, dtype):
    layer = _layer(**SINGLE_RANK[name])
    g = torch.Generator().manual_seed(2)
    batches = [
        ((torch.randn(shape + (H,), generator=g).to(dtype), torch.randn(shape + (E,), generator=g)), {})
        for shape in ((7,), (3, 3))
    ]  # a [T, H] and a [B, S, H] micro-batch
    expected = [layer(*args) for args, _ in batches]
    for got, want, (args, _) in zip(_staged(layer, batches), expected, batches):
        assert got.shape == args[0].shape and got.dtype == dtype
        assert torch.equal(got, want)


def test_precomputed_routing_stages_equal_the_forward():
    layer = _layer()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, H, generator=g).to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(6, E, generator=g), -1).topk(K, dim=-1)
    routing = {"topk_ids": ids.to(torch.int32), "topk_weights": weights}
    started = layer.start(x, **routing)
    assert torch.equal(layer.finish(layer.run_experts(started.wait()), started).wait(), layer(x, **routing))


BAD_INPUTS = {
    "hidden size": lambda x, lg: ((x[:, :-1], lg), {}),
    "hidden dtype": lambda x, lg: ((x.to(torch.int32), lg), {}),
    "logits shape": lambda x, lg: ((x, lg[:, :-1]), {}),
    "logits and ids": lambda x, lg: ((x, lg), {"topk_ids": lg.topk(K).indices, "topk_weights": lg.topk(K).values}),
    "no routing": lambda x, lg: ((x,), {}),
    "non-finite logits": lambda x, lg: ((x, lg.index_fill(0, torch.tensor([2]), float("nan"))), {}),
    "ids out of range": lambda x, lg: ((x,), {"topk_ids": torch.full((5, K), E), "topk_weights": torch.ones(5, K)}),
}


@pytest.mark.parametrize("bad", sorted(BAD_INPUTS))
def test_start_checks_its_inputs_as_forward_does(bad):
    layer = _layer()
    args, kwargs = BAD_INPUTS[bad](torch.randn(5, H), torch.randn(5, E))
    with pytest.raises(InvalidInput) as from_forward:
        layer(*args, **kwargs)
    with pytest.raises(InvalidInput) as from_start:
        layer.start(*args, **kwargs)
    assert str(from_start.value) == str(from_forward.value)


def test_the_fused_path_has_no_stages():
    w13, w2 = _weights()
    layer = moe.MoELayer.from_float(w13, w2, K, scheme="w8a8-int8", vendor=FusedInt8())
    assert layer.fused
    with pytest.raises(UnsupportedCapability, match=r"MoELayer.start: .*fused_deep_moe.*fused=False"):
        layer.start(torch.randn(4, H), torch.randn(4, E))


def test_stages_without_weights_or_with_foreign_handles_raise():
    with pytest.raises(InvalidInput, match="expected weights"):
        moe.MoELayer(H, I, E, K, vendor="cpu").start(torch.randn(4, H), torch.randn(4, E))
    layer, other = _layer(), _layer()
    started = layer.start(torch.randn(4, H), torch.randn(4, E))
    rows = layer.run_experts(started.wait())
    with pytest.raises(InvalidInput, match="started: expected what this layer's start"):
        other.finish(rows, started)
    with pytest.raises(InvalidInput, match="started: expected"):
        layer.finish(rows, started.wait())  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="dispatched: expected a moe.DispatchOutput"):
        layer.run_experts(started)  # type: ignore[arg-type]


def test_the_overlap_example_runs_under_torchrun_and_reports_equal_results():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", HAL_VENDOR="cpu")
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "examples/ep_overlap.py",
        "--tokens",
        "24",
        "--hidden",
        "64",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--intermediate",
        "32",
        "--repeats",
        "3",
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-5000:])
    assert "interleaved equals sequential bit for bit on every rank: True" in done.stdout
    assert "sequential " in done.stdout and "ratio interleaved / sequential" in done.stdout
