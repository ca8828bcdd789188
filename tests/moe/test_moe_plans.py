"""Scheme-aware dispatch (design.md section 4, step 3) on the CPU, CUDA and Ascend declared tables.

The layer asks `hal` for its plan with the scheme's traits; these tests resolve the same
plans against the declared tables of absent hardware, so no GPU or NPU is needed.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import moe
from hal import DispatchConfig, DispatchDtype, UnsupportedDispatchDtype, resolve_dispatch_plan

H = 7168  # DeepSeek-V3's hidden size: 56 fp8 channel groups

SCHEMES = {
    "unquantized": moe.Unquantized(),
    "w8a8-int8": moe.W8A8Int8(),
    "w8a8-fp8-block": moe.W8A8Fp8Block(),
    "w4a4-int4": moe.W4A4Int4(),
    "nvfp4": moe.NvFp4(input_global_scale=100.0, intermediate_global_scale=100.0),
}

#: (vendor fixture, declared model) -> scheme -> resolved dispatch dtype, or None when rejected.
EXPECTED = {
    ("cpu", "cpu"): {
        "unquantized": "bf16",
        "w8a8-int8": "int8",
        "w8a8-fp8-block": "fp8",
        "w4a4-int4": "bf16",
        "nvfp4": None,
    },
    ("cuda", "H100"): {
        "unquantized": "bf16",
        "w8a8-int8": "fp8",
        "w8a8-fp8-block": "fp8",
        "w4a4-int4": "bf16",
        "nvfp4": None,
    },
    ("cuda", "B200"): {
        "unquantized": "bf16",
        "w8a8-int8": "fp8",
        "w8a8-fp8-block": "fp8",
        "w4a4-int4": "bf16",
        "nvfp4": "nvfp4",
    },
    ("cuda", "A100"): {
        "unquantized": "bf16",
        "w8a8-int8": "bf16",
        "w8a8-fp8-block": "bf16",
        "w4a4-int4": "bf16",
        "nvfp4": None,
    },
    ("ascend", "A2"): {
        "unquantized": "bf16",
        "w8a8-int8": "int8",
        "w8a8-fp8-block": "int8",
        "w4a4-int4": "bf16",
        "nvfp4": None,
    },
    ("ascend", "A3"): {
        "unquantized": "bf16",
        "w8a8-int8": "int8",
        "w8a8-fp8-block": "int8",
        "w4a4-int4": "bf16",
        "nvfp4": None,
    },
}

CASES = [(vendor, model, scheme) for (vendor, model), table in EXPECTED.items() for scheme in table]


@pytest.mark.parametrize(("vendor_name", "model", "scheme_name"), CASES)
def test_scheme_plan_on_declared_tables(request, vendor_name, model, scheme_name):
    vendor = request.getfixturevalue(vendor_name)
    caps = vendor.declared_capabilities(model)
    scheme = SCHEMES[scheme_name]
    expected = EXPECTED[(vendor_name, model)][scheme_name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if expected is None:
            with pytest.raises(UnsupportedDispatchDtype, match=scheme.traits.preferred_dtype.value):
                resolve_dispatch_plan(vendor, H, scheme=scheme.traits, capabilities=caps, environ={})
            return
        plan = resolve_dispatch_plan(vendor, H, scheme=scheme.traits, capabilities=caps, environ={})
    assert plan.resolved.value == expected
    assert plan.source.value == "scheme"
    assert plan.requested is scheme.traits.preferred_dtype
    fell_back = plan.requested is not plan.resolved
    assert (plan.fallback is not None) == fell_back
    assert len(caught) == int(fell_back)  # one fallback warning, only when a fallback applied
    assert plan.bytes_per_token == plan.resolved.bytes_per_token(H, plan.scale_layout)
    if plan.resolved is DispatchDtype.FP8:
        # int8 carried as fp8 keeps its per-token scale; the block scheme uses 128-channel groups.
        expected_scales = 1 if scheme_name == "w8a8-int8" else H // 128
        assert plan.bytes_per_token == H + 4 * expected_scales != 2 * H


def test_the_layer_resolves_the_same_plan_as_hal(cpu):
    for name in ("unquantized", "w8a8-int8", "w8a8-fp8-block", "w4a4-int4"):
        layer = moe.MoELayer(256, 64, 8, 2, scheme=name, vendor=cpu, environ={})
        direct = resolve_dispatch_plan(cpu, 256, scheme=SCHEMES[name].traits, environ={})
        assert layer.plan == direct


def test_explicit_and_environment_requests_beat_the_scheme(cpu):
    explicit = moe.MoELayer(
        256,
        64,
        8,
        2,
        scheme="w8a8-int8",
        vendor=cpu,
        dispatch=DispatchConfig(dtype="bf16"),
        environ={"HAL_DISPATCH_DTYPE": "fp8"},
    )
    assert (explicit.plan.resolved.value, explicit.plan.source.value) == ("bf16", "explicit")
    env = moe.MoELayer(256, 64, 8, 2, scheme="w8a8-int8", vendor=cpu, environ={"HAL_DISPATCH_DTYPE": "fp8"})
    assert (env.plan.resolved.value, env.plan.source.value) == ("fp8", "environment")


@pytest.mark.parametrize(("vendor_name", "model"), list(EXPECTED))
@pytest.mark.parametrize("weights", [torch.float16, torch.float32], ids=str)
def test_fp16_and_fp32_models_dispatch_in_their_own_dtype_on_declared_tables(request, vendor_name, model, weights):
    """Every shipped table carries fp16 and fp32: the model dtype decides, without a fallback."""
    vendor = request.getfixturevalue(vendor_name)
    traits = moe.Unquantized(weights).traits
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = resolve_dispatch_plan(
            vendor, H, scheme=traits, capabilities=vendor.declared_capabilities(model), environ={}
        )
    wanted = DispatchDtype.cast_of(weights)
    assert (plan.source.value, plan.requested, plan.resolved, plan.fallback) == ("model-dtype", wanted, wanted, None)
    assert plan.scheme == "unquantized" and plan.model_dtype is wanted
    assert plan.bytes_per_token == H * weights.itemsize


def test_unquantized_fp32_models_dispatch_fp32(cpu):
    layer = moe.MoELayer(256, 64, 8, 2, scheme=moe.Unquantized(torch.float32), vendor=cpu, environ={})
    assert layer.plan.resolved is DispatchDtype.FP32 and layer.plan.bytes_per_token == 1024
    assert layer.plan == resolve_dispatch_plan(cpu, 256, scheme="fp32", environ={})
    bf16 = moe.MoELayer(256, 64, 8, 2, scheme=moe.Unquantized(torch.bfloat16), vendor=cpu, environ={})
    plan = bf16.plan
    assert (plan.resolved, plan.source.value, plan.bytes_per_token) == (DispatchDtype.BF16, "scheme", 512)
