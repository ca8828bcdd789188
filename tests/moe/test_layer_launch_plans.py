"""An eager layer records its forward per input signature as a launch plan (`moe.LaunchPlans`, the default)
where its vendor has launch plans: when it records, what it replays, when plans are dropped and which layers
never record (on the CPU, through a vendor whose plans are emulated: tests/support/replay_vendor.py; the CUDA
vendor's real plans: tests/vendors/cuda/test_cuda_launch_plans.py)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import moe
from hal import InvalidInput
from hal.reference import ReferenceOps
from tests.support.moe_reference import TOLERANCE, random_weights, reference_moe, relative_error, softmax_topk
from tests.support.replay_vendor import PlanningCpu
from vendors.cpu import CpuVendor
from vendors.cuda.launch_plans import LaunchPlanSet

E, H, I, K = 16, 160, 48, 4


def _layers(seed: int = 1, **kwargs) -> tuple[moe.MoELayer, moe.MoELayer, PlanningCpu]:
    """A layer on a vendor with launch plans and a plain one over the same weights."""
    w13, w2 = random_weights(E, H, I, seed)
    vendor = PlanningCpu()
    planned = moe.MoELayer.from_float(w13, w2, K, vendor=vendor, environ={}, **kwargs)
    plain = moe.MoELayer.from_float(w13, w2, K, vendor="cpu", check_routing=False, environ={})
    return planned, plain, vendor


def _inputs(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, H, generator=g).to(torch.bfloat16), torch.randn(tokens, E, generator=g)


def _recorded(vendor: PlanningCpu) -> int:
    return sum(s.captured for s in vendor.ops.sets)


def _replayed(vendor: PlanningCpu) -> int:
    return sum(s.replayed for s in vendor.ops.sets)


def test_a_signature_is_recorded_at_its_second_call_and_replayed_after():
    planned, plain, vendor = _layers()
    for call, tokens in enumerate((3, 3, 3, 5, 3)):
        x, logits = _inputs(tokens, call)
        assert torch.equal(planned(x, logits), plain(x, logits))
    assert planned.launch_plan_count == 1 and planned.graph_count == 0
    assert _recorded(vendor) == 1
    assert _replayed(vendor) == 3  # calls 2 (right after recording), 3 and 5; 5 tokens were seen once


def test_precomputed_routing_is_recorded_apart_from_logits():
    planned, plain, _ = _layers()
    x, logits = _inputs(6, 1)
    ids = torch.randint(0, E, (6, K), generator=torch.Generator().manual_seed(2))
    weights = torch.rand(6, K, generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        assert torch.equal(planned(x, logits), plain(x, logits))
        assert torch.equal(planned(x, topk_ids=ids, topk_weights=weights), plain(x, topk_ids=ids, topk_weights=weights))
    assert planned.launch_plan_count == 2


def test_large_batches_and_signatures_past_the_budget_run_the_plain_forward():
    planned, plain, vendor = _layers(launch_plans=moe.LaunchPlans(max_tokens=16, max_plans=2))
    for tokens in (40, 40, 1, 1, 2, 2, 3, 3, 3):
        x, logits = _inputs(tokens, 10 + tokens)
        assert torch.equal(planned(x, logits), plain(x, logits))
    assert planned.launch_plan_count == 2  # 40 is above max_tokens, 3 came after the budget was spent
    assert _recorded(vendor) == 2


def test_new_weights_drop_the_plans_and_a_copy_records_its_own():
    planned, _, _ = _layers()
    x, logits = _inputs(4, 5)
    planned(x, logits)
    planned(x, logits)
    assert planned.launch_plan_count == 1
    w13, w2 = random_weights(E, H, I, 9)
    planned.load_weights(w13, w2)
    assert planned.launch_plan_count == 0
    fresh = moe.MoELayer.from_float(w13, w2, K, vendor="cpu", check_routing=False, environ={})
    for _ in range(3):
        assert torch.equal(planned(x, logits), fresh(x, logits))
    twin = copy.deepcopy(planned)
    assert twin.launch_plan_count == 0
    assert torch.equal(twin(x, logits), fresh(x, logits))


@pytest.mark.parametrize(
    "options",
    [{"launch_plans": None}, {"check_routing": True}, {"graphs": moe.GraphConfig()}],
    ids=["off", "check-routing", "graphs-instead"],
)
def test_layers_that_must_not_record_run_the_plain_forward(options):
    if "graphs" in options:  # graphs need the vendor's graph capture: the plans' vendor has none
        with pytest.raises(Exception, match="graph"):
            _layers(**options)
        return
    planned, plain, vendor = _layers(**options)
    x, logits = _inputs(4, 6)
    for _ in range(3):
        assert torch.equal(planned(x, logits), plain(x, logits))
    assert planned.launch_plan_count == 0 and _recorded(vendor) == 0
    why = "launch_plans=None" if "launch_plans" in options else "check_routing"
    assert planned.eager_calls.startswith("the plain forward: ") and why in planned.eager_calls
    assert f"eager calls: {planned.eager_calls}" in planned.explanation.text()


def test_the_explanation_says_what_eager_calls_recorded_and_why_plans_were_refused():
    planned, _, _ = _layers()
    x, logits = _inputs(4, 9)
    assert "0 recorded" in planned.explanation.text()
    planned(x, logits)
    planned(x, logits)
    assert planned.explanation.as_dict()["eager_calls"].endswith("(1 recorded)")
    w13, w2 = random_weights(E, H, I, 3)
    refusing = moe.MoELayer.from_float(w13, w2, K, vendor=_RecordingCpu(), environ={})
    for _ in range(2):
        refusing(x, logits)
    assert "1 recorded; refused: {'" in refusing.eager_calls and "torch op aten." in refusing.eager_calls
    assert "records no launch plans" in moe.MoELayer.from_float(w13, w2, K, vendor="cpu").eager_calls


def test_a_vendor_without_launch_plans_records_nothing():
    w13, w2 = random_weights(E, H, I, 1)
    layer = moe.MoELayer.from_float(w13, w2, K, vendor="cpu", environ={})
    x, logits = _inputs(4, 7)
    for _ in range(3):
        layer(x, logits)
    assert layer.launch_plan_count == 0


def test_launch_plans_settings_are_checked():
    with pytest.raises(InvalidInput, match="launch_plans"):
        _layers(launch_plans={"max_tokens": 8})
    with pytest.raises(InvalidInput, match="max_plans"):
        moe.LaunchPlans(max_plans=0)
    with pytest.raises(InvalidInput, match="max_tokens"):
        moe.LaunchPlans(max_tokens=-1)


def test_bad_input_to_a_planned_layer_is_refused_as_before():
    planned, _, _ = _layers()
    x, logits = _inputs(4, 8)
    planned(x, logits)
    planned(x, logits)
    with pytest.raises(InvalidInput):
        planned(x[:, :-1], logits)
    with pytest.raises(InvalidInput):
        planned(x, logits[:, :-1])
    assert planned.launch_plan_count == 1


def test_a_compiled_layer_s_op_goes_through_the_launch_plans():
    planned, plain, vendor = _layers()
    compiled = torch.compile(planned, backend="eager", fullgraph=True)
    for seed in range(4):
        x, logits = _inputs(5, seed)
        assert torch.equal(compiled(x, logits), plain(x, logits))
    assert planned.launch_plan_count == 1
    assert _replayed(vendor) == 3


class _RecordingOps(ReferenceOps):
    """The reference ops with the CUDA vendor's real launch-plan recorder (on the CPU: no launches)."""

    def launch_plan_set(self, device: torch.device) -> LaunchPlanSet:
        return LaunchPlanSet(device, lambda: None, lambda: True)


