"""A CPU vendor declaring `graph_capture`, for the layer's bookkeeping of captured forwards on a machine
without graphs. Its `GraphSet` is an emulation: a capture keeps its own input and output tensors like a
CUDA graph, but a replay runs the captured function again on those inputs instead of replaying recorded
kernels. It shows which calls are replayed and when captures are dropped; whether a real replay equals
the plain forward is tested on the GPU (tests/vendors/cuda/test_cuda_graphs.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from hal import GraphSet, InvalidInput
from hal.reference import ReferenceOps
from vendors.cpu import CpuVendor


class EmulatedGraphSet(GraphSet):
    """Captures that run their function again on their own inputs (see the module)."""

    def __init__(self) -> None:
        self.captured = 0
        self.replayed = 0

    def capture(self, fn: Callable[..., torch.Tensor], example_inputs: Sequence[torch.Tensor]) -> Callable:
        inputs = tuple(t.clone() for t in example_inputs)
        output = fn(*inputs)
        self.captured += 1

        def replay(*given: torch.Tensor) -> torch.Tensor:
            if [(t.shape, t.dtype) for t in given] != [(t.shape, t.dtype) for t in inputs]:
                raise InvalidInput("captured call: expected inputs shaped like the capture's")
            for mine, theirs in zip(inputs, given):
                mine.copy_(theirs)
            output.copy_(fn(*inputs))
            self.replayed += 1
            return output.clone()

        return replay


class ReplayOps(ReferenceOps):
    """The reference ops and one `EmulatedGraphSet` per `graph_set` (or `launch_plan_set`) call (`sets` keeps
    them)."""

    def __init__(self) -> None:
        self.sets: list[EmulatedGraphSet] = []

    def graph_set(self, device: torch.device) -> EmulatedGraphSet:
        made = EmulatedGraphSet()
        self.sets.append(made)
        return made


class ReplayingCpu(CpuVendor):
    """The CPU vendor declaring `graph_capture`, its captures emulated (`ReplayOps`)."""

    name = "cpu-replaying"

    def _detect_capabilities(self):
        return dataclasses.replace(super()._detect_capabilities(), graph_capture=True)

    def _make_ops(self) -> ReplayOps:
        return ReplayOps()


class PlanningOps(ReplayOps):
    """`ReplayOps` whose emulated sets are launch plans (`hal.Vendor.launch_plan_set`) instead of graphs."""

    def graph_set(self, device: torch.device) -> EmulatedGraphSet:
        return ReferenceOps.graph_set(self, device)  # no graphs: the reference's refusal

    def launch_plan_set(self, device: torch.device) -> EmulatedGraphSet:
        return ReplayOps.graph_set(self, device)


class PlanningCpu(CpuVendor):
    """The CPU vendor with launch plans (`hal.Vendor.launch_plan_set`), emulated (`PlanningOps`); it does not
    read values back on the host, as a GPU vendor would not (so layers leave `check_routing` off)."""

    name = "cpu-planning"

    def _detect_capabilities(self):
        return dataclasses.replace(super()._detect_capabilities(), host_synchronous=False)

    def _make_ops(self) -> PlanningOps:
        return PlanningOps()
