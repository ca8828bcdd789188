"""Our routers against transformers' own router modules, built from small configs with random weights
(no download): the same expert ids per token (as sets; near-ties, where fp32 could go either way, are
left out by the float64 reference's margin) and the same weights at fp32 tolerance."""

from __future__ import annotations

import pytest
import torch

from moe.routing import GroupedSigmoidTopK, GroupedTopK, Routing, SigmoidTopK, SoftmaxTopK
from tests.support.routing_reference import (
    assert_matches_where_decided,
    ref_grouped_topk_detail,
    ref_sigmoid_topk_detail,
    ref_softmax_topk_detail,
)

transformers = pytest.importorskip("transformers")

HIDDEN = 48  # not a multiple of 128 (nor of 32)


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fill every parameter and buffer of a router with seeded random values (biases small)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            scale = 0.05 if "bias" in name else HIDDEN**-0.5
            tensor.copy_(torch.randn(tensor.shape, generator=g) * scale)
    return module.eval()


def _hidden(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _dicts(ids: torch.Tensor, weights: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i, w)) for i, w in zip(ids.tolist(), weights.float().tolist())]


def _check(ours: Routing, their_ids, their_weights, margins, k) -> None:
    """Ours equals transformers' on every token the float64 reference says is decided."""
    assert_matches_where_decided(ours, _dicts(their_ids, their_weights), margins, k, tol=2e-6)


def _margins(detail) -> list[float]:
    return [d[-1] for d in detail]


SOFTMAX_MODELS = [
    pytest.param("mixtral", "MixtralConfig", "MixtralTopKRouter", {"num_local_experts": 8}, 2, True, id="mixtral"),
    pytest.param(
        "qwen2_moe",
        "Qwen2MoeConfig",
        "Qwen2MoeTopKRouter",
        {"num_experts": 60, "norm_topk_prob": False},
        4,
        False,
        id="qwen2-moe",
    ),
    pytest.param(
        "qwen3_moe",
        "Qwen3MoeConfig",
        "Qwen3MoeTopKRouter",
        {"num_experts": 128, "norm_topk_prob": True},
        8,
        True,
        id="qwen3-moe",
    ),
    pytest.param(
        "olmoe", "OlmoeConfig", "OlmoeTopKRouter", {"num_experts": 64, "norm_topk_prob": False}, 8, False, id="olmoe"
    ),
]


def _module(package: str, config_name: str, class_name: str, **config):
    modeling = __import__(f"transformers.models.{package}.modeling_{package}", fromlist=[class_name])
    heads = {"num_attention_heads": 4, "num_key_value_heads": 4}  # HIDDEN must divide among them
    config = getattr(transformers, config_name)(hidden_size=HIDDEN, **heads, **config)
    return getattr(modeling, class_name)(config)


@pytest.mark.parametrize(("package", "config_name", "class_name", "config", "k", "renormalize"), SOFTMAX_MODELS)
def test_softmax_topk_equals_transformers_router(package, config_name, class_name, config, k, renormalize):
    router = _randomize(_module(package, config_name, class_name, num_experts_per_tok=k, **config), seed=k)
    with torch.no_grad():
        logits, weights, ids = router(_hidden(2000, seed=1))
    ours = SoftmaxTopK(logits.shape[1], k, renormalize=renormalize)(logits)
    _check(ours, ids, weights, _margins(ref_softmax_topk_detail(logits, k, renormalize)), k)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_gpt_oss_router_is_renormalized_softmax_topk(k):
    # gpt-oss takes the softmax of the k largest logits (its linear has a bias): the same weights
    router = _randomize(
        _module("gpt_oss", "GptOssConfig", "GptOssTopKRouter", num_local_experts=32, num_experts_per_tok=k), seed=2
    )
    with torch.no_grad():
        logits, weights, ids = router(_hidden(1000, seed=2))
    ours = SoftmaxTopK(32, k)(logits)
    _check(ours, ids, weights, _margins(ref_softmax_topk_detail(logits, k, True)), k)


@pytest.mark.parametrize(("experts", "k"), [(16, 1), (128, 1), (16, 2)])
def test_llama4_router_equals_sigmoid_topk(experts, k):
    router = _randomize(
        _module("llama4", "Llama4TextConfig", "Llama4Router", num_local_experts=experts, num_experts_per_tok=k), seed=3
    )
    with torch.no_grad():
        scores, logits = router(_hidden(2000, seed=3))
    ours = SigmoidTopK(experts, k, weights_on_input=(k == 1))(logits)
    assert ours.weights_on_input is (k == 1)
    # transformers gives a dense [T, E] score matrix: the chosen experts' sigmoids, zeros elsewhere
    their_ids = scores.topk(k, dim=-1).indices
    assert int((scores > 0).sum(-1).max()) == k
    _check(ours, their_ids, scores.gather(1, their_ids), _margins(ref_sigmoid_topk_detail(logits, k)), k)


