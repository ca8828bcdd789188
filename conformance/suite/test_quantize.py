"""quantize / dequantize for every dispatch dtype and scale layout the vendor carries, and int4
activations where it declares the int4 grouped matmul: error bounds, formats, edge rows."""

from __future__ import annotations

import math

import pytest
import torch

from conformance import dtype_facts
from conformance.capability import dispatch_label, gemm_label, mark, require_dispatch, require_gemm
from conformance.reference import generator, worst
from conformance.tolerances import quantize_bound
from hal import DispatchDtype, GemmKind, InvalidInput, PackedInt4Tensor, QuantizedTensor, ScaleLayout
from hal.reference import activation_value

FORMATS = [(d, layout) for d in DispatchDtype.concrete() for layout in d.scale_layouts()]
INPUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _params(extra: list[tuple[str, object]]):
    return [
        pytest.param(d, layout, value, id=f"{d}-{layout}-{name}", marks=mark(dispatch_label(d)))
        for d, layout in FORMATS
        for name, value in extra
    ]


def _hidden(dtype: DispatchDtype, layout: ScaleLayout, wanted: int) -> int:
    """`wanted` rounded up to what the format needs (nvfp4: whole 16-value blocks)."""
    multiple = dtype_facts.channel_multiple(dtype, layout)
    return math.ceil(wanted / multiple) * multiple


def _quantize(vendor, x, dtype, layout):
    return vendor.quantize(x.to(vendor.device), dtype, layout=layout)


def _check_bound(q: QuantizedTensor, x: torch.Tensor, dtype: DispatchDtype, layout: ScaleLayout, vendor) -> None:
    ref = x.double()
    for value, what in (
        (activation_value(q), "the format's value"),
        (vendor.dequantize(q, torch.float32).double().cpu(), "vendor.dequantize"),
    ):
        assert value.shape == ref.shape, f"{what}: shape {tuple(value.shape)} != {tuple(ref.shape)}"
        bound = quantize_bound(dtype.value, layout.value, ref.reshape(-1, ref.shape[-1])).reshape(ref.shape)
        error = (value - ref).abs()
        assert bool((error <= bound).all()), f"{what}: {worst(error, bound)}"


def _expected_scale(dtype: DispatchDtype, layout: ScaleLayout, lead: tuple[int, ...], hidden: int):
    shape = dtype_facts.scale_shape(dtype, layout, lead, hidden)
    return None if shape is None else (dtype_facts.facts(dtype).scale_dtype, shape)


@pytest.mark.parametrize(
    "dtype, layout, input_dtype", _params([(str(t).removeprefix("torch."), t) for t in INPUT_DTYPES])
)
def test_round_trip_error_is_within_one_rounding(hal_vendor, dtype, layout, input_dtype):
    require_dispatch(hal_vendor, dtype)
    gen = generator("quantize", dtype, layout, input_dtype)
    hidden = _hidden(dtype, layout, 200)  # not a multiple of 128: a partial fp8 group
    x = (torch.randn(33, hidden, generator=gen) * torch.logspace(-2, 1, 33)[:, None]).to(input_dtype)
    _check_bound(_quantize(hal_vendor, x, dtype, layout), x, dtype, layout, hal_vendor)


@pytest.mark.parametrize(
    "dtype, layout, shape",
    _params([("2d", (17, 256)), ("3d", (2, 5, 256)), ("no-tokens", (0, 256)), ("one-token", (1, 256))]),
)
def test_formats_scales_and_device(hal_vendor, dtype, layout, shape):
    require_dispatch(hal_vendor, dtype)
    x = torch.randn(*shape, generator=generator("format", dtype, layout, shape)).to(torch.bfloat16)
    q = _quantize(hal_vendor, x, dtype, layout)
    assert isinstance(q, QuantizedTensor), f"quantize returned {type(q).__name__}"
    assert (q.dtype, q.layout) == (dtype, layout)
    assert q.data.dtype == dtype_facts.facts(dtype).storage
    assert tuple(q.shape) == shape, f"logical shape {tuple(q.shape)}, expected {shape}"
    assert q.data.device == hal_vendor.device
    expected = _expected_scale(dtype, layout, shape[:-1], shape[-1])
    if expected is None:
        assert q.scale is None
    else:
        assert q.scale is not None and (q.scale.dtype, tuple(q.scale.shape)) == expected
    if dtype_facts.facts(dtype).global_scale:
        assert q.global_scale is not None and q.global_scale.numel() == 1
    if x.numel():
        _check_bound(q, x, dtype, layout, hal_vendor)


