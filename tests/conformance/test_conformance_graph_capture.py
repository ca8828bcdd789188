"""The suite's graph-capture section passes a vendor whose replays compute on the inputs they are given and
fails vendors whose replays hand back the captured output or ignore new inputs (captures emulated on the
CPU: tests/support/replay_vendor.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from conformance.suite import test_graph_capture as section
from tests.support.replay_vendor import EmulatedGraphSet, ReplayingCpu, ReplayOps
from vendors.cpu import CpuVendor

CHECKS = [
    section.test_a_captured_call_replays_new_inputs_like_the_plain_call,
    section.test_a_graphed_layer_equals_the_plain_layer_call_after_call,
]


class StaleOutput(EmulatedGraphSet):
    """Every replay returns the output of the capture."""

    def capture(self, fn: Callable[..., torch.Tensor], example_inputs: Sequence[torch.Tensor]) -> Callable:
        output = fn(*example_inputs)
        return lambda *given: output.clone()


class CaptureInputs(EmulatedGraphSet):
    """Replays run again, but on the capture's own inputs (the new ones are never copied in)."""

    def capture(self, fn: Callable[..., torch.Tensor], example_inputs: Sequence[torch.Tensor]) -> Callable:
        inputs = tuple(t.clone() for t in example_inputs)
        return lambda *given: fn(*inputs)


def _vendor(graph_set: type[EmulatedGraphSet]) -> ReplayingCpu:
    class Ops(ReplayOps):
        def graph_set(self, device: torch.device) -> EmulatedGraphSet:
            return graph_set()

    class Faulty(ReplayingCpu):
        name = f"cpu-{graph_set.__name__.lower()}"

        def _make_ops(self) -> ReplayOps:
            return Ops()

    return Faulty()


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_a_vendor_whose_replays_compute_on_their_inputs_passes(check):
    check(ReplayingCpu())


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("faulty", [StaleOutput, CaptureInputs])
def test_a_vendor_whose_replays_ignore_new_inputs_fails(check, faulty):
    with pytest.raises(AssertionError, match="differs from the plain"):
        check(_vendor(faulty))


def test_a_vendor_without_graph_capture_is_skipped_with_the_reason():
    with pytest.raises(pytest.skip.Exception, match="declares no graph_capture"):
        CHECKS[0](CpuVendor())
