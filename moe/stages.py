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

import torch

from moe.dispatch import DispatchOutput, Pending


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
