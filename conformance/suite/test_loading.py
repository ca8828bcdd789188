"""Loading is validated and all or nothing on every vendor: weights, biases, the shared-expert gate and state
dicts holding inf or NaN, or of another layer's shape, are refused with `InvalidInput` naming the tensor,
and the layer then computes and saves exactly what it did before; a property test feeds state dicts with
random corruptions, each refused without a change or computed within the layer's float64 bound."""

from __future__ import annotations

import pytest
import torch

from conformance.capability import BAD_INPUT, mark
from conformance.checks import same_result
from conformance.reference import generator, relative_error, softmax_topk
from conformance.reference import moe as reference_moe
from conformance.tolerances import layer_tolerance
from hal import InvalidInput, Vendor
from moe import MoELayer, SharedExperts, Unquantized

pytest.importorskip("hypothesis", reason="the property tests need hypothesis: pip install 'moe-hal[test]'")
from hypothesis import given
from hypothesis import strategies as st

from conformance.corruptions import corrupted
from conformance.hypothesis_settings import property_settings

pytestmark = mark(BAD_INPUT)

EXPERTS, HIDDEN, INTERMEDIATE, SHARED, TOP_K, TOKENS = 8, 96, 40, 24, 2, 16


def _weights(seed: int, intermediate: int = INTERMEDIATE) -> tuple[torch.Tensor, ...]:
    gen = generator("loading", seed, intermediate)
    w13 = torch.randn(EXPERTS, HIDDEN, 2 * intermediate, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, intermediate, HIDDEN, generator=gen) / intermediate**0.5
    shared = (
        torch.randn(HIDDEN, 2 * SHARED, generator=gen) / HIDDEN**0.5,
        torch.randn(SHARED, HIDDEN, generator=gen) / SHARED**0.5,
        torch.randn(HIDDEN, generator=gen) / 4,
    )
    return w13, w2, *shared


def _layer(vendor: Vendor, seed: int, intermediate: int = INTERMEDIATE) -> MoELayer:
    w13, w2, s13, s2, gate = _weights(seed, intermediate)
    layer = MoELayer(
        HIDDEN,
        intermediate,
        EXPERTS,
        TOP_K,
        scheme=Unquantized(torch.bfloat16),
        vendor=vendor,
        shared_experts=SharedExperts(SHARED, gated=True),
        environ={},
    )
    device = vendor.device
    layer.load_weights(w13.to(device), w2.to(device))
    layer.load_shared_experts(s13.to(device), s2.to(device), gate.to(device))
    return layer


def _inputs(vendor: Vendor) -> tuple[torch.Tensor, torch.Tensor]:
    gen = generator("loading inputs")
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
    return x.to(vendor.device), torch.randn(TOKENS, EXPERTS, generator=gen).to(vendor.device)


def _state(layer: MoELayer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in layer.state_dict().items()}


def _same_state(layer: MoELayer, before: dict[str, torch.Tensor]) -> None:
    after = layer.state_dict()
    assert after.keys() == before.keys(), "a refused load changed the state dict's keys"
    for key, t in after.items():
        assert torch.equal(t, before[key]), f"a refused load changed {key}"


def _poisoned(t: torch.Tensor, value: float) -> torch.Tensor:
    out = t.clone()
    out.view(-1)[out.numel() // 2] = value
    return out


def test_non_finite_weights_biases_and_gate_are_refused_by_name_and_change_nothing(hal_vendor):
    layer = _layer(hal_vendor, 1)
    x, logits = _inputs(hal_vendor)
    out, state = layer(x, logits), _state(layer)
    w13, w2, s13, s2, gate = (t.to(hal_vendor.device) for t in _weights(2))
    calls = {
        "w13": lambda: layer.load_weights(_poisoned(w13, float("nan")), w2),
        "w2": lambda: layer.load_weights(w13, _poisoned(w2, float("-inf"))),
        "shared expert w13": lambda: layer.load_shared_experts(_poisoned(s13, float("inf")), s2, gate),
        "shared expert gate": lambda: layer.load_shared_experts(s13, s2, _poisoned(gate, float("nan"))),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidInput, match=f"^{name}: expected finite values"):
            call()
        _same_state(layer, state)
        assert same_result(hal_vendor, layer(x, logits), out), f"a refused {name} changed the output"


def test_a_state_dict_of_another_layer_or_with_a_non_finite_tensor_is_refused_and_changes_nothing(hal_vendor):
    layer = _layer(hal_vendor, 3)
    x, logits = _inputs(hal_vendor)
    out, state = layer(x, logits), _state(layer)
    wider = _layer(hal_vendor, 4, intermediate=2 * INTERMEDIATE).state_dict()
    with pytest.raises(InvalidInput, match=r"experts\.w13_weight: expected bfloat16 of shape"):
        layer.load_state_dict(wider)
    other = _state(_layer(hal_vendor, 5))
    for key in ("experts.w2_weight", "shared_experts.gate", "shared_experts.store.w13_weight"):
        with pytest.raises(InvalidInput, match=f"{key}: expected finite values"):
            layer.load_state_dict(dict(other, **{key: _poisoned(other[key], float("nan"))}))
    _same_state(layer, state)
    assert same_result(hal_vendor, layer(x, logits), out)


def test_corrupted_state_dicts_are_refused_without_a_change_or_computed_within_bound(hal_vendor, hal_depth):
    layer = _layer(hal_vendor, 6)
    source = _state(_layer(hal_vendor, 7))
    x, logits = _inputs(hal_vendor)
    w13, w2, s13, s2, gate = _weights(7)
    ids, weights = softmax_topk(logits.cpu(), TOP_K)
    routed = reference_moe(x.cpu(), ids, weights, w13.double(), w2.double())
    h = x.cpu().double() @ s13.double()
    shared = (torch.nn.functional.silu(h[:, :SHARED]) * h[:, SHARED:]) @ s2.double()
    want = routed + shared * torch.sigmoid(x.cpu().double() @ gate.double())[:, None]
    bound = layer_tolerance("unquantized", "bf16")

    @property_settings(hal_depth)
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        _, state = corrupted(source, data, lambda key: key.rsplit("_", 1)[0] + "_zero_point")
        strict = data.draw(st.booleans(), label="strict")
        before, out = _state(layer), layer(x, logits)
        try:
            layer.load_state_dict(state, strict=strict)
        except InvalidInput:
            _same_state(layer, before)
            assert same_result(hal_vendor, layer(x, logits), out), "a refused state dict changed the output"
            return
        error = relative_error(layer(x, logits).cpu(), want)
        assert error <= bound, f"an accepted state dict computes with error {error:.3g} > {bound}"

    check()
