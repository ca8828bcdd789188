"""Dispatch-dtype resolution on the vendor equals what its declared table implies, for every
dtype and scheme: kept, fallen back (with one warning per vendor instance), or refused."""

from __future__ import annotations

import warnings

import pytest

from conformance.capability import DECLARATIONS, dispatch_label, mark
from conformance.expectations import expected_bytes_per_token, expected_layout, expected_resolution
from hal import (
    KNOWN_SCHEMES,
    DispatchConfig,
    DispatchDtype,
    DispatchFallbackWarning,
    InvalidInput,
    UnsupportedDispatchDtype,
    resolve_dispatch_plan,
)

HIDDEN = 7168


def _label(requested: DispatchDtype | None, scheme: str | None) -> str:
    if requested is not None:
        return dispatch_label(requested)
    return dispatch_label(KNOWN_SCHEMES[scheme].preferred_dtype) if scheme else DECLARATIONS


CASES = [
    pytest.param(
        requested, scheme, id=f"{requested or 'auto'}-{scheme or 'no-scheme'}", marks=mark(_label(requested, scheme))
    )
    for requested in [*DispatchDtype.concrete(), None]
    for scheme in [None, *KNOWN_SCHEMES]
]


def _resolve(vendor, requested, traits):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = resolve_dispatch_plan(
            vendor, HIDDEN, config=DispatchConfig(dtype=requested or "auto"), scheme=traits, environ={}
        )
    return plan, [w for w in caught if issubclass(w.category, DispatchFallbackWarning)]


@pytest.mark.parametrize("requested, scheme", CASES)
def test_resolution_follows_the_declared_table(fresh_hal_vendor, requested, scheme):
    vendor = fresh_hal_vendor()  # a new instance: fallback warnings are counted per instance
    caps = vendor.capabilities()
    traits = KNOWN_SCHEMES[scheme] if scheme else None
    expected = expected_resolution(caps, requested, traits)
    if expected.outcome == "invalid":
        with pytest.raises(InvalidInput, match=str(expected.wanted)):
            _resolve(vendor, requested, traits)
        return
    if expected.outcome == "rejected":
        with pytest.raises(UnsupportedDispatchDtype) as raised:
            _resolve(vendor, requested, traits)
        message = str(raised.value)
        assert vendor.name in message and str(expected.wanted) in message, message
        return

    plan, warned = _resolve(vendor, requested, traits)
    assert (plan.requested, plan.resolved) == (expected.wanted, expected.resolved)
    layout = expected_layout(caps, plan.resolved, traits)
    assert plan.scale_layout is layout
    assert plan.bytes_per_token == expected_bytes_per_token(plan.resolved, layout, HIDDEN)
    assert plan.buffer_bytes(64) == 64 * plan.bytes_per_token
    if expected.outcome == "native":
        assert plan.fallback is None and warned == []
        return
    assert plan.fallback is not None
    assert (plan.fallback.source, plan.fallback.target) == (expected.wanted, expected.resolved)
    assert len(warned) == 1, f"expected one fallback warning, got {[str(w.message) for w in warned]}"
    again, warned_again = _resolve(vendor, requested, traits)
    assert again.resolved == plan.resolved
    assert warned_again == [], "the fallback warned twice for one vendor instance"
