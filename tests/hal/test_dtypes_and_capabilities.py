"""DispatchDtype parsing and sizes; Capabilities as a frozen value; the vendors' declared tables."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hal import Capabilities, DeclaredFallback, DispatchDtype, GemmKind, Int8QuantMode, InvalidInput, ScaleLayout
from vendors.ascend.capabilities import generation_of
from vendors.cuda.capabilities import cuda_capabilities


@pytest.mark.parametrize(
    "text, dtype",
    [
        ("bf16", DispatchDtype.BF16),
        ("BF16", DispatchDtype.BF16),
        (" BFloat16 ", DispatchDtype.BF16),
        ("FP8", DispatchDtype.FP8),
        ("fp8-e4m3", DispatchDtype.FP8),
        ("Int8", DispatchDtype.INT8),
        ("NVFP4", DispatchDtype.NVFP4),
        ("Auto", DispatchDtype.AUTO),
        ("FP16", DispatchDtype.FP16),
        ("float16", DispatchDtype.FP16),
        ("Half", DispatchDtype.FP16),
        ("fp32", DispatchDtype.FP32),
        ("float32", DispatchDtype.FP32),
        ("float", DispatchDtype.FP32),
    ],
)
def test_parse_is_case_insensitive(text, dtype):
    assert DispatchDtype.parse(text) is dtype


@pytest.mark.parametrize("bad", ["fp4", "", "int4", 8, None])
def test_unknown_names_list_the_valid_ones(bad):
    names = ", ".join(DispatchDtype.names())  # every row of hal's table, then auto
    assert names.startswith("bf16") and names.endswith("auto")
    with pytest.raises(InvalidInput, match=f"expected one of {names}"):
        DispatchDtype.parse(bad)


@pytest.mark.parametrize("hidden", [128, 2048, 4096, 7168, 200])
def test_bytes_per_token_formulas(hidden):
    assert DispatchDtype.BF16.bytes_per_token(hidden) == 2 * hidden
    assert DispatchDtype.FP16.bytes_per_token(hidden) == 2 * hidden
    assert DispatchDtype.FP32.bytes_per_token(hidden) == 4 * hidden
    assert DispatchDtype.INT8.bytes_per_token(hidden) == hidden + 4
    assert DispatchDtype.FP8.bytes_per_token(hidden, ScaleLayout.PER_TOKEN) == hidden + 4
    groups = -(-hidden // 128)
    assert DispatchDtype.FP8.bytes_per_token(hidden) == hidden + 4 * groups
    if hidden % 16 == 0:
        assert DispatchDtype.NVFP4.bytes_per_token(hidden) == hidden // 2 + hidden // 16


def test_concrete_sizes_for_deepseek_hidden():
    assert DispatchDtype.FP8.bytes_per_token(7168) == 7168 + 56 * 4
    assert DispatchDtype.NVFP4.bytes_per_token(7168) == 3584 + 448


def test_bytes_per_token_rejects_bad_arguments():
    with pytest.raises(InvalidInput, match="multiple of 16"):
        DispatchDtype.NVFP4.bytes_per_token(100)
    with pytest.raises(InvalidInput, match="auto"):
        DispatchDtype.AUTO.bytes_per_token(128)
    with pytest.raises(InvalidInput, match="scale layout"):
        DispatchDtype.INT8.bytes_per_token(128, ScaleLayout.GROUP_128)


def _table(**overrides):
    base = dict(device_name="t", dispatch_dtypes={"bf16", "int8"}, fallbacks={"fp8": "int8"})
    base.update(overrides)
    return Capabilities(**base)


def test_capabilities_are_frozen_and_derive_fp8_support():
    caps = _table()
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.dispatch_dtypes = frozenset()  # type: ignore[misc]
    with pytest.raises(TypeError):
        caps.fallbacks[DispatchDtype.NVFP4] = None  # type: ignore[index]
    assert not caps.supports_fp8_dispatch
    assert _table(dispatch_dtypes={"bf16", "fp8", "int8"}, fallbacks={}).supports_fp8_dispatch
    assert caps.fallback_for("FP8") is DispatchDtype.INT8 and caps.fallback_for("nvfp4") is None
    assert json.loads(json.dumps(caps.as_dict()))["dispatch_fallbacks"] == {"fp8": "int8"}


def test_consistency_problems_are_found():
    assert _table().consistency_problems() == []
    problems = _table(
        fallbacks={"fp8": "nvfp4", "int8": "bf16"},
        default_dispatch_dtype="fp8",
        scale_layouts={"int8": "per-token-group-128"},
    ).consistency_problems()
    text = " | ".join(problems)
    assert "fp8 -> nvfp4 targets an unsupported dtype" in text
    assert "fallback declared for int8" in text
    assert "default dispatch dtype fp8" in text
    assert "scale layout per-token-group-128 declared for int8" in text


def test_one_fallback_map_with_reasons_and_derived_views():
    caps = _table(
        dispatch_dtypes={"bf16"},
        fallbacks={
            "fp8": DeclaredFallback("bf16", "no fp8 here"),
            "nvfp4": DeclaredFallback(None, "no fp4"),
            "int8": None,
        },
    )
    assert caps.fallback_for("fp8") is DispatchDtype.BF16 and caps.fallback_for("nvfp4") is None
    assert dict(caps.fallback_reasons) == {DispatchDtype.FP8: "no fp8 here", DispatchDtype.NVFP4: "no fp4"}
    assert caps.fallbacks[DispatchDtype.INT8] == DeclaredFallback(None, "")
    assert caps.int8_quant_mode is Int8QuantMode.NONE  # derived: int8 is not carried
    assert _table().int8_quant_mode is Int8QuantMode.PER_TOKEN_DYNAMIC
    assert caps.fp8_scale_layout is ScaleLayout.GROUP_128  # fp8's default
    assert _table(scale_layouts={"fp8": "per-token"}).fp8_scale_layout is ScaleLayout.PER_TOKEN
    with pytest.raises(InvalidInput, match="auto"):
        DeclaredFallback("auto")


def test_auto_is_not_a_capability():
    with pytest.raises(InvalidInput, match="auto"):
        _table(dispatch_dtypes={"bf16", "auto"})


def test_declared_tables_of_shipped_vendors_are_consistent(cpu, cuda, ascend):
    for vendor in (cpu, cuda, ascend):
        for model, caps in vendor.declared_models().items():
            assert caps.consistency_problems() == [], (vendor.name, model)
            assert caps.default_dispatch_dtype is DispatchDtype.BF16, (vendor.name, model)


def test_cuda_tables_follow_the_compute_capability():
    ampere, ada, hopper, blackwell = (cuda_capabilities("x", cc) for cc in ((8, 0), (8, 9), (9, 0), (10, 0)))
    assert not ampere.supports_fp8_dispatch and ada.supports_fp8_dispatch and hopper.supports_fp8_dispatch
    assert DispatchDtype.NVFP4 in blackwell.dispatch_dtypes and DispatchDtype.NVFP4 not in hopper.dispatch_dtypes
    assert hopper.fallback_for("int8") is DispatchDtype.FP8 and hopper.int8_quant_mode is Int8QuantMode.NONE
    assert GemmKind.FP8_BLOCK128 in hopper.grouped_matmul and GemmKind.FP8_BLOCK128 not in ampere.grouped_matmul
    assert hopper.collective_backend == "nccl"


def test_ascend_tables_carry_the_float_casts_and_int8(ascend):
    for model in ("A2", "A3"):
        caps = ascend.declared_capabilities(model.lower())
        assert caps.dispatch_dtypes == {DispatchDtype.BF16, DispatchDtype.FP16, DispatchDtype.FP32, DispatchDtype.INT8}
        assert caps.fallback_for("fp8") is DispatchDtype.INT8 and caps.fallback_for("nvfp4") is None
        assert caps.int8_quant_mode is Int8QuantMode.PER_TOKEN_DYNAMIC
        assert caps.collective_backend == "hccl" and caps.limits.max_inner_dim == 65535
    a5 = ascend.declared_capabilities("A5")  # fp8 only where the chip computes it
    assert a5.supports_fp8_dispatch and a5.fallback_for("nvfp4") is None
    assert generation_of("Ascend910_9392") == "A3" and generation_of("Ascend910B3") == "A2"
    assert generation_of("Ascend950PR") == "A5" and generation_of("Ascend310P3") is None


def test_unknown_device_model_lists_the_declared_ones(cuda):
    with pytest.raises(InvalidInput, match="H100, H200, B200, L40S, A100.*'V100'"):
        cuda.declared_capabilities("V100")


def test_quantized_containers_reject_malformed_parts():
    import torch

    from hal import QuantizedTensor, QuantizedWeight

    with pytest.raises(InvalidInput, match="multiple of 16 channels"):
        QuantizedTensor(
            torch.zeros(1, 12, dtype=torch.uint8),
            "nvfp4",
            "block-16",
            torch.zeros(1, 1, dtype=torch.float8_e4m3fn),
            torch.ones(1),
        )
    with pytest.raises(InvalidInput, match="global_scale: expected a one-element fp32"):
        QuantizedTensor(
            torch.zeros(1, 8, dtype=torch.uint8),
            "nvfp4",
            "block-16",
            torch.zeros(1, 1, dtype=torch.float8_e4m3fn),
            torch.ones(1, dtype=torch.float64),
        )
    with pytest.raises(InvalidInput, match=r"scale: expected torch.float32 of shape \(2,\)"):
        QuantizedTensor(torch.zeros(2, 8, dtype=torch.int8), "int8", "per-token", torch.zeros(3))
    with pytest.raises(InvalidInput, match="layout"):
        QuantizedTensor(torch.zeros(2, 8, dtype=torch.int8), "int8", "per-token-group-128", torch.zeros(2, 1))
    with pytest.raises(InvalidInput, match=r"scale: expected float32 of shape \(2, 1, 1\)"):
        QuantizedWeight(torch.zeros(2, 4, 4, dtype=torch.float8_e4m3fn), "block-128x128", torch.zeros(2, 4))
    with pytest.raises(InvalidInput, match="3 dimensions"):
        QuantizedWeight(torch.zeros(4, 4))
    with pytest.raises(InvalidInput, match=r"^QuantizedWeight.layout: expected one of .*'per-channel'.*got 'foo'"):
        QuantizedWeight(torch.zeros(2, 4, 4), "foo")
    with pytest.raises(InvalidInput, match=r"^QuantizedWeight.data: expected a torch.Tensor, got 'list'"):
        QuantizedWeight([[1]])
    with pytest.raises(InvalidInput, match=r"^QuantizedWeight.scale: expected a torch.Tensor or None, got 'float'"):
        QuantizedWeight(torch.zeros(2, 4, 4, dtype=torch.int8), "per-channel", 1.0)
