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
