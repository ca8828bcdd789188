"""One forward of `MoELayer` in stages, so an engine can interleave micro-batches.

`MoELayer.start` routes, quantizes and starts the dispatch (a `StartedForward`); its `wait()`
gives the `DispatchOutput`; `MoELayer.run_experts` computes the experts; `MoELayer.finish`
starts the combine (a `Pending`) whose `wait()` gives the output. Between a start and its
wait, or a finish and its wait, the caller may issue another micro-batch's work, which the
dispatcher's collectives (`async_op=True`) then overlap::

    a, b = layer.start(x0, logits0), layer.start(x1, logits1)
    done_a = layer.finish(layer.run_experts(a.wait()), a)   # b's dispatch travels meanwhile
    done_b = layer.finish(layer.run_experts(b.wait()), b)   # a's combine travels meanwhile
    y0, y1 = done_a.wait(), done_b.wait()                   # == layer(x0, logits0), layer(x1, logits1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hal import UnsupportedCapability, invalid
from moe.dispatch import DispatchOutput, Pending
from moe.layer_inputs import check_hidden_states, routing_inputs

if TYPE_CHECKING:
    from moe.pipeline import UnfusedPipeline


@dataclass(frozen=True, eq=False)
class StartedForward:
    """One micro-batch whose dispatch is on its way (`MoELayer.start`); `finish` takes it back."""

    dispatch: Pending  #: `wait()` gives the `DispatchOutput`
    rows: torch.Tensor  #: the input as `[T, H]` rows (the shared experts take them)
    shape: torch.Size  #: the input's shape, which the output takes
    layer_id: int  #: `id()` of the layer that started it

    @property
    def dtype(self) -> torch.dtype:
        """The input's dtype, which the output takes."""
        return self.rows.dtype

    def wait(self) -> DispatchOutput:
        """The dispatch output (waits for its communication; the same object on every call)."""
        return self.dispatch.wait()  # type: ignore[return-value]


__all__ = ["StartedForward"]


class StagedForward:
    """`MoELayer.start` / `run_experts` / `finish`: one forward in stages (a mixin of `MoELayer`, which provides
    the attributes and the private helpers these use)."""

    def start(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        *,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
    ) -> StartedForward:
        """Route, quantize and start the dispatch of one micro-batch (arguments and checks as `forward`);
        `wait()` on the result gives the `DispatchOutput` for `run_experts`. With a process group this is
        collective, like `forward`: every rank starts (and finishes) its micro-batches in the same order;
        a low-latency dispatcher holds at most two micro-batches in flight.

        `finish(run_experts(started.wait()), started).wait()` equals `forward(...)` bit for bit. Eager only,
        on the unfused path: the fused op (`fused_deep_moe`) raises `UnsupportedCapability`."""
        pipeline = self._unfused_pipeline("start")
        x = check_hidden_states(hidden_states, self.hidden_size, self.vendor.device)
        logits, ids, weights = routing_inputs(
            self, hidden_states, router_logits, topk_ids, topk_weights, self.vendor.device
        )
        routed_x, routing = self._routed_rows(x, logits, ids, weights)
        pending = self.dispatcher.dispatch_async(routed_x, routing, pipeline.quantize)
        return StartedForward(pending, x, hidden_states.shape, id(self))

    def run_experts(self, dispatched: DispatchOutput) -> torch.Tensor:
        """This rank's experts' output rows for a dispatch output (`start(...).wait()`), by the runner of
        its format."""
        if not isinstance(dispatched, DispatchOutput):
            raise invalid("dispatched", "a moe.DispatchOutput (MoELayer.start(...).wait())", type(dispatched).__name__)
        return self._unfused_pipeline("run_experts").experts(dispatched)

    def finish(self, expert_output: torch.Tensor, started: StartedForward) -> Pending:
        """Start the combine of `expert_output` (`run_experts`) for the micro-batch `started`; `wait()` on
        the result gives its output, in the input's shape and dtype. The shared experts run here, beside
        the combine; the tensor-parallel sum (a collective) runs in `wait()`."""
        if not isinstance(started, StartedForward) or started.layer_id != id(self):
            raise invalid(
                "started",
                "what this layer's start() returned",
                "one of another layer" if isinstance(started, StartedForward) else type(started).__name__,
            )
        self._unfused_pipeline("finish")
        x, partial, shared = started.rows, self.tensor_shard.size > 1, self.shared_experts
        out_dtype = torch.float32 if partial or shared is not None else x.dtype
        combining = self.dispatcher.combine_async(expert_output, started.wait(), out_dtype)
        shared_output = None if shared is None else self.vendor.overlap(lambda: shared(self.vendor, self.scheme, x))

        def output() -> torch.Tensor:
            out: torch.Tensor = combining.wait()  # type: ignore[assignment]
            if shared_output is not None:
                out = out + shared_output()
            out = (self._tensor_parallel_sum(out) if partial else out).to(x.dtype)
            return out if out.shape == started.shape else out.view(started.shape)

        return Pending([], output)

    def _unfused_pipeline(self, stage: str) -> UnfusedPipeline:
        if self.fused:
            raise UnsupportedCapability(
                f"MoELayer.{stage}: this layer takes the vendor's fused op (fused_deep_moe), one op for dispatch, "
                "experts and combine, which has no stages; build it with fused=False to run it in stages"
            )
        return self._loaded_pipeline()  # type: ignore[return-value]  # not fused: unfused
