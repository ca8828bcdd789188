"""`Vendor.grouped_matmul` checks every call, also after calls that passed with the same operands: activations,
row indices and groups on another device (a row index's device before its values, so a tensor the host cannot
read is refused, not read), out-of-range rows and group values where reading them is free, a new output dtype
or activation, a weight recast in place."""

from __future__ import annotations

import pytest
import torch

import hal
from hal import InvalidInput, ScaleLayout
from hal.groups import Groups

E, K, N, T = 4, 32, 24, 6


def _operands(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    vendor = hal.get_vendor("cpu")
    weight = vendor.quantize_weight(torch.randn(E, K, N, generator=gen), ScaleLayout.NONE, torch.bfloat16)
    x = torch.randn(T, K, generator=gen).to(torch.bfloat16)
    groups = Groups.from_counts(torch.tensor([2, 0, 3, 1]))
    return vendor, weight, x, groups


def _reference(x, weight, counts):
    rows, out = 0, []
    for e, c in enumerate(counts):
        out.append(x[rows : rows + c].double() @ weight.data[e].double())
        rows += c
    return torch.cat(out)


def test_repeated_calls_compute_the_float64_product():
    vendor, weight, x, groups = _operands()
    first = vendor.grouped_matmul(x, weight, groups)
    again = vendor.grouped_matmul(x.clone(), weight, groups)
    assert torch.equal(first, again)
    torch.testing.assert_close(again.double(), _reference(x, weight, [2, 0, 3, 1]), rtol=2e-2, atol=2e-2)


def test_each_call_still_checks_the_devices_of_what_it_brings():
    vendor, weight, x, groups = _operands()
    vendor.grouped_matmul(x, weight, groups, row_index=torch.arange(T))  # a call that passes
    with pytest.raises(InvalidInput, match="x"):
        vendor.grouped_matmul(x.to("meta"), weight, groups, row_index=torch.arange(T))
    with pytest.raises(InvalidInput, match="row_index"):
        vendor.grouped_matmul(x, weight, groups, row_index=torch.arange(T, device="meta"))
    with pytest.raises(InvalidInput, match="groups"):
        vendor.grouped_matmul(x, weight, Groups.from_counts(torch.tensor([2, 0, 3, 1], device="meta")))


def test_each_call_still_reads_row_indices_and_group_values_where_that_is_free():
    vendor, weight, x, groups = _operands()
    vendor.grouped_matmul(x, weight, groups, row_index=torch.arange(T))
    with pytest.raises(InvalidInput, match="row_index"):
        vendor.grouped_matmul(x, weight, groups, row_index=torch.tensor([0, 1, 2, 3, 4, T]))
    with pytest.raises(InvalidInput, match="groups"):
        vendor.grouped_matmul(x, weight, Groups.from_counts(torch.tensor([2, -1, 3, 1])))


def test_a_new_output_dtype_or_activation_meets_the_full_checks():
    vendor, weight, x, groups = _operands()
    vendor.grouped_matmul(x, weight, groups)
    with pytest.raises(InvalidInput, match="out_dtype"):
        vendor.grouped_matmul(x, weight, groups, out_dtype=torch.int32)
    with pytest.raises(InvalidInput):
        vendor.grouped_matmul(x, weight, groups, activation="no-such-activation")
    with pytest.raises(InvalidInput, match="even number of output columns"):
        odd = vendor.quantize_weight(torch.randn(E, K, N + 1), ScaleLayout.NONE, torch.bfloat16)
        vendor.grouped_matmul(x, odd, groups, activation="silu-glu")


def test_a_weight_recast_in_place_is_checked_again():
    vendor, weight, x, groups = _operands()
    vendor.grouped_matmul(x, weight, groups)
    weight.data.data = weight.data.data.to(torch.float16)  # what an in-place `.half()` of a module's buffers does
    with pytest.raises(InvalidInput, match="supported pairing"):
        vendor.grouped_matmul(x, weight, groups)