@pytest.mark.parametrize("dtype, layout, _", _params([("zero-rows", None)]))
def test_all_zero_rows_stay_zero(hal_vendor, dtype, layout, _):
    require_dispatch(hal_vendor, dtype)
    x = torch.randn(6, 256, generator=generator("zeros", dtype, layout)).to(torch.bfloat16)
    x[1] = 0
    x[4] = 0
    q = _quantize(hal_vendor, x, dtype, layout)
    value = hal_vendor.dequantize(q, torch.float32).cpu()
    assert bool(torch.isfinite(value).all()), "a zero row dequantized to inf/NaN"
    assert bool((value[[1, 4]] == 0).all()), "a zero row did not come back as zeros"
    if q.scale is not None:
        assert bool(torch.isfinite(q.scale.float()).all()), "a zero row got a non-finite scale"
    _check_bound(q, x, dtype, layout, hal_vendor)


@pytest.mark.parametrize("dtype, layout, bad", _params([("inf", float("inf")), ("nan", float("nan"))]))
def test_non_finite_rows_are_refused_or_kept_to_themselves(hal_vendor, dtype, layout, bad):
    """The documented contract: `InvalidInput`, or every finite row quantized as if alone."""
    require_dispatch(hal_vendor, dtype)
    x = torch.randn(5, 256, generator=generator("non-finite", dtype, layout)).to(torch.bfloat16)
    x[2, 7] = bad
    extra = {}
    if dtype_facts.facts(dtype).global_scale:  # the per-tensor scale must not come from the bad row
        extra["global_scale"] = torch.tensor([448.0 * 6 / 4.0], device=hal_vendor.device)
    try:
        q = hal_vendor.quantize(x.to(hal_vendor.device), dtype, layout=layout, **extra)
    except InvalidInput:
        return
    good = [0, 1, 3, 4]
    rows = QuantizedTensor(q.data[good], q.dtype, q.layout, None if q.scale is None else q.scale[good], q.global_scale)
    _check_bound(rows, x[good], dtype, layout, hal_vendor)


@pytest.mark.parametrize("dtype, layout, _", _params([("strided", None)]))
def test_non_contiguous_input_equals_contiguous(hal_vendor, dtype, layout, _):
    require_dispatch(hal_vendor, dtype)
    base = torch.randn(256, 12, generator=generator("strided", dtype, layout)).to(torch.bfloat16)
    x = base.t()  # [12, 256], not contiguous
    q_strided = _quantize(hal_vendor, x, dtype, layout)
    q_dense = _quantize(hal_vendor, x.contiguous(), dtype, layout)
    assert torch.equal(activation_value(q_strided), activation_value(q_dense))


@pytest.mark.parametrize(
    "dtype, layout, out_dtype", _params([(str(t).removeprefix("torch."), t) for t in INPUT_DTYPES])
)
def test_dequantize_returns_the_requested_dtype(hal_vendor, dtype, layout, out_dtype):
    require_dispatch(hal_vendor, dtype)
    x = torch.randn(4, 256, generator=generator("out", dtype, layout)).to(torch.bfloat16)
    q = _quantize(hal_vendor, x, dtype, layout)
    out = hal_vendor.dequantize(q, out_dtype)
    assert out.dtype == out_dtype and tuple(out.shape) == (4, 256) and out.device == hal_vendor.device
    exact = activation_value(q)
    assert torch.allclose(out.double().cpu(), exact, rtol=2.0**-7, atol=0), "dequantize disagrees with the format"


INT4 = mark(gemm_label(GemmKind.INT4))


@INT4
@pytest.mark.parametrize("shape", [(33, 256), (2, 3, 64), (0, 64)], ids=["2d", "3d", "no-tokens"])
def test_int4_activations_are_within_half_a_step(hal_vendor, shape):
    require_gemm(hal_vendor, GemmKind.INT4)
    gen = generator("int4", shape)
    x = (torch.randn(*shape, generator=gen) * 3).to(torch.bfloat16)
    x.view(-1, shape[-1])[:1] = 0  # an all-zero token
    q = hal_vendor.quantize_int4(x.to(hal_vendor.device))
    assert isinstance(q, PackedInt4Tensor), f"quantize_int4 returned {type(q).__name__}"
    assert tuple(q.data.shape) == (*shape[:-1], shape[-1] // 8) and q.data.dtype == torch.int32
    assert tuple(q.scale.shape) == shape[:-1] and q.scale.dtype == torch.float32
    value, ref = activation_value(q), x.double()
    bound = quantize_bound("int4", "per-token", ref.reshape(-1, shape[-1])).reshape(ref.shape)
    error = (value - ref).abs()
    assert bool((error <= bound).all()), worst(error, bound)
