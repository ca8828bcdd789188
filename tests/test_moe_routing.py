"""Routers: SoftmaxTopK and GroupedSigmoidTopK against an independent float64 reference, and validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hal import InvalidInput
from moe.routing import GroupedSigmoidTopK, Routing, SoftmaxTopK

# -- independent float64 references (plain Python per token; never call the code under test) -------


def _rows(logits: torch.Tensor) -> list[list[float]]:
    """The logits as float64 Python lists, exactly as the router sees them (after dtype rounding)."""
    return logits.to(torch.float64).tolist()


def _top(values: list[float], k: int, eligible: list[int] | None = None) -> list[int]:
    """Indices of the k largest values (among `eligible`), largest first."""
    pool = range(len(values)) if eligible is None else eligible
    return sorted(pool, key=lambda i: values[i], reverse=True)[:k]


def ref_softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> list[dict[int, float]]:
    """Per token: {expert id: weight}."""
    out = []
    for row in _rows(logits):
        m = max(row)
        exps = [math.exp(x - m) for x in row]
        total = sum(exps)
        probs = [e / total for e in exps]
        ids = _top(probs, k)
        weights = [probs[i] for i in ids]
        if renormalize:
            s = sum(weights)
            weights = [w / s for w in weights]
        out.append(dict(zip(ids, weights)))
    return out


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def ref_grouped_detail(logits, k, num_groups, topk_groups, bias=None, renormalize=True, scale=1.0):
    """Per token: ({expert id: weight}, set of kept group indices)."""
    out = []
    bias_list = [0.0] * logits.shape[1] if bias is None else bias.to(torch.float64).tolist()
    for row in _rows(logits):
        n = len(row)
        per_group = n // num_groups
        scores = [_sigmoid(x) for x in row]
        choice = [s + b for s, b in zip(scores, bias_list)]
        if num_groups > 1:
            group_scores = []
            for g in range(num_groups):
                members = sorted((choice[i] for i in range(g * per_group, (g + 1) * per_group)), reverse=True)
                group_scores.append(members[0] + members[1])
            kept = set(_top(group_scores, topk_groups))
        else:
            kept = {0}
        eligible = [i for i in range(n) if i // per_group in kept]
        ids = _top(choice, k, eligible)
        weights = [scores[i] for i in ids]
        if renormalize:
            s = sum(weights)
            weights = [w / s for w in weights]
        out.append(({i: w * scale for i, w in zip(ids, weights)}, kept))
    return out


def ref_grouped(logits, k, num_groups, topk_groups, bias=None, renormalize=True, scale=1.0):
    return [d for d, _ in ref_grouped_detail(logits, k, num_groups, topk_groups, bias, renormalize, scale)]


def as_dicts(r: Routing) -> list[dict[int, float]]:
    """The routing as per-token {expert id: weight}; asserts ids are unique per token."""
    out = []
    for ids, ws in zip(r.topk_ids.tolist(), r.topk_weights.tolist()):
        assert len(set(ids)) == len(ids), f"duplicate expert in {ids}"
        out.append(dict(zip(ids, ws)))
    return out


def assert_matches(r: Routing, expected: list[dict[int, float]], k: int, *, tol: float = 2e-6) -> None:
    """Shape/dtype contract, then per-token equal id sets and weights matched per id."""
    assert r.topk_ids.dtype == torch.int64
    assert r.topk_weights.dtype == torch.float32
    assert tuple(r.topk_ids.shape) == tuple(r.topk_weights.shape) == (len(expected), k)
    assert (r.num_tokens, r.top_k) == (len(expected), k)
    got = as_dicts(r)
    for t, (g, e) in enumerate(zip(got, expected)):
        assert set(g) == set(e), f"token {t}: ids {sorted(g)} != reference {sorted(e)}"
        for i in e:
            assert g[i] == pytest.approx(e[i], rel=tol, abs=tol), f"token {t}, expert {i}"


def distinct_logits(tokens: int, experts: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Random logits whose values in every row are well separated (>= 0.25 apart), so no ties in
    any dtype: a shuffled ladder of multiples of 0.25 (exact in bf16/fp16) around zero."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(experts, generator=g).to(torch.float32) * 0.25 - experts * 0.125 for _ in range(tokens)]
    x = torch.stack(rows) if rows else torch.empty(0, experts)
    return x.to(dtype)


def randn_logits(tokens: int, experts: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=g) * scale


def logit(p: float) -> float:
    """The logit whose sigmoid is p."""
    return math.log(p / (1.0 - p))


# -- SoftmaxTopK ---------------------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("tokens", "experts", "k"), [(1, 4, 1), (7, 8, 2), (33, 16, 4), (5, 64, 8)])
def test_softmax_topk_matches_reference(tokens, experts, k, renormalize):
    x = randn_logits(tokens, experts, seed=tokens * 1000 + experts + k)
    r = SoftmaxTopK(experts, k, renormalize=renormalize)(x)
    assert_matches(r, ref_softmax_topk(x, k, renormalize), k)


def test_softmax_topk_renormalized_weights_sum_to_one():
    x = randn_logits(50, 16, seed=1)
    r = SoftmaxTopK(16, 3)(x)
    assert torch.allclose(r.topk_weights.sum(-1), torch.ones(50), atol=1e-6)
    assert (r.topk_weights > 0).all()


def test_softmax_topk_without_renormalize_weights_are_softmax_probabilities():
    x = randn_logits(20, 12, seed=2)
    r = SoftmaxTopK(12, 3, renormalize=False)(x)
    probs = torch.softmax(x.double(), dim=-1)
    assert torch.allclose(r.topk_weights.double(), probs.gather(1, r.topk_ids), atol=1e-6)
    # a strict subset of a distribution: sums below one
    assert (r.topk_weights.sum(-1) < 1 - 1e-4).all()
    # and they are the k largest probabilities: nothing left out beats the smallest kept one
    left_out = probs.scatter(1, r.topk_ids, -1.0)
    assert (left_out.max(-1).values < r.topk_weights.double().min(-1).values).all()


def test_softmax_topk_default_is_renormalize():
    x = randn_logits(4, 8, seed=3)
    assert SoftmaxTopK(8, 2).renormalize is True
    assert torch.allclose(SoftmaxTopK(8, 2)(x).topk_weights.sum(-1), torch.ones(4), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_accepts_float_dtypes_and_returns_fp32_int64(dtype, renormalize):
    x = distinct_logits(9, 16, seed=4, dtype=dtype)
    r = SoftmaxTopK(16, 4, renormalize=renormalize)(x)
    assert r.topk_ids.dtype == torch.int64 and r.topk_weights.dtype == torch.float32
    assert_matches(r, ref_softmax_topk(x, 4, renormalize), 4)


def test_softmax_topk_half_precision_logits_reference_uses_rounded_values():
    # the weights follow the bf16-rounded logits, computed in (at least) fp32: not bf16-coarse
    x = randn_logits(6, 8, seed=5).to(torch.bfloat16)
    r = SoftmaxTopK(8, 2, renormalize=False)(x)
    assert_matches(r, ref_softmax_topk(x, 2, False), 2, tol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_zero_tokens_gives_empty_outputs(renormalize):
    r = SoftmaxTopK(8, 3, renormalize=renormalize)(torch.empty(0, 8, dtype=torch.bfloat16))
    assert tuple(r.topk_ids.shape) == (0, 3) and tuple(r.topk_weights.shape) == (0, 3)
    assert r.topk_ids.dtype == torch.int64 and r.topk_weights.dtype == torch.float32
    assert (r.num_tokens, r.top_k) == (0, 3)


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_with_k_equal_to_num_experts_keeps_every_expert(renormalize):
    x = randn_logits(5, 6, seed=6)
    r = SoftmaxTopK(6, 6, renormalize=renormalize)(x)
    assert_matches(r, ref_softmax_topk(x, 6, renormalize), 6)
    assert all(sorted(row) == list(range(6)) for row in r.topk_ids.tolist())
    # all experts kept: the full softmax, which already sums to one either way
    assert torch.allclose(r.topk_weights.sum(-1), torch.ones(5), atol=1e-6)


def test_softmax_topk_single_expert():
    x = randn_logits(3, 1, seed=7)
    r = SoftmaxTopK(1, 1, renormalize=False)(x)
    assert r.topk_ids.tolist() == [[0]] * 3
    assert torch.allclose(r.topk_weights, torch.ones(3, 1))


def test_softmax_topk_large_logits_do_not_overflow():
    x = torch.tensor([[1000.0, 999.0, -1000.0, 0.0], [-500.0, -501.0, -499.0, -502.0]])
    r = SoftmaxTopK(4, 2, renormalize=False)(x)
    assert torch.isfinite(r.topk_weights).all()
    assert_matches(r, ref_softmax_topk(x, 2, False), 2)


def test_softmax_topk_non_contiguous_logits():
    x = randn_logits(8, 6, seed=8).t()  # [6 tokens, 8 experts], transposed storage
    assert not x.is_contiguous()
    assert_matches(SoftmaxTopK(8, 3)(x), ref_softmax_topk(x, 3, True), 3)


def test_softmax_topk_does_not_modify_logits():
    x = randn_logits(4, 8, seed=9)
    before = x.clone()
    SoftmaxTopK(8, 2)(x)
    assert torch.equal(x, before)


def test_softmax_topk_tokens_are_routed_independently():
    x = randn_logits(10, 8, seed=10)
    router = SoftmaxTopK(8, 3)
    whole = as_dicts(router(x))
    for t in range(10):
        single = as_dicts(router(x[t : t + 1]))[0]
        assert set(single) == set(whole[t])
        for i in single:
            assert single[i] == pytest.approx(whole[t][i], abs=1e-6)


def test_softmax_topk_hand_example():
    # softmax of [ln 1, ln 2, ln 3, ln 4] is [0.1, 0.2, 0.3, 0.4]
    x = torch.tensor([[0.0, math.log(2), math.log(3), math.log(4)]])
    raw = as_dicts(SoftmaxTopK(4, 2, renormalize=False)(x))[0]
    assert set(raw) == {3, 2}
    assert raw[3] == pytest.approx(0.4, abs=1e-6) and raw[2] == pytest.approx(0.3, abs=1e-6)
    norm = as_dicts(SoftmaxTopK(4, 2)(x))[0]
    assert norm[3] == pytest.approx(4 / 7, abs=1e-6) and norm[2] == pytest.approx(3 / 7, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 6),
    experts=st.integers(1, 24),
    k_frac=st.floats(0.0, 1.0),
    renormalize=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_softmax_topk_property_agrees_with_reference(tokens, experts, k_frac, renormalize, dtype, seed):
    k = max(1, min(experts, 1 + int(k_frac * experts)))
    x = distinct_logits(tokens, experts, seed, dtype=dtype)
    r = SoftmaxTopK(experts, k, renormalize=renormalize)(x)
    assert_matches(r, ref_softmax_topk(x, k, renormalize), k)
    if renormalize and tokens:
        assert torch.allclose(r.topk_weights.sum(-1), torch.ones(tokens), atol=1e-5)


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
    router = GroupedSigmoidTopK(experts, k, num_groups=groups, topk_groups=keep, correction_bias=bias,
                                renormalize=renormalize, routed_scaling_factor=2.5)
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
    plain = [set(_top([_sigmoid(v) + (0 if bias is None else bias[i].item()) for i, v in enumerate(row)], k))
             for row in _rows(x)]
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
    still = as_dicts(GroupedSigmoidTopK(4, 2, num_groups=2, topk_groups=1, correction_bias=bias,
                                        renormalize=False)(x))[0]
    assert set(still) == {0, 1}
    bias = torch.tensor([0.0, 0.0, 1.0, 1.0])  # group 1: 1.3+1.2 = 2.5 > 1.7: group 1 wins
    moved = as_dicts(GroupedSigmoidTopK(4, 2, num_groups=2, topk_groups=1, correction_bias=bias,
                                        renormalize=False)(x))[0]
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
    r = GroupedSigmoidTopK(16, 5, num_groups=1, topk_groups=1, correction_bias=bias if use_bias else None,
                           renormalize=False)(x)
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
    scaled = GroupedSigmoidTopK(16, 4, num_groups=4, topk_groups=2, renormalize=renormalize,
                                routed_scaling_factor=scale)(x)
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
def test_grouped_property_agrees_with_reference(tokens, per_group, groups, keep_frac, k_frac, use_bias,
                                                renormalize, seed):
    experts = per_group * groups
    keep = max(1, min(groups, 1 + int(keep_frac * groups)))
    k = max(1, min(keep * per_group, 1 + int(k_frac * keep * per_group)))
    # well-separated logits and a bias on a coarse grid so no near-ties in experts or groups
    x = distinct_logits(tokens, experts, seed) * 4
    bias = (distinct_logits(1, experts, seed + 1)[0] * 0.01) if use_bias else None
    # fp32 sigmoids saturate: two experts (or groups) can score exactly alike, and either choice is right
    selection = torch.sigmoid(x.float()) + (0 if bias is None else bias.float())
    group_scores = selection.view(tokens, groups, per_group).topk(min(2, per_group), dim=-1).values.sum(-1)
    assume(all(len(set(row)) == len(row) for row in selection.tolist() + group_scores.tolist()))
    r = GroupedSigmoidTopK(experts, k, num_groups=groups, topk_groups=keep, correction_bias=bias,
                           renormalize=renormalize)(x)
    detail = ref_grouped_detail(x, k, groups, keep, bias, renormalize)
    assert tuple(r.topk_ids.shape) == (tokens, k)
    for t, ids in enumerate(r.topk_ids.tolist()):
        assert {i // per_group for i in ids} <= detail[t][1]
    assert_matches(r, [d for d, _ in detail], k, tol=1e-5)


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda **kw: SoftmaxTopK(8, **kw),
    lambda **kw: GroupedSigmoidTopK(8, **kw),
], ids=["softmax", "grouped"])
@pytest.mark.parametrize("top_k", [9, 0, -1])
def test_bad_top_k_rejected(make, top_k):
    with pytest.raises(InvalidInput, match="top_k"):
        make(top_k=top_k)


@pytest.mark.parametrize("cls", [SoftmaxTopK, GroupedSigmoidTopK])
@pytest.mark.parametrize("num_experts", [0, -4])
def test_bad_num_experts_rejected(cls, num_experts):
    with pytest.raises(InvalidInput, match="num_experts"):
        cls(num_experts, 1)


@pytest.mark.parametrize("top_k", [2.0, True, "2", None])
def test_non_int_top_k_rejected(top_k):
    with pytest.raises(InvalidInput, match="top_k"):
        SoftmaxTopK(8, top_k)


def test_num_groups_not_dividing_experts_rejected():
    with pytest.raises(InvalidInput, match="num_groups"):
        GroupedSigmoidTopK(10, 2, num_groups=4, topk_groups=2)


@pytest.mark.parametrize("num_groups", [0, -2])
def test_non_positive_num_groups_rejected(num_groups):
    with pytest.raises(InvalidInput, match="num_groups"):
        GroupedSigmoidTopK(8, 2, num_groups=num_groups)


def test_topk_groups_above_num_groups_rejected():
    with pytest.raises(InvalidInput, match="topk_groups"):
        GroupedSigmoidTopK(8, 2, num_groups=4, topk_groups=5)


def test_topk_groups_zero_rejected():
    with pytest.raises(InvalidInput, match="topk_groups"):
        GroupedSigmoidTopK(8, 2, num_groups=4, topk_groups=0)


def test_groups_of_one_expert_rejected():
    with pytest.raises(InvalidInput, match="num_groups"):
        GroupedSigmoidTopK(8, 2, num_groups=8, topk_groups=4)


def test_top_k_above_experts_in_kept_groups_rejected():
    # 4 groups of 2, keep 2 -> only 4 experts eligible
    with pytest.raises(InvalidInput, match="top_k"):
        GroupedSigmoidTopK(8, 5, num_groups=4, topk_groups=2)
    GroupedSigmoidTopK(8, 4, num_groups=4, topk_groups=2)  # the boundary itself is fine


@pytest.mark.parametrize("bias", [torch.zeros(7), torch.zeros(9), torch.zeros(1, 8), torch.zeros(8, 1),
                                  torch.tensor(0.0), [0.0] * 8], ids=["7", "9", "1x8", "8x1", "scalar", "list"])
def test_correction_bias_wrong_shape_or_type_rejected(bias):
    with pytest.raises(InvalidInput, match="correction_bias"):
        GroupedSigmoidTopK(8, 2, num_groups=4, topk_groups=2, correction_bias=bias)


def test_correction_bias_integer_rejected():
    with pytest.raises(InvalidInput, match="correction_bias"):
        GroupedSigmoidTopK(8, 2, correction_bias=torch.zeros(8, dtype=torch.int64))


@pytest.mark.parametrize("factor", [0, -1.0, float("nan"), "2"])
def test_bad_routed_scaling_factor_rejected(factor):
    with pytest.raises(InvalidInput, match="routed_scaling_factor"):
        GroupedSigmoidTopK(8, 2, routed_scaling_factor=factor)


ROUTERS = [
    pytest.param(lambda: SoftmaxTopK(8, 2), id="softmax"),
    pytest.param(lambda: GroupedSigmoidTopK(8, 2, num_groups=4, topk_groups=2,
                                            correction_bias=torch.zeros(8)), id="grouped"),
]

BAD_LOGITS = [
    pytest.param(torch.zeros(3, 7), id="too-few-experts"),
    pytest.param(torch.zeros(3, 9), id="too-many-experts"),
    pytest.param(torch.zeros(8), id="1-D"),
    pytest.param(torch.zeros(2, 3, 8), id="3-D"),
    pytest.param(torch.tensor(1.0), id="0-D"),
    pytest.param(torch.zeros(3, 8, dtype=torch.int64), id="int64"),
    pytest.param(torch.zeros(3, 8, dtype=torch.int32), id="int32"),
    pytest.param(torch.zeros(3, 8, dtype=torch.bool), id="bool"),
    pytest.param(torch.zeros(3, 8, dtype=torch.complex64), id="complex"),
    pytest.param([[0.0] * 8] * 3, id="list"),
    pytest.param(None, id="None"),
]


@pytest.mark.parametrize("make", ROUTERS)
@pytest.mark.parametrize("logits", BAD_LOGITS)
def test_bad_logits_rejected_naming_the_argument(make, logits):
    router = make()
    with pytest.raises(InvalidInput, match="router_logits"):
        router(logits)


@pytest.mark.parametrize("make", ROUTERS)
def test_wrong_expert_count_message_states_expected_shape(make):
    with pytest.raises(InvalidInput, match=r"router_logits.*8.*\(3, 7\)"):
        make()(torch.zeros(3, 7))


@pytest.mark.parametrize("make", ROUTERS)
def test_integer_logits_message_names_dtype(make):
    with pytest.raises(InvalidInput, match=r"router_logits.*floating.*int64"):
        make()(torch.zeros(3, 8, dtype=torch.int64))


@pytest.mark.parametrize("make", ROUTERS)
def test_non_tensor_message_names_type(make):
    with pytest.raises(InvalidInput, match=r"router_logits.*Tensor.*list"):
        make()([[0.0] * 8])


def test_invalid_input_is_a_value_error():
    with pytest.raises(ValueError):
        SoftmaxTopK(4, 5)


@pytest.mark.parametrize("make", ROUTERS)
def test_router_still_works_after_a_bad_call(make):
    router = make()
    x = randn_logits(6, 8, seed=27)
    first = router(x)
    for bad in (torch.zeros(3, 7), torch.zeros(3, 8, dtype=torch.int64), "logits"):
        with pytest.raises(InvalidInput):
            router(bad)
    again = router(x)
    assert torch.equal(first.topk_ids, again.topk_ids)
    assert torch.equal(first.topk_weights, again.topk_weights)
    if isinstance(router, SoftmaxTopK):
        assert_matches(again, ref_softmax_topk(x, 2, True), 2)
    else:
        assert_matches(again, ref_grouped(x, 2, 4, 2, torch.zeros(8)), 2, tol=1e-5)


def test_reprs_name_settings():
    assert "top_k=2" in repr(SoftmaxTopK(8, 2)) and "renormalize=False" in repr(SoftmaxTopK(8, 2, renormalize=False))
    text = repr(GroupedSigmoidTopK(8, 2, num_groups=4, topk_groups=2, routed_scaling_factor=2.5))
    assert "num_groups=4" in text and "topk_groups=2" in text and "2.5" in text
