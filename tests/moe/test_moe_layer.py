"""The MoE layer on the CPU vendor against an independent float64 MoE, plus its contracts."""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
import torch

import moe
from hal import (
    DeclaredFallback,
    DispatchConfig,
    DispatchDtype,
    DispatchFallbackWarning,
    GemmKind,
    InvalidInput,
    UnsupportedDispatchDtype,
)
from tests.support.moe_reference import (
    EMULATED_TOLERANCE,
    TOLERANCE,
    emulated_integer_moe,
    random_weights,
    reference_moe,
    relative_error,
    seed_of,
    softmax_topk,
)
from vendors.cpu import CpuVendor

E, H, I, K = 8, 192, 64, 2  # H = 128 + 64: a partial fp8 channel group


class CarriesInt8AsFp8(CpuVendor):
    """A CPU vendor whose dispatcher carries fp8 but not int8 (as CUDA declares)."""

    name = "cpu-int8-as-fp8"

    def _detect_capabilities(self):
        caps = super()._detect_capabilities()
        return dataclasses.replace(
            caps,
            device_name="cpu (int8 carried as fp8)",
            dispatch_dtypes=frozenset({DispatchDtype.BF16, DispatchDtype.FP8}),
            fallbacks={
                DispatchDtype.INT8: DeclaredFallback(DispatchDtype.FP8, "this test vendor carries int8 as fp8"),
                DispatchDtype.NVFP4: None,
            },
        )


class CarriesNvfp4(CpuVendor):
    """A CPU vendor whose dispatcher also carries nvfp4 (as sm100 CUDA declares)."""

    name = "cpu-nvfp4"

    def _detect_capabilities(self):
        caps = super()._detect_capabilities()
        return dataclasses.replace(caps, dispatch_dtypes=caps.dispatch_dtypes | {DispatchDtype.NVFP4}, fallbacks={})


class WithoutInt4(CpuVendor):
    """A CPU vendor that does not declare the int4 grouped matmul."""

    name = "cpu-no-int4"

    def _detect_capabilities(self):
        caps = super()._detect_capabilities()
        return dataclasses.replace(caps, grouped_matmul=caps.grouped_matmul - {GemmKind.INT4})


def _inputs(tokens: int, seed: int, dtype=torch.bfloat16, skew: bool = False, dead: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    logits = torch.randn(tokens, E, generator=g)
    if skew:  # uneven loads: expert 0 is almost everyone's first choice
        logits[:, 0] += 4.0
    for e in dead:  # experts that receive no token
        logits[:, e] = -1e4
    return x, logits


def _check_against_reference(layer, x, logits, w13, w2, tolerance):
    y = layer(x, logits)
    assert y.dtype == x.dtype and y.shape == x.shape
    ids, weights = softmax_topk(logits, K)
    ref = reference_moe(x, ids, weights, w13, w2)
    error = relative_error(y, ref)
    assert error < tolerance, f"relative error {error:.4f} >= {tolerance}"
    return error


SCHEME_CASES = [
    ("unquantized", "bf16"),
    ("unquantized", "fp8"),
    ("unquantized", "int8"),
    ("w8a8-int8", "auto"),
    ("w8a8-int8", "fp8"),
    ("w8a8-int8", "bf16"),
    ("w8a8-fp8-block", "auto"),
    ("w8a8-fp8-block", "int8"),
    ("w8a8-fp8-block", "bf16"),
    ("w4a4-int4", "auto"),
]
TOKEN_CASES = {"uneven": (24, True, ()), "idle-experts": (16, False, (3, 5)), "one-token": (1, False, ())}


@pytest.mark.parametrize("tokens_case", sorted(TOKEN_CASES))
@pytest.mark.parametrize(("scheme", "dispatch"), SCHEME_CASES)
def test_layer_matches_float64_reference(cpu, scheme, dispatch, tokens_case):
    tokens, skew, dead = TOKEN_CASES[tokens_case]
    seed = seed_of(scheme, dispatch, tokens_case)
    w13, w2 = random_weights(E, H, I, seed)
    layer = moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor=cpu, dispatch=DispatchConfig(dtype=dispatch))
    resolved = layer.plan.resolved.value
    x, logits = _inputs(tokens, seed + 1, skew=skew, dead=dead)
    _check_against_reference(layer, x, logits, w13, w2, TOLERANCE[(scheme, resolved)])


