"""Everything a layer loads is checked before anything is stored, and a refused load changes nothing.

Non-finite values, shapes and dtypes of float weights, biases, shared experts and their gate,
weights in hal's formats and state dicts are refused with `InvalidInput` naming the tensor;
after each refusal the layer's `state_dict()` and forward are the ones it had.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moe
from hal import InvalidInput
from tests.support.load_checks import Before, same
from tests.support.moe_reference import random_weights

E, H, I, K, IS = 8, 96, 40, 2, 24
VENDORS = ["cpu", "ascend-emulated"]
SCHEMES = ["unquantized", "w8a8-int8", "w8a8-fp8-block"]


def _layer(vendor: str, scheme: str = "unquantized", seed: int = 3, inter: int = I, **kwargs) -> moe.MoELayer:
    w13, w2 = random_weights(E, H, inter, seed)
    return moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor=vendor, environ={}, **kwargs)


def _poisoned(t: torch.Tensor, value: float = float("nan"), at: int = 5) -> torch.Tensor:
    out = t.clone()
    out.view(-1)[at] = value
    return out


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("which", ["w13", "w2", "w13_bias", "w2_bias"])
def test_non_finite_float_weights_and_biases_are_refused_by_name(vendor, which):
    w13, w2 = random_weights(E, H, I, 3)
    given = {"w13": w13, "w2": w2, "w13_bias": torch.randn(E, 2 * I) * 0.1, "w2_bias": torch.randn(E, H) * 0.1}
    layer = moe.MoELayer.from_float(
        w13, w2, K, vendor=vendor, environ={}, w13_bias=given["w13_bias"], w2_bias=given["w2_bias"]
    )
    before = Before(layer)
    given[which] = _poisoned(given[which], float("inf") if which.endswith("bias") else float("nan"))
    with pytest.raises(InvalidInput, match=rf"^{which}: expected finite values, got 1 non-finite"):
        layer.load_weights(given["w13"] * 2, given["w2"], w13_bias=given["w13_bias"], w2_bias=given["w2_bias"])
    before.unchanged(layer)


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("which", ["w13", "w2", "gate"])
def test_non_finite_shared_experts_and_their_gate_are_refused_by_name(vendor, which):
    layer = _layer(vendor, shared_experts=moe.SharedExperts(IS, gated=True))
    s13, s2 = (w[0] for w in random_weights(1, H, IS, 4))
    gate = torch.randn(H) * 0.1
    layer.load_shared_experts(s13, s2, gate=gate)
    before = Before(layer)
    given = {"w13": s13, "w2": s2, "gate": gate}
    given[which] = _poisoned(given[which])
    with pytest.raises(InvalidInput, match=rf"^shared expert {which}: expected finite values"):
        layer.load_shared_experts(given["w13"], given["w2"], gate=given["gate"])
    before.unchanged(layer)


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize(
    ("scheme", "part"),
    [
        ("w8a8-int8", "w13.scale"),
        ("w8a8-int8", "w2.scale"),
        ("w8a8-fp8-block", "w13.data"),
        ("w8a8-fp8-block", "w2.scale"),
    ],
)
def test_non_finite_weights_in_hal_formats_are_refused_by_name(vendor, scheme, part):
    layer = _layer(vendor, scheme)
    before = Before(layer)
    w13, w2 = random_weights(E, H, I, 5)
    stored = moe.make_scheme(scheme).quantize_weights(layer.vendor, w13, w2)
    field, attr = part.split(".")
    weight = getattr(stored, field)
    bad = dataclasses.replace(weight, **{attr: _poisoned(getattr(weight, attr))})
    with pytest.raises(InvalidInput, match=rf"^expert weights\.{part}: expected finite values"):
        layer.load_expert_weights(dataclasses.replace(stored, **{field: bad}))
    before.unchanged(layer)


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_state_dict_with_a_non_finite_tensor_is_refused_by_key_and_changes_nothing(vendor, scheme):
    layer = _layer(vendor, scheme, bias=False)
    other = _layer(vendor, scheme, seed=9).state_dict()
    before = Before(layer)
    for key in [k for k, t in layer.state_dict().items() if torch.is_floating_point(t)]:
        bad = dict(other, **{key: _poisoned(other[key])})
        with pytest.raises(InvalidInput, match=rf"{key}: expected finite values"):
            layer.load_state_dict(bad)
        before.unchanged(layer)


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_state_dict_of_another_intermediate_size_is_refused_with_both_shapes(vendor, scheme):
    layer = _layer(vendor, scheme)
    before = Before(layer)
    other = _layer(vendor, scheme, inter=2 * I).state_dict()
    width = 2 * I
    with pytest.raises(InvalidInput, match=rf"experts\.w13_weight: expected .* of shape \[{E}, {H}, {width}\], got"):
        layer.load_state_dict(other)
    before.unchanged(layer)
    fresh = moe.MoELayer(H, I, E, K, scheme=scheme, vendor=vendor, environ={})
    with pytest.raises(InvalidInput, match=r"experts\.w2_weight: expected .* of shape"):
        fresh.load_state_dict(other)
    assert fresh.expert_weights is None and not fresh.state_dict()


@pytest.mark.parametrize("vendor", VENDORS)
def test_a_state_dict_of_another_dtype_or_format_is_refused_with_both_dtypes(vendor):
    layer = _layer(vendor)
    before = Before(layer)
    state = layer.state_dict()
    with pytest.raises(InvalidInput, match=r"experts\.w13_weight: expected bfloat16 of shape .*, got float32"):
        layer.load_state_dict(dict(state, **{"experts.w13_weight": state["experts.w13_weight"].float()}))
    before.unchanged(layer)
    int8 = _layer(vendor, "w8a8-int8")
    before = Before(int8)
    state = int8.state_dict()
    extra = dict(state, **{"experts.w13_global_scale": torch.ones(E)})
    with pytest.raises(InvalidInput, match=r"experts\.w13_global_scale: expected no such tensor"):
        int8.load_state_dict(extra, strict=False)
    missing = {k: v for k, v in state.items() if k != "experts.w2_scale"}
    with pytest.raises(InvalidInput, match=r"experts\.w2_scale: expected this tensor, got none"):
        int8.load_state_dict(missing, strict=False)
    before.unchanged(int8)


@pytest.mark.parametrize("vendor", VENDORS)
def test_a_refused_shared_expert_state_leaves_the_routed_experts_unloaded_too(vendor):
    layer = _layer(vendor, shared_experts=moe.SharedExperts(IS, gated=True))
    s13, s2 = (w[0] for w in random_weights(1, H, IS, 4))
    layer.load_shared_experts(s13, s2, gate=torch.randn(H) * 0.1)
    before = Before(layer)
    other = _layer(vendor, seed=8, shared_experts=moe.SharedExperts(IS, gated=True))
    other.load_shared_experts(s13 * 2, s2, gate=torch.randn(H))
    state = other.state_dict()
    for key, bad in (
        ("shared_experts.gate", torch.randn(H + 1)),
        ("shared_experts.gate", _poisoned(state["shared_experts.gate"])),
        ("shared_experts.store.w2_weight", state["shared_experts.store.w2_weight"][:, :-1]),
    ):
        with pytest.raises(InvalidInput, match=rf"{key}: expected"):
            layer.load_state_dict(dict(state, **{key: bad}))
        before.unchanged(layer)
    layer.load_state_dict(state)  # the same state, whole, loads
    assert torch.equal(layer(before.x, before.logits), other(before.x, before.logits))


@pytest.mark.parametrize("vendor", VENDORS)
def test_a_layer_inside_a_model_is_left_unchanged_by_a_refused_model_state(vendor):
    model = torch.nn.ModuleDict({"moe": _layer(vendor), "proj": torch.nn.Linear(4, 4)})
    before = Before(model["moe"])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["moe.experts.w2_weight"] = _poisoned(state["moe.experts.w2_weight"], float("-inf"))
    with pytest.raises(RuntimeError, match=r"moe\.experts\.w2_weight: expected finite values"):
        model.load_state_dict(state)  # torch's own report for a plain parent module
    before.unchanged(model["moe"])
    other = _layer(vendor, seed=11)
    state = {f"moe.{k}": v for k, v in other.state_dict().items()}
    state.update({f"proj.{k}": v for k, v in model["proj"].state_dict().items()})
    model.load_state_dict(state)
    assert torch.equal(model["moe"](before.x, before.logits), other(before.x, before.logits))


@pytest.mark.parametrize("vendor", VENDORS)
def test_a_part_refused_by_a_submodule_rolls_back_the_parts_loaded_before_it(vendor):
    layer = _layer(vendor, shared_experts=moe.SharedExperts(IS))
    s13, s2 = (w[0] for w in random_weights(1, H, IS, 4))
    layer.load_shared_experts(s13, s2)
    before = Before(layer)
    other = _layer(vendor, seed=12, shared_experts=moe.SharedExperts(IS))
    other.load_shared_experts(s13 * 3, s2)
    state = other.state_dict()
    no_data = state["shared_experts.store.w2_weight"].to("meta")  # right shape and dtype, but nothing to copy
    with pytest.raises(InvalidInput, match=r"shared_experts\.store\.w2_weight: expected a tensor with data"):
        layer.load_state_dict(dict(state, **{"shared_experts.store.w2_weight": no_data}))
    before.unchanged(layer)  # the routed experts, loaded before the shared ones were refused, are the old ones


@pytest.mark.parametrize("scheme", ["w4a16-mxfp4", "w4a16-nvfp4"])
def test_weight_only_fp4_state_dicts_are_checked_against_their_stored_layout(scheme):
    inter = 64  # a multiple of mxfp4's 32-value blocks
    layer = _layer("cpu", scheme, inter=inter)
    before = Before(layer)
    other = _layer("cpu", scheme, seed=9, inter=inter).state_dict()
    wrong = dict(other, **{"experts.w2_weight": other["experts.w2_weight"][:, :-1]})
    with pytest.raises(InvalidInput, match=rf"experts\.w2_weight: expected uint8 of shape \[{E}, {inter // 2}, {H}\]"):
        layer.load_state_dict(wrong)
    scale = other["experts.w13_scale"].clone()
    if scale.dtype == torch.uint8:  # mxfp4's e8m0 bytes: 255 is NaN
        scale.view(-1)[7] = 255
    else:
        scale.view(torch.uint8).view(-1)[7] = 0x7F
    with pytest.raises(InvalidInput, match=r"experts\.w13_scale: expected finite values"):
        layer.load_state_dict(dict(other, **{"experts.w13_scale": scale}))
    before.unchanged(layer)
    layer.load_state_dict(other)
    assert all(same(t, other[key]) for key, t in layer.state_dict().items())


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize(
    ("given", "scheme", "stored"),
    [
        ("w8a8-fp8", "w8a8-int8", "float8_e4m3fn"),
        ("w8a8-int8", "w8a8-fp8", "int8"),
        ("w4a4-int4", "w8a8-int8", "int32"),
    ],
)
def test_weights_of_another_scheme_in_the_same_layout_are_refused_with_their_storage(vendor, given, scheme, stored):
    if vendor == "ascend-emulated" and "w8a8-fp8" in (given, scheme):
        pytest.skip("the emulated Ascend vendor runs w8a8-fp8 as its int8 fallback")
    layer = _layer(vendor, scheme)
    before = Before(layer)
    w13, w2 = random_weights(E, H, I, 5)
    other = moe.make_scheme(given).quantize_weights(moe.MoELayer.from_float(w13, w2, K, scheme=given).vendor, w13, w2)
    with pytest.raises(InvalidInput, match=rf"^expert weights\.w13: expected .* weights stored as .*got '.* {stored}'"):
        layer.load_expert_weights(other)
    before.unchanged(layer)


@pytest.mark.parametrize("value", [0.0, 1e-45, -0.5, float("inf")])
@pytest.mark.parametrize("key", ["experts.w13_global_scale", "experts.w2_global_scale"])
def test_nvfp4_global_scales_outside_the_normal_positive_range_are_refused(key, value):
    layer = _layer("cpu", "w4a16-nvfp4", inter=48)  # nvfp4 scales blocks of 16 along K
    before = Before(layer)
    other = _layer("cpu", "w4a16-nvfp4", seed=9, inter=48)
    state = other.state_dict()
    bad = state[key].clone()
    bad.view(-1)[1] = value
    with pytest.raises(InvalidInput, match=rf"{key}: expected (positive global scales|finite values)"):
        layer.load_state_dict(dict(state, **{key: bad}))
    before.unchanged(layer)
    weights = other.expert_weights
    field = key.split(".")[1].removesuffix("_global_scale")
    wrong = dataclasses.replace(getattr(weights, field), global_scale=bad)
    with pytest.raises(InvalidInput, match=rf"expert weights\.{field}\.global_scale: expected"):
        layer.load_expert_weights(dataclasses.replace(weights, **{field: wrong}))
    before.unchanged(layer)


@pytest.mark.parametrize("vendor", VENDORS)
def test_finite_weights_that_overflow_the_stored_dtype_are_refused(vendor):
    w13, w2 = random_weights(E, H, I, 3)
    big = w13.clone()
    big[1, 2, 3] = 1e5  # finite in fp32, inf in fp16
    with pytest.raises(InvalidInput, match=r"^w13: expected values within float16's range.*got 1 that overflow"):
        moe.MoELayer.from_float(big, w2, K, scheme="fp16", vendor=vendor, environ={})
    layer = moe.MoELayer(H, I, E, K, bias=True, vendor=vendor, environ={})
    layer.load_weights(w13, w2, w13_bias=torch.randn(E, 2 * I) * 0.1, w2_bias=torch.randn(E, H) * 0.1)
    before = Before(layer)
    huge = torch.full((E, 2 * I), 1e300, dtype=torch.float64)
    with pytest.raises(InvalidInput, match=r"^w13_bias: expected values within float32's range"):
        layer.load_weights(w13, w2, w13_bias=huge, w2_bias=torch.zeros(E, H))
    before.unchanged(layer)


def test_hal_format_weights_with_a_number_where_a_tensor_belongs_are_refused_by_name():
    layer = _layer("cpu", "w8a8-int8")
    weights = dataclasses.replace(layer.expert_weights, input_global_scale=1.0)
    with pytest.raises(
        InvalidInput, match=r"^weights.input_global_scale: expected a torch.Tensor or None, got 'float'"
    ):
        layer.load_expert_weights(weights)
