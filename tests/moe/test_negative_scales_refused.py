"""A weight scale is a magnitude: a negative one (which would flip its block's signs) is refused by name on every
way weights enter a layer, while a zero scale (an all-zero block's) loads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moe
from hal import InvalidInput
from moe.checkpoint import ExpertCheckpointLoader
from tests.support.checkpoint_synthetic import encode_fp8_block, per_expert
from tests.support.load_checks import Before
from tests.support.moe_reference import random_weights

E, H, K = 8, 96, 2
# (scheme, intermediate size): nvfp4's e4m3 block scales need I a multiple of 16
SCHEMES = [("w8a8-int8", 40), ("w8a8-fp8-block", 40), ("w4a16-nvfp4", 48)]


def _layer(scheme: str, inter: int, seed: int = 3) -> moe.MoELayer:
    w13, w2 = random_weights(E, H, inter, seed)
    return moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor="cpu", environ={})


def _with(t: torch.Tensor, value: float, at: int = 3) -> torch.Tensor:
    out = t.float().clone()
    out.view(-1)[at] = value
    return out.to(t.dtype)


@pytest.mark.parametrize(("scheme", "inter"), SCHEMES)
@pytest.mark.parametrize("key", ["experts.w13_scale", "experts.w2_scale"])
def test_a_state_dict_with_a_negative_scale_is_refused_by_key_and_a_zero_scale_loads(scheme, inter, key):
    layer = _layer(scheme, inter)
    before = Before(layer)
    state = _layer(scheme, inter, seed=9).state_dict()
    with pytest.raises(InvalidInput, match=rf"{key}: expected non-negative scales, got 1 negative \(e\.g\. -0\.5\)"):
        layer.load_state_dict(dict(state, **{key: _with(state[key], -0.5)}))
    before.unchanged(layer)
    layer.load_state_dict(dict(state, **{key: _with(state[key], 0.0)}))


@pytest.mark.parametrize(("scheme", "inter"), SCHEMES)
@pytest.mark.parametrize("field", ["w13", "w2"])
def test_hal_format_weights_with_a_negative_scale_are_refused_by_name(scheme, inter, field):
    layer = _layer(scheme, inter)
    before = Before(layer)
    weights = _layer(scheme, inter, seed=9).expert_weights
    weight = getattr(weights, field)
    bad = dataclasses.replace(weight, scale=_with(weight.scale, -2.0, at=0))
    with pytest.raises(InvalidInput, match=rf"expert weights\.{field}\.scale: expected non-negative scales"):
        layer.load_expert_weights(dataclasses.replace(weights, **{field: bad}))
    before.unchanged(layer)


def test_a_checkpoint_block_scale_that_is_negative_is_refused_by_name():
    prefix, hidden, inter = "model.layers.0.mlp", 256, 256
    ckpt = per_expert(lambda w, e, p: encode_fp8_block(w), hidden, inter, 2, prefix, seed=1)
    name = f"{prefix}.experts.1.down_proj.weight_scale_inv"
    loader = ExpertCheckpointLoader("fp8-block128", 2, hidden, inter, prefix=prefix)
    with pytest.raises(InvalidInput, match=rf"{name}: expected non-negative scales, got 1 negative"):
        loader.add(name, _with(ckpt.tensors[name], -1.0, at=1))
    loader.add(name, ckpt.tensors[name])  # the refused tensor left nothing behind
