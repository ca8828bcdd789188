"""fp16 and fp32 models in their own dtype: the layer of `Unquantized(dtype)` with inputs in that
dtype resolves its dispatch by the model-dtype rule on the vendor's declared table, and stays
within the dtype's bound of the float64 MoE of the same values; a vendor that carries the model
dtype as something else (its declared fallback, or the scheme's bf16 where it declares nothing)
is held to that dtype's layer bound instead."""

from __future__ import annotations

import pytest
import torch

from conformance import dtype_facts
from conformance.capability import layer_label, mark, require_gemm
from conformance.reference import generator, moe as reference_moe, relative_error, softmax_topk
from conformance.tolerances import MODEL_DTYPE_LAYER_TOLERANCE, layer_tolerance
from hal import KNOWN_SCHEMES, Capabilities, DispatchConfig, DispatchDtype, GemmKind, PlanSource
from moe import MoELayer, Unquantized

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 256, 128, 2
CASES = [
    (model, dispatcher, tokens)
    for model in MODEL_DTYPE_LAYER_TOLERANCE
    for dispatcher, tokens in (("local", 37), ("low-latency", 37), ("local", 1))
]


def expected_carrier(caps: Capabilities, model: DispatchDtype) -> DispatchDtype | None:
    """What a model-dtype request becomes on a declared table: kept where carried, else the declared
    fallback where it is carried, else the unquantized scheme's own dtype where that is carried."""
    if model in caps.dispatch_dtypes:
        return model
    target = caps.dispatch_fallbacks.get(model)
    if target is not None and target in caps.dispatch_dtypes:
        return target
    scheme = KNOWN_SCHEMES["unquantized"].dispatch_dtype
    return scheme if scheme in caps.dispatch_dtypes else None


@pytest.mark.parametrize(
    "model, dispatcher, tokens",
    [
        pytest.param(m, d, t, id=f"{m}-model-{d}-{t}-tokens", marks=mark(layer_label("unquantized")))
        for m, d, t in CASES
    ],
)
def test_a_model_computes_in_its_own_dtype(hal_vendor, model, dispatcher, tokens):
    require_gemm(hal_vendor, GemmKind(model))
    dtype = dtype_facts.facts(model).storage
    gen = generator("model-dtype", model, dispatcher, tokens)
    w13 = (torch.randn(EXPERTS, HIDDEN, 2 * INTERMEDIATE, generator=gen) / HIDDEN**0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, INTERMEDIATE, HIDDEN, generator=gen) / INTERMEDIATE**0.5).to(dtype)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    logits = torch.randn(tokens, EXPERTS, generator=gen)
    config = DispatchConfig(max_dispatch_tokens_per_rank=64 if dispatcher == "low-latency" else None)
    carrier = expected_carrier(hal_vendor.capabilities(), DispatchDtype.parse(model))
    assert carrier is not None, f"vendor {hal_vendor.name} carries neither {model} nor bf16"
    layer = MoELayer.from_float(
        w13, w2, TOP_K, scheme=Unquantized(dtype), dispatch=config, vendor=hal_vendor, environ={}
    )
    plan = layer.plan
    assert (plan.source, plan.requested, plan.resolved) == (
        PlanSource.MODEL_DTYPE,
        DispatchDtype.parse(model),
        carrier,
    ), f"plan {plan.as_dict()}"
    y = layer(x.to(hal_vendor.device), logits.to(hal_vendor.device))
    assert tuple(y.shape) == tuple(x.shape) and y.dtype == dtype and y.device == hal_vendor.device
    ids, weights = softmax_topk(logits, TOP_K)
    error = relative_error(y, reference_moe(x, ids, weights, w13, w2))
    bound = (
        MODEL_DTYPE_LAYER_TOLERANCE[model] if carrier.value == model else layer_tolerance("unquantized", carrier.value)
    )
    assert error <= bound, (
        f"relative error {error:.3g} > {bound} for an {model} model carried as {carrier} "
        f"({'fused' if layer.fused else 'unfused'} path)"
    )
