"""SigmoidTopK (Llama-4 top-1 with the weight on the input, MiniMax-M2 with a correction bias)
against float64 references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe.routing import SigmoidTopK
from tests.support.routing_reference import (
    _sigmoid,
    as_dicts,
    assert_matches,
    assert_matches_where_decided,
    distinct_logits,
    logit,
    randn_logits,
    ref_sigmoid_topk,
    ref_sigmoid_topk_detail,
)


@pytest.mark.parametrize("scale", [1.0, 2.5])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize(("tokens", "experts", "k"), [(1, 4, 1), (9, 16, 1), (17, 16, 2), (33, 64, 8), (5, 6, 6)])
def test_sigmoid_topk_matches_reference(tokens, experts, k, use_bias, renormalize, scale):
    seed = tokens * 100 + experts + k
    x = randn_logits(tokens, experts, seed=seed)
    bias = randn_logits(1, experts, seed=seed + 1, scale=0.2)[0] if use_bias else None
    router = SigmoidTopK(experts, k, correction_bias=bias, renormalize=renormalize, routed_scaling_factor=scale)
    assert_matches(router(x), ref_sigmoid_topk(x, k, bias, renormalize, scale), k, tol=1e-5)


def test_llama4_top1_weight_is_sigmoid_of_the_largest_logit_and_applies_on_input():
    x = randn_logits(40, 16, seed=1)
    r = SigmoidTopK(16, 1, weights_on_input=True)(x)
    assert r.weights_on_input is True and (r.num_tokens, r.top_k) == (40, 1)
    best = x.max(dim=-1)
    assert torch.equal(r.topk_ids[:, 0], best.indices)
    assert torch.allclose(r.topk_weights[:, 0], torch.sigmoid(best.values), rtol=1e-6, atol=0)
    # not renormalized: a single sigmoid weight, strictly between 0 and 1 for moderate logits
    assert ((r.topk_weights > 0) & (r.topk_weights < 1)).all()


def test_default_is_not_renormalized_and_not_on_input():
    router = SigmoidTopK(8, 2)
    assert (router.renormalize, router.routed_scaling_factor, router.weights_on_input) == (False, 1.0, False)
    assert router.correction_bias is None
    assert router(randn_logits(3, 8, seed=2)).weights_on_input is False


def test_hand_example_without_bias():
    p = [0.2, 0.9, 0.6, 0.75]
    x = torch.tensor([[logit(v) for v in p]])
    got = as_dicts(SigmoidTopK(4, 2)(x))[0]
    assert set(got) == {1, 3}
    assert got[1] == pytest.approx(0.9, abs=1e-6) and got[3] == pytest.approx(0.75, abs=1e-6)
    norm = as_dicts(SigmoidTopK(4, 2, renormalize=True, routed_scaling_factor=2.0)(x))[0]
    assert norm[1] == pytest.approx(2 * 0.9 / 1.65, abs=1e-6) and norm[3] == pytest.approx(2 * 0.75 / 1.65, abs=1e-6)


def test_choice_without_bias_follows_logits_where_fp32_sigmoids_saturate():
    # sigmoid(20), sigmoid(25) and sigmoid(30) are all exactly 1.0 in fp32: the logits still decide
    x = torch.tensor([[20.0, 30.0, 25.0, -1.0]])
    assert torch.sigmoid(x[0, :3]).eq(1.0).all()
    r = SigmoidTopK(4, 1)(x)
    assert r.topk_ids.tolist() == [[1]] and r.topk_weights.tolist() == [[1.0]]
    assert SigmoidTopK(4, 2)(x).topk_ids.tolist() == [[1, 2]]


def test_bias_steers_the_choice_but_not_the_weights():
    p = [0.9, 0.8, 0.1, 0.7]
    x = torch.tensor([[logit(v) for v in p]])
    assert set(as_dicts(SigmoidTopK(4, 2)(x))[0]) == {0, 1}
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])  # expert 2 chooses at 1.1
    got = as_dicts(SigmoidTopK(4, 2, correction_bias=bias)(x))[0]
    assert set(got) == {0, 2}
    assert got[2] == pytest.approx(0.1, abs=1e-6) and got[0] == pytest.approx(0.9, abs=1e-6)
    norm = as_dicts(SigmoidTopK(4, 2, correction_bias=bias, renormalize=True)(x))[0]
    assert norm[2] == pytest.approx(0.1, abs=1e-6) and norm[0] == pytest.approx(0.9, abs=1e-6)


def test_zero_bias_chooses_like_no_bias():
    x = distinct_logits(20, 32, seed=3) * 0.1  # away from saturation
    plain = SigmoidTopK(32, 4)(x)
    zero = SigmoidTopK(32, 4, correction_bias=torch.zeros(32))(x)
    assert [set(a) for a in plain.topk_ids.tolist()] == [set(a) for a in zero.topk_ids.tolist()]


@pytest.mark.parametrize("renormalize", [False, True])
def test_top1_renormalized_weight_is_the_scaling_factor(renormalize):
    x = randn_logits(10, 8, seed=4)
    r = SigmoidTopK(8, 1, renormalize=renormalize, routed_scaling_factor=2.5)(x)
    expected = torch.full((10, 1), 2.5) if renormalize else 2.5 * torch.sigmoid(x.max(-1, keepdim=True).values)
    assert torch.allclose(r.topk_weights, expected, rtol=1e-6, atol=0)


def test_underflowing_scores_renormalize_to_finite_zeros():
    # every sigmoid underflows to 0 in fp32: the renormalized weights stay finite (no 0/0)
    x = torch.full((2, 8), -200.0)
    x[0, 3] = -150.0
    r = SigmoidTopK(8, 2, renormalize=True)(x)
    assert torch.isfinite(r.topk_weights).all()
    assert 3 in r.topk_ids[0].tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_half_and_double_logits_are_routed_in_fp32(dtype):
    x = randn_logits(30, 16, seed=5).to(dtype)
    r = SigmoidTopK(16, 3, routed_scaling_factor=1.5)(x)
    expected = 1.5 * torch.sigmoid(x.float()).gather(1, r.topk_ids)
    assert torch.equal(r.topk_weights, expected)  # fp32 math on the rounded logits, not dtype-coarse
    assert_matches(r, ref_sigmoid_topk(x, 3, None, False, 1.5), 3, tol=1e-5)


@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_realistic_shape_128_experts_2000_tokens(k, use_bias):
    x = randn_logits(2000, 128, seed=6 + k)
    bias = randn_logits(1, 128, seed=7, scale=0.05)[0] if use_bias else None
    router = SigmoidTopK(128, k, correction_bias=bias, renormalize=use_bias, weights_on_input=(k == 1))
    detail = ref_sigmoid_topk_detail(x, k, bias, use_bias)
    assert_matches_where_decided(router(x), [d for d, _ in detail], [m for _, m in detail], k, tol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 6),
    experts=st.integers(1, 24),
    k_frac=st.floats(0.0, 1.0),
    use_bias=st.booleans(),
    renormalize=st.booleans(),
    scale=st.sampled_from([1.0, 0.5, 2.5]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_sigmoid_topk_property_agrees_with_reference(
    tokens, experts, k_frac, use_bias, renormalize, scale, dtype, seed
):
    k = max(1, min(experts, 1 + int(k_frac * experts)))
    x = distinct_logits(tokens, experts, seed, dtype=dtype) * 0.5  # |logit| <= 3: sigmoids far from saturation
    # a bias on a grid coarser than the score differences it could tie with
    bias = distinct_logits(1, experts, seed + 1)[0] * 0.25 if use_bias else None
    if bias is not None and tokens:
        choice = torch.sigmoid(x.float()) + bias
        gaps = choice.sort(dim=-1).values.diff(dim=-1)
        if experts > 1 and gaps.min() < 1e-4:
            bias = None  # a near-tie: the choice would be ambiguous
    r = SigmoidTopK(experts, k, correction_bias=bias, renormalize=renormalize, routed_scaling_factor=scale)(x)
    assert_matches(r, ref_sigmoid_topk(x, k, bias, renormalize, scale), k, tol=1e-5)
    if tokens and not renormalize:
        assert all(0 < w <= scale * _sigmoid(3.0) + 1e-6 for row in r.topk_weights.tolist() for w in row)
