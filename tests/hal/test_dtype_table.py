"""hal's tables of dispatch dtypes and grouped-matmul kinds, checked against the conformance suite's
independent restatement (`conformance.dtype_facts`) and through the code that reads them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance import dtype_facts
from hal import (
    DTYPES,
    GEMM_KINDS,
    ActivationFormat,
    Capabilities,
    DispatchConfig,
    DispatchDtype,
    GemmKind,
    InvalidInput,
    QuantizedTensor,
    QuantizedWeight,
    ScaleLayout,
    SchemeTraits,
    gemm_kind_of,
    gemm_kinds_consuming,
    resolve_dispatch_plan,
)
from hal import reference
from moe.dispatch.wire import pack, unpack
from vendors.cpu import CpuVendor

FORMATS = [(d, layout) for d in DispatchDtype.concrete() for layout in d.scale_layouts()]


def test_every_concrete_dtype_has_one_row():
    assert list(DTYPES) == DispatchDtype.concrete()
    assert all(spec.dtype is dtype for dtype, spec in DTYPES.items())
    with pytest.raises(InvalidInput, match="auto"):
        _ = DispatchDtype.AUTO.spec


@pytest.mark.parametrize("dtype", DispatchDtype.concrete(), ids=str)
def test_hal_rows_agree_with_the_suites_restatement(dtype):
    spec, facts = dtype.spec, dtype_facts.facts(dtype)
    assert (spec.storage, spec.values_per_element, spec.scale_dtype, spec.global_scale) == (
        facts.storage,
        facts.values_per_element,
        facts.scale_dtype,
        facts.global_scale,
    )


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(FORMATS), st.integers(1, 20000))
def test_bytes_per_token_agree_with_the_suites_restatement(fmt, hidden):
    dtype, layout = fmt
    hidden = hidden * dtype_facts.channel_multiple(dtype, layout)
    assert dtype.bytes_per_token(hidden, layout) == dtype_facts.bytes_per_token(dtype, layout, hidden)


@pytest.mark.parametrize("dtype, layout", FORMATS, ids=str)
@pytest.mark.parametrize("hidden", [256, 7168, 200])
def test_what_the_reference_makes_fits_the_row(dtype, layout, hidden):
    """The reference quantizer's output matches the row: storage, scale shape, bytes on the wire."""
    hidden = hidden - hidden % dtype_facts.channel_multiple(dtype, layout)
    x = torch.randn(3, 5, hidden).to(torch.bfloat16)
    q = reference.quantize(x, dtype, layout)
    assert q.data.dtype == dtype.spec.storage and tuple(q.shape) == (3, 5, hidden)
    expected = dtype_facts.scale_shape(dtype, layout, (3, 5), hidden)
    assert (None if q.scale is None else tuple(q.scale.shape)) == expected
    plan = resolve_dispatch_plan(
        CpuVendor(),
        hidden,
        config=DispatchConfig(dtype=dtype),
        environ={},
        scheme=SchemeTraits("probe", dtype, frozenset({dtype}), scale_layouts={dtype: layout}),
        capabilities=dataclasses.replace(
            CpuVendor().capabilities(), dispatch_dtypes=frozenset(DispatchDtype.concrete()), fallbacks={}
        ),
    )
    rows = QuantizedTensor(
        q.data.reshape(15, -1),
        q.dtype,
        q.layout,
        None if q.scale is None else q.scale.reshape(15, *q.scale.shape[2:]),
        q.global_scale,
    )
    records = pack(rows, plan)
    assert records.shape == (15, plan.bytes_per_token)
    back = unpack(records, plan, q.global_scale)
    assert torch.equal(reference.activation_value(back), reference.activation_value(rows))


