"""The vendor's declarations: available, consistent, resolved once, every fallback well-founded."""

from __future__ import annotations

import pytest

from conformance.capability import DECLARATIONS, mark
from hal import KNOWN_SCHEMES, Capabilities, DispatchDtype, GemmKind, Int8QuantMode

pytestmark = mark(DECLARATIONS)

#: Backends torch.distributed knows (plus the vendors' own collective libraries).
KNOWN_BACKENDS = {"gloo", "nccl", "hccl", "mpi", "ucc", "xccl", "cncl", "mccl"}


def test_the_vendor_is_available_and_names_its_devices(hal_vendor):
    assert hal_vendor.probe().available, hal_vendor.probe().reason
    devices = hal_vendor.devices()
    assert devices, "devices() returned no device"
    assert hal_vendor.device == devices[0]


def test_capabilities_are_resolved_once(hal_vendor):
    first = hal_vendor.capabilities()
    assert isinstance(first, Capabilities), f"capabilities() returned {type(first).__name__}"
    assert hal_vendor.capabilities() is first, "capabilities() built a new table on the second call"


def test_the_declaration_has_no_contradiction(hal_vendor):
    assert hal_vendor.capabilities().consistency_problems() == []


def test_derived_flags_agree_with_the_tables(hal_vendor):
    caps = hal_vendor.capabilities()
    assert caps.supports_fp8_dispatch == (DispatchDtype.FP8 in caps.dispatch_dtypes)
    for dtype in DispatchDtype.concrete():
        assert caps.supports_dispatch(dtype) == (dtype in caps.dispatch_dtypes), dtype
        assert caps.fallback_for(dtype) == caps.dispatch_fallbacks.get(dtype), dtype
    for kind in GemmKind:
        assert caps.supports_gemm(kind) == (kind in caps.grouped_matmul), kind
    int8 = DispatchDtype.INT8 in caps.dispatch_dtypes
    assert (caps.int8_quant_mode is not Int8QuantMode.NONE) == int8, (
        f"int8_quant_mode {caps.int8_quant_mode} with int8 dispatch {'declared' if int8 else 'absent'}"
    )


def test_the_default_dispatch_dtype_is_carried(hal_vendor):
    caps = hal_vendor.capabilities()
    assert caps.default_dispatch_dtype in caps.dispatch_dtypes


def test_every_fallback_targets_a_carried_dtype(hal_vendor):
    caps = hal_vendor.capabilities()
    for source, target in caps.dispatch_fallbacks.items():
        assert source not in caps.dispatch_dtypes, f"fallback declared for {source}, which is carried natively"
        assert target is None or target in caps.dispatch_dtypes, f"fallback {source} -> {target} is not carried"


def test_the_fallback_table_has_no_cycle(hal_vendor):
    caps = hal_vendor.capabilities()
    for start in DispatchDtype.concrete():
        seen = [start]
        current: DispatchDtype | None = start
        while current is not None and current not in caps.dispatch_dtypes:
            current = caps.dispatch_fallbacks.get(current)
            assert current not in seen, f"fallback cycle: {' -> '.join(map(str, [*seen, current]))}"
            seen.append(current)  # type: ignore[arg-type]


def test_fused_schemes_are_known_and_dispatchable(hal_vendor):
    caps = hal_vendor.capabilities()
    for scheme in caps.fused_deep_moe:
        assert scheme in KNOWN_SCHEMES, f"fused_deep_moe names an unknown scheme {scheme!r}"
        wanted = KNOWN_SCHEMES[scheme].preferred_dtype
        carried = wanted if wanted in caps.dispatch_dtypes else caps.dispatch_fallbacks.get(wanted)
        assert carried is not None, f"fused scheme {scheme} wants {wanted} dispatch, which is rejected"


def test_fp8_scale_layout_is_an_fp8_layout(hal_vendor):
    caps = hal_vendor.capabilities()
    assert caps.fp8_scale_layout in DispatchDtype.FP8.scale_layouts()


def test_limits_are_positive(hal_vendor):
    for name, value in hal_vendor.capabilities().limits.as_dict().items():
        assert value is None or (isinstance(value, int) and value > 0), f"{name} = {value!r}"


def test_the_collective_backend_is_named(hal_vendor):
    backend = hal_vendor.capabilities().collective_backend
    assert backend in KNOWN_BACKENDS, f"collective_backend {backend!r} is not one of {sorted(KNOWN_BACKENDS)}"


def test_every_declared_model_table_is_consistent(hal_vendor):
    models = hal_vendor.declared_models()
    assert models, "declared_models() is empty"
    assert hal_vendor.default_model in models
    for model, caps in models.items():
        assert isinstance(caps, Capabilities), model
        assert caps.consistency_problems() == [], model
        assert hal_vendor.declared_capabilities(model.upper()) == caps, model


@pytest.mark.parametrize("attribute", ["name", "description"])
def test_the_vendor_describes_itself(hal_vendor, attribute):
    value = getattr(hal_vendor, attribute)
    assert isinstance(value, str) and value.strip(), f"{attribute} is {value!r}"
