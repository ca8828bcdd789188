"""GroupedTopK: DeepSeek-V2 (softmax scores, a group scores its best) and every scoring x group-score
combination against float64 references; GroupedSigmoidTopK as its V3 preset; realistic shapes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moe.routing import GroupedSigmoidTopK, GroupedTopK
from tests.support.routing_reference import (
    as_dicts,
    assert_matches,
    assert_matches_where_decided,
    distinct_logits,
    randn_logits,
    ref_grouped_topk_detail,
    ref_softmax_topk,
)

COMBOS = [("softmax", "max"), ("softmax", "top2-sum"), ("sigmoid", "max"), ("sigmoid", "top2-sum")]


def _ref(x, k, groups, keep, **kw):
    return [d for d, _, _ in ref_grouped_topk_detail(x, k, groups, keep, **kw)]


@pytest.mark.parametrize(("scoring", "group_score"), COMBOS)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize(
    ("experts", "k", "groups", "keep"),
    [(8, 3, 4, 2), (16, 4, 4, 2), (64, 6, 8, 3), (12, 6, 3, 3), (16, 2, 1, 1), (64, 8, 8, 4)],
)
def test_grouped_topk_matches_reference(experts, k, groups, keep, use_bias, renormalize, scoring, group_score):
    seed = experts * 100 + k * 10 + groups
    x = randn_logits(25, experts, seed=seed)
    bias = randn_logits(1, experts, seed=seed + 1, scale=0.01 if scoring == "softmax" else 0.3)[0] if use_bias else None
    router = GroupedTopK(
        experts,
        k,
        num_groups=groups,
        topk_groups=keep,
        scoring=scoring,
        group_score=group_score,
        correction_bias=bias,
        renormalize=renormalize,
        routed_scaling_factor=16.0,
    )
    expected = _ref(
        x, k, groups, keep, scoring=scoring, group_score=group_score, bias=bias, renormalize=renormalize, scale=16.0
    )
    assert_matches(router(x), expected, k, tol=1e-5)


def test_defaults_are_deepseek_v2_with_renormalization():
    router = GroupedTopK(16, 4)
    assert (router.scoring, router.group_score, router.renormalize, router.routed_scaling_factor) == (
        "softmax",
        "max",
        True,
        1.0,
    )
    assert (router.num_groups, router.topk_groups, router.correction_bias) == (1, 1, None)


def test_v2_hand_example_group_max_differs_from_top2_sum():
    # softmax of log-weights: probabilities proportional to w; groups {0,1,2} and {3,4,5}
    w = [0.40, 0.02, 0.01, 0.22, 0.20, 0.15]
    x = torch.tensor([[math.log(v) for v in w]])
    # a group scores its best: 0.40 vs 0.22 -> group 0 wins, experts 0 and 1
    v2 = as_dicts(GroupedTopK(6, 2, num_groups=2, topk_groups=1, renormalize=False)(x))[0]
    assert set(v2) == {0, 1}
    assert v2[0] == pytest.approx(0.40, abs=1e-6) and v2[1] == pytest.approx(0.02, abs=1e-6)
    # here a group's best picks group 0 (0.40 vs 0.25), its best two group 1 (0.42 vs 0.45)
    w2 = [0.40, 0.01, 0.02, 0.25, 0.20, 0.12]
    x2 = torch.tensor([[math.log(v) for v in w2]])
    assert set(as_dicts(GroupedTopK(6, 2, num_groups=2, topk_groups=1, renormalize=False)(x2))[0]) == {0, 2}
    top2 = as_dicts(GroupedTopK(6, 2, num_groups=2, topk_groups=1, group_score="top2-sum", renormalize=False)(x2))[0]
    assert set(top2) == {3, 4}
    assert top2[3] == pytest.approx(0.25, abs=1e-6) and top2[4] == pytest.approx(0.20, abs=1e-6)
    # renormalized and scaled
    norm = as_dicts(GroupedTopK(6, 2, num_groups=2, topk_groups=1, routed_scaling_factor=16.0)(x))[0]
    assert norm[0] == pytest.approx(16 * 0.40 / 0.42, abs=1e-5) and norm[1] == pytest.approx(16 * 0.02 / 0.42, abs=1e-5)


def test_softmax_weights_are_over_all_experts_not_the_eligible_ones():
    x = randn_logits(20, 16, seed=1)
    r = GroupedTopK(16, 3, num_groups=4, topk_groups=1, renormalize=False)(x)
    probs = torch.softmax(x.double(), dim=-1)
    assert torch.allclose(r.topk_weights.double(), probs.gather(1, r.topk_ids), atol=1e-7)


def test_softmax_with_bias_chooses_by_biased_and_weighs_by_unbiased_scores():
    # Ernie-4.5 style: softmax scores, a correction bias for the choice only
    w = [0.5, 0.3, 0.15, 0.05]
    x = torch.tensor([[math.log(v) for v in w]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.5])
    got = as_dicts(GroupedTopK(4, 2, correction_bias=bias, renormalize=False)(x))[0]
    assert set(got) == {0, 3}
    assert got[3] == pytest.approx(0.05, abs=1e-6) and got[0] == pytest.approx(0.5, abs=1e-6)


def test_groups_of_one_expert_allowed_with_group_max():
    x = randn_logits(30, 8, seed=2)
    # each expert its own group, keep 3 groups: the 3 best experts stay eligible, the top-2 of them win
    r = GroupedTopK(8, 2, num_groups=8, topk_groups=3)(x)
    assert_matches(r, ref_softmax_topk(x, 2, True), 2)


@pytest.mark.parametrize(("scoring", "group_score"), COMBOS)
def test_keeping_every_group_is_ungrouped_topk(scoring, group_score):
    x = randn_logits(20, 32, seed=3)
    bias = randn_logits(1, 32, seed=4, scale=0.1)[0]
    grouped = GroupedTopK(
        32, 5, num_groups=4, topk_groups=4, scoring=scoring, group_score=group_score, correction_bias=bias
    )(x)
    plain = GroupedTopK(32, 5, scoring=scoring, correction_bias=bias)(x)
    assert torch.equal(grouped.topk_ids, plain.topk_ids) and torch.equal(grouped.topk_weights, plain.topk_weights)


@pytest.mark.parametrize("use_bias", [False, True])
def test_grouped_sigmoid_is_the_v3_preset(use_bias):
    x = randn_logits(40, 32, seed=5)
    bias = randn_logits(1, 32, seed=6, scale=0.3)[0] if use_bias else None
    kwargs = {
        "num_groups": 8,
        "topk_groups": 3,
        "correction_bias": bias,
        "renormalize": True,
        "routed_scaling_factor": 2.5,
    }
    preset = GroupedSigmoidTopK(32, 4, **kwargs)
    general = GroupedTopK(32, 4, scoring="sigmoid", group_score="top2-sum", **kwargs)
    assert isinstance(preset, GroupedTopK) and (preset.scoring, preset.group_score) == ("sigmoid", "top2-sum")
    a, b = preset(x), general(x)
    assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_weights, b.topk_weights)


def test_grouped_chosen_experts_lie_in_kept_groups_and_grouping_matters():
    x = randn_logits(60, 64, seed=7)
    r = GroupedTopK(64, 6, num_groups=8, topk_groups=2)(x)
    detail = ref_grouped_topk_detail(x, 6, 8, 2)
    for t, ids in enumerate(r.topk_ids.tolist()):
        assert {i // 8 for i in ids} <= detail[t][1]
    ungrouped = torch.softmax(x, -1).topk(6, dim=-1).indices
    assert any(set(a) != set(b) for a, b in zip(r.topk_ids.tolist(), ungrouped.tolist()))


SCENARIOS = [
    pytest.param("softmax", "max", None, False, 16.0, id="deepseek-v2"),
    pytest.param("sigmoid", "top2-sum", "bias", True, 2.5, id="deepseek-v3"),
]


@pytest.mark.parametrize(("scoring", "group_score", "bias_kind", "renormalize", "scale"), SCENARIOS)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 8])
def test_realistic_shape_256_experts_8_groups_keep_4_2000_tokens(
    k, scoring, group_score, bias_kind, renormalize, scale
):
    x = randn_logits(2000, 256, seed=10 + k)
    bias = randn_logits(1, 256, seed=9, scale=0.05)[0] if bias_kind else None
    router = GroupedTopK(
        256,
        k,
        num_groups=8,
        topk_groups=4,
        scoring=scoring,
        group_score=group_score,
        correction_bias=bias,
        renormalize=renormalize,
        routed_scaling_factor=scale,
    )
    detail = ref_grouped_topk_detail(
        x, k, 8, 4, scoring=scoring, group_score=group_score, bias=bias, renormalize=renormalize, scale=scale
    )
    r = router(x)
    assert_matches_where_decided(r, [d for d, _, _ in detail], [m for _, _, m in detail], k, tol=1e-5)
    groups = (r.topk_ids // 32).tolist()
    assert all(set(g) <= kept for g, (_, kept, _) in zip(groups, detail))


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 5),
    per_group=st.integers(2, 5),
    groups=st.integers(1, 5),
    keep_frac=st.floats(0.0, 1.0),
    k_frac=st.floats(0.0, 1.0),
    combo=st.sampled_from(COMBOS),
    use_bias=st.booleans(),
    renormalize=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_grouped_topk_property_agrees_with_reference(
    tokens, per_group, groups, keep_frac, k_frac, combo, use_bias, renormalize, seed
):
    scoring, group_score = combo
    experts = per_group * groups
    keep = max(1, min(groups, 1 + int(keep_frac * groups)))
    k = max(1, min(keep * per_group, 1 + int(k_frac * keep * per_group)))
    x = distinct_logits(tokens, experts, seed)
    bias = distinct_logits(1, experts, seed + 1)[0] * 0.01 if use_bias else None
    detail = ref_grouped_topk_detail(
        x, k, groups, keep, scoring=scoring, group_score=group_score, bias=bias, renormalize=renormalize
    )
    assume(all(margin > 1e-5 for _, _, margin in detail))  # no near-ties in experts or groups
    r = GroupedTopK(
        experts,
        k,
        num_groups=groups,
        topk_groups=keep,
        scoring=scoring,
        group_score=group_score,
        correction_bias=bias,
        renormalize=renormalize,
    )(x)
    for t, ids in enumerate(r.topk_ids.tolist()):
        assert {i // per_group for i in ids} <= detail[t][1]
    assert_matches(r, [d for d, _, _ in detail], k, tol=1e-5)
