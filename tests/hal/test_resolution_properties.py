"""Property test: over random capability tables and requests, resolution is sound."""

from __future__ import annotations

import warnings

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance.expectations import expected_bytes_per_token
from hal import (
    ENV_DISPATCH_DTYPE,
    KNOWN_SCHEMES,
    Capabilities,
    DispatchConfig,
    DispatchDtype,
    InvalidInput,
    ScaleLayout,
    UnsupportedDispatchDtype,
    resolve_dispatch_plan,
)
from vendors.cpu import CpuVendor

#: The buffer formula, written out independently of hal (the conformance suite's own).
expected_bytes = expected_bytes_per_token

CONCRETE = DispatchDtype.concrete()


@st.composite
def capability_tables(draw: st.DrawFn) -> Capabilities:
    supported = draw(st.sets(st.sampled_from(CONCRETE), min_size=1))
    fallbacks = {
        d: draw(st.one_of(st.none(), st.sampled_from(CONCRETE)))
        for d in CONCRETE
        if d not in supported and draw(st.booleans())
    }
    return Capabilities(
        device_name="random",
        dispatch_dtypes=frozenset(supported),
        fallbacks=fallbacks,
        default_dispatch_dtype=draw(st.sampled_from(sorted(supported))),
        scale_layouts={DispatchDtype.FP8: draw(st.sampled_from([ScaleLayout.GROUP_128, ScaleLayout.PER_TOKEN]))},
    )


requests = st.sampled_from([DispatchDtype.AUTO, *CONCRETE])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    caps=capability_tables(),
    explicit=requests,
    env=st.one_of(st.none(), requests),
    scheme=st.one_of(st.none(), st.sampled_from(sorted(KNOWN_SCHEMES))),
    runner=st.one_of(st.none(), requests),
    hidden=st.one_of(st.integers(1, 64).map(lambda n: 16 * n), st.integers(1, 9000)),
)
def test_resolved_dtype_is_supported_or_the_call_raises(caps, explicit, env, scheme, runner, hidden):
    vendor = CpuVendor()
    environ = {} if env is None else {ENV_DISPATCH_DTYPE: env.value}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = resolve_dispatch_plan(
                vendor,
                hidden,
                config=DispatchConfig(dtype=explicit),
                scheme=scheme,
                runner_dtype=runner,
                environ=environ,
                capabilities=caps,
            )
    except UnsupportedDispatchDtype as exc:
        assert "random" in str(exc)
        return
    except InvalidInput as exc:
        # only two legitimate reasons: a request the scheme cannot consume, or nvfp4 with H % 16 != 0
        assert "accepts" in str(exc) or (hidden % 16 and "multiple of 16" in str(exc)), str(exc)
        return
    assert p.resolved in caps.dispatch_dtypes
    assert p.bytes_per_token == expected_bytes(p.resolved, p.scale_layout, hidden)
    if p.fallback is None:
        assert p.resolved is p.requested
    else:
        assert caps.dispatch_fallbacks[p.requested] is p.resolved
    if scheme is not None:
        assert p.resolved in KNOWN_SCHEMES[scheme].accepts
