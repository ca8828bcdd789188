"""A vendor op whose result has the wrong structure (not a tensor, another shape, dtype or device type) is
the vendor's fault: `hal.VendorFault` naming the vendor, the op and what came back, before any later op reads
it under its own argument names."""

from __future__ import annotations

import pytest
import torch

import hal
import moe
from hal import VendorFault
from hal.reference import ReferenceOps
from vendors.cpu import CpuVendor

E, H, I, K, T = 8, 48, 40, 2, 7


def _vendor(ops_class: type[ReferenceOps]) -> CpuVendor:
    class Faulty(CpuVendor):
        name = "faulty-result"

        def _make_ops(self):
            return ops_class()

    return Faulty()


class HalfPrecisionGemm(ReferenceOps):
    def grouped_matmul(self, x, weight, groups, *, kind, out_dtype):
        return super().grouped_matmul(x, weight, groups, kind=kind, out_dtype=out_dtype).half()


class ShortGemm(ReferenceOps):
    def grouped_matmul_activated(self, x, weight, groups, *, kind, out_dtype, activation):
        y = super().grouped_matmul_activated(x, weight, groups, kind=kind, out_dtype=out_dtype, activation=activation)
        return y[:-1]


class UngatedGemm(ReferenceOps):
    """Returns the gate and up columns without applying the activation (twice the width)."""

    def grouped_matmul_activated(self, x, weight, groups, *, kind, out_dtype, activation):
        return super().grouped_matmul(x, weight, groups, kind=kind, out_dtype=out_dtype)


class ListGemm(ReferenceOps):
    def grouped_matmul_gathered(self, x, row_index, weight, groups, *, kind, out_dtype, activation):
        return [
            super().grouped_matmul_gathered(
                x, row_index, weight, groups, kind=kind, out_dtype=out_dtype, activation=activation
            )
        ]


class WideCombine(ReferenceOps):
    def weighted_combine(self, rows, index, topk_weights, *, out_dtype):
        out = super().weighted_combine(rows, index, topk_weights, out_dtype=out_dtype)
        return torch.cat([out, out], dim=-1)


class Fp32Combine(ReferenceOps):
    def weighted_combine(self, rows, index, topk_weights, *, out_dtype):
        return super().weighted_combine(rows, index, topk_weights, out_dtype=torch.float32)


class Int32Ids(ReferenceOps):
    def softmax_topk(self, logits, *, top_k, renormalize):
        weights, ids = super().softmax_topk(logits, top_k=top_k, renormalize=renormalize)
        return weights, ids.int()


class OneIdPerToken(ReferenceOps):
    def softmax_topk(self, logits, *, top_k, renormalize):
        weights, ids = super().softmax_topk(logits, top_k=top_k, renormalize=renormalize)
        return weights[:, :1], ids[:, :1]


class CountsOfOneExpertLess(ReferenceOps):
    def sort_by_expert(self, topk_ids, *, num_experts):
        order, inverse, counts = super().sort_by_expert(topk_ids, num_experts=num_experts)
        return order, inverse, counts[:-1]


class SortWithoutTokens(ReferenceOps):
    def sort_by_expert_tokens(self, topk_ids, *, num_experts):
        return super().sort_by_expert(topk_ids, num_experts=num_experts)


class RowsDropped(ReferenceOps):
    def quantize(self, x, *, dtype, layout, global_scale):
        return super().quantize(x[:-1], dtype=dtype, layout=layout, global_scale=global_scale)


class Int8ForFp8(ReferenceOps):
    def quantize(self, x, *, dtype, layout, global_scale):
        return super().quantize(x, dtype=hal.DispatchDtype.INT8, layout=layout, global_scale=global_scale)


class PlainTensorQuantize(ReferenceOps):
    def quantize(self, x, *, dtype, layout, global_scale):
        return super().quantize(x, dtype=dtype, layout=layout, global_scale=global_scale).data


