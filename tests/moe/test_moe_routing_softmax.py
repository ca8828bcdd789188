"""SoftmaxTopK against float64 references, and the routers' argument validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hal import InvalidInput
from moe.routing import GroupedSigmoidTopK, SoftmaxTopK
from tests.support.routing_reference import (
    as_dicts,
    assert_matches,
    assert_matches_where_decided,
    distinct_logits,
    randn_logits,
    ref_grouped,
    ref_softmax_topk,
    ref_softmax_topk_detail,
)

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


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("scale", [2.5, 0.5, 16])
def test_softmax_topk_routed_scaling_factor_multiplies_after_renormalization(scale, renormalize):
    x = randn_logits(20, 16, seed=11)
    base = SoftmaxTopK(16, 4, renormalize=renormalize)(x)
    scaled = SoftmaxTopK(16, 4, renormalize=renormalize, routed_scaling_factor=scale)(x)
    assert torch.equal(base.topk_ids, scaled.topk_ids)
    assert torch.allclose(scaled.topk_weights, base.topk_weights * scale, rtol=1e-6, atol=0)
    if renormalize:  # scaled after renormalizing: the weights sum to the factor, not to one
        assert torch.allclose(scaled.topk_weights.sum(-1), torch.full((20,), float(scale)), rtol=1e-5)
    assert_matches(scaled, ref_softmax_topk(x, 4, renormalize, scale), 4, tol=1e-5)


def test_softmax_topk_default_scaling_factor_is_one_and_exact():
    x = randn_logits(8, 16, seed=12)
    assert SoftmaxTopK(16, 2).routed_scaling_factor == 1.0
    assert torch.equal(SoftmaxTopK(16, 2)(x).topk_weights, SoftmaxTopK(16, 2, routed_scaling_factor=1)(x).topk_weights)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 8])
def test_softmax_topk_realistic_shape_256_experts_2000_tokens(k, renormalize):
    x = randn_logits(2000, 256, seed=100 + k)
    detail = ref_softmax_topk_detail(x, k, renormalize, 2.5)
    r = SoftmaxTopK(256, k, renormalize=renormalize, routed_scaling_factor=2.5)(x)
    assert_matches_where_decided(r, [d for d, _ in detail], [m for _, m in detail], k, tol=1e-5)


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


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make", [lambda **kw: SoftmaxTopK(8, **kw), lambda **kw: GroupedSigmoidTopK(8, **kw)], ids=["softmax", "grouped"]
)
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


@pytest.mark.parametrize(
    "bias",
    [torch.zeros(7), torch.zeros(9), torch.zeros(1, 8), torch.zeros(8, 1), torch.tensor(0.0), [0.0] * 8],
    ids=["7", "9", "1x8", "8x1", "scalar", "list"],
)
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
    pytest.param(
        lambda: GroupedSigmoidTopK(8, 2, num_groups=4, topk_groups=2, correction_bias=torch.zeros(8)), id="grouped"
    ),
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
