"""Dispatch-dtype resolution: every precedence level, the declared fallbacks, isolation."""

from __future__ import annotations

import os
import warnings
from types import MappingProxyType

import pytest

from hal import (
    ENV_DISPATCH_DTYPE,
    DispatchConfig,
    DispatchDtype,
    DispatchFallbackWarning,
    HalDeprecationWarning,
    InvalidInput,
    PlanSource,
    ScaleLayout,
    UnsupportedDispatchDtype,
    resolve_dispatch_plan,
)

BF16, FP8, INT8, NVFP4 = DispatchDtype.BF16, DispatchDtype.FP8, DispatchDtype.INT8, DispatchDtype.NVFP4
EMPTY: MappingProxyType[str, str] = MappingProxyType({})
H = 4096


def plan(vendor, caps=None, *, dtype="auto", env=EMPTY, scheme=None, runner=None, hidden=H):
    """Resolve with an explicit, read-only environment so tests never depend on the process's."""
    return resolve_dispatch_plan(
        vendor,
        hidden,
        config=DispatchConfig(dtype=dtype),
        scheme=scheme,
        runner_dtype=runner,
        environ=env,
        capabilities=caps,
    )


# -- one test per precedence level -------------------------------------------------------------


def test_explicit_setting_decides(cpu):
    p = plan(cpu, dtype="INT8")
    assert (p.requested, p.source, p.resolved) == (INT8, PlanSource.EXPLICIT, INT8)


def test_environment_variable_decides_when_nothing_explicit(cpu):
    p = plan(cpu, env={ENV_DISPATCH_DTYPE: "Fp8"})
    assert (p.source, p.resolved) == (PlanSource.ENVIRONMENT, FP8)


def test_legacy_variable_decides_with_a_deprecation_naming_the_replacement(cpu):
    with pytest.warns(HalDeprecationWarning, match=ENV_DISPATCH_DTYPE):
        p = plan(cpu, env={"DEEP_NORMAL_MODE_USE_INT8_QUANT": "1"})
    assert (p.source, p.resolved) == (PlanSource.LEGACY_ENVIRONMENT, INT8)


def test_scheme_declared_dtype_decides(cpu):
    p = plan(cpu, scheme="w8a8-int8")
    assert (p.source, p.resolved, p.scheme) == (PlanSource.SCHEME, INT8, "w8a8-int8")


def test_input_global_scale_means_nvfp4(cuda):
    p = plan(cuda, cuda.declared_capabilities("B200"), scheme="nvfp4")
    assert (p.source, p.resolved, p.scale_layout) == (PlanSource.SCHEME, NVFP4, ScaleLayout.BLOCK_16)
    assert "input global scale" in p.trace[4].detail and p.trace[4].source is PlanSource.SCHEME


def test_runner_requirement_decides_without_scheme(cpu):
    p = plan(cpu, runner="fp8")
    assert (p.source, p.resolved) == (PlanSource.RUNNER, FP8)


def test_vendor_default_is_bf16_even_where_fp8_is_supported(cuda):
    caps = cuda.declared_capabilities("H100")
    assert caps.supports_fp8_dispatch
    p = plan(cuda, caps)
    assert (p.source, p.resolved, p.bytes_per_token) == (PlanSource.VENDOR_DEFAULT, BF16, 2 * H)


# -- combinations ------------------------------------------------------------------------------


def test_explicit_beats_environment(cpu):
    assert plan(cpu, dtype="bf16", env={ENV_DISPATCH_DTYPE: "int8"}).resolved is BF16


def test_environment_beats_scheme(cpu):
    p = plan(cpu, env={ENV_DISPATCH_DTYPE: "bf16"}, scheme="w8a8-int8")
    assert (p.source, p.resolved) == (PlanSource.ENVIRONMENT, BF16)


