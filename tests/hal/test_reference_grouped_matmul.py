"""Grouped matmul of the reference ops (through the CPU vendor), against float64 references built here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hal import (
    DispatchDtype,
    Groups,
    InvalidInput,
    KernelLimits,
    QuantizedTensor,
    QuantizedWeight,
    ScaleLayout,
    UnsupportedCapability,
)
from tests.support.gemm_helpers import (
    Bf16OnlyVendor,
    row_scale,
    gen,
    make_groups,
    reference,
    assert_within,
    dequant_x,
    dequant_w,
    FORMS,
    COUNTS,
)
from vendors.cpu import CpuVendor


@pytest.fixture(scope="module")
def vendor() -> CpuVendor:
    return CpuVendor()


# -- exact results ---------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_fp32_exact_on_integers(vendor: CpuVendor, form: str) -> None:
    g = gen(1)
    x = torch.randint(-8, 9, (9, 64), generator=g).float()
    w = torch.randint(-8, 9, (6, 64, 24), generator=g).float()
    y = vendor.grouped_matmul(x, QuantizedWeight(w), make_groups(COUNTS, form))
    assert y.dtype == torch.float32 and y.shape == (9, 24)
    assert torch.equal(y.double(), reference(x, w, COUNTS))


@pytest.mark.parametrize("form", FORMS)
def test_int8_exact_with_power_of_two_scales(vendor: CpuVendor, form: str) -> None:
    g = gen(2)
    m, k, n, e = 9, 96, 40, 6
    xd = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    wd = torch.randint(-127, 128, (e, k, n), generator=g, dtype=torch.int8)
    xs = 2.0 ** torch.randint(-6, 3, (m,), generator=g).float()
    ws = 2.0 ** torch.randint(-6, 3, (e, n), generator=g).float()
    x = QuantizedTensor(xd, DispatchDtype.INT8, ScaleLayout.PER_TOKEN, xs)
    w = QuantizedWeight(wd, ScaleLayout.PER_CHANNEL, ws)
    y = vendor.grouped_matmul(x, w, make_groups(COUNTS, form), out_dtype=torch.float32)
    # |integer sums| <= 96 * 127^2 < 2^24 and the scales are powers of two: exact in fp32
    assert torch.equal(y.double(), reference(xd, wd, COUNTS) * xs.double()[:, None] * row_scale(ws, COUNTS))
    assert vendor.grouped_matmul(x, w, make_groups(COUNTS, form)).dtype == torch.bfloat16


# -- random inputs within tolerance ----------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_float_kinds(vendor: CpuVendor, form: str, dtype: torch.dtype) -> None:
    g = gen(3)
    x = torch.randn(9, 200, generator=g).to(dtype)
    w = (torch.randn(6, 200, 72, generator=g) * 0.1).to(dtype)
    y = vendor.grouped_matmul(x, QuantizedWeight(w), make_groups(COUNTS, form))
    assert y.dtype == dtype and y.shape == (9, 72)
    assert_within(y, x, w, COUNTS)
    y32 = vendor.grouped_matmul(x, QuantizedWeight(w), make_groups(COUNTS, form), out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    assert_within(y32, x, w, COUNTS)


def test_bf16_quantized_tensor_activations(vendor: CpuVendor) -> None:
    g = gen(4)
    x = torch.randn(9, 64, generator=g)
    w = torch.randn(6, 64, 16, generator=g).to(torch.bfloat16)
    q = vendor.quantize(x, DispatchDtype.BF16)
    y = vendor.grouped_matmul(q, QuantizedWeight(w), make_groups(COUNTS, "counts"))
    assert y.dtype == torch.bfloat16
    assert_within(y, q.data, w, COUNTS)


QUANT_KINDS = [
    (DispatchDtype.INT8, ScaleLayout.PER_TOKEN, ScaleLayout.PER_CHANNEL, torch.int8),
    (DispatchDtype.FP8, ScaleLayout.PER_TOKEN, ScaleLayout.PER_CHANNEL, torch.float8_e4m3fn),
    (DispatchDtype.FP8, ScaleLayout.GROUP_128, ScaleLayout.BLOCK_128X128, torch.float8_e4m3fn),
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("xdtype", "xlayout", "wlayout", "wdtype"), QUANT_KINDS)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_quantized_kinds(
    vendor: CpuVendor,
    form: str,
    xdtype: DispatchDtype,
    xlayout: ScaleLayout,
    wlayout: ScaleLayout,
    wdtype: torch.dtype,
    out_dtype: torch.dtype | None,
) -> None:
    g = gen(5)
    k, n = 200, 300  # partial 128-tiles in K and N
    x = torch.randn(9, k, generator=g) * 2
    w = torch.randn(6, k, n, generator=g) * 0.05
    w[3, 128:, :] *= 50  # tiles with very different scales
    qx = vendor.quantize(x, xdtype, layout=xlayout)
    qw = vendor.quantize_weight(w, wlayout, wdtype)
    y = vendor.grouped_matmul(qx, qw, make_groups(COUNTS, form), out_dtype=out_dtype)
    assert y.dtype == (out_dtype or torch.bfloat16) and y.shape == (9, n)
    a, b = dequant_x(qx), dequant_w(qw)
    assert_within(y, a, b, COUNTS)
    # and the quantized product is close to the float product (quantization error only)
    rel = (y.double() - reference(x, w, COUNTS)).norm() / reference(x, w, COUNTS).norm()
    assert rel < (0.02 if xdtype is DispatchDtype.INT8 else 0.08)


# -- shapes and layouts ----------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("xdtype", "xlayout", "wlayout", "wdtype"), QUANT_KINDS)
def test_zero_rows(
    vendor: CpuVendor, form: str, xdtype: DispatchDtype, xlayout: ScaleLayout, wlayout: ScaleLayout, wdtype: torch.dtype
) -> None:
    qx = vendor.quantize(torch.zeros(0, 130), xdtype, layout=xlayout)
    qw = vendor.quantize_weight(torch.randn(3, 130, 20, generator=gen(6)), wlayout, wdtype)
    y = vendor.grouped_matmul(qx, qw, make_groups([0, 0, 0], form))
    assert y.shape == (0, 20) and y.dtype == torch.bfloat16
    yf = vendor.grouped_matmul(
        torch.zeros(0, 130), QuantizedWeight(torch.randn(3, 130, 20)), make_groups([0, 0, 0], form)
    )
    assert yf.shape == (0, 20) and yf.dtype == torch.float32


@pytest.mark.parametrize("form", FORMS)
def test_single_group(vendor: CpuVendor, form: str) -> None:
    g = gen(7)
    x = torch.randn(7, 32, generator=g)
    w = torch.randn(1, 32, 8, generator=g)
    y = vendor.grouped_matmul(x, QuantizedWeight(w), make_groups([7], form, torch.int32))
    assert_within(y, x, w, [7])


@pytest.mark.parametrize("form", FORMS)
def test_non_contiguous_operands(vendor: CpuVendor, form: str) -> None:
    g = gen(8)
    x = torch.randn(64, 9, generator=g).t()  # [9, 64], transposed
    w = torch.randn(6, 24, 64, generator=g).transpose(1, 2)  # [6, 64, 24], transposed
    assert not x.is_contiguous() and not w.is_contiguous()
    y = vendor.grouped_matmul(x, QuantizedWeight(w), make_groups(COUNTS, form))
    assert_within(y, x, w, COUNTS)
    sliced = torch.randn(9, 128, generator=g)[:, ::2]
    y = vendor.grouped_matmul(sliced, QuantizedWeight(w), make_groups(COUNTS, form))
    assert_within(y, sliced, w, COUNTS)
    # quantized operands with non-contiguous storage
    qx = vendor.quantize(torch.randn(9, 64, generator=g), DispatchDtype.INT8)
    qw = vendor.quantize_weight(torch.randn(6, 64, 24, generator=g), ScaleLayout.PER_CHANNEL)
    qx_nc = QuantizedTensor(qx.data.t().contiguous().t(), qx.dtype, qx.layout, qx.scale)
    qw_nc = QuantizedWeight(qw.data.transpose(1, 2).contiguous().transpose(1, 2), qw.layout, qw.scale)
    assert not qx_nc.data.is_contiguous() and not qw_nc.data.is_contiguous()
    y = vendor.grouped_matmul(qx_nc, qw_nc, make_groups(COUNTS, form), out_dtype=torch.float32)
    assert torch.equal(y, vendor.grouped_matmul(qx, qw, make_groups(COUNTS, form), out_dtype=torch.float32))


# -- errors ----------------------------------------------------------------------------------------


def _valid_call(vendor: CpuVendor) -> None:
    x = torch.randn(9, 16, generator=gen(9))
    w = torch.randn(6, 16, 4, generator=gen(10))
    y = vendor.grouped_matmul(x, QuantizedWeight(w), make_groups(COUNTS, "counts"))
    assert_within(y, x, w, COUNTS)


@pytest.mark.parametrize(
    ("groups", "x_shape", "w_shape", "match"),
    [
        (Groups.from_counts(torch.tensor([2, 3, 3])), (9, 16), (3, 16, 4), r"9 rows"),
        (Groups.from_counts(torch.tensor([5, -1, 5])), (9, 16), (3, 16, 4), r"non-negative"),
        (Groups.from_offsets(torch.tensor([5, 3, 9])), (9, 16), (3, 16, 4), r"non-decreasing"),
        (Groups.from_offsets(torch.tensor([3, 9])), (9, 16), (3, 16, 4), r"groups: expected 3 groups"),
        (Groups.from_counts(torch.tensor([3, 3, 3])), (9, 16), (3, 15, 4), r"x \(9, 16\).*weight \(3, 15, 4\)"),
        (Groups.from_counts(torch.tensor([3, 3, 3])), (9, 16, 1), (3, 16, 4), r"x: expected a 2-D"),
    ],
)
def test_bad_groups_and_shapes(
    vendor: CpuVendor, groups: Groups, x_shape: tuple[int, ...], w_shape: tuple[int, ...], match: str
) -> None:
    x = torch.randn(*x_shape)
    w = QuantizedWeight(torch.randn(*w_shape))
    with pytest.raises(InvalidInput, match=match):
        vendor.grouped_matmul(x, w, groups)
    _valid_call(vendor)


def test_bad_operand_types_and_pairings(vendor: CpuVendor) -> None:
    groups = make_groups([2, 2], "counts")
    w = QuantizedWeight(torch.randn(2, 16, 4))
    qx = vendor.quantize(torch.randn(4, 16), DispatchDtype.INT8)
    with pytest.raises(InvalidInput, match="supported pairing"):
        vendor.grouped_matmul(qx, w, groups)  # int8 activations with fp32 weights
    with pytest.raises(InvalidInput, match="supported pairing"):
        vendor.grouped_matmul(torch.randn(4, 16, dtype=torch.bfloat16), w, groups)
    with pytest.raises(InvalidInput, match="weight"):
        vendor.grouped_matmul(torch.randn(4, 16), torch.randn(2, 16, 4), groups)
    with pytest.raises(InvalidInput, match="groups"):
        vendor.grouped_matmul(torch.randn(4, 16), w, torch.tensor([2, 2]))
    with pytest.raises(InvalidInput, match="out_dtype"):
        vendor.grouped_matmul(torch.randn(4, 16), w, groups, out_dtype=torch.int32)
    with pytest.raises(InvalidInput, match=r"x: expected a tensor on device cpu, got 'meta'"):
        vendor.grouped_matmul(torch.empty(4, 16, device="meta"), w, groups)
    _valid_call(vendor)


class _LimitedVendor(CpuVendor):
    def _detect_capabilities(self):  # type: ignore[no-untyped-def]
        return dataclasses.replace(super()._detect_capabilities(), limits=KernelLimits(max_group_rows=4))


def test_undeclared_kind_rejected() -> None:
    vendor = Bf16OnlyVendor()
    qx = vendor.quantize(torch.randn(4, 16), DispatchDtype.INT8)
    qw = vendor.quantize_weight(torch.randn(2, 16, 4), ScaleLayout.PER_CHANNEL)
    with pytest.raises(UnsupportedCapability, match=r"'cpu'.*int8"):
        vendor.grouped_matmul(qx, qw, make_groups([1, 3], "counts"))
    x = torch.randn(4, 16).to(torch.bfloat16)
    w = torch.randn(2, 16, 4).to(torch.bfloat16)
    y = vendor.grouped_matmul(x, QuantizedWeight(w), make_groups([1, 3], "counts"))
    assert_within(y, x, w, [1, 3])


def test_declared_limits_enforced() -> None:
    vendor = _LimitedVendor()
    w = torch.randn(2, 16, 4)
    with pytest.raises(InvalidInput, match="max_group_rows"):
        vendor.grouped_matmul(torch.randn(5, 16), QuantizedWeight(w), make_groups([2, 3], "offsets"))
    x = torch.randn(4, 16)
    y = vendor.grouped_matmul(x, QuantizedWeight(w), make_groups([2, 2], "offsets"))
    assert_within(y, x, w, [2, 2])
