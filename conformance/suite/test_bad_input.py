"""Bad input raises a `HalError` subclass whose message names the argument, and the vendor keeps
working afterwards. Only what can be seen without reading device values is required (shapes,
dtypes, types, declared capabilities): value checks such as group lists that do not add up
would cost a device synchronisation, which a graph-capturable kernel must not pay."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from conformance.capability import BAD_INPUT, mark
from conformance.checks import assert_unchanged, snapshot
from conformance.operands import random_codes_activation, random_codes_weight, to_device
from conformance.reference import relative_error
from conformance.tolerances import layer_tolerance
from hal import (
    KNOWN_SCHEMES,
    DispatchDtype,
    GemmKind,
    Groups,
    HalError,
    InvalidInput,
    ScaleLayout,
    UnsupportedCapability,
    Vendor,
)

pytestmark = mark(BAD_INPUT)


def _x(vendor: Vendor, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.ones(shape, dtype=dtype, device=vendor.device)


def _weight(vendor: Vendor, experts: int = 3, k: int = 64, n: int = 32):
    return vendor.quantize_weight(torch.ones(experts, k, n, device=vendor.device) / 8, ScaleLayout.NONE, torch.bfloat16)


def _groups(vendor: Vendor, *counts: int) -> Groups:
    return Groups.from_counts(torch.tensor(counts, device=vendor.device))


def _default(vendor: Vendor) -> DispatchDtype:
    return vendor.capabilities().default_dispatch_dtype


#: name -> (the bad call, the argument names one of which its message must name)
CASES: dict[str, tuple[Callable[[Vendor], object], tuple[str, ...]]] = {
    "quantize-a-list": (lambda v: v.quantize([[1.0, 2.0]], _default(v)), ("x",)),
    "quantize-integers": (lambda v: v.quantize(_x(v, 4, 64, dtype=torch.int32), _default(v)), ("x",)),
    "quantize-a-scalar": (lambda v: v.quantize(_x(v), _default(v)), ("x",)),
    "quantize-to-auto": (lambda v: v.quantize(_x(v, 4, 64), DispatchDtype.AUTO), ("dtype",)),
    "quantize-an-unknown-dtype": (lambda v: v.quantize(_x(v, 4, 64), "fp12"), ("dtype", "dispatch dtype")),
    "quantize-with-a-wrong-layout": (
        lambda v: v.quantize(_x(v, 4, 64), DispatchDtype.BF16, layout=ScaleLayout.BLOCK_128X128),
        ("layout",),
    ),
    "dequantize-a-tensor": (lambda v: v.dequantize(_x(v, 4, 64)), ("q",)),
    "dequantize-to-integers": (
        lambda v: v.dequantize(v.quantize(_x(v, 4, 64), _default(v)), torch.int32),
        ("out_dtype",),
    ),
    "quantize-weight-2d": (
        lambda v: v.quantize_weight(_x(v, 64, 32, dtype=torch.float32), ScaleLayout.NONE),
        ("weight",),
    ),
    "quantize-weight-activation-layout": (
        lambda v: v.quantize_weight(_x(v, 2, 64, 32, dtype=torch.float32), ScaleLayout.PER_TOKEN),
        ("layout",),
    ),
    "gemm-k-mismatch": (
        lambda v: v.grouped_matmul(_x(v, 5, 48), _weight(v), _groups(v, 2, 2, 1)),
        ("x", "weight", "K"),
    ),
    "gemm-group-count": (lambda v: v.grouped_matmul(_x(v, 5, 64), _weight(v), _groups(v, 2, 3)), ("groups",)),
    "gemm-3d-activations": (lambda v: v.grouped_matmul(_x(v, 1, 5, 64), _weight(v), _groups(v, 2, 2, 1)), ("x",)),
    "gemm-weight-as-tensor": (
        lambda v: v.grouped_matmul(_x(v, 5, 64), _x(v, 3, 64, 32), _groups(v, 2, 2, 1)),
        ("weight",),
    ),
    "gemm-groups-as-tensor": (
        lambda v: v.grouped_matmul(_x(v, 5, 64), _weight(v), torch.tensor([2, 2, 1])),
        ("groups",),
    ),
    "gemm-mixed-float-dtypes": (
        lambda v: v.grouped_matmul(_x(v, 5, 64, dtype=torch.float16), _weight(v), _groups(v, 2, 2, 1)),
        ("x", "weight", "operands"),
    ),
    "gemm-integer-out-dtype": (
        lambda v: v.grouped_matmul(_x(v, 5, 64), _weight(v), _groups(v, 2, 2, 1), out_dtype=torch.int32),
        ("out_dtype",),
    ),
    "swiglu-odd-width": (lambda v: v.swiglu(_x(v, 4, 63)), ("x",)),
    "swiglu-integers": (lambda v: v.swiglu(_x(v, 4, 64, dtype=torch.int32)), ("x",)),
}


def _names_one_of(message: str, names: tuple[str, ...]) -> bool:
    return any(re.search(rf"(?<![\w]){re.escape(n)}(?![\w])", message) for n in names)


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_clearly(hal_vendor, case):
    call, names = CASES[case]
    before = snapshot(hal_vendor)
    with pytest.raises(HalError) as raised:
        call(hal_vendor)
    message = str(raised.value)
    assert _names_one_of(message, names), f"the message does not name {' or '.join(names)}: {message!r}"
    assert_unchanged(hal_vendor, before)


def test_bad_input_after_good_calls_of_the_same_shapes_is_still_refused(hal_vendor):
    """Checks the hal keeps per signature of arguments (`hal.verdicts`) never let a bad call through: after good
    calls, the same shapes with another dtype, output dtype, group count or dispatch dtype are refused as before."""
    before = snapshot(hal_vendor)
    weight, groups = _weight(hal_vendor), _groups(hal_vendor, 2, 2, 1)
    for _ in range(2):
        hal_vendor.grouped_matmul(_x(hal_vendor, 5, 64), weight, groups)
        hal_vendor.quantize(_x(hal_vendor, 4, 64), DispatchDtype.BF16)
    for name in ("gemm-mixed-float-dtypes", "gemm-integer-out-dtype", "gemm-group-count", "quantize-to-auto"):
        call, names = CASES[name]
        with pytest.raises(HalError) as raised:
            call(hal_vendor)
        assert _names_one_of(str(raised.value), names), (name, str(raised.value))
    with pytest.raises(HalError):
        hal_vendor.quantize(_x(hal_vendor, 4, 64, dtype=torch.int32), DispatchDtype.BF16)
    assert_unchanged(hal_vendor, before)


def test_undeclared_gemm_kinds_are_refused(hal_vendor):
    """Every kind the vendor does not declare raises `UnsupportedCapability` naming the kind."""
    before = snapshot(hal_vendor)
    gen = torch.Generator().manual_seed(0)
    for kind in GemmKind:
        if hal_vendor.capabilities().supports_gemm(kind):
            continue
        x = to_device(random_codes_activation(kind.value, 4, 64, gen), hal_vendor.device)
        w = to_device(random_codes_weight(kind.value, 2, 64, 32, gen), hal_vendor.device)
        with pytest.raises(UnsupportedCapability, match=re.escape(str(kind))):
            hal_vendor.grouped_matmul(x, w, _groups(hal_vendor, 3, 1))
    assert_unchanged(hal_vendor, before)


def test_int4_activations_follow_the_declaration(hal_vendor):
    before = snapshot(hal_vendor)
    x = _x(hal_vendor, 4, 60)  # 60 is not a multiple of 8
    if hal_vendor.capabilities().supports_gemm(GemmKind.INT4):
        with pytest.raises(HalError, match=r"\bx\b"):
            hal_vendor.quantize_int4(x)
    else:
        with pytest.raises(UnsupportedCapability):
            hal_vendor.quantize_int4(_x(hal_vendor, 4, 64))
    assert_unchanged(hal_vendor, before)


def test_fused_deep_moe_is_refused_where_not_declared(hal_vendor):
    """Every scheme without a declared fused op raises `UnsupportedCapability` naming the scheme."""
    before = snapshot(hal_vendor)
    w13, w2 = _weight(hal_vendor, 2, 64, 64), _weight(hal_vendor, 2, 32, 64)
    ids = torch.zeros(3, 1, dtype=torch.int64, device=hal_vendor.device)
    for scheme in KNOWN_SCHEMES:
        if scheme in hal_vendor.capabilities().fused_deep_moe:
            continue
        with pytest.raises(UnsupportedCapability, match=re.escape(scheme)):
            hal_vendor.fused_deep_moe(
                _x(hal_vendor, 3, 64), ids, torch.ones(3, 1, device=hal_vendor.device), w13, w2, scheme=scheme
            )
    assert_unchanged(hal_vendor, before)


def test_the_layer_refuses_bad_input_and_keeps_working(hal_vendor):
    from moe import MoELayer

    w13, w2 = torch.randn(4, 64, 64) / 8, torch.randn(4, 32, 64) / 6
    layer = MoELayer.from_float(w13, w2, 2, vendor=hal_vendor, environ={})
    x = torch.randn(5, 64, device=hal_vendor.device).to(torch.bfloat16)
    logits = torch.randn(5, 4, device=hal_vendor.device)
    before = layer(x, logits)
    for bad in ((x[:, :60], logits), (x, logits[:, :3]), (x.to(torch.int32), logits)):
        with pytest.raises(HalError):
            layer(*bad)
    after = layer(x, logits)
    same = (
        torch.equal(after, before)
        if hal_vendor.capabilities().deterministic
        else relative_error(after, before.double().cpu()) <= layer_tolerance("unquantized", "bf16")
    )  # not bit-reproducible
    assert same, "the layer computes differently after refusing bad input"


def test_group_lists_in_host_memory_that_do_not_fit_are_refused(hal_vendor):
    """A group list in host memory costs nothing to read, so on every vendor its numbers are checked
    (`InvalidInput` naming `groups`): negative counts, decreasing offsets, more rows than x has (fewer
    leave the rows beyond the groups unspecified). A raw error from inside the vendor fails."""
    before = snapshot(hal_vendor)
    x, w = _x(hal_vendor, 5, 64), _weight(hal_vendor)
    bad = [
        Groups.from_counts(torch.tensor([3, -1, 3])),
        Groups.from_counts(torch.tensor([2, 2, 3])),
        Groups.from_offsets(torch.tensor([3, 2, 5])),
        Groups.from_offsets(torch.tensor([1, 2, 9])),
    ]
    for groups in bad:
        for extra in ({}, {"activation": "silu-glu"}):
            with pytest.raises(InvalidInput, match=r"^groups:"):
                hal_vendor.grouped_matmul(x, w, groups, **extra)
    assert_unchanged(hal_vendor, before)


def test_an_object_that_is_not_a_process_group_is_refused(hal_vendor):
    """Only a torch.distributed process group (or None where one rank is meant) reaches a vendor's
    communication: anything else is `InvalidInput` naming `process_group`, never a raw error."""
    w13, w2 = _weight(hal_vendor, 2, 64, 64), _weight(hal_vendor, 2, 32, 64)
    x, ids = _x(hal_vendor, 3, 64), torch.zeros(3, 1, dtype=torch.int64, device=hal_vendor.device)
    weights = torch.ones(3, 1, device=hal_vendor.device)
    scheme = next(iter(sorted(hal_vendor.capabilities().fused_deep_moe)), "w8a8-int8")
    calls = [
        lambda: hal_vendor.fused_deep_moe(x, ids, weights, w13, w2, scheme=scheme, process_group="group"),
        lambda: hal_vendor.prepare_fused(w13, w2, scheme=scheme, process_group=3),
    ]
    for name in sorted(hal_vendor.capabilities().ep_dispatchers) or ["any"]:
        common = {"dtype": "bf16", "num_experts": 2, "process_group": object()}
        calls.append(lambda name=name, common=common: hal_vendor.ep_dispatch(x, ids, name=name, **common))
        calls.append(
            lambda name=name, common=common: hal_vendor.prepare_ep(name, hidden_size=64, capacity=None, **common)
        )
    for call in calls:
        with pytest.raises(InvalidInput, match=r"^process_group:"):
            call()