def _layer_output(vendor: CpuVendor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    layer = moe.MoELayer.from_float(
        torch.randn(E, H, 2 * I, generator=gen) / 7, torch.randn(E, I, H, generator=gen) / 6, K, vendor=vendor
    )
    return layer(torch.randn(T, H, generator=gen).bfloat16(), torch.randn(T, E, generator=gen))


@pytest.mark.parametrize(
    ("ops", "said"),
    [
        (ShortGemm, r"grouped_matmul returned torch.bfloat16 \(13, 40\) on cpu, expected torch.bfloat16 \(14, 40\)"),
        (UngatedGemm, r"grouped_matmul returned torch.bfloat16 \(14, 80\) on cpu, expected torch.bfloat16 \(14, 40\)"),
        (ListGemm, r"grouped_matmul returned list, expected torch.bfloat16 \(14, 40\)"),
        (WideCombine, r"weighted_combine returned torch.bfloat16 \(7, 96\) on cpu, expected torch.bfloat16 \(7, 48\)"),
        (Fp32Combine, r"weighted_combine returned torch.float32 \(7, 48\) on cpu, expected torch.bfloat16 \(7, 48\)"),
    ],
)
def test_a_layer_on_a_vendor_with_a_malformed_result_stops_with_the_vendors_fault(ops, said):
    with pytest.raises(VendorFault, match=r"vendor 'faulty-result': " + said):
        _layer_output(_vendor(ops))


@pytest.mark.parametrize(
    ("ops", "said"),
    [
        (
            Int32Ids,
            r"softmax_topk returned torch.int32 \(7, 2\) on cpu as output 1, expected \(torch.float32 \(7, 2\), ",
        ),
        (OneIdPerToken, r"softmax_topk returned torch.float32 \(7, 1\) on cpu as output 0, expected"),
        (CountsOfOneExpertLess, r"sort_by_expert returned torch.int64 \(7,\) on cpu as output 2, expected .*\(8,\)"),
        (SortWithoutTokens, r"sort_by_expert returned tuple of 3, expected a tuple of 4 tensors"),
    ],
)
def test_routing_and_sorting_results_of_the_wrong_form_are_the_vendors_fault(ops, said):
    vendor = _vendor(ops)
    gen = torch.Generator().manual_seed(5)
    with pytest.raises(VendorFault, match=r"vendor 'faulty-result': " + said):
        weights, ids = vendor.softmax_topk(torch.randn(T, E, generator=gen), K)
        vendor.sort_by_expert(torch.randint(0, E, (T, K), generator=gen), E, tokens=ops is SortWithoutTokens)


@pytest.mark.parametrize(
    ("ops", "said"),
    [
        (RowsDropped, r"quantize returned fp8 \(per-token\) data torch.float8_e4m3fn \(5, 64\) on cpu, "),
        (Int8ForFp8, r"quantize returned int8 \(per-token\) data torch.int8 \(6, 64\) on cpu, "),
        (PlainTensorQuantize, r"quantize returned Tensor, "),
    ],
)
def test_a_quantize_result_of_another_dtype_or_shape_is_the_vendors_fault(ops, said):
    with pytest.raises(
        VendorFault, match=r"vendor 'faulty-result': " + said + r"expected fp8 \(per-token\) of shape \(6, 64\)"
    ):
        _vendor(ops).quantize(torch.randn(6, 64).bfloat16(), "fp8_e4m3", layout="per-token")


def test_a_plain_grouped_matmul_of_the_wrong_dtype_is_the_vendors_fault():
    vendor = _vendor(HalfPrecisionGemm)
    x = torch.randn(6, H).bfloat16()
    weight = vendor.quantize_weight(torch.randn(2, H, 32), layout="none", dtype=torch.bfloat16)
    groups = hal.Groups.from_counts(torch.tensor([4, 2]))
    with pytest.raises(
        VendorFault, match=r"grouped_matmul returned torch.float16 \(6, 32\) on cpu, expected torch.bfloat16"
    ):
        vendor.grouped_matmul(x, weight, groups)


def test_well_formed_results_pass_unchanged():
    reference = _layer_output(CpuVendor())
    assert torch.equal(_layer_output(_vendor(ReferenceOps)), reference)
