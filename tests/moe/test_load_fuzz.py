"""Property: a valid checkpoint or state dict with one random corruption (inf or NaN in a random tensor, a
wrong shape or dtype, a missing, extra or truncated tensor) is either refused with `hal.InvalidInput`,
leaving the layer (or the loader) as it was, or loaded and computed within the layer's bound of the
float64 MoE of the uncorrupted weights. Never another error, never a silently different layer.

The default run draws a few dozen examples per path; `-m slow` runs the long profile.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moe
from conformance.corruptions import corrupted
from conformance.tolerances import layer_tolerance
from hal import DispatchConfig, InvalidInput
from moe.checkpoint import ExpertCheckpointLoader
from tests.checkpoint.test_checkpoint_formats import ENCODERS
from tests.support.checkpoint_synthetic import per_expert
from tests.support.load_checks import Before
from tests.support.moe_reference import random_weights, reference_moe, relative_error, softmax_topk

P = "model.layers.4.mlp"
E, H, I, K, T = 4, 128, 128, 2, 12  # checkpoints (fp8-block128 splits gate and up on 128-row tiles)
HS, IS = 64, 96  # state dicts (multiples of 32, mxfp4's block)
#: (vendor, scheme) of the state-dict path; nvfp4 and the weight-only 4-bit schemes on the CPU vendor only (no
#: fp4 on Atlas A2/A3)
LAYERS = [(v, s) for v in ("cpu", "ascend-emulated") for s in ("unquantized", "w8a8-int8", "w8a8-fp8-block")] + [
    ("cpu", s) for s in ("nvfp4", "w4a16-mxfp4", "w4a16-nvfp4")
]
QUICK = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
LONG = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))


def _scheme(name: str) -> moe.QuantScheme | str:
    return moe.NvFp4(moe.nvfp4_global_scale(5.0), moe.nvfp4_global_scale(3.0)) if name == "nvfp4" else name


def _dispatch(scheme: object) -> DispatchConfig | None:
    return DispatchConfig(dtype="bf16") if isinstance(scheme, moe.NvFp4) else None  # the CPU carries no nvfp4


@functools.cache
def _checkpoint(fmt: str):
    return per_expert(ENCODERS[fmt], H, I, E, P, seed=13)


@functools.cache
def _master() -> tuple[torch.Tensor, torch.Tensor]:
    return random_weights(E, HS, IS, 21)


@functools.cache
def _checkpoint_reference(fmt: str) -> torch.Tensor:
    """The float64 MoE of the uncorrupted checkpoint for `_inputs()`."""
    x, logits = _inputs()
    ids, weights = softmax_topk(logits, K)
    return reference_moe(x, ids, weights, *_checkpoint(fmt).expected(range(E)))


@functools.cache
def _state_reference() -> torch.Tensor:
    """The float64 MoE of the state loaded (w13 halved) for `_inputs()`."""
    (w13, w2), (x, logits) = _master(), _inputs(HS)
    ids, weights = softmax_topk(logits, K)
    return reference_moe(x, ids, weights, w13.double() * 0.5, w2.double())


def _inputs(hidden: int = H) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return torch.randn(T, hidden, generator=g).to(torch.bfloat16), torch.randn(T, E, generator=g)


def _checkpoint_property(data: st.DataObject) -> None:
    fmt = data.draw(st.sampled_from(sorted(ENCODERS)), label="format")
    vendor = data.draw(st.sampled_from(["cpu"] if fmt == "nvfp4" else ["cpu", "ascend-emulated"]), label="vendor")
    ckpt = _checkpoint(fmt)
    _, tensors = corrupted(ckpt.tensors, data, lambda key: key.rsplit(".", 1)[0] + ".weight_zero_point")
    loader = ExpertCheckpointLoader(fmt, E, H, I)
    try:
        for name, t in tensors.items():
            loader.add(name, t)
        scheme = loader.scheme()
        layer = moe.MoELayer(H, I, E, K, scheme=scheme, vendor=vendor, environ={}, dispatch=_dispatch(scheme))
        layer.load_expert_weights(loader.build())
    except InvalidInput:
        return
    x, logits = _inputs()
    assert relative_error(layer(x, logits), _checkpoint_reference(fmt)) <= _bound(layer)


@functools.cache
def _layer_and_state(vendor: str, name: str) -> tuple[moe.MoELayer, dict[str, torch.Tensor]]:
    """A layer, and the state of another one (of half its w13) to load into it; the layer changes only
    where a corrupted state is accepted, which makes it that state's layer."""
    scheme, (w13, w2) = _scheme(name), _master()
    kwargs = dict(scheme=scheme, vendor=vendor, environ={}, dispatch=_dispatch(scheme))
    layer = moe.MoELayer.from_float(w13, w2, K, **kwargs)
    return layer, moe.MoELayer.from_float(w13 * 0.5, w2, K, **kwargs).state_dict()


def _state_dict_property(data: st.DataObject) -> None:
    layer, source = _layer_and_state(*data.draw(st.sampled_from(LAYERS), label="layer"))
    _, state = corrupted(source, data, lambda key: key.rsplit("_", 1)[0] + "_zero_point")
    strict = data.draw(st.booleans(), label="strict")
    before = Before(layer)
    try:
        layer.load_state_dict(state, strict=strict)
    except InvalidInput:
        before.unchanged(layer)
        return
    x, logits = _inputs(HS)
    error = relative_error(layer(x, logits), _state_reference())
    assert error <= _bound(layer)


def _bound(layer: moe.MoELayer) -> float:
    """The layer's error bound: its scheme's, or the declared one of the scheme fallback it converted at load."""
    if layer.source_scheme is not None:
        return layer.vendor.capabilities().scheme_fallbacks[layer.source_scheme.name].max_error
    return layer_tolerance(layer.scheme.name, str(layer.plan.resolved))


@QUICK
@given(data=st.data())
def test_a_corrupted_checkpoint_is_refused_or_computes_its_float64_moe(data):
    _checkpoint_property(data)


@QUICK
@given(data=st.data())
def test_a_corrupted_state_dict_is_refused_without_a_change_or_computes_its_float64_moe(data):
    _state_dict_property(data)


@pytest.mark.slow
@LONG
@given(data=st.data())
def test_many_corrupted_checkpoints_are_refused_or_compute_their_float64_moe(data):
    _checkpoint_property(data)


@pytest.mark.slow
@LONG
@given(data=st.data())
def test_many_corrupted_state_dicts_are_refused_without_a_change_or_compute_their_float64_moe(data):
    _state_dict_property(data)
