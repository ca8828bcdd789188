"""A vendor's own expert-parallel dispatcher (e.g. Ascend's MC2 ops), behind the same interface.

Selected by `DispatchConfig(ep_dispatcher=NAME)` where the vendor declares NAME in
`capabilities().ep_dispatchers`. The vendor's op quantizes to the plan's dtype and moves the
rows in one step, so the layer's dispatch quantizer is not applied here; the experts receive
the rows grouped by local expert (`ep-normal`, rows past the counts' sum are padding the
grouped matmul leaves undefined), and the vendor's combine returns each token's weighted sum.
"""

from __future__ import annotations

from typing import Any

import torch

from hal import DispatchPlan, Vendor, invalid
from moe.dispatch.base import DispatchFormat, DispatchOutput, Dispatcher
from moe.routing import Routing
from moe.schemes.base import Quantizer


class VendorEpDispatcher(Dispatcher):
    """Dispatch and combine through `vendor.ep_dispatch` / `vendor.ep_combine` with dispatcher `name`."""

    format = DispatchFormat.EP_NORMAL

    def __init__(self, plan: DispatchPlan, num_experts: int, process_group: Any, *, vendor: Vendor,
                 name: str) -> None:
        if not isinstance(vendor, Vendor):
            raise invalid("vendor", "a hal.Vendor", type(vendor).__name__)
        if not isinstance(name, str) or not name:
            raise invalid("name", "the name of a dispatcher the vendor declares (a non-empty str)", name)
        super().__init__(plan, num_experts, process_group, vendor=vendor)
        self.name = name
        self._vendor = vendor

    def dispatch(self, hidden_states: torch.Tensor, routing: Routing, quantize: Quantizer) -> DispatchOutput:
        """This rank's experts' rows in the plan's dtype, grouped by local expert, and their counts."""
        payload, counts, handle = self._vendor.ep_dispatch(
            hidden_states, routing.topk_ids, name=self.name, dtype=self.plan.resolved, num_experts=self.num_experts,
            process_group=self.process_group)
        return DispatchOutput(self.format, payload, counts, (handle, routing))

    def combine(self, expert_output: torch.Tensor, dispatched: DispatchOutput,
                out_dtype: torch.dtype) -> torch.Tensor:
        """Each token's top-k weighted sum of its experts' outputs, on its own rank."""
        handle, routing = dispatched.handle
        return self._vendor.ep_combine(expert_output, routing.topk_weights, handle, name=self.name,
                                       out_dtype=out_dtype)

    def __repr__(self) -> str:
        return (f"VendorEpDispatcher({self.name}, dtype={self.plan.resolved}, experts={self.num_experts}, "
                f"rank={self.rank}/{self.world_size})")
