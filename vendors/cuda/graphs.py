"""CUDA graphs for `hal.GraphSet`: one memory pool and one lock per set; and the ops that make the vendor's sets
(CUDA graphs, and launch plans: `vendors.cuda.launch_plans`).

Captures run on the set's own stream. A replay runs on the caller's stream, under the set's lock:
inputs copied into the capture's own, the graph replayed, the output cloned, all in the caller's
stream order, so nothing has to be joined for the common case of one stream. The captures of a set
share the memory of their intermediates (the pool), so no two of their replays may overlap: a replay
from another stream than the set's last one first waits for that stream's work (one event),
whichever threads and streams the calls come from.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from hal import GraphSet, InvalidInput, invalid
from vendors.cuda.kernels.current import capturing, current_device, current_stream
from vendors.cuda.kernels.launch import direct_launches
from vendors.cuda.launch_plans import LaunchPlanSet

#: warm-up runs before a capture (kernels compiled and tuned, lazily built constants made)
WARMUP_RUNS = 2


class CudaGraphSet(GraphSet):
    """Captured calls on one CUDA device sharing a graph memory pool and a stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device=device)
        self._pool = torch.cuda.graph_pool_handle()
        self._lock = threading.Lock()
        self._last_stream: torch.cuda.Stream | None = None  #: the stream the set's last work was ordered on

    def capture(self, fn: Callable[..., torch.Tensor], example_inputs: Sequence[torch.Tensor]) -> CapturedGraph:
        if not callable(fn):
            raise invalid("fn", "a callable", type(fn).__name__)
        inputs = tuple(example_inputs)
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor) or t.device != self.device:
                raise invalid(f"example_inputs[{i}]", f"a tensor on {self.device}", getattr(t, "device", t))
        with self._lock:
            return CapturedGraph(self, fn, inputs)


class CapturedGraph:
    """One captured call: copy the inputs into the capture's own, replay, copy the output out."""

    def __init__(self, owner: CudaGraphSet, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> None:
        self._owner = owner
        stream = owner._stream
        caller = torch.cuda.current_stream(owner.device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            self._inputs = tuple(t.clone() for t in inputs)
            for _ in range(WARMUP_RUNS):
                fn(*self._inputs)
        stream.synchronize()
        self._graph = torch.cuda.CUDAGraph()
        # thread_local: other threads may keep working on the device while this one captures
        with torch.cuda.graph(self._graph, pool=owner._pool, stream=stream, capture_error_mode="thread_local"):
            output = fn(*self._inputs)
        if not isinstance(output, torch.Tensor):
            raise invalid("fn", "a function returning one tensor", type(output).__name__)
        self._output = output
        self._shapes = tuple((t.shape, t.dtype) for t in inputs)
        caller.wait_stream(stream)
        owner._last_stream = caller

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        if tuple((t.shape, t.dtype) for t in inputs) != self._shapes:
            raise InvalidInput(
                f"captured call: expected inputs {[(tuple(s), d) for s, d in self._shapes]}, got "
                f"{[(tuple(t.shape), t.dtype) for t in inputs]}"
            )
        owner = self._owner
        with owner._lock:
            caller = torch.cuda.current_stream(owner.device)
            last = owner._last_stream
            if last is not None and last != caller:  # the set's last replay or capture ran elsewhere
                caller.wait_stream(last)
            owner._last_stream = caller
            for mine, given in zip(self._inputs, inputs):
                mine.copy_(given, non_blocking=True)
            self._graph.replay()
            return self._output.clone()


class CapturingOps:
    """The CUDA ops' captured calls: CUDA graphs (`graph_set`) and launch plans (`launch_plan_set`)."""

    def graph_set(self, device: torch.device) -> CudaGraphSet:
        """CUDA graphs sharing a memory pool and a stream."""
        return CudaGraphSet(device)

    def launch_plan_set(self, device: torch.device) -> LaunchPlanSet:
        """Launch plans of the Triton kernels' launches on `device` (`vendors.cuda.launch_plans`)."""
        # the stream a launch runs on (`kernels.launch`): the current device's current stream
        return LaunchPlanSet(device, lambda: current_stream(current_device()), direct_launches, capturing)
