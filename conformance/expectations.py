"""What the design's rules imply for a vendor's declared table, restated independently of `hal`.

The suite compares what `hal` resolves on a vendor with these expectations (design.md
section 4): an explicit request outside a scheme's accepted set is invalid; a carried
dtype is kept; an uncarried one follows the declared fallback (when the target is
carried and the scheme accepts it) or is rejected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hal import FP8_GROUP_SIZE, NVFP4_BLOCK_SIZE, Capabilities, DispatchDtype, ScaleLayout, SchemeTraits


@dataclass(frozen=True)
class Expected:
    """The outcome a request should have: `native`, `fallback`, `rejected` or `invalid`."""

    outcome: str
    wanted: DispatchDtype
    resolved: DispatchDtype | None = None


def expected_resolution(caps: Capabilities, requested: DispatchDtype | None,
                        scheme: SchemeTraits | None) -> Expected:
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
    """The activation scale layout a plan carries `dtype` with."""
    if dtype is DispatchDtype.FP8:
        return scheme.fp8_layout if scheme is not None and scheme.fp8_layout else caps.fp8_scale_layout
    return {DispatchDtype.BF16: ScaleLayout.NONE, DispatchDtype.INT8: ScaleLayout.PER_TOKEN,
            DispatchDtype.NVFP4: ScaleLayout.BLOCK_16}[dtype]


def expected_bytes_per_token(dtype: DispatchDtype, layout: ScaleLayout, hidden: int) -> int:
    """Payload plus per-token scales of one token: what a dispatch buffer must hold."""
    if dtype is DispatchDtype.BF16:
        return 2 * hidden
    if dtype is DispatchDtype.INT8:
        return hidden + 4
    if dtype is DispatchDtype.FP8:
        return hidden + 4 * (math.ceil(hidden / FP8_GROUP_SIZE) if layout is ScaleLayout.GROUP_128 else 1)
    return hidden // 2 + hidden // NVFP4_BLOCK_SIZE
