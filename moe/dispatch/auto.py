"""Expert-parallel mode chosen per call: low-latency for decode-sized batches, normal above them.

Every rank of the group must take the same mode in a call (their collectives must match), and
ranks route different numbers of tokens, so the choice needs the largest batch of any rank. The
normal mode's count exchange carries each rank's token count beside its counts; after its one
host synchronisation every rank knows the largest batch and takes low-latency mode when it fits
the capacity (its fixed-size collectives then move the tokens) or goes on in normal mode with
the counts in hand. A call costs one host synchronisation either way (a layer built for
low-latency mode alone costs none and can be captured in a CUDA graph).
"""

from __future__ import annotations

from typing import Any

import torch

from hal import DispatchPlan, Vendor
from moe.dispatch.all_to_all import AllToAllDispatcher
from moe.dispatch.base import DispatchFormat, DispatchOutput, Dispatcher, Pending
from moe.dispatch.low_latency import LowLatencyDispatcher
from moe.routing import Routing
from moe.schemes.base import Quantizer


class AutoDispatcher(Dispatcher):
    """Low-latency mode for calls whose largest batch (over the group) fits `capacity`, normal above."""

    format = DispatchFormat.EP_NORMAL
    capturable = False  # the mode is chosen per call from the batch sizes read back

    def __init__(
        self,
        plan: DispatchPlan,
        num_experts: int,
        capacity: int,
        process_group: Any = None,
        *,
        vendor: Vendor | None = None,
    ) -> None:
        super().__init__(plan, num_experts, process_group, vendor=vendor)
        self.normal = AllToAllDispatcher(plan, num_experts, process_group, vendor=vendor)
        self.low_latency = LowLatencyDispatcher(plan, num_experts, capacity, process_group, vendor=vendor)
        self.capacity = self.low_latency.capacity
        self._last = "normal"

    @property
    def last_mode(self) -> str:
        """ "normal" or "low-latency": what the latest dispatch took."""
        return self._last

    def dispatch(self, hidden_states: torch.Tensor, routing: Routing, quantize: Quantizer) -> DispatchOutput:
        pending = self.dispatch_async(hidden_states, routing, quantize, async_op=False)
        return pending.wait()  # type: ignore[return-value]

    def dispatch_async(
        self, hidden_states: torch.Tensor, routing: Routing, quantize: Quantizer, *, async_op: bool = True
    ) -> Pending:
        """Exchange the counts (with every rank's batch size), then dispatch in the mode they call for."""
        sizes = self.normal.exchange_sizes(routing.topk_ids)
        if sizes.max_tokens <= self.capacity:
            self._last = "low-latency"
            return self.low_latency.dispatch_async(hidden_states, routing, quantize, async_op=async_op)
        self._last = "normal"
        return self.normal.dispatch_async(hidden_states, routing, quantize, sizes=sizes, async_op=async_op)

    def _mode(self, dispatched: DispatchOutput) -> Dispatcher:
        return self.low_latency if self.low_latency.owns(dispatched) else self.normal

    def combine(self, expert_output: torch.Tensor, dispatched: DispatchOutput, out_dtype: torch.dtype) -> torch.Tensor:
        return self._mode(dispatched).combine(expert_output, dispatched, out_dtype)

    def combine_async(
        self, expert_output: torch.Tensor, dispatched: DispatchOutput, out_dtype: torch.dtype, *, async_op: bool = True
    ) -> Pending:
        return self._mode(dispatched).combine_async(  # type: ignore[call-arg]
            expert_output, dispatched, out_dtype, async_op=async_op
        )

    def __repr__(self) -> str:
        return (
            f"AutoDispatcher(dtype={self.plan.resolved}, experts={self.num_experts}, capacity={self.capacity}, "
            f"rank={self.rank}/{self.world_size}, last={self.last_mode})"
        )
