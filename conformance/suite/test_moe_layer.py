"""The MoE layer of every scheme the vendor can run, against the float64 MoE of its float
weights, for every dispatch dtype the scheme accepts; and `fused_deep_moe` where declared,
against the unfused path on the same inputs."""

from __future__ import annotations

import pytest
import torch

from conformance.capability import build_scheme, fused_label, layer_label, mark, require_fused, require_scheme
from conformance.expectations import expected_resolution
from conformance.reference import emulated_integer_moe, generator, moe as reference_moe, relative_error, softmax_topk
from conformance.tolerances import (
    EMULATED_LAYER_TOLERANCE,
    FUSED_TOLERANCE,
    WEIGHT_ONLY_LAYER_TOLERANCE,
    layer_tolerance,
)
from hal import KNOWN_SCHEMES, DispatchConfig, DispatchDtype, UnsupportedDispatchDtype
from hal.reference import weight_value
from moe import MoELayer

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 256, 128, 2


def _weights(seed_parts: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    gen = generator("weights", *seed_parts)
    w13 = torch.randn(EXPERTS, HIDDEN, 2 * INTERMEDIATE, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, INTERMEDIATE, HIDDEN, generator=gen) / INTERMEDIATE**0.5
    return w13, w2


def _inputs(tokens: int, seed_parts: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    gen = generator("inputs", *seed_parts)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    logits = torch.randn(tokens, EXPERTS, generator=gen)
    logits[: tokens // 3, 0] += 3.0  # uneven loads: expert 0 is popular
    return x, logits


def _cases():
    for scheme, traits in KNOWN_SCHEMES.items():
        requests = [None, *sorted(traits.accepts, key=lambda d: d.value)]
        for requested in requests:
            yield scheme, requested, "local", 29
        for dispatcher, tokens in (("low-latency", 29), ("local", 1), ("local", 0)):
            yield scheme, None, dispatcher, tokens


@pytest.mark.parametrize(
    "scheme, requested, dispatcher, tokens",
    [
        pytest.param(s, r, d, t, id=f"{s}-{r or 'auto'}-{d}-{t}-tokens", marks=mark(layer_label(s)))
        for s, r, d, t in _cases()
    ],
)
def test_layer_matches_the_float64_moe(hal_vendor, scheme, requested, dispatcher, tokens):
    require_scheme(hal_vendor, scheme)
    parts = (scheme, requested, dispatcher, tokens)
    w13, w2 = _weights(parts)
    x, logits = _inputs(tokens, parts)
    quant = build_scheme(scheme, input_amax=float(x.abs().max()) if tokens else 4.0)
    config = DispatchConfig(
        dtype=requested or DispatchDtype.AUTO, max_dispatch_tokens_per_rank=64 if dispatcher == "low-latency" else None
    )
    expected = expected_resolution(hal_vendor.capabilities(), requested, KNOWN_SCHEMES[scheme])
    build = dict(scheme=quant, dispatch=config, vendor=hal_vendor, environ={})
    if expected.outcome == "rejected":
        with pytest.raises(UnsupportedDispatchDtype):
            MoELayer.from_float(w13, w2, TOP_K, **build)
        return
    layer = MoELayer.from_float(w13, w2, TOP_K, **build)
    assert layer.plan.resolved == expected.resolved
    y = layer(x.to(hal_vendor.device), logits.to(hal_vendor.device))
    assert tuple(y.shape) == tuple(x.shape) and y.dtype == x.dtype and y.device == hal_vendor.device
    ids, weights = softmax_topk(logits, TOP_K)
    ref = reference_moe(x, ids, weights, w13, w2)
    bound = layer_tolerance(scheme, str(expected.resolved))
    error = relative_error(y, ref)
    path = "fused" if layer.fused else "unfused"
    assert error <= bound, (
        f"relative error {error:.4g} > {bound} for scheme {scheme} carried as {expected.resolved} ({path} path)"
    )
    kind = KNOWN_SCHEMES[scheme].gemm_kind
    if kind is not None and kind.spec.weight_only and expected.resolved is DispatchDtype.BF16 and tokens:
        stored = layer.experts.weights  # as the vendor prepared them: the values its GEMMs multiply by
        exact = reference_moe(x, ids, weights, weight_value(stored.w13).float(), weight_value(stored.w2).float())
        error = relative_error(y, exact)
        assert error <= WEIGHT_ONLY_LAYER_TOLERANCE, (
            f"relative error {error:.4g} > {WEIGHT_ONLY_LAYER_TOLERANCE} against the MoE of the layer's own "
            f"{kind} weights ({path} path)"
        )
    if scheme in EMULATED_LAYER_TOLERANCE and expected.resolved in (DispatchDtype.INT8, DispatchDtype.BF16):
        levels, tight = EMULATED_LAYER_TOLERANCE[scheme]
        error = relative_error(y, emulated_integer_moe(x, ids, weights, w13, w2, levels))
        assert error <= tight, (
            f"relative error {error:.4g} > {tight} against the MoE rounded where {scheme} rounds ({path} path)"
        )


@pytest.mark.parametrize("scheme", [pytest.param(s, marks=mark(fused_label(s))) for s in KNOWN_SCHEMES])
def test_fused_deep_moe_equals_the_unfused_path(hal_vendor, scheme):
    require_fused(hal_vendor, scheme)
    caps = hal_vendor.capabilities()
    quant = build_scheme(scheme)
    if not caps.supports_gemm(quant.gemm_kind()):
        pytest.skip(
            f"vendor {hal_vendor.name} declares no {quant.gemm_kind()} grouped matmul: "
            "there is no unfused path to compare with"
        )
    w13, w2 = _weights(("fused", scheme))
    x, logits = _inputs(23, ("fused", scheme))
    x_dev, logits_dev = x.to(hal_vendor.device), logits.to(hal_vendor.device)
    fused = MoELayer.from_float(w13, w2, TOP_K, scheme=quant, vendor=hal_vendor, environ={})
    unfused = MoELayer.from_float(w13, w2, TOP_K, scheme=quant, vendor=hal_vendor, environ={}, fused=False)
    assert fused.fused and not unfused.fused
    y_fused, y_unfused = fused(x_dev, logits_dev), unfused(x_dev, logits_dev)
    assert y_fused.dtype == x.dtype and tuple(y_fused.shape) == tuple(x.shape)
    difference = relative_error(y_fused, y_unfused.double().cpu())
    assert difference <= FUSED_TOLERANCE, f"fused differs from unfused by {difference:.4g} (> {FUSED_TOLERANCE})"
    ids, weights = softmax_topk(logits, TOP_K)
    error = relative_error(y_fused, reference_moe(x, ids, weights, w13, w2))
    bound = layer_tolerance(scheme, str(fused.plan.resolved))
    assert error <= bound, f"fused relative error {error:.4g} > {bound} against the float64 MoE"
