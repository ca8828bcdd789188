"""Scheme fallbacks declared by a vendor, in both directions: a vendor without int8 GEMMs running W8A8-INT8
models as W8A8-FP8 (the card's reverse example), weights converted exactly once at load and never per
forward; the conformance check of declared fallbacks on such a vendor; undeclared chains refused naming
both the scheme and the dispatch fallback; declarations that contradict themselves refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import conformance.suite.test_scheme_fallbacks as fallback_checks
import moe
from hal import Capabilities, GemmKind, InvalidInput, LayerSpec, ReferenceOps, SchemeFallback, UnsupportedCapability
from hal.cli import main
from vendors.cpu.vendor import CpuVendor


class CountingOps(ReferenceOps):
    """The reference, counting weight quantizations (a conversion at load shows up here)."""

    def __init__(self) -> None:
        self.weight_quantizations = 0

    def quantize_weight(self, weight, *, layout, dtype):  # type: ignore[no-untyped-def]
        self.weight_quantizations += 1
        return super().quantize_weight(weight, layout=layout, dtype=dtype)


class NoInt8Gemm(CpuVendor):
    """A device without int8 GEMMs that declares W8A8-INT8 models run as W8A8-FP8."""

    name = "no-int8-gemm"

    def _detect_capabilities(self) -> Capabilities:
        base = super()._detect_capabilities()
        return dataclasses.replace(
            base,
            device_name="a device without int8 GEMMs",
            grouped_matmul=base.grouped_matmul - {GemmKind.INT8},
            scheme_fallbacks={
                "w8a8-int8": SchemeFallback("w8a8-fp8", "no int8 tensor cores: int8 weights as fp8 per channel", 0.08)
            },
        )

    def _make_ops(self) -> CountingOps:
        return CountingOps()


class NoFp8AtAll(CpuVendor):
    """A device with neither fp8 GEMMs nor fp8 dispatch, declaring no fallback for either."""

    name = "no-fp8"

    def _detect_capabilities(self) -> Capabilities:
        base = super()._detect_capabilities()
        fp8 = {GemmKind.FP8_BLOCK128, GemmKind.FP8_ROWWISE}
        return dataclasses.replace(
            base, grouped_matmul=base.grouped_matmul - fp8, dispatch_dtypes=base.dispatch_dtypes - {"fp8"}
        )


def _weights(e=16, h=256, i=192, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, h, 2 * i, generator=g) / h**0.5, torch.randn(e, i, h, generator=g) / i**0.5


def test_int8_models_run_as_fp8_where_int8_gemms_are_lacking_and_convert_once():
    vendor = NoInt8Gemm()
    w13, w2 = _weights()
    layer = moe.MoELayer.from_float(w13, w2, 4, scheme="w8a8-int8", vendor=vendor, environ={})
    assert (layer.scheme.name, layer.source_scheme.name) == ("w8a8-fp8", "w8a8-int8")
    assert layer.expert_weights.w13.data.dtype == torch.float8_e4m3fn
    at_load = vendor.ops.weight_quantizations
    assert at_load == 2 * 16  # both projections of each expert, once
    x, logits = torch.randn(33, 256).to(torch.bfloat16), torch.randn(33, 16)
    first = layer(x, logits)
    for _ in range(3):
        assert torch.equal(layer(x, logits), first)
    assert vendor.ops.weight_quantizations == at_load, "weights were quantized again during a forward"
    assert "scheme fallback: w8a8-int8 -> w8a8-fp8" in layer.explanation.text()


def test_the_conformance_check_holds_on_a_vendor_declaring_the_reverse_fallback():
    fallback_checks.test_declared_scheme_fallback_stays_within_its_bound(NoInt8Gemm(), "quick", "w8a8-int8", 8)


def test_an_undeclared_chain_is_refused_naming_both_fallbacks():
    with pytest.raises(UnsupportedCapability) as refused:
        moe.MoELayer(256, 192, 8, 2, scheme="w8a8-fp8-block", vendor=NoFp8AtAll(), environ={})
    message = str(refused.value)
    assert "no scheme fallback is declared" in message
    assert "no dispatch fallback is declared for its activations (fp8) either" in message


def test_refused_scheme_fallbacks_name_their_reason_on_the_emulated_npu():
    from vendors.ascend.emulation.vendor import EmulatedAscendVendor

    spec = LayerSpec(1024, 512, 8, 2, scheme="nvfp4")
    problems = " ".join(p.message for p in spec.problems(EmulatedAscendVendor("Ascend910B3").capabilities()))
    assert "its scheme fallback is refused: Atlas A2 has no fp4 support" in problems
    assert "the dispatch fallback of its activations (nvfp4) is refused too" in problems


def test_contradicting_scheme_fallback_declarations_are_refused():
    with pytest.raises(InvalidInput, match="scheme"):
        Capabilities("x", frozenset({"bf16"}), scheme_fallbacks={"w8a8-int8": SchemeFallback("no-such-scheme")})
    with pytest.raises(InvalidInput, match="falls back to itself"):
        Capabilities("x", frozenset({"bf16"}), scheme_fallbacks={"int8": SchemeFallback("w8a8-int8")})
    with pytest.raises(InvalidInput, match="max_error"):
        SchemeFallback("w8a8-int8", "why", -1.0)
    caps = Capabilities(
        "x",
        frozenset({"bf16"}),
        grouped_matmul=frozenset({GemmKind.BF16, GemmKind.INT8}),
        scheme_fallbacks={"w8a8-int8": SchemeFallback("w8a8-fp8")},
    )
    problems = caps.consistency_problems()
    assert any("whose int8 grouped matmul is declared" in p for p in problems)
    assert any("targets an undeclared fp8-rowwise matmul" in p for p in problems)


def test_hal_explain_shows_the_scheme_then_the_dispatch_fallback(capsys):
    assert main(["explain", "--vendor", "ascend-emulated", "--device-model", "A2", "--scheme", "w8a8-fp8-block"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "scheme: w8a8-fp8-block -> w8a8-int8, weights converted once at load: Atlas A2 has no fp8 matmul" in out
    assert "fallback: fp8 -> int8" in out
    assert (
        main(["explain", "--vendor", "ascend-emulated", "--device-model", "A2", "--scheme", "w8a8-fp8-block", "--json"])
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["scheme_fallback"]["runs_as"] == "w8a8-int8" and data["plan"]["resolved"] == "int8"
