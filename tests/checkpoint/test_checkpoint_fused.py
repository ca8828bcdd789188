"""Fused all-experts tensors (transformers' `gate_up_proj` / `down_proj` in each orientation, gpt-oss's
interleaved gate/up with biases) load with expert and tensor parallelism, reading only what a rank needs."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from safetensors.torch import save_file

from moe.checkpoint import ExpertCheckpointLoader, load_safetensors
from tests.support.checkpoint_synthetic import fused_checkpoint

E, H, I = 4, 48, 32
PREFIX = "model.layers.0.mlp"
LAYOUTS = {
    "out-in": dict(fused_layout="out-in"),
    "in-out": dict(fused_layout="in-out"),
    "gpt-oss": dict(fused_layout="in-out", gate_up_interleaved=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("bias", [False, True])
def test_fused_layouts_with_expert_and_tensor_parallelism(tmp_path, layout, bias):
    ckpt, tensors = fused_checkpoint(E, H, I, layout=layout, bias=bias)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    local = range(1, 3)
    for rank in range(2):
        loader = ExpertCheckpointLoader(
            "bf16", E, H, I, local_experts=local, tp_rank=rank, tp_size=2, bias=bias, **LAYOUTS[layout]
        )
        assert sorted(load_safetensors(path, PREFIX, loader)) == sorted(tensors)
        built = loader.build()
        w13, w2 = ckpt.expected(local, rank, 2)
        assert torch.equal(built.w13.data.double(), w13) and torch.equal(built.w2.data.double(), w2)
        if bias:
            b13, b2 = ckpt.expected_biases(local, rank, 2)
            assert torch.equal(built.w13_bias.double(), b13) and torch.equal(built.w2_bias.double(), b2)


def test_a_fused_tensor_may_hold_only_the_local_experts():
    ckpt, tensors = fused_checkpoint(E, H, I)
    loader = ExpertCheckpointLoader("bf16", E, H, I, local_experts=range(2, 4))
    for name, t in tensors.items():
        assert loader.add(name, t[2:4])  # an engine that already took its experts' rows
    w13, w2 = ckpt.expected(range(2, 4))
    built = loader.build()
    assert torch.equal(built.w13.data.double(), w13) and torch.equal(built.w2.data.double(), w2)


def test_other_ranks_experts_are_not_kept():
    """Of a fused tensor, only copies of the local experts' shard stay: the tensor given is freed."""
    _, tensors = fused_checkpoint(E, H, I)
    loader = ExpertCheckpointLoader("bf16", E, H, I, local_experts=range(3, 4), tp_rank=1, tp_size=2)
    refs = []
    for name in list(tensors):
        t = tensors.pop(name)
        refs.append(weakref.ref(t))
        loader.add(name, t)
        del t
    gc.collect()
    assert all(r() is None for r in refs)
    assert not loader.add(f"{PREFIX}.experts.0.gate_proj.weight", torch.zeros(I, H, dtype=torch.bfloat16))


def test_a_per_expert_gate_up_tensor_is_split_into_gate_and_up():
    ckpt, tensors = fused_checkpoint(2, H, I)
    loader = ExpertCheckpointLoader("bf16", 2, H, I, tp_rank=1, tp_size=2)
    for e in range(2):
        loader.add(f"{PREFIX}.experts.{e}.gate_up_proj.weight", tensors[f"{PREFIX}.experts.gate_up_proj"][e])
        loader.add(f"{PREFIX}.experts.{e}.down_proj.weight", tensors[f"{PREFIX}.experts.down_proj"][e])
    assert torch.equal(loader.build().w13.data.double(), ckpt.expected(range(2), 1, 2)[0])


def test_a_plain_activation_takes_up_and_down_only():
    ckpt, tensors = fused_checkpoint(2, H, I)
    loader = ExpertCheckpointLoader("bf16", 2, H, I, activation_gated=False)
    for e in range(2):
        loader.add(f"{PREFIX}.experts.{e}.up_proj.weight", ckpt.values[(e, "up")].to(torch.bfloat16))
        loader.add(f"{PREFIX}.experts.{e}.down_proj.weight", ckpt.values[(e, "down")].to(torch.bfloat16))
    built = loader.build()
    assert not built.activation.gated and built.w13.data.shape == (2, H, I)
    assert torch.equal(built.w13.data.double(), ckpt.expected(range(2), gated=False)[0])
