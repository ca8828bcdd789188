"""What every router shares: argument validation, the empty batch, logits dtypes, non-finite rows
kept to themselves, reprs and the `Routing` contract (weights_on_input)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hal import InvalidInput
from moe.routing import GroupedSigmoidTopK, GroupedTopK, Router, Routing, SigmoidTopK, SoftmaxTopK
from tests.support.routing_reference import (
    assert_matches,
    distinct_logits,
    randn_logits,
    ref_grouped_topk_detail,
    ref_sigmoid_topk,
    ref_softmax_topk,
)

E = 16
BIAS = torch.linspace(-0.3, 0.3, E)


def _grouped_ref(k, groups, keep, **kw):
    return lambda x: [d for d, _, _ in ref_grouped_topk_detail(x, k, groups, keep, **kw)]


#: (id, router factory, float64 reference of logits, top_k)
CASES = [
    ("softmax", lambda: SoftmaxTopK(E, 4), lambda x: ref_softmax_topk(x, 4, True), 4),
    (
        "softmax-scaled",
        lambda: SoftmaxTopK(E, 3, renormalize=False, routed_scaling_factor=2.5),
        lambda x: ref_softmax_topk(x, 3, False, 2.5),
        3,
    ),
    ("llama4", lambda: SigmoidTopK(E, 1, weights_on_input=True), lambda x: ref_sigmoid_topk(x, 1), 1),
    (
        "sigmoid-bias",
        lambda: SigmoidTopK(E, 4, correction_bias=BIAS, renormalize=True, routed_scaling_factor=1.5),
        lambda x: ref_sigmoid_topk(x, 4, BIAS, True, 1.5),
        4,
    ),
    (
        "deepseek-v2",
        lambda: GroupedTopK(E, 4, num_groups=4, topk_groups=2, renormalize=False, routed_scaling_factor=16.0),
        _grouped_ref(4, 4, 2, renormalize=False, scale=16.0),
        4,
    ),
    (
        "grouped-sigmoid-max",
        lambda: GroupedTopK(E, 3, num_groups=8, topk_groups=3, scoring="sigmoid", correction_bias=BIAS),
        _grouped_ref(3, 8, 3, scoring="sigmoid", bias=BIAS),
        3,
    ),
    (
        "deepseek-v3",
        lambda: GroupedSigmoidTopK(E, 4, num_groups=4, topk_groups=2, correction_bias=BIAS, routed_scaling_factor=2.5),
        _grouped_ref(4, 4, 2, scoring="sigmoid", group_score="top2-sum", bias=BIAS, scale=2.5),
        4,
    ),
]
ROUTERS = [pytest.param(make, id=name) for name, make, _, _ in CASES]
WITH_REFERENCE = [pytest.param(make, ref, k, id=name) for name, make, ref, k in CASES]


# -- results -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize(("make", "ref", "k"), WITH_REFERENCE)
def test_every_router_accepts_float_dtypes_and_matches_reference(make, ref, k, dtype):
    x = distinct_logits(11, E, seed=3, dtype=dtype) * 0.5  # 0.125 apart: exact in every dtype, no ties
    r = make()(x)
    assert_matches(r, ref(x), k, tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("make", ROUTERS)
def test_every_router_routes_an_empty_batch(make, dtype):
    router = make()
    r = router(torch.empty(0, E, dtype=dtype))
    assert tuple(r.topk_ids.shape) == tuple(r.topk_weights.shape) == (0, router.top_k)
    assert r.topk_ids.dtype == torch.int64 and r.topk_weights.dtype == torch.float32
    assert r.weights_on_input is router.weights_on_input


@pytest.mark.parametrize("make", ROUTERS)
def test_routing_carries_the_routers_weights_on_input(make):
    router = make()
    r = router(randn_logits(3, E, seed=1))
    assert r.weights_on_input is router.weights_on_input
    assert router.weights_on_input is (isinstance(router, SigmoidTopK) and router.top_k == 1)


NON_FINITE_ROWS = {
    1: [float("nan")] + [0.5] * (E - 1),
    2: [float("inf")] + [0.0] * (E - 1),
    3: [float("-inf")] * E,
    5: [float("nan")] * E,
    6: [float("inf"), float("-inf")] * (E // 2),
    8: [float("-inf")] * (E - 2) + [1.0, 2.0],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("make", "ref", "k"), WITH_REFERENCE)
def test_non_finite_rows_never_change_other_rows(make, ref, k, dtype):
    router = make()
    x = randn_logits(10, E, seed=7).to(dtype)
    for row, values in NON_FINITE_ROWS.items():
        x[row] = torch.tensor(values, dtype=dtype)
    clean = [t for t in range(10) if t not in NON_FINITE_ROWS]
    mixed = router(x)
    alone = router(x[clean])
    assert torch.equal(mixed.topk_ids[clean], alone.topk_ids)
    assert torch.equal(mixed.topk_weights[clean], alone.topk_weights)
    assert_matches(alone, ref(x[clean]), k, tol=1e-5)
    # the bad rows still get valid, distinct expert ids (the layer may index with them before it checks)
    ids = mixed.topk_ids
    assert ((ids >= 0) & (ids < E)).all()
    assert all(len(set(row)) == k for row in ids.tolist())


@pytest.mark.parametrize("make", ROUTERS)
def test_every_router_leaves_logits_untouched_and_is_stateless(make):
    router = make()
    x = randn_logits(6, E, seed=9)
    before = x.clone()
    first = router(x)
    router(randn_logits(4, E, seed=10))
    again = router(x)
    assert torch.equal(x, before)
    assert torch.equal(first.topk_ids, again.topk_ids) and torch.equal(first.topk_weights, again.topk_weights)


@pytest.mark.parametrize("cls", [SigmoidTopK, GroupedTopK, GroupedSigmoidTopK])
def test_correction_bias_is_copied_not_aliased(cls):
    bias = torch.zeros(E)
    router = cls(E, 2, correction_bias=bias)
    x = randn_logits(5, E, seed=11)
    before = router(x)
    bias[0] = 100.0  # the caller reuses its buffer
    after = router(x)
    assert torch.equal(before.topk_ids, after.topk_ids)
    assert router.correction_bias.dtype == torch.float32


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", ROUTERS)
@pytest.mark.parametrize(
    "logits",
    [
        torch.zeros(3, E - 1),
        torch.zeros(E),
        torch.zeros(2, 3, E),
        torch.zeros(3, E, dtype=torch.int32),
        torch.zeros(3, E, dtype=torch.bool),
        torch.zeros(3, E, dtype=torch.complex64),
        [[0.0] * E],
        None,
    ],
    ids=["experts", "1-D", "3-D", "int32", "bool", "complex", "list", "None"],
)
def test_every_router_rejects_bad_logits(make, logits):
    with pytest.raises(InvalidInput, match="router_logits"):
        make()(logits)


ALL_CLASSES = [SoftmaxTopK, SigmoidTopK, GroupedTopK, GroupedSigmoidTopK]


@pytest.mark.parametrize("cls", ALL_CLASSES)
@pytest.mark.parametrize("value", ["no", "False", 1, 0, None, 1.0], ids=repr)
def test_renormalize_must_be_a_bool(cls, value):
    with pytest.raises(InvalidInput, match=r"renormalize: expected a bool"):
        cls(E, 2, renormalize=value)


@pytest.mark.parametrize("cls", ALL_CLASSES)
@pytest.mark.parametrize(
    "value",
    [0, 0.0, -1.0, float("inf"), float("-inf"), float("nan"), True, False, "2", None, torch.tensor(2.0), 1j],
    ids=repr,
)
def test_routed_scaling_factor_must_be_finite_and_positive(cls, value):
    with pytest.raises(InvalidInput, match="routed_scaling_factor: expected a finite positive number"):
        cls(E, 2, routed_scaling_factor=value)


@pytest.mark.parametrize("cls", ALL_CLASSES)
def test_routed_scaling_factor_int_accepted_as_float(cls):
    router = cls(E, 2, routed_scaling_factor=3)
    assert router.routed_scaling_factor == 3.0 and isinstance(router.routed_scaling_factor, float)


@pytest.mark.parametrize("cls", [SigmoidTopK, GroupedTopK, GroupedSigmoidTopK])
@pytest.mark.parametrize(
    "bias",
    [
        torch.zeros(E - 1),
        torch.zeros(1, E),
        torch.tensor(0.0),
        [0.0] * E,
        torch.zeros(E, dtype=torch.int64),
        torch.tensor([float("nan")] + [0.0] * (E - 1)),
        torch.tensor([0.0] * (E - 1) + [float("inf")]),
    ],
    ids=["short", "2-D", "0-D", "list", "int64", "nan", "inf"],
)
def test_bad_correction_bias_rejected(cls, bias):
    with pytest.raises(InvalidInput, match="correction_bias"):
        cls(E, 2, correction_bias=bias)


@pytest.mark.parametrize("value", ["sum", "Softmax", None, "tanh"])
def test_bad_scoring_rejected(value):
    with pytest.raises(InvalidInput, match=r"scoring: expected one of 'softmax', 'sigmoid'"):
        GroupedTopK(E, 2, scoring=value)


@pytest.mark.parametrize("value", ["top2", "sum", "mean", 2, None])
def test_bad_group_score_rejected(value):
    with pytest.raises(InvalidInput, match=r"group_score: expected one of 'max', 'top2-sum'"):
        GroupedTopK(E, 2, group_score=value)


def test_grouped_presets_take_no_scoring_arguments():
    with pytest.raises(TypeError):
        GroupedSigmoidTopK(E, 2, scoring="softmax")


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_weights_on_input_must_be_a_bool(value):
    with pytest.raises(InvalidInput, match="weights_on_input"):
        SigmoidTopK(E, 1, weights_on_input=value)


@pytest.mark.parametrize("k", [2, 4])
def test_weights_on_input_needs_top_1(k):
    with pytest.raises(InvalidInput, match=rf"top_k: expected 1 with weights_on_input=True.*got {k}"):
        SigmoidTopK(E, k, weights_on_input=True)


def test_routing_weights_on_input_contract():
    ids, weights = torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1)
    assert Routing(ids, weights).weights_on_input is False
    assert Routing(ids, weights, weights_on_input=True).weights_on_input is True
    with pytest.raises(InvalidInput, match=r"weights_on_input: expected top-1 routing.*\(4, 2\)"):
        Routing(torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2), weights_on_input=True)
    with pytest.raises(InvalidInput, match="weights_on_input: expected a bool"):
        Routing(ids, weights, weights_on_input=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Routing(ids, weights).weights_on_input = True  # type: ignore[misc]


# -- reprs ---------------------------------------------------------------------------------------


def test_reprs_name_class_and_every_setting():
    assert repr(SoftmaxTopK(8, 2, renormalize=False, routed_scaling_factor=2.5)) == (
        "SoftmaxTopK(num_experts=8, top_k=2, renormalize=False, routed_scaling_factor=2.5)"
    )
    assert repr(SigmoidTopK(8, 1, weights_on_input=True)) == (
        "SigmoidTopK(num_experts=8, top_k=1, correction_bias=None, renormalize=False, "
        "routed_scaling_factor=1.0, weights_on_input=True)"
    )
    assert repr(GroupedTopK(8, 2, num_groups=4, topk_groups=2, correction_bias=torch.zeros(8))) == (
        "GroupedTopK(num_experts=8, top_k=2, num_groups=4, topk_groups=2, scoring='softmax', group_score='max', "
        "correction_bias=Tensor[8], renormalize=True, routed_scaling_factor=1.0)"
    )
    assert repr(GroupedSigmoidTopK(8, 2, num_groups=4, topk_groups=2, routed_scaling_factor=2.5)) == (
        "GroupedSigmoidTopK(num_experts=8, top_k=2, num_groups=4, topk_groups=2, correction_bias=None, "
        "renormalize=True, routed_scaling_factor=2.5)"
    )


@pytest.mark.parametrize("make", ROUTERS)
def test_every_router_is_a_router_with_a_docstring(make):
    router = make()
    assert isinstance(router, Router)
    assert type(router).__doc__ and type(router).__name__ in repr(router)


# -- devices -------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", ROUTERS)
def test_every_router_routes_meta_logits_so_the_math_never_reads_data(make):
    # meta tensors hold no data: any host synchronisation (.item(), bool(tensor)) would raise
    router = make().to("meta")
    assert router.correction_bias is None or router.correction_bias.device.type == "meta"
    r = router(torch.empty(37, E, device="meta", dtype=torch.bfloat16))
    assert r.topk_ids.device.type == r.topk_weights.device.type == "meta"
    assert tuple(r.topk_ids.shape) == tuple(r.topk_weights.shape) == (37, router.top_k)
    assert r.topk_ids.dtype == torch.int64 and r.topk_weights.dtype == torch.float32


@pytest.mark.parametrize("make", ROUTERS)
def test_to_moves_the_bias_in_place_and_returns_the_router(make):
    router = make()
    x = randn_logits(9, E, seed=12)
    before = router(x)
    bias = router.correction_bias
    assert router.to(torch.device("cpu")) is router and router.to("cpu") is router
    assert router.correction_bias is bias  # already there: nothing copied
    after = router(x)
    assert torch.equal(before.topk_ids, after.topk_ids) and torch.equal(before.topk_weights, after.topk_weights)