def test_environment_beats_legacy_variable(cpu):
    with pytest.warns(HalDeprecationWarning):
        p = plan(cpu, env={ENV_DISPATCH_DTYPE: "fp8", "SGLANG_DEEPEP_BF16_DISPATCH": "true"})
    assert (p.source, p.resolved) == (PlanSource.ENVIRONMENT, FP8)


def test_scheme_beats_runner_and_default(cpu):
    p = plan(cpu, scheme="w8a8-fp8-block", runner="bf16")
    assert (p.source, p.resolved, p.scale_layout) == (PlanSource.SCHEME, FP8, ScaleLayout.GROUP_128)


def test_runner_beats_vendor_default(cpu):
    assert plan(cpu, runner="int8").source is PlanSource.RUNNER


def test_auto_in_environment_falls_through(cpu):
    p = plan(cpu, env={ENV_DISPATCH_DTYPE: "auto"}, scheme="w8a8-int8")
    assert p.source is PlanSource.SCHEME


def test_unknown_environment_value_names_the_variable(cpu):
    with pytest.raises(InvalidInput, match=f"{ENV_DISPATCH_DTYPE}.*{', '.join(DispatchDtype.names())}.*'fp9'"):
        plan(cpu, env={ENV_DISPATCH_DTYPE: "fp9"})


def test_request_the_scheme_cannot_consume_is_invalid_input(cpu):
    with pytest.raises(InvalidInput, match="w4a4-int4.*accepts bf16.*int8"):
        plan(cpu, dtype="int8", scheme="w4a4-int4")


def test_trace_records_every_source_and_marks_the_decider(cpu):
    p = plan(cpu, dtype="fp8", env={ENV_DISPATCH_DTYPE: "int8"}, scheme="unquantized")
    assert [s.source for s in p.trace] == list(PlanSource)
    assert [s.decided for s in p.trace] == [True, False, False, False, False, False, False]
    assert p.trace[1].says is INT8 and p.trace[3].says is None and p.trace[4].says is BF16


# -- declared fallbacks on the real vendor classes ---------------------------------------------


def test_ascend_fp8_falls_back_to_int8_and_warns_once_per_vendor(ascend):
    caps = ascend.declared_capabilities("A3")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = plan(ascend, caps, dtype="fp8")
        second = plan(ascend, caps, dtype="fp8")
    fallback_warnings = [w for w in caught if issubclass(w.category, DispatchFallbackWarning)]
    assert len(fallback_warnings) == 1
    assert "fp8" in str(fallback_warnings[0].message) and "int8" in str(fallback_warnings[0].message)
    for p in (first, second):
        assert (p.requested, p.resolved) == (FP8, INT8)
        assert p.fallback is not None and "fp8" in p.fallback.reason
        assert p.bytes_per_token == H + 4


def test_a_new_vendor_instance_warns_again(ascend):
    from vendors.ascend import AscendVendor

    other = AscendVendor()
    with pytest.warns(DispatchFallbackWarning):
        plan(ascend, ascend.declared_capabilities("A2"), dtype="fp8")
    with pytest.warns(DispatchFallbackWarning):
        plan(other, other.declared_capabilities("A2"), dtype="fp8")


def test_cuda_int8_falls_back_to_fp8(cuda):
    with pytest.warns(DispatchFallbackWarning, match="int8.*fp8"):
        p = plan(cuda, cuda.declared_capabilities("H100"), dtype="int8")
    assert (p.resolved, p.fallback.source, p.fallback.target) == (FP8, INT8, FP8)


def test_int8_scheme_on_cuda_dispatches_fp8_per_token(cuda):
    with pytest.warns(DispatchFallbackWarning):
        p = plan(cuda, cuda.declared_capabilities("H200"), scheme="w8a8-int8")
    assert (p.resolved, p.scale_layout, p.bytes_per_token) == (FP8, ScaleLayout.PER_TOKEN, H + 4)


