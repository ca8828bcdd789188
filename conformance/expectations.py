"""What the design's rules imply for a vendor's declared table, restated independently of `hal`.

The suite compares what `hal` resolves on a vendor with these expectations (design.md
section 4): an explicit request outside a scheme's accepted set is invalid; a carried
dtype is kept; an uncarried one follows the declared fallback (when the target is
carried and the scheme accepts it) or is rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

from conformance import dtype_facts
from hal import Capabilities, DispatchDtype, ScaleLayout, SchemeTraits


@dataclass(frozen=True)
class Expected:
    """The outcome a request should have: `native`, `fallback`, `rejected` or `invalid`."""

    outcome: str
    wanted: DispatchDtype
    resolved: DispatchDtype | None = None


def expected_resolution(caps: Capabilities, requested: DispatchDtype | None, scheme: SchemeTraits | None) -> Expected:
    """The outcome of requesting `requested` (None: auto) for `scheme` on a declared table."""
    if requested is None:
        wanted = scheme.preferred_dtype if scheme is not None else caps.default_dispatch_dtype
    else:
        wanted = requested
        if scheme is not None and wanted not in scheme.accepts:
            return Expected("invalid", wanted)
    if wanted in caps.dispatch_dtypes:
        return Expected("native", wanted, wanted)
    target = caps.dispatch_fallbacks.get(wanted)
    if target is None or target not in caps.dispatch_dtypes:
        return Expected("rejected", wanted)
    if scheme is not None and target not in scheme.accepts:
        return Expected("rejected", wanted)
    return Expected("fallback", wanted, target)


def expected_layout(caps: Capabilities, dtype: DispatchDtype, scheme: SchemeTraits | None) -> ScaleLayout:
    """The activation scale layout a plan carries `dtype` with: the scheme's choice where it makes
    one, else the vendor's declared one, else the dtype's only (or first) layout."""
    if scheme is not None and scheme.scale_layouts.get(dtype):
        return scheme.scale_layouts[dtype]
    return caps.scale_layouts.get(dtype) or dtype.scale_layouts()[0]


def expected_bytes_per_token(dtype: DispatchDtype, layout: ScaleLayout, hidden: int) -> int:
    """Payload plus per-token scales of one token: what a dispatch buffer must hold."""
    return dtype_facts.bytes_per_token(dtype, layout, hidden)