class _RecordingCpu(CpuVendor):
    name = "cpu-recording"

    def _detect_capabilities(self):
        return dataclasses.replace(super()._detect_capabilities(), host_synchronous=False)

    def _make_ops(self) -> _RecordingOps:
        return _RecordingOps()


def test_a_forward_of_torch_ops_is_refused_says_why_and_runs_plainly():
    w13, w2 = random_weights(E, H, I, 3)
    layer = moe.MoELayer.from_float(w13, w2, K, vendor=_RecordingCpu(), environ={})
    plain = moe.MoELayer.from_float(w13, w2, K, vendor="cpu", check_routing=False, environ={})
    for seed in range(3):
        x, logits = _inputs(7, seed)
        assert torch.equal(layer(x, logits), plain(x, logits))
    assert layer.launch_plan_count == 1
    (reason,) = layer.launch_plan_refusals
    assert "torch op aten." in reason
    assert plain.launch_plan_refusals == {}


@pytest.mark.parametrize("top_k", [1, 8])
def test_replayed_calls_match_the_float64_moe_on_a_realistic_shape(top_k):
    """128 experts, hidden 1000 and intermediate 360 (not multiples of 128), 1500 tokens: a replayed call
    agrees with the float64 MoE as a plain one does."""
    experts, hidden, inter, tokens = 128, 1000, 360, 1500
    w13, w2 = random_weights(experts, hidden, inter, 11)
    vendor = PlanningCpu()
    layer = moe.MoELayer.from_float(
        w13, w2, top_k, vendor=vendor, environ={}, launch_plans=moe.LaunchPlans(max_tokens=2048)
    )
    g = torch.Generator().manual_seed(12)
    for _ in range(2):  # the first call runs plainly, the second records
        layer(torch.randn(tokens, hidden, generator=g).to(torch.bfloat16), torch.randn(tokens, experts, generator=g))
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=g)
    ids, weights = softmax_topk(logits, top_k)
    error = relative_error(layer(x, logits), reference_moe(x, ids, weights, w13, w2))
    assert error < TOLERANCE[("unquantized", "bf16")], f"relative error {error:.4f}"
    assert layer.launch_plan_count == 1 and _replayed(vendor) == 2
    assert "up to 2048 tokens" in layer.eager_calls and "(1 recorded)" in layer.explanation.text()