def test_ascend_rejects_nvfp4_naming_vendor_and_supported_dtypes(ascend):
    with pytest.raises(
        UnsupportedDispatchDtype, match=r"'ascend'.*nvfp4.*supported dispatch dtypes: bf16, fp16, fp32, int8"
    ):
        plan(ascend, ascend.declared_capabilities("A3"), dtype="nvfp4")


def test_nvfp4_scheme_is_rejected_on_ascend(ascend):
    with pytest.raises(UnsupportedDispatchDtype, match="nvfp4"):
        plan(ascend, ascend.declared_capabilities("A3"), scheme="nvfp4")


def test_cuda_before_blackwell_rejects_nvfp4_and_sm80_carries_fp8_as_bf16(cuda):
    with pytest.raises(UnsupportedDispatchDtype, match="sm100"):
        plan(cuda, cuda.declared_capabilities("H100"), dtype="nvfp4")
    with pytest.warns(DispatchFallbackWarning):
        assert plan(cuda, cuda.declared_capabilities("A100"), dtype="fp8").resolved is BF16


def test_fp8_block_scheme_on_ascend_falls_back_to_int8(ascend):
    with pytest.warns(DispatchFallbackWarning):
        p = plan(ascend, ascend.declared_capabilities("A3"), scheme="w8a8-fp8-block")
    assert (p.source, p.requested, p.resolved) == (PlanSource.SCHEME, FP8, INT8)


@pytest.mark.parametrize("model", ["A2", "A3"])
def test_unquantized_and_w4a4_dispatch_bf16_on_ascend(ascend, model):
    caps = ascend.declared_capabilities(model)
    assert plan(ascend, caps, scheme="unquantized").resolved is BF16
    assert plan(ascend, caps, scheme="w4a4-int4").resolved is BF16


# -- isolation ---------------------------------------------------------------------------------


def test_draft_and_target_plans_do_not_affect_each_other(cpu):
    before = dict(os.environ)
    target = resolve_dispatch_plan(cpu, 7168, config=DispatchConfig(dtype="fp8"), scheme="w8a8-fp8-block")
    draft = resolve_dispatch_plan(cpu, 2048, config=DispatchConfig(dtype="bf16"))
    target_again = resolve_dispatch_plan(cpu, 7168, config=DispatchConfig(dtype="fp8"), scheme="w8a8-fp8-block")
    assert (target.resolved, draft.resolved) == (FP8, BF16)
    assert target == target_again
    assert (target.bytes_per_token, draft.bytes_per_token) == (7168 + 4 * 56, 2 * 2048)
    assert dict(os.environ) == before


def test_resolution_only_reads_the_environment_mapping(cpu):
    env = MappingProxyType({ENV_DISPATCH_DTYPE: "int8"})  # writes would raise TypeError
    assert plan(cpu, env=env).resolved is INT8


def test_buffers_are_sized_from_the_plan(cpu):
    p = plan(cpu, dtype="int8", hidden=7168)
    assert p.buffer_bytes(128) == 128 * (7168 + 4)
    with pytest.raises(InvalidInput, match="tokens"):
        p.buffer_bytes(-1)


@pytest.mark.parametrize("hidden", [0, -8, 3.5, True])
def test_bad_hidden_size_is_invalid_input(cpu, hidden):
    with pytest.raises(InvalidInput, match="hidden_size"):
        plan(cpu, hidden=hidden)


def test_bad_config_values_are_invalid_input():
    with pytest.raises(InvalidInput, match="dispatch dtype.*'float7'"):
        DispatchConfig(dtype="float7")
    with pytest.raises(InvalidInput, match="max_dispatch_tokens_per_rank"):
        DispatchConfig(max_dispatch_tokens_per_rank=0)


def test_unknown_scheme_lists_the_known_ones(cpu):
    with pytest.raises(InvalidInput, match="unquantized, w8a8-int8"):
        plan(cpu, scheme="w3a3")