@pytest.mark.parametrize("tokens_case", sorted(TOKEN_CASES))
@pytest.mark.parametrize(("scheme", "qmax"), [("w8a8-int8", 127), ("w4a4-int4", 7)])
def test_integer_schemes_match_an_emulated_reference(cpu, scheme, qmax, tokens_case):
    tokens, skew, dead = TOKEN_CASES[tokens_case]
    seed = seed_of("emulated", scheme, tokens_case)
    w13, w2 = random_weights(E, H, I, seed)
    layer = moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor=cpu)
    x, logits = _inputs(tokens, seed + 1, skew=skew, dead=dead)
    ids, weights = softmax_topk(logits, K)
    error = relative_error(layer(x, logits), emulated_integer_moe(x, ids, weights, w13, w2, qmax))
    assert error < EMULATED_TOLERANCE[scheme], f"relative error {error:.4f}"


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unquantized_weight_dtypes_and_input_dtypes(cpu, weight_dtype):
    w13, w2 = random_weights(E, H, I, 11)
    layer = moe.MoELayer.from_float(w13, w2, K, scheme=moe.Unquantized(weight_dtype), vendor=cpu)
    # unquantized layers dispatch in their weights' dtype (the model-dtype rule) unless configured
    assert layer.plan.resolved is DispatchDtype.cast_of(weight_dtype)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x, logits = _inputs(9, 12, dtype=dtype)
        _check_against_reference(layer, x, logits, w13, w2, TOLERANCE[("unquantized", "bf16")])


def test_zero_tokens_give_an_empty_output_of_the_input_dtype(cpu):
    w13, w2 = random_weights(E, H, I, 3)
    for scheme in ("unquantized", "w8a8-int8", "w8a8-fp8-block", "w4a4-int4"):
        layer = moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor=cpu)
        y = layer(torch.zeros(0, H, dtype=torch.float16), torch.zeros(0, E))
        assert y.shape == (0, H) and y.dtype == torch.float16


def test_leading_dimensions_are_kept(cpu):
    w13, w2 = random_weights(E, H, I, 5)
    layer = moe.MoELayer.from_float(w13, w2, K, vendor=cpu)
    x, logits = _inputs(12, 6)
    flat = layer(x, logits)
    shaped = layer(x.view(3, 4, H), logits.view(3, 4, E))
    assert shaped.shape == (3, 4, H)
    assert torch.equal(shaped.view(12, H), flat)


def test_nvfp4_follows_the_vendor_declaration(cpu):
    w13, w2 = random_weights(E, H, I, 21)
    x, logits = _inputs(16, 22)
    scheme = moe.NvFp4(moe.nvfp4_global_scale(float(x.abs().max())), moe.nvfp4_global_scale(4.0))
    # The CPU vendor declares nvfp4 dispatch rejected: the plan says so at construction.
    with pytest.raises(UnsupportedDispatchDtype, match="nvfp4"):
        moe.MoELayer(H, I, E, K, scheme=scheme, vendor=cpu)
    # Asked for bf16 dispatch, it quantizes to nvfp4 on the experts' side.
    layer = moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor=cpu, dispatch=DispatchConfig(dtype="bf16"))
    assert layer.plan.resolved is DispatchDtype.BF16
    _check_against_reference(layer, x, logits, w13, w2, TOLERANCE[("nvfp4", "bf16")])
    # A vendor that carries nvfp4 dispatches it, scales and global scale included.
    carrier = moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor=CarriesNvfp4())
    assert carrier.plan.resolved is DispatchDtype.NVFP4
    assert carrier.plan.bytes_per_token == H // 2 + H // 16
    _check_against_reference(carrier, x, logits, w13, w2, TOLERANCE[("nvfp4", "nvfp4")])


def test_nvfp4_is_not_built_from_a_bare_name(cpu):
    with pytest.raises(InvalidInput, match="global scales"):
        moe.MoELayer(H, I, E, K, scheme="nvfp4", vendor=cpu)


def test_int8_scheme_requantizes_when_the_vendor_carries_fp8():
    vendor = CarriesInt8AsFp8()
    w13, w2 = random_weights(E, H, I, 31)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = moe.MoELayer.from_float(w13, w2, K, scheme="w8a8-int8", vendor=vendor)
    assert [w.category for w in caught] == [DispatchFallbackWarning]
    assert layer.plan.requested is DispatchDtype.INT8 and layer.plan.resolved is DispatchDtype.FP8
    assert layer.plan.scale_layout.value == "per-token"
    x, logits = _inputs(20, 32, skew=True)
    _check_against_reference(layer, x, logits, w13, w2, TOLERANCE[("w8a8-int8", "fp8")])


def test_low_latency_on_one_rank_equals_the_local_dispatcher(cpu):
    w13, w2 = random_weights(E, H, I, 41)
    x, logits = _inputs(10, 42, skew=True)
    for scheme in ("unquantized", "w8a8-fp8-block"):
        local = moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor=cpu)
        masked = moe.MoELayer.from_float(
            w13, w2, K, scheme=scheme, vendor=cpu, dispatch=DispatchConfig(max_dispatch_tokens_per_rank=16)
        )
        assert isinstance(masked.dispatcher, moe.LowLatencyDispatcher)
        assert torch.equal(masked(x, logits), local(x, logits))
        with pytest.raises(InvalidInput, match="max_dispatch_tokens_per_rank=16"):
            masked(*_inputs(17, 43))
        assert torch.equal(masked(x, logits), local(x, logits))


