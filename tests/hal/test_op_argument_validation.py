"""The op methods of `hal.Vendor` refuse bad arguments with `InvalidInput` naming the argument, for
every vendor (here the CPU and the emulated Ascend vendor, which does not run in step with the
host): expert ids, row indices and a GEMM's `row_index` of the wrong dtype or out of range, int32 and int64 giving
the same results, output dtypes that are strings or integers, counts that are bools."""

from __future__ import annotations

import pytest
import torch

import hal
from hal import InvalidInput, ScaleLayout, checks
from hal.reference import sort_by_expert as reference_sort
from hal.reference import weighted_combine as reference_combine
from tests.support.refusals import refused

VENDORS = ["cpu", "ascend-emulated"]
E, T, K, H = 8, 6, 2, 16


@pytest.fixture(params=VENDORS)
def vendor(request) -> hal.Vendor:
    return hal.get_vendor(request.param)


def _ids(dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor([[0, 7], [3, 3], [5, 1], [2, 6], [7, 0], [4, 4]], dtype=dtype)


def _combine_operands(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(T * K, H, generator=gen).to(torch.bfloat16)
    index = torch.randperm(T * K, generator=gen)
    weights = torch.rand(T, K, generator=gen)
    return rows, index, weights


# -- sort_by_expert --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, shown", [(-1, "[-1, 7]"), (E, "[0, 8]"), (1000, "[0, 1000]")], ids=["negative", "num-experts", "far-out"]
)
def test_out_of_range_expert_ids_are_refused(vendor, bad, shown):
    ids = _ids()
    ids[2, 1] = bad
    message = refused(lambda: vendor.sort_by_expert(ids, E), "topk_ids")
    assert f"expert ids in [0, {E})" in message and shown in message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.uint8, torch.int16])
def test_expert_ids_must_be_int32_or_int64(vendor, dtype):
    message = refused(lambda: vendor.sort_by_expert(_ids().to(dtype), E), "topk_ids")
    assert "int32 or int64" in message


@pytest.mark.parametrize("bad", [True, False, 0, -3, 8.0, "8", torch.tensor(8), None])
def test_num_experts_must_be_a_positive_int(vendor, bad):
    refused(lambda: vendor.sort_by_expert(_ids(), bad), "num_experts")


@pytest.mark.parametrize(
    "bad",
    [[[0, 1]], torch.zeros(2, 2, 2, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)],
    ids=["list", "3d", "1d"],
)
def test_expert_ids_must_be_a_2d_tensor(vendor, bad):
    refused(lambda: vendor.sort_by_expert(bad, E), "topk_ids")


@pytest.mark.parametrize("bad", [1, 0, "yes", None, torch.tensor(True)])
def test_the_tokens_flag_must_be_a_bool(vendor, bad):
    refused(lambda: vendor.sort_by_expert(_ids(), E, tokens=bad), "tokens")


def test_the_tokens_of_the_sorted_rows_are_the_pairs_over_k(vendor):
    order, inverse, counts, token = vendor.sort_by_expert(_ids(torch.int32), E, tokens=True)
    plain = vendor.sort_by_expert(_ids(), E)
    assert all(torch.equal(a, b) for a, b in zip((order, inverse, counts), plain))
    assert token.dtype == torch.int64 and torch.equal(token, order // K)


def test_int32_and_int64_ids_sort_identically(vendor):
    wide = vendor.sort_by_expert(_ids(torch.int64), E)
    narrow = vendor.sort_by_expert(_ids(torch.int32), E)
    for a, b in zip(wide, narrow):
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)
    order, _, counts = wide
    assert counts.tolist() == torch.bincount(_ids().reshape(-1), minlength=E).tolist()
    assert order.tolist() == sorted(range(T * K), key=lambda p: (int(_ids().reshape(-1)[p]), p))


def test_a_bad_call_leaves_the_vendor_working(vendor):
    good = vendor.sort_by_expert(_ids(), E)
    with pytest.raises(InvalidInput):
        vendor.sort_by_expert(_ids() - 1, E)
    assert all(torch.equal(a, b) for a, b in zip(vendor.sort_by_expert(_ids(), E), good))


# -- weighted_combine ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["float32", "bf16", torch.int8, torch.int32, torch.float64, None, 5])
def test_out_dtype_must_be_a_float_torch_dtype(vendor, bad):
    rows, index, weights = _combine_operands()
    message = refused(lambda: vendor.weighted_combine(rows, index, weights, bad), "out_dtype")
    assert "torch.bfloat16, torch.float16 or torch.float32" in message


