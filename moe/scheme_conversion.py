"""Weights converted once, at load, to the scheme a vendor runs in place of the one asked for.

Where a vendor lacks the grouped-matmul kind of a layer's scheme and declares a scheme fallback
(`hal.Capabilities.scheme_fallbacks`: FP8 checkpoints as W8A8-INT8 on Atlas A2/A3), the layer computes
with the fallback scheme and every loading path converts: weights in the original scheme's format
(`load_expert_weights`, `moe.checkpoint`) are dequantized and quantized again in the running scheme's
format; float weights (`from_float`, `load_weights`, the transformers drop-in) are first quantized as the
original scheme stores them, so the layer is the original model converted. One expert at a time, in fp32
on the host, then through the vendor's `quantize_weight`: no full-precision copy of all experts is made,
and nothing is converted per forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hal import HOST_DEVICE, Capabilities, QuantizedWeight, SchemeChoice, choose_scheme
from hal.reference import dequantize_weight, quantize_weight
from moe.schemes import ExpertWeights, QuantScheme, make_scheme


def running_scheme(capabilities: Capabilities, requested: QuantScheme) -> tuple[QuantScheme, SchemeChoice]:
    """The scheme a layer of `requested` computes with, and the choice that led to it."""
    choice = choose_scheme(capabilities, requested.traits)
    return (make_scheme(choice.effective.name) if choice.converted else requested), choice


def holds_format(scheme: QuantScheme, weight: QuantizedWeight) -> bool:
    """Whether `weight` is in `scheme`'s weight format (layout and storage dtype)."""
    spec = scheme.gemm_kind().spec
    if weight.layout is not spec.weight_layout:
        return False
    return spec.weight_dtype is None or weight.data.dtype == spec.weight_dtype


def as_stored(source: QuantScheme, w: torch.Tensor) -> torch.Tensor:
    """Float weights `[e, K, N]` (a few experts) as `source` stores them, back in fp32 on the host."""
    spec = source.gemm_kind().spec
    stored = quantize_weight(w.detach().to(HOST_DEVICE, torch.float32), spec.weight_layout, spec.weight_dtype)
    return dequantize_weight(stored)


def convert_float(
    source: QuantScheme,
    quantize: Callable[[torch.Tensor, torch.Tensor], ExpertWeights],
    w13: torch.Tensor,
    w2: torch.Tensor,
    device: torch.device,
) -> ExpertWeights:
    """Float weights of the original model, quantized as `source` stores them and then by `quantize` (the
    running scheme's `quantize_weights` on the vendor), one expert at a time."""
    return _per_expert(
        w13.shape[0], lambda e: quantize(*(as_stored(source, w[e : e + 1]).to(device) for w in (w13, w2)))
    )


def convert_quantized(
    quantize: Callable[[torch.Tensor, torch.Tensor], ExpertWeights], weights: ExpertWeights, device: torch.device
) -> ExpertWeights:
    """Weights in the original scheme's format, dequantized and quantized by `quantize`, one expert at a time;
    biases, global scales and the activation carried over."""

    def one(e: int) -> ExpertWeights:
        pair = (dequantize_weight(_host(w.select(slice(e, e + 1)))).to(device) for w in (weights.w13, weights.w2))
        return quantize(*pair)

    converted = _per_expert(weights.num_experts, one)
    return ExpertWeights(
        converted.w13, converted.w2, w13_bias=weights.w13_bias, w2_bias=weights.w2_bias, activation=weights.activation
    )


def _per_expert(experts: int, convert: Callable[[int], ExpertWeights]) -> ExpertWeights:
    parts = [convert(e) for e in range(experts)]
    return ExpertWeights(_cat([p.w13 for p in parts]), _cat([p.w2 for p in parts]), activation=parts[0].activation)


def _host(w: QuantizedWeight) -> QuantizedWeight:
    move = lambda t: None if t is None else t.to(HOST_DEVICE)
    return QuantizedWeight(w.data.to(HOST_DEVICE), w.layout, move(w.scale), move(w.global_scale))


def _cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    first = parts[0]
    joined = {
        name: None if getattr(first, name) is None else torch.cat([getattr(p, name) for p in parts])
        for name in ("scale", "global_scale")
    }
    return QuantizedWeight(torch.cat([p.data for p in parts]), first.layout, joined["scale"], joined["global_scale"])


__all__ = ["as_stored", "convert_float", "convert_quantized", "holds_format", "running_scheme"]
