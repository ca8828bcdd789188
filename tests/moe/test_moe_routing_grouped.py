"""GroupedSigmoidTopK (DeepSeek-V3 routing) against float64 references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moe.routing import GroupedSigmoidTopK
from tests.support.routing_reference import (
    _rows,
    _sigmoid,
    _top,
    as_dicts,
    assert_matches,
    distinct_logits,
    logit,
    randn_logits,
    ref_grouped,
    ref_grouped_detail,
)

# -- GroupedSigmoidTopK --------------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize(
    ("experts", "k", "groups", "keep"),
    [(8, 3, 4, 2), (16, 4, 4, 2), (32, 8, 8, 4), (16, 2, 1, 1), (12, 6, 3, 3), (64, 8, 8, 3)],
)
def test_grouped_matches_reference(experts, k, groups, keep, use_bias, renormalize):
    seed = experts * 100 + k * 10 + groups
    x = randn_logits(25, experts, seed=seed)
    bias = randn_logits(1, experts, seed=seed + 1, scale=0.3)[0] if use_bias else None
    router = GroupedSigmoidTopK(
        experts,
        k,
        num_groups=groups,
        topk_groups=keep,
        correction_bias=bias,
        renormalize=renormalize,
        routed_scaling_factor=2.5,
    )
    r = router(x)
    assert_matches(r, ref_grouped(x, k, groups, keep, bias, renormalize, 2.5), k, tol=1e-5)


@pytest.mark.parametrize("use_bias", [False, True])
def test_grouped_chosen_experts_lie_in_kept_groups(use_bias):
    experts, groups, keep, k = 32, 8, 3, 6
    per_group = experts // groups
    x = randn_logits(40, experts, seed=11)
    bias = randn_logits(1, experts, seed=12, scale=0.5)[0] if use_bias else None
    r = GroupedSigmoidTopK(experts, k, num_groups=groups, topk_groups=keep, correction_bias=bias)(x)
    detail = ref_grouped_detail(x, k, groups, keep, bias)
    for t, ids in enumerate(r.topk_ids.tolist()):
        kept = detail[t][1]
        assert len(kept) == keep
        assert {i // per_group for i in ids} <= kept, f"token {t}: {ids} outside kept groups {kept}"
    # the restriction matters: in some token the best experts overall are not all in kept groups
    plain = [
        set(_top([_sigmoid(v) + (0 if bias is None else bias[i].item()) for i, v in enumerate(row)], k))
        for row in _rows(x)
    ]
    assert any(set(ids) != p for ids, p in zip(r.topk_ids.tolist(), plain))


def test_grouped_hand_example_eight_experts_four_groups_keep_two_top_three():
    # groups {0,1} {2,3} {4,5} {6,7}; sigmoid scores chosen by hand
    p = [0.9, 0.1, 0.6, 0.55, 0.2, 0.3, 0.8, 0.7]
    # group scores (sum of the two best): 1.0, 1.15, 0.5, 1.5 -> keep groups 3 and 1
    # top-3 of experts {2, 3, 6, 7}: 6 (0.8), 7 (0.7), 2 (0.6); expert 0 (0.9, the best) is not eligible
    x = torch.tensor([[logit(v) for v in p]])
    router = GroupedSigmoidTopK(8, 3, num_groups=4, topk_groups=2, renormalize=False)
    got = as_dicts(router(x))[0]
    assert set(got) == {6, 7, 2}
    for i, w in {6: 0.8, 7: 0.7, 2: 0.6}.items():
        assert got[i] == pytest.approx(w, abs=1e-6)
    norm = as_dicts(GroupedSigmoidTopK(8, 3, num_groups=4, topk_groups=2)(x))[0]
    for i, w in {6: 0.8, 7: 0.7, 2: 0.6}.items():
        assert norm[i] == pytest.approx(w / 2.1, abs=1e-6)
    # sanity: the reference agrees with the hand computation
    assert set(ref_grouped(x, 3, 4, 2)[0]) == {6, 7, 2}


def test_grouped_hand_example_group_score_is_sum_of_two_best_not_max():
    # group 0 = {0,1,2}: best 0.95 but second best 0.05 -> 1.0
    # group 1 = {3,4,5}: 0.6, 0.6, 0.1 -> 1.2 ; keep 1 group -> group 1, although it lacks the top expert
    p = [0.95, 0.05, 0.04, 0.6, 0.58, 0.1]
    x = torch.tensor([[logit(v) for v in p]])
    got = as_dicts(GroupedSigmoidTopK(6, 2, num_groups=2, topk_groups=1, renormalize=False)(x))[0]
    assert set(got) == {3, 4}
    assert got[3] == pytest.approx(0.6, abs=1e-6) and got[4] == pytest.approx(0.58, abs=1e-6)


def test_grouped_bias_changes_selection_but_not_weights():
    p = [0.9, 0.8, 0.1, 0.7]
    x = torch.tensor([[logit(v) for v in p]])
    without = as_dicts(GroupedSigmoidTopK(4, 2, renormalize=False)(x))[0]
    assert set(without) == {0, 1}
    # a large bias on the low-scoring expert 2 (choice 0.1 + 1.0 = 1.1) makes it chosen ...
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])
    with_bias = as_dicts(GroupedSigmoidTopK(4, 2, correction_bias=bias, renormalize=False)(x))[0]
    assert set(with_bias) == {0, 2}
    # ... with its unbiased sigmoid score as weight (not 1.1); expert 0's weight is unchanged
    assert with_bias[2] == pytest.approx(0.1, abs=1e-6)
    assert with_bias[0] == pytest.approx(0.9, abs=1e-6) == without[0]
    # renormalized: over the unbiased scores 0.9 + 0.1
    norm = as_dicts(GroupedSigmoidTopK(4, 2, correction_bias=bias)(x))[0]
    assert norm[0] == pytest.approx(0.9, abs=1e-6) and norm[2] == pytest.approx(0.1, abs=1e-6)


def test_grouped_bias_also_steers_group_selection():
    # groups {0,1} and {2,3}; unbiased, group 0 wins (0.9+0.8 vs 0.3+0.2)
    p = [0.9, 0.8, 0.3, 0.2]
    x = torch.tensor([[logit(v) for v in p]])
    plain = as_dicts(GroupedSigmoidTopK(4, 2, num_groups=2, topk_groups=1, renormalize=False)(x))[0]
    assert set(plain) == {0, 1}
    bias = torch.tensor([0.0, 0.0, 0.5, 0.5])  # group 1 becomes 0.8+0.7 = 1.5 < 1.7: still group 0
    still = as_dicts(GroupedSigmoidTopK(4, 2, num_groups=2, topk_groups=1, correction_bias=bias, renormalize=False)(x))[
        0
    ]
    assert set(still) == {0, 1}
    bias = torch.tensor([0.0, 0.0, 1.0, 1.0])  # group 1: 1.3+1.2 = 2.5 > 1.7: group 1 wins
    moved = as_dicts(GroupedSigmoidTopK(4, 2, num_groups=2, topk_groups=1, correction_bias=bias, renormalize=False)(x))[
        0
    ]
    assert set(moved) == {2, 3}
    assert moved[2] == pytest.approx(0.3, abs=1e-6) and moved[3] == pytest.approx(0.2, abs=1e-6)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_grouped_bias_dtypes_accepted(bias_dtype):
    x = randn_logits(10, 16, seed=13)
    bias = randn_logits(1, 16, seed=14, scale=0.25)[0].to(bias_dtype)
    r = GroupedSigmoidTopK(16, 4, num_groups=4, topk_groups=2, correction_bias=bias)(x)
    assert_matches(r, ref_grouped(x, 4, 4, 2, bias), 4, tol=1e-5)


@pytest.mark.parametrize("use_bias", [False, True])
def test_grouped_single_group_is_plain_topk_of_biased_scores(use_bias):
    x = randn_logits(30, 16, seed=15)
    bias = randn_logits(1, 16, seed=16, scale=0.4)[0] if use_bias else torch.zeros(16)
    r = GroupedSigmoidTopK(
        16, 5, num_groups=1, topk_groups=1, correction_bias=bias if use_bias else None, renormalize=False
    )(x)
    choice = torch.sigmoid(x.double()) + bias.double()
    expected_ids = choice.topk(5, dim=-1).indices
    for t in range(30):
        assert set(r.topk_ids[t].tolist()) == set(expected_ids[t].tolist())
    assert torch.allclose(r.topk_weights.double(), torch.sigmoid(x.double()).gather(1, r.topk_ids), atol=1e-6)


def test_grouped_keep_all_groups_is_plain_topk():
    x = randn_logits(20, 16, seed=17)
    grouped = GroupedSigmoidTopK(16, 4, num_groups=4, topk_groups=4)(x)
    plain = GroupedSigmoidTopK(16, 4)(x)
    assert [set(a) for a in grouped.topk_ids.tolist()] == [set(a) for a in plain.topk_ids.tolist()]
    assert_matches(grouped, ref_grouped(x, 4, 1, 1), 4, tol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("scale", [1.0, 2.5, 0.5, 3])
def test_grouped_routed_scaling_factor_multiplies_weights(scale, renormalize):
    x = randn_logits(12, 16, seed=18)
    base = GroupedSigmoidTopK(16, 4, num_groups=4, topk_groups=2, renormalize=renormalize)(x)
    scaled = GroupedSigmoidTopK(
        16, 4, num_groups=4, topk_groups=2, renormalize=renormalize, routed_scaling_factor=scale
    )(x)
    assert torch.equal(base.topk_ids, scaled.topk_ids)
    assert torch.allclose(scaled.topk_weights, base.topk_weights * scale, rtol=1e-6, atol=1e-7)
    if renormalize:
        assert torch.allclose(scaled.topk_weights.sum(-1), torch.full((12,), float(scale)), atol=1e-5)
    assert_matches(scaled, ref_grouped(x, 4, 4, 2, None, renormalize, scale), 4, tol=1e-5)


def test_grouped_renormalize_default_and_sum():
    x = randn_logits(15, 8, seed=19)
    router = GroupedSigmoidTopK(8, 3, num_groups=4, topk_groups=2)
    assert router.renormalize is True and router.routed_scaling_factor == 1.0
    assert torch.allclose(router(x).topk_weights.sum(-1), torch.ones(15), atol=1e-6)
    raw = GroupedSigmoidTopK(8, 3, num_groups=4, topk_groups=2, renormalize=False)(x)
    w = raw.topk_weights
    assert ((w > 0) & (w < 1)).all()
    assert torch.allclose(w.double(), torch.sigmoid(x.double()).gather(1, raw.topk_ids), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_grouped_accepts_float_dtypes_and_returns_fp32_int64(dtype):
    x = distinct_logits(9, 16, seed=20, dtype=dtype)
    r = GroupedSigmoidTopK(16, 4, num_groups=4, topk_groups=2)(x)
    assert r.topk_ids.dtype == torch.int64 and r.topk_weights.dtype == torch.float32
    assert_matches(r, ref_grouped(x, 4, 4, 2), 4, tol=1e-5)


def test_grouped_zero_tokens_gives_empty_outputs():
    bias = torch.zeros(16)
    r = GroupedSigmoidTopK(16, 4, num_groups=4, topk_groups=2, correction_bias=bias)(torch.empty(0, 16))
    assert tuple(r.topk_ids.shape) == (0, 4) and tuple(r.topk_weights.shape) == (0, 4)
    assert r.topk_ids.dtype == torch.int64 and r.topk_weights.dtype == torch.float32


def test_grouped_top_k_equal_to_kept_experts():
    # top_k == topk_groups * experts per group: exactly the kept groups' experts, all of them
    x = randn_logits(10, 12, seed=21)
    r = GroupedSigmoidTopK(12, 6, num_groups=4, topk_groups=2)(x)
    assert_matches(r, ref_grouped(x, 6, 4, 2), 6, tol=1e-5)
    for ids in r.topk_ids.tolist():
        groups = {i // 3 for i in ids}
        assert len(groups) == 2 and set(ids) == {g * 3 + j for g in groups for j in range(3)}


def test_grouped_non_contiguous_logits():
    x = randn_logits(16, 7, seed=22).t()  # [7 tokens, 16 experts], transposed storage
    bias = randn_logits(1, 16, seed=23, scale=0.2)[0]
    r = GroupedSigmoidTopK(16, 4, num_groups=4, topk_groups=2, correction_bias=bias)(x)
    assert_matches(r, ref_grouped(x, 4, 4, 2, bias), 4, tol=1e-5)


def test_grouped_does_not_modify_logits_or_bias():
    x = randn_logits(5, 8, seed=24)
    bias = randn_logits(1, 8, seed=25)[0]
    xb, bb = x.clone(), bias.clone()
    GroupedSigmoidTopK(8, 2, num_groups=4, topk_groups=2, correction_bias=bias)(x)
    assert torch.equal(x, xb) and torch.equal(bias, bb)


def test_grouped_tokens_are_routed_independently():
    x = randn_logits(12, 16, seed=26)
    router = GroupedSigmoidTopK(16, 3, num_groups=4, topk_groups=2, correction_bias=torch.linspace(-0.2, 0.2, 16))
    whole = as_dicts(router(x))
    for t in range(12):
        single = as_dicts(router(x[t : t + 1]))[0]
        assert set(single) == set(whole[t])


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(0, 5),
    per_group=st.integers(2, 5),
    groups=st.integers(1, 5),
    keep_frac=st.floats(0.0, 1.0),
    k_frac=st.floats(0.0, 1.0),
    use_bias=st.booleans(),
    renormalize=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_grouped_property_agrees_with_reference(
    tokens, per_group, groups, keep_frac, k_frac, use_bias, renormalize, seed
):
    experts = per_group * groups
    keep = max(1, min(groups, 1 + int(keep_frac * groups)))
    k = max(1, min(keep * per_group, 1 + int(k_frac * keep * per_group)))
    # well-separated logits and a bias on a coarse grid so no near-ties in experts or groups
    x = distinct_logits(tokens, experts, seed) * 4
    bias = (distinct_logits(1, experts, seed + 1)[0] * 0.01) if use_bias else None
    # fp32 sigmoids saturate: two experts (or groups) can score exactly alike, and either choice is right
    selection = torch.sigmoid(x.float()) + (0 if bias is None else bias.float())
    group_scores = selection.view(tokens, groups, per_group).topk(min(2, per_group), dim=-1).values.sum(-1)
    # and scores a few ulps apart may order either way (the router and the reference sum in different orders:
    # group scores 1.0074999 and 1.0075001 were seen to flip), so every pair must stand clearly apart
    assume(
        all(
            min((b - a for a, b in zip(sorted(row), sorted(row)[1:])), default=1.0) > 1e-5
            for row in selection.tolist() + group_scores.tolist()
        )
    )
    r = GroupedSigmoidTopK(
        experts, k, num_groups=groups, topk_groups=keep, correction_bias=bias, renormalize=renormalize
    )(x)
    detail = ref_grouped_detail(x, k, groups, keep, bias, renormalize)
    assert tuple(r.topk_ids.shape) == (tokens, k)
    for t, ids in enumerate(r.topk_ids.tolist()):
        assert {i // per_group for i in ids} <= detail[t][1]
    assert_matches(r, [d for d, _ in detail], k, tol=1e-5)