def test_minimax_m2_router_equals_sigmoid_topk_with_bias():
    router = _randomize(
        _module("minimax_m2", "MiniMaxM2Config", "MiniMaxM2TopKRouter", num_local_experts=64, num_experts_per_tok=8),
        seed=4,
    )
    bias = torch.randn(64, generator=torch.Generator().manual_seed(5)) * 0.05
    with torch.no_grad():
        logits, weights, ids = router(_hidden(2000, seed=4), bias)
    ours = SigmoidTopK(64, 8, correction_bias=bias, renormalize=True)(logits)
    _check(ours, ids, weights, _margins(ref_sigmoid_topk_detail(logits, 8, bias, True)), 8)


def test_ernie_4_5_router_equals_softmax_grouped_topk_with_bias():
    router = _randomize(
        _module(
            "ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeTopKRouter", moe_num_experts=64, num_experts_per_tok=6
        ),
        seed=6,
    )
    bias = router.moe_statics.e_score_correction_bias.detach()[0].clone()
    with torch.no_grad():
        logits, weights, ids = router(_hidden(2000, seed=6))
    ours = GroupedTopK(64, 6, correction_bias=bias)(logits)
    _check(ours, ids, weights, _margins(ref_grouped_topk_detail(logits, 6, 1, 1, bias=bias)), 6)


@pytest.mark.parametrize(
    ("experts", "k", "groups", "keep"), [(256, 8, 8, 4), (64, 6, 8, 3), (32, 1, 4, 2), (16, 4, 1, 1)]
)
def test_deepseek_v3_router_equals_grouped_sigmoid_topk(experts, k, groups, keep):
    config = {
        "n_routed_experts": experts,
        "num_experts_per_tok": k,
        "n_group": groups,
        "topk_group": keep,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
    }
    router = _randomize(_module("deepseek_v3", "DeepseekV3Config", "DeepseekV3TopkRouter", **config), seed=experts)
    bias = router.e_score_correction_bias.detach().clone()
    with torch.no_grad():
        logits, weights, ids = router(_hidden(2000, seed=7))
    ours = GroupedSigmoidTopK(
        experts, k, num_groups=groups, topk_groups=keep, correction_bias=bias, routed_scaling_factor=2.5
    )(logits)
    detail = ref_grouped_topk_detail(
        logits, k, groups, keep, scoring="sigmoid", group_score="top2-sum", bias=bias, scale=2.5
    )
    _check(ours, ids, weights, _margins(detail), k)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_deepseek_v3_router_without_renormalization(norm_topk_prob):
    config = {
        "n_routed_experts": 64,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": norm_topk_prob,
        "routed_scaling_factor": 1.0,
    }
    router = _randomize(_module("deepseek_v3", "DeepseekV3Config", "DeepseekV3TopkRouter", **config), seed=8)
    bias = router.e_score_correction_bias.detach().clone()
    with torch.no_grad():
        logits, weights, ids = router(_hidden(1000, seed=8))
    ours = GroupedTopK(
        64,
        4,
        num_groups=4,
        topk_groups=2,
        scoring="sigmoid",
        group_score="top2-sum",
        correction_bias=bias,
        renormalize=norm_topk_prob,
    )(logits)
    detail = ref_grouped_topk_detail(
        logits, 4, 4, 2, scoring="sigmoid", group_score="top2-sum", bias=bias, renormalize=norm_topk_prob
    )
    _check(ours, ids, weights, _margins(detail), 4)


@pytest.mark.parametrize(("experts", "k", "groups", "keep"), [(160, 6, 8, 3), (256, 8, 8, 4), (64, 1, 4, 1)])
def test_deepseek_v2_group_limited_greedy_equals_grouped_softmax_topk(experts, k, groups, keep):
    # transformers' V2 router applies no renormalization (V2's norm_topk_prob is False) and scales by the factor
    config = {
        "n_routed_experts": experts,
        "num_experts_per_tok": k,
        "n_group": groups,
        "topk_group": keep,
        "topk_method": "group_limited_greedy",
        "routed_scaling_factor": 16.0,
    }
    router = _randomize(_module("deepseek_v2", "DeepseekV2Config", "DeepseekV2TopkRouter", **config), seed=experts)
    with torch.no_grad():
        logits, weights, ids = router(_hidden(2000, seed=9))
    ours = GroupedTopK(experts, k, num_groups=groups, topk_groups=keep, renormalize=False, routed_scaling_factor=16.0)(
        logits
    )
    detail = ref_grouped_topk_detail(logits, k, groups, keep, renormalize=False, scale=16.0)
    _check(ours, ids, weights, _margins(detail), k)


def test_deepseek_v2_greedy_equals_softmax_topk_with_scaling_factor():
    config = {"n_routed_experts": 64, "num_experts_per_tok": 6, "topk_method": "greedy", "routed_scaling_factor": 1.5}
    router = _randomize(_module("deepseek_v2", "DeepseekV2Config", "DeepseekV2TopkRouter", **config), seed=10)
    with torch.no_grad():
        logits, weights, ids = router(_hidden(2000, seed=10))
    margins = _margins(ref_softmax_topk_detail(logits, 6, False, 1.5))
    _check(SoftmaxTopK(64, 6, renormalize=False, routed_scaling_factor=1.5)(logits), ids, weights, margins, 6)
    _check(GroupedTopK(64, 6, renormalize=False, routed_scaling_factor=1.5)(logits), ids, weights, margins, 6)