def test_draft_and_target_models_keep_their_own_plans(cpu):
    before = dict(os.environ)
    w13, w2 = random_weights(E, H, I, 81)
    draft = moe.MoELayer.from_float(w13, w2, K, scheme="unquantized", vendor=cpu)
    target = moe.MoELayer.from_float(w13, w2, K, scheme="w8a8-int8", vendor=cpu, environ={"HAL_DISPATCH_DTYPE": "fp8"})
    third = moe.MoELayer.from_float(w13, w2, K, scheme="w8a8-int8", vendor=cpu, environ={})
    assert (draft.plan.resolved, target.plan.resolved, third.plan.resolved) == (
        DispatchDtype.BF16,
        DispatchDtype.FP8,
        DispatchDtype.INT8,
    )
    assert target.plan.source.value == "environment" and third.plan.source.value == "scheme"
    for step in range(3):  # interleaved calls, as speculative decoding does
        x, logits = _inputs(6 + step, 82 + step)
        _check_against_reference(draft, x, logits, w13, w2, TOLERANCE[("unquantized", "bf16")])
        _check_against_reference(target, x, logits, w13, w2, TOLERANCE[("w8a8-int8", "fp8")])
        _check_against_reference(third, x, logits, w13, w2, TOLERANCE[("w8a8-int8", "int8")])
    assert dict(os.environ) == before
    assert draft.plan.resolved is DispatchDtype.BF16 and target.plan.resolved is DispatchDtype.FP8


def test_grouped_sigmoid_router_in_the_layer(cpu):
    w13, w2 = random_weights(E, H, I, 91)
    bias = torch.linspace(-0.5, 0.5, E)
    router = moe.GroupedSigmoidTopK(E, K, num_groups=4, topk_groups=2, correction_bias=bias)
    layer = moe.MoELayer.from_float(w13, w2, K, vendor=cpu, router=router)
    x, logits = _inputs(10, 92)
    routing = router(logits)
    ref = reference_moe(x, routing.topk_ids, routing.topk_weights.to(torch.float64), w13, w2)
    assert relative_error(layer(x, logits), ref) < TOLERANCE[("unquantized", "bf16")]


BAD_CALLS = {
    "hidden size": (lambda x, lg: (x[:, :-1], lg), "hidden_states"),
    "integer hidden states": (lambda x, lg: (x.to(torch.int32), lg), "hidden_states"),
    "float64 hidden states": (lambda x, lg: (x.to(torch.float64), lg), "hidden_states"),
    "logits of another expert count": (lambda x, lg: (x, lg[:, :-1]), "router_logits"),
    "logits of another token count": (lambda x, lg: (x, lg[:-1]), "router_logits"),
    "integer logits": (lambda x, lg: (x, lg.to(torch.int64)), "router_logits"),
    "not tensors": (lambda x, lg: (x.tolist(), lg), "hidden_states"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_raises_and_leaves_the_layer_usable(cpu, case):
    w13, w2 = random_weights(E, H, I, 101)
    layer = moe.MoELayer.from_float(w13, w2, K, scheme="w8a8-int8", vendor=cpu)
    x, logits = _inputs(7, 102)
    before = layer(x, logits)
    corrupt, argument = BAD_CALLS[case]
    with pytest.raises(InvalidInput, match=argument):
        layer(*corrupt(x, logits))
    assert torch.equal(layer(x, logits), before)


def test_bad_construction_raises_invalid_input(cpu):
    with pytest.raises(InvalidInput, match="top_k"):
        moe.MoELayer(H, I, 4, 5, vendor=cpu)
    with pytest.raises(InvalidInput, match="hidden_size"):
        moe.MoELayer(0, I, E, K, vendor=cpu)
    with pytest.raises(InvalidInput, match="router"):
        moe.MoELayer(H, I, E, K, vendor=cpu, router=moe.SoftmaxTopK(E, K + 1))
    with pytest.raises(InvalidInput, match="scheme"):
        moe.MoELayer(H, I, E, K, vendor=cpu, scheme="w3a3")
    with pytest.raises(InvalidInput, match="accepts"):  # w4a4 cannot consume an fp8 dispatch
        moe.MoELayer(H, I, E, K, vendor=cpu, scheme="w4a4-int4", dispatch=DispatchConfig(dtype="fp8"))
    layer = moe.MoELayer(H, I, E, K, vendor=cpu)
    with pytest.raises(InvalidInput, match="load_weights"):
        layer(*_inputs(2, 1))
    w13, w2 = random_weights(E, H, I, 1)
    with pytest.raises(InvalidInput, match="w13, w2"):
        layer.load_weights(w13[:, :, :-2], w2)
    with pytest.raises(InvalidInput, match="w13, w2"):
        layer.load_weights(w13[:-1], w2[:-1])
    layer.load_weights(w13, w2)
    assert layer(*_inputs(2, 1)).shape == (2, H)