def test_layouts_are_checked_against_the_row():
    assert DispatchDtype.FP8.spec.layout(None) is ScaleLayout.GROUP_128
    assert DispatchDtype.FP8.spec.layout("per-token") is ScaleLayout.PER_TOKEN
    with pytest.raises(InvalidInput, match="scale layout: expected one of per-token for int8"):
        DispatchDtype.INT8.spec.layout(ScaleLayout.GROUP_128)
    with pytest.raises(InvalidInput, match="multiple of 16 for nvfp4"):
        DispatchDtype.NVFP4.spec.check_hidden("hidden_size", 100, ScaleLayout.BLOCK_16)
    DispatchDtype.FP8.spec.check_hidden("hidden_size", 100, ScaleLayout.GROUP_128)  # partial fp8 groups are fine


def test_aliases_come_from_the_rows():
    for spec in DTYPES.values():
        for alias in (spec.dtype.value, *spec.aliases):
            assert DispatchDtype.parse(alias.upper()) is spec.dtype


# -- grouped-matmul kinds ---------------------------------------------------------------------------


def _operands(kind: GemmKind):
    from conformance.operands import random_codes_activation, random_codes_weight

    gen = torch.Generator().manual_seed(0)
    return random_codes_activation(kind.value, 4, 64, gen), random_codes_weight(kind.value, 2, 64, 32, gen)


@pytest.mark.parametrize("weights", list(GemmKind), ids=str)
@pytest.mark.parametrize("activations", list(GemmKind), ids=str)
def test_every_pairing_names_one_kind_or_is_refused(activations, weights):
    x, _ = _operands(activations)
    _, w = _operands(weights)
    matches = [k for k in GemmKind if k.spec.accepts(ActivationFormat.of(x)) and k.spec.pairs_with(w)]
    assert len(matches) <= 1, f"the table is ambiguous for this pairing: {matches}"
    if activations is weights:
        assert matches == [activations]
    if matches:
        assert gemm_kind_of(x, w) is matches[0]
    else:
        with pytest.raises(InvalidInput, match="supported pairing"):
            gemm_kind_of(x, w)


def test_the_bf16_kind_also_takes_rows_as_they_were_dispatched():
    x = torch.randn(4, 64).to(torch.bfloat16)
    w = QuantizedWeight(torch.randn(2, 64, 32).to(torch.bfloat16))
    assert gemm_kind_of(QuantizedTensor(x, DispatchDtype.BF16, ScaleLayout.NONE), w) is GemmKind.BF16


def test_consumers_of_each_dtype():
    assert gemm_kinds_consuming(DispatchDtype.FP8) == (GemmKind.FP8_ROWWISE, GemmKind.FP8_BLOCK128)
    assert gemm_kinds_consuming(DispatchDtype.INT8) == (GemmKind.INT8,)
    assert gemm_kinds_consuming(DispatchDtype.BF16) == (GemmKind.BF16, GemmKind.BF16_MXFP4, GemmKind.BF16_NVFP4)
    assert all(GEMM_KINDS[k].default_out_dtype == torch.bfloat16 for k in GemmKind if not GEMM_KINDS[k].is_float)


def test_what_a_vendor_quantizes_to_follows_its_table():
    caps = Capabilities(device_name="t", dispatch_dtypes={"bf16"}, grouped_matmul={GemmKind.BF16, GemmKind.INT8})
    assert caps.quantizes_to("int8") and caps.quantizes_to("bf16")  # int8: its GEMM kind consumes it
    assert not caps.quantizes_to("fp8") and not caps.quantizes_to("nvfp4")
    assert caps.layout_for("fp8") is ScaleLayout.GROUP_128 and caps.layout_for("int8") is ScaleLayout.PER_TOKEN
    per_token = dataclasses.replace(
        caps, scale_layouts={**caps.scale_layouts, DispatchDtype.FP8: ScaleLayout.PER_TOKEN}
    )
    assert per_token.layout_for("fp8") is ScaleLayout.PER_TOKEN
    bad = Capabilities(device_name="t", dispatch_dtypes={"bf16"}, scale_layouts={"int8": "per-token-group-128"})
    assert any("scale layout per-token-group-128 declared for int8" in p for p in bad.consistency_problems())
