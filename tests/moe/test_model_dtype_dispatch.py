"""Model-dtype dispatch: fp16 and fp32 dispatch dtypes, and unquantized fp16 / fp32 models computing in
their own dtype (the "model dtype" step of resolution), with provenance, fallbacks, the CLI, and the
layer's accuracy on a realistic shape against float64."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

import moe
from conformance import dtype_facts
from conformance.reference import moe_features
from hal import (
    DeclaredFallback,
    DTYPES,
    KNOWN_SCHEMES,
    Capabilities,
    Codec,
    DispatchConfig,
    DispatchDtype,
    DispatchFallbackWarning,
    InvalidInput,
    PlanSource,
    ScaleLayout,
    UnsupportedDispatchDtype,
    parse_scheme,
    reference,
    resolve_dispatch_plan,
)
from hal.cli import main
from vendors.cpu import CpuVendor

FP16, FP32, BF16 = DispatchDtype.FP16, DispatchDtype.FP32, DispatchDtype.BF16
FLOATS = {torch.float16: FP16, torch.float32: FP32}


# -- the table rows ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("torch_dtype", "dtype"), list(FLOATS.items()), ids=str)
def test_fp16_and_fp32_are_cast_rows(torch_dtype, dtype):
    spec = DTYPES[dtype]
    assert (spec.storage, spec.codec, spec.layouts, spec.scale_dtype) == (
        torch_dtype,
        Codec.CAST,
        (ScaleLayout.NONE,),
        None,
    )
    assert DispatchDtype.cast_of(torch_dtype) is dtype and DispatchDtype.cast_of(torch.bfloat16) is BF16
    assert DispatchDtype.cast_of(torch.int8) is None
    for hidden in (1000, 7168, 200):
        assert dtype.bytes_per_token(hidden) == torch_dtype.itemsize * hidden
        assert dtype_facts.bytes_per_token(dtype, "none", hidden) == torch_dtype.itemsize * hidden
    assert DispatchDtype.parse("float16") is FP16 and DispatchDtype.parse("HALF") is FP16
    assert DispatchDtype.parse("float32") is FP32 and DispatchDtype.parse("float") is FP32


def test_the_suites_bounds_hold_for_the_reference_casts():
    gen = torch.Generator().manual_seed(3)
    magnitudes = torch.logspace(-6, 3, 64, dtype=torch.float64)[:, None]  # fp16 subnormals to 1000s
    x = torch.randn(64, 1000, generator=gen, dtype=torch.float64) * magnitudes
    for dtype in (FP16, FP32):
        q = reference.quantize(x.float(), dtype)
        assert q.data.dtype == dtype.spec.storage and q.scale is None
        error = (reference.activation_value(q) - x.float().double()).abs()
        assert bool((error <= dtype_facts.quantize_bound(dtype.value, "none", x.float().double())).all())
    exact = reference.quantize(x.float(), FP32)
    assert torch.equal(exact.data, x.float())  # fp32 rows of fp32 input are carried exactly
    rounded = {
        d: (reference.activation_value(reference.quantize(x.float(), d)) - x.float().double()).abs().max()
        for d in (BF16, FP16)
    }
    assert float(rounded[FP16]) < float(rounded[BF16]) / 4  # fp16 rounds 8x finer than bf16


# -- scheme traits ----------------------------------------------------------------------------------


def test_unquantized_instances_carry_their_model_dtype():
    base = KNOWN_SCHEMES["unquantized"]
    assert moe.Unquantized.traits is base and base.dispatch_dtype is BF16 and base.model_dtype is None
    assert moe.Unquantized().traits == base  # bf16 stays the default for bf16
    for torch_dtype, dtype in FLOATS.items():
        traits = moe.Unquantized(torch_dtype).traits
        assert (traits.name, traits.model_dtype, traits.preferred_dtype) == ("unquantized", dtype, dtype)
        assert traits.dispatch_dtype is BF16 and traits.accepts == base.accepts
        assert parse_scheme(dtype.value) == traits == base.with_model_dtype(torch_dtype)
    assert parse_scheme("float32") == parse_scheme("fp32") and parse_scheme("bf16") is base
    assert repr(moe.make_scheme("float32")) == "Unquantized(dtype=torch.float32)"
    assert moe.make_scheme("half").gemm_kind().value == "fp16"


def test_only_float_model_dtypes_of_the_unquantized_scheme_are_accepted():
    with pytest.raises(InvalidInput, match="model dtype: expected a float dtype.*int8"):
        KNOWN_SCHEMES["unquantized"].with_model_dtype("int8")
    with pytest.raises(InvalidInput, match="computes in the model dtype \\(unquantized\\).*'w8a8-int8'"):
        KNOWN_SCHEMES["w8a8-int8"].with_model_dtype(torch.float32)
    with pytest.raises(InvalidInput, match="model_dtype"):
        dataclasses.replace(KNOWN_SCHEMES["w8a8-int8"], model_dtype=FP32)


# -- resolution: provenance, precedence, fallbacks ----------------------------------------------------


def _plan(vendor, scheme, *, dtype="auto", env=None, runner=None, caps=None):
    return resolve_dispatch_plan(
        vendor,
        1000,
        config=DispatchConfig(dtype=dtype),
        scheme=scheme,
        runner_dtype=runner,
        environ=env or {},
        capabilities=caps,
    )


def test_the_model_dtype_decides_and_the_trace_says_so(cpu):
    plan = _plan(cpu, moe.Unquantized(torch.float32).traits, runner="fp8")
    assert (plan.source, plan.requested, plan.resolved, plan.fallback) == (PlanSource.MODEL_DTYPE, FP32, FP32, None)
    assert plan.model_dtype is FP32 and plan.bytes_per_token == 4000 and plan.scale_layout is ScaleLayout.NONE
    step = next(s for s in plan.trace if s.decided)
    assert step.source is PlanSource.MODEL_DTYPE and "fp32 weights" in step.detail
    scheme_step = next(s for s in plan.trace if s.source is PlanSource.SCHEME)
    assert scheme_step.says is BF16 and not scheme_step.decided  # the scheme's own dtype, below it
    assert plan.as_dict()["source"] == "model-dtype" and plan.as_dict()["model_dtype"] == "fp32"
    quantized = _plan(cpu, "w8a8-int8")
    assert quantized.trace[3].source is PlanSource.MODEL_DTYPE and quantized.trace[3].says is None
    assert "quantizes" in quantized.trace[3].detail and quantized.model_dtype is None


def test_explicit_and_environment_settings_still_win(cpu):
    traits = moe.Unquantized(torch.float16).traits
    explicit = _plan(cpu, traits, dtype="bf16", env={"HAL_DISPATCH_DTYPE": "fp32"})
    assert (explicit.source, explicit.resolved) == (PlanSource.EXPLICIT, BF16)
    env = _plan(cpu, traits, env={"HAL_DISPATCH_DTYPE": "fp32"})
    assert (env.source, env.resolved) == (PlanSource.ENVIRONMENT, FP32)


def _caps_without_fp32(cpu, **fallback):
    dtypes = cpu.capabilities().dispatch_dtypes - {FP32}
    return dataclasses.replace(cpu.capabilities(), device_name="no-fp32", dispatch_dtypes=dtypes, **fallback)


def test_a_declared_fallback_applies_with_its_reason_and_warns_once(cpu):
    caps = _caps_without_fp32(
        cpu, fallbacks={FP32: DeclaredFallback(BF16, "no fp32 path on this device"), DispatchDtype.NVFP4: None}
    )
    assert caps.consistency_problems() == []
    with pytest.warns(DispatchFallbackWarning, match="no fp32 path"):
        plan = _plan(cpu, "fp32", caps=caps)
    assert (plan.source, plan.requested, plan.resolved) == (PlanSource.MODEL_DTYPE, FP32, BF16)
    assert plan.fallback.reason == "no fp32 path on this device" and plan.bytes_per_token == 2000
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _plan(cpu, "fp32", caps=caps).resolved is BF16  # once per vendor instance


@pytest.mark.parametrize("declared", ["absent", "rejected"])
def test_a_model_dtype_the_vendor_cannot_carry_yields_to_the_schemes_dtype(cpu, declared):
    extra = {"fallbacks": {FP32: DeclaredFallback(None, "fp32 is rejected here")}} if declared == "rejected" else {}
    caps = _caps_without_fp32(cpu, **extra)
    with pytest.warns(DispatchFallbackWarning):
        plan = _plan(cpu, moe.Unquantized(torch.float32).traits, caps=caps)
    assert (plan.requested, plan.resolved, plan.fallback.target) == (FP32, BF16, BF16)
    said = "fp32 is rejected here" if declared == "rejected" else "no-fp32 declares no fp32 dispatch"
    assert said in plan.fallback.reason and "yields to the bf16 of scheme 'unquantized'" in plan.fallback.reason
    with pytest.raises(UnsupportedDispatchDtype, match="cannot dispatch fp32"):  # an explicit request is not softened
        _plan(cpu, "fp32", dtype="fp32", caps=caps)


class _NoFp32Cpu(CpuVendor):
    """The CPU reference with a table that carries no fp32 (declares fp32 -> bf16)."""

    def _detect_capabilities(self) -> Capabilities:
        caps = super()._detect_capabilities()
        return dataclasses.replace(
            caps,
            dispatch_dtypes=caps.dispatch_dtypes - {FP32},
            fallbacks={**caps.fallbacks, FP32: DeclaredFallback(BF16, "test: fp32 travels as bf16")},
        )


def test_a_layer_on_a_vendor_without_fp32_dispatch_carries_bf16_and_computes_fp32():
    gen = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(8, 256, 192, generator=gen) / 16, torch.randn(8, 96, 256, generator=gen) / 10
    with pytest.warns(DispatchFallbackWarning, match="fp32 travels as bf16"):
        layer = moe.MoELayer.from_float(
            w13, w2, 2, scheme=moe.Unquantized(torch.float32), vendor=_NoFp32Cpu(), environ={}
        )
    assert (layer.plan.resolved, layer.plan.fallback.source) == (BF16, FP32)
    x, logits = torch.randn(40, 256, generator=gen), torch.randn(40, 8, generator=gen)
    routing = layer.router(logits)
    y = layer(x, logits)
    error = _max_relative(y, _float64_moe(x, routing.topk_ids, routing.topk_weights, w13, w2))
    assert y.dtype == torch.float32 and 1e-4 < error < 2e-2  # the input's bf16 rounding, nothing more


# -- the CLI ----------------------------------------------------------------------------------------


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        status = main(list(argv))
    except SystemExit as exc:
        status = int(exc.code)
    out, err = capsys.readouterr()
    return status, out, err


def test_explain_shows_the_model_dtype_step(capsys, monkeypatch):
    monkeypatch.delenv("HAL_DISPATCH_DTYPE", raising=False)
    status, out, _ = _run(
        capsys, "explain", "--vendor", "cpu", "--scheme", "unquantized", "--model-dtype", "fp32", "--hidden", "1000"
    )
    assert status == 0 and "model-dtype" in out and "fp32 weights' dtype" in out
    assert "requested: fp32 (from model-dtype)" in out and "resolved:  fp32 (none), 4000 bytes per token" in out
    status, out, _ = _run(capsys, "explain", "--vendor", "cpu", "--scheme", "fp16", "--json")
    plan = json.loads(out)["plan"]
    assert (plan["source"], plan["resolved"], plan["model_dtype"], plan["scheme"]) == (
        "model-dtype",
        "fp16",
        "fp16",
        "unquantized",
    )
    status, out, _ = _run(capsys, "explain", "--vendor", "cpu", "--model-dtype", "bf16", "--json")
    assert json.loads(out)["plan"]["source"] == "scheme"  # bf16 models: the scheme's own dtype
    status, _, err = _run(capsys, "explain", "--vendor", "cpu", "--scheme", "w8a8-int8", "--model-dtype", "fp32")
    assert status == 2 and err.count("\n") == 1 and "quantizes its activations" in err
    status, _, err = _run(capsys, "explain", "--vendor", "cpu", "--model-dtype", "int8")
    assert status == 2 and "expected a float dtype" in err


# -- the layer, against float64, on a realistic shape -----------------------------------------------

EXPERTS, HIDDEN, INTER, TOP_K, TOKENS = 64, 1000, 384, 8, 1000  # H and I not multiples of 128


def _float64_moe(x, ids, weights, w13, w2):  # type: ignore[no-untyped-def]
    """The float64 MoE (SiLU-GLU experts), vectorized per expert: the suite's reference."""
    return moe_features(x, ids, weights, w13, w2)