@pytest.mark.parametrize("case", ["negative", "past-the-rows", "float", "2d", "too-short", "list"])
def test_bad_row_indices_are_refused(vendor, case):
    rows, index, weights = _combine_operands()
    bad = {
        "negative": lambda: torch.where(index == 3, -1, index),
        "past-the-rows": lambda: torch.where(index == 3, T * K, index),
        "float": lambda: index.to(torch.float32),
        "2d": lambda: index.view(T, K),
        "too-short": lambda: index[:-1],
        "list": lambda: index.tolist(),
    }[case]()
    refused(lambda: vendor.weighted_combine(rows, bad, weights, torch.float32), "index")


@pytest.mark.parametrize(
    "argument, dtype",
    [
        ("rows", torch.int8),
        ("rows", torch.float64),
        ("rows", torch.int64),
        ("topk_weights", torch.int64),
        ("topk_weights", torch.bool),
    ],
)
def test_rows_and_weights_must_be_floating_point(vendor, argument, dtype):
    rows, index, weights = _combine_operands()
    operands = {"rows": rows, "topk_weights": weights}
    operands[argument] = operands[argument].to(dtype)
    refused(lambda: vendor.weighted_combine(operands["rows"], index, operands["topk_weights"], torch.float32), argument)


def test_int32_and_int64_indices_combine_identically(vendor):
    rows, index, weights = _combine_operands(1)
    wide = vendor.weighted_combine(rows, index, weights, torch.float32)
    narrow = vendor.weighted_combine(rows, index.to(torch.int32), weights, torch.float32)
    assert torch.equal(wide, narrow)
    terms = rows.double()[index].view(T, K, H) * weights.double().unsqueeze(-1)
    assert torch.allclose(wide.double(), terms.sum(1), rtol=2.0**-20, atol=1e-6)


def test_an_integer_out_dtype_never_wraps_around(vendor):
    rows = torch.full((T * K, H), 100.0, dtype=torch.bfloat16)  # each sum is 200: an int8 would wrap to -56
    with pytest.raises(InvalidInput, match="out_dtype"):
        vendor.weighted_combine(rows, None, torch.ones(T, K), torch.int8)


# -- grouped_matmul(row_index=) ---------------------------------------------------------------------


def _gemm_operands() -> tuple[torch.Tensor, hal.QuantizedWeight, hal.Groups, torch.Tensor]:
    """Six tokens, their twelve (token, slot) rows sorted by expert, and bf16 weights of eight experts."""
    ids = _ids()
    order, _, counts = reference_sort(ids, E)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    w = hal.QuantizedWeight(torch.randn(E, H, 2 * H, generator=gen).to(torch.bfloat16), ScaleLayout.NONE)
    return x, w, hal.Groups.from_counts(counts), torch.div(order, K, rounding_mode="floor")


@pytest.mark.parametrize("case", ["float", "two-dim", "negative", "past-the-tokens", "a-list"])
def test_bad_gemm_row_indices_are_refused(vendor, case):
    x, w, groups, index = _gemm_operands()
    bad = {
        "float": index.float(),
        "two-dim": index[None],
        "negative": index - 1,
        "past-the-tokens": index + T,
        "a-list": index.tolist(),
    }[case]
    message = refused(lambda: vendor.grouped_matmul(x, w, groups, row_index=bad), "row_index")
    if case in ("negative", "past-the-tokens"):
        assert f"rows of x in [0, {T})" in message


@pytest.mark.parametrize("activation", [None, "silu-glu"])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_read_through_an_index_equal_the_gathered_rows(vendor, activation, bias):
    """int32 and int64 indices, with the activation and an expert bias (which the call adds before it)."""
    x, w, groups, index = _gemm_operands()
    extra = {} if activation is None else {"activation": activation}
    if bias:
        extra["bias"] = torch.randn(E, 2 * H, generator=torch.Generator().manual_seed(4))
    want = vendor.grouped_matmul(x[index], w, groups, **extra)
    for dtype in (torch.int64, torch.int32):
        assert torch.equal(vendor.grouped_matmul(x, w, groups, row_index=index.to(dtype), **extra), want)


# -- where value checks are made ---------------------------------------------------------------------


