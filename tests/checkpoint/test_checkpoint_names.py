"""The name mapping: HF per-expert, Mixtral and fused names to (expert, projection, kind), with a layer filter."""

from __future__ import annotations

import pytest

from hal import InvalidInput
from moe.checkpoint import ExpertTensorName, NameStyle, Projection, TensorKind, expert_tensor_name, parse_expert_name

CASES = {
    "model.layers.3.mlp.experts.7.gate_proj.weight": ("model.layers.3.mlp", 7, "gate", "weight", "hf"),
    "model.layers.3.mlp.experts.0.up_proj.weight_scale_inv": ("model.layers.3.mlp", 0, "up", "weight_scale_inv", "hf"),
    "model.layers.3.mlp.experts.12.down_proj.weight_scale_2": (
        "model.layers.3.mlp",
        12,
        "down",
        "weight_scale_2",
        "hf",
    ),
    "model.layers.3.mlp.experts.5.down_proj.input_scale": ("model.layers.3.mlp", 5, "down", "input_scale", "hf"),
    "model.layers.3.mlp.experts.5.gate_up_proj.bias": ("model.layers.3.mlp", 5, "gate_up", "bias", "hf"),
    "model.layers.0.block_sparse_moe.experts.1.w1.weight": (
        "model.layers.0.block_sparse_moe",
        1,
        "gate",
        "weight",
        "mixtral",
    ),
    "model.layers.0.block_sparse_moe.experts.1.w3.weight_scale": (
        "model.layers.0.block_sparse_moe",
        1,
        "up",
        "weight_scale",
        "mixtral",
    ),
    "model.layers.0.block_sparse_moe.experts.1.w2.weight": (
        "model.layers.0.block_sparse_moe",
        1,
        "down",
        "weight",
        "mixtral",
    ),
    "model.layers.0.mlp.experts.gate_up_proj": ("model.layers.0.mlp", None, "gate_up", "weight", "fused"),
    "model.layers.0.mlp.experts.down_proj": ("model.layers.0.mlp", None, "down", "weight", "fused"),
    "model.layers.0.mlp.experts.gate_up_proj_bias": ("model.layers.0.mlp", None, "gate_up", "bias", "fused"),
    "language_model.model.layers.2.feed_forward.experts.down_proj.weight": (
        "language_model.model.layers.2.feed_forward",
        None,
        "down",
        "weight",
        "fused",
    ),
    "experts.3.gate_proj.weight": ("", 3, "gate", "weight", "hf"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_names_parse(name):
    prefix, expert, projection, kind, style = CASES[name]
    assert parse_expert_name(name) == ExpertTensorName(
        prefix, expert, Projection(projection), TensorKind(kind), NameStyle(style)
    )


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.3.mlp.gate.weight",  # the router
        "model.layers.3.mlp.shared_experts.gate_proj.weight",  # DeepSeek's shared experts
        "model.layers.3.mlp.shared_expert.up_proj.weight",  # Qwen2-MoE's
        "model.layers.3.mlp.shared_expert_gate.weight",
        "model.layers.3.mlp.experts.7.gate_proj.weight_zero_point",
        "model.layers.3.mlp.experts.x.gate_proj.weight",
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.0.mlp.router.weight",  # gpt-oss's router
    ],
)
def test_other_tensors_are_not_expert_tensors(name):
    assert parse_expert_name(name) is None


@pytest.mark.parametrize(
    "name, projection, kind",
    [
        ("model.layers.0.mlp.experts.gate_up_proj_blocks", Projection.GATE_UP, TensorKind.BLOCKS),
        ("model.layers.0.mlp.experts.gate_up_proj_scales", Projection.GATE_UP, TensorKind.SCALES),
        ("model.layers.0.mlp.experts.down_proj_blocks", Projection.DOWN, TensorKind.BLOCKS),
        ("model.layers.0.mlp.experts.down_proj_bias", Projection.DOWN, TensorKind.BIAS),
    ],
)
def test_gpt_oss_mxfp4_names_are_fused_expert_tensors(name, projection, kind):
    parsed = parse_expert_name(name, "model.layers.0.mlp")
    assert parsed is not None and parsed.fused and (parsed.projection, parsed.kind) == (projection, kind)
    assert expert_tensor_name("model.layers.0.mlp", None, projection, kind) == name


def test_the_layer_prefix_filters_exactly():
    name = "model.layers.13.mlp.experts.0.gate_proj.weight"
    assert parse_expert_name(name, "model.layers.13.mlp") is not None
    assert parse_expert_name(name, "model.layers.13.mlp.experts") is not None
    assert parse_expert_name(name, "model.layers.13.mlp.") is not None
    assert parse_expert_name(name, "model.layers.3.mlp") is None
    assert parse_expert_name(name, "layers.13.mlp") is None
    assert parse_expert_name("experts.0.gate_proj.weight", "") is not None


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[4] != "fused" or c[3] != "weight"])
def test_names_render_back(name):
    p = parse_expert_name(name)
    rendered = expert_tensor_name(p.prefix, p.expert, p.projection, p.kind, p.style)
    assert parse_expert_name(rendered) == p


def test_a_name_must_be_a_string():
    with pytest.raises(InvalidInput, match="name"):
        parse_expert_name(3)  # type: ignore[arg-type]