def _max_relative(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref|."""
    return float((y.double() - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def realistic() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(13)
    w13 = torch.randn(EXPERTS, HIDDEN, 2 * INTER, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, INTER, HIDDEN, generator=gen) / INTER**0.5
    return w13, w2, torch.randn(TOKENS, HIDDEN, generator=gen), torch.randn(TOKENS, EXPERTS, generator=gen)


_REFERENCES: dict[torch.dtype, torch.Tensor] = {}  # float64 MoE of the weights and inputs in each dtype


def _layer_error(realistic, dtype: torch.dtype, dispatch: str = "auto") -> tuple[float, moe.MoELayer]:
    w13, w2, x, logits = realistic
    w13, w2, x = w13.to(dtype), w2.to(dtype), x.to(dtype)  # the reference takes these same values
    layer = moe.MoELayer.from_float(
        w13, w2, TOP_K, scheme=moe.Unquantized(dtype), vendor="cpu", environ={}, dispatch=DispatchConfig(dtype=dispatch)
    )
    y = layer(x, logits)
    assert y.dtype == dtype and tuple(y.shape) == (TOKENS, HIDDEN)
    if dtype not in _REFERENCES:
        routing = layer.router(logits)
        _REFERENCES[dtype] = _float64_moe(x, routing.topk_ids, routing.topk_weights, w13, w2)
    return _max_relative(y, _REFERENCES[dtype]), layer


@pytest.mark.slow
def test_an_fp32_model_is_within_1e_5_of_float64(realistic):
    error, layer = _layer_error(realistic, torch.float32)
    assert (layer.plan.resolved, layer.plan.source) == (FP32, PlanSource.MODEL_DTYPE)
    assert error <= 1e-5, f"max abs error / max abs reference {error:.3g}"  # measured 5e-7 (bf16 dispatch: 2e-3)


@pytest.mark.slow
def test_an_fp16_model_is_not_rounded_to_bf16(realistic):
    error, layer = _layer_error(realistic, torch.float16)
    assert layer.plan.resolved is FP16
    # fp16 outputs of two GEMMs, swiglu and the combine: a few 2^-11 roundings (measured 5e-4).
    assert error <= 2e-3, f"max abs error / max abs reference {error:.3g}"
    carried_as_bf16, _ = _layer_error(realistic, torch.float16, dispatch="bf16")
    assert error < carried_as_bf16 / 3, f"fp16 dispatch {error:.3g} vs bf16 dispatch {carried_as_bf16:.3g}"