def test_values_are_read_only_where_that_is_free():
    host, device = torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64, device="meta")
    assert checks.values_are_free(False, host) and checks.values_are_free(True, device)
    assert not checks.values_are_free(False, device)
    # a tensor whose values cannot be read (meta) passes the type checks untouched
    checks.expert_ids(device, 4)
    checks.combine_operands(
        torch.zeros(4, 3, device="meta"),
        torch.zeros(4, dtype=torch.int64, device="meta"),
        torch.zeros(2, 2, device="meta"),
    )
    with pytest.raises(InvalidInput, match="topk_ids"):  # a host-synchronous vendor reads them
        checks.expert_ids(host - 1, 4, host_synchronous=True)


def test_the_reference_functions_check_host_ids_too():
    with pytest.raises(InvalidInput, match=r"topk_ids: expected expert ids in \[0, 8\)"):
        reference_sort(_ids() + 1, E)
    rows, index, weights = _combine_operands()
    with pytest.raises(InvalidInput, match="index"):
        reference_combine(rows, index + 1, weights, torch.float32)


# -- the other op methods ------------------------------------------------------------------------------


def _weight(v: hal.Vendor):
    return v.quantize_weight(torch.ones(3, 64, 32) / 8, ScaleLayout.NONE, torch.bfloat16)


def _w8(v: hal.Vendor):
    return v.quantize_weight(torch.ones(3, 64, 32) / 8, ScaleLayout.PER_CHANNEL, torch.int8)


X = torch.ones(5, 64, dtype=torch.bfloat16)
GROUPS = hal.Groups.from_counts(torch.tensor([2, 2, 1]))
#: name -> (the bad call, the argument its message must begin with)
OTHER_CASES = {
    "quantize-dtype-unknown": (lambda v: v.quantize(X, "fp12"), "dtype"),
    "quantize-dtype-torch": (lambda v: v.quantize(X, torch.int8), "dtype"),
    "quantize-layout-list": (lambda v: v.quantize(X, "bf16", layout=[1]), "layout"),
    "dequantize-out-string": (lambda v: v.dequantize(v.quantize(X, "bf16"), "float32"), "out_dtype"),
    "quantize-weight-dtype-string": (
        lambda v: v.quantize_weight(torch.ones(3, 64, 32), "per-channel", "int8"),
        "dtype",
    ),
    "gemm-out-string": (lambda v: v.grouped_matmul(X, _weight(v), GROUPS, out_dtype="bf16"), "out_dtype"),
    "gemm-bias-integers": (
        lambda v: v.grouped_matmul(X, _weight(v), GROUPS, bias=torch.ones(3, 32, dtype=torch.int32)),
        "bias",
    ),
    "activate-plain-scalar": (lambda v: v.activate(torch.tensor(1.0), "silu"), "x"),
    "fused-scheme-list": (
        lambda v: v.fused_deep_moe(X, _ids()[:5], torch.ones(5, 2), _w8(v), _w8(v), scheme=["x"]),
        "scheme",
    ),
    "prepare-fused-scheme-list": (lambda v: v.prepare_fused(_w8(v), _w8(v), scheme=["x"]), "scheme"),
    "ep-dispatch-name-list": (
        lambda v: v.ep_dispatch(X, _ids()[:5], name=["x"], dtype="bf16", num_experts=E, process_group=None),
        "name",
    ),
    "ep-combine-name-list": (
        lambda v: v.ep_combine(X, torch.ones(5, 2), None, name=["x"], out_dtype=torch.bfloat16),
        "name",
    ),
}


@pytest.mark.parametrize("case", OTHER_CASES)
def test_other_ops_name_the_bad_argument(vendor, case):
    call, argument = OTHER_CASES[case]
    refused(lambda: call(vendor), argument)


WEIGHT_LAYOUTS = {spec.weight_layout for spec in hal.GEMM_KINDS.values()} - {ScaleLayout.NONE}


@pytest.mark.parametrize("layout", sorted(WEIGHT_LAYOUTS, key=str), ids=str)
def test_a_weight_dtype_refused_for_a_layout_lists_each_allowed_dtype_once(layout):
    message = refused(
        lambda: hal.get_vendor("cpu").quantize_weight(torch.ones(2, 256, 32), layout, torch.float16), "dtype"
    )
    allowed = message.split("expected None or ", 1)[1].split(" for ", 1)[0].split(" or ")
    assert allowed and len(allowed) == len(set(allowed)), message
