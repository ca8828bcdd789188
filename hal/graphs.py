"""Captured calls: a sequence of a vendor's ops recorded once and replayed (CUDA graphs, NPU graphs).

A `GraphSet` belongs to one user (a layer): its captures share the device memory of their
intermediates and replay one at a time, in the order they are called, so they never
overwrite each other's work. A capture reads its inputs from tensors of its own, so a call
copies the caller's tensors in, replays and returns a new output tensor; the caller's
tensors may be freed or overwritten as soon as the call returns.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

import torch

#: a captured call: tensors shaped like the capture's example inputs in, a new output tensor out
CapturedCall = Callable[..., torch.Tensor]


class GraphSet(abc.ABC):
    """Captures that share memory and replay one at a time (see `hal.Vendor.graph_set`)."""

    @abc.abstractmethod
    def capture(self, fn: Callable[..., torch.Tensor], example_inputs: Sequence[torch.Tensor]) -> CapturedCall:
        """Run `fn(*example_inputs)` to warm up, capture it, and return the call that replays it.

        `fn` must issue only the vendor's device work: no host synchronisation, no allocation that
        depends on values. The returned call takes tensors of the example inputs' shapes, dtypes
        and device and returns what `fn` returns for them, bit for bit.
        """

    def can_capture(self) -> bool:
        """Whether a capture made now may be kept (True by default); False while the set cannot record, e.g.
        inside another capture: callers then run the plain function and try again later."""
        return True


__all__ = ["CapturedCall", "GraphSet"]
