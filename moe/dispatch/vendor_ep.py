"""A vendor's own expert-parallel dispatcher (Ascend's MC2 ops, DeepEP on CUDA), behind the same interface.

Selected by `DispatchConfig(ep_dispatcher=NAME)` where the vendor declares NAME in
`capabilities().ep_dispatchers`. The vendor's op quantizes to the plan's dtype and moves the
rows in one step, so the layer's dispatch quantizer is not applied here. In normal mode the
experts receive the rows grouped by local expert (`ep-normal`, rows past the counts' sum are
padding the grouped matmul leaves undefined); in low-latency mode (a capacity, for a NAME the
vendor declares in `ep_low_latency`) the masked `[L, capacity * ranks, H]` layout. "auto" takes
low-latency mode when the largest batch of the group fits the capacity (one small all-reduce and
a host read decide it), normal above. The vendor's combine returns each token's weighted sum.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hal import DispatchPlan, UnsupportedCapability, Vendor, invalid
from moe.dispatch.base import DispatchFormat, DispatchOutput, Dispatcher
from moe.routing import Routing
from moe.schemes.base import Quantizer

_FORMATS = {
    "normal": (DispatchFormat.EP_NORMAL,),
    "low-latency": (DispatchFormat.EP_LOW_LATENCY,),
    "auto": (DispatchFormat.EP_NORMAL, DispatchFormat.EP_LOW_LATENCY),
}


class VendorEpDispatcher(Dispatcher):
    """Dispatch and combine through `vendor.ep_dispatch` / `vendor.ep_combine` with dispatcher `name`."""

    format = DispatchFormat.EP_NORMAL

    def __init__(
        self,
        plan: DispatchPlan,
        num_experts: int,
        process_group: Any,
        *,
        vendor: Vendor,
        name: str,
        mode: str = "normal",
        capacity: int | None = None,
    ) -> None:
        if not isinstance(vendor, Vendor):
            raise invalid("vendor", "a hal.Vendor", type(vendor).__name__)
        if not isinstance(name, str) or not name:
            raise invalid("name", "the name of a dispatcher the vendor declares (a non-empty str)", name)
        if mode not in _FORMATS:
            raise invalid("mode", f"one of {', '.join(_FORMATS)}", mode)
        super().__init__(plan, num_experts, process_group, vendor=vendor)
        caps = vendor.capabilities()
        if mode != "normal" and name not in caps.ep_low_latency:
            raise UnsupportedCapability(
                f"dispatch.ep_mode {mode!r}: vendor {vendor.name!r} declares no low-latency mode for expert-parallel "
                f"dispatcher {name!r} (declared for: {', '.join(sorted(caps.ep_low_latency)) or 'none'})"
            )
        self.name, self.mode, self.capacity = name, mode, capacity
        self.capturable = mode == "low-latency"  # normal mode sizes its buffers by counts read back
        self._vendor = vendor
        self.format = _FORMATS[mode][-1] if mode != "auto" else DispatchFormat.EP_NORMAL
        self._last = self.format
        vendor.prepare_ep(
            name,
            process_group=process_group,
            num_experts=num_experts,
            hidden_size=plan.hidden_size,
            dtype=plan.resolved,
            capacity=None if mode == "normal" else capacity,
            layout=plan.scale_layout,
        )

    @property
    def formats(self) -> tuple[DispatchFormat, ...]:
        return _FORMATS[self.mode]

    @property
    def last_mode(self) -> str:
        return "low-latency" if self._last is DispatchFormat.EP_LOW_LATENCY else "normal"

    def _low_latency_now(self, tokens: int, device: torch.device) -> bool:
        if self.mode != "auto":
            return self.mode == "low-latency"
        largest = torch.tensor([tokens], dtype=torch.int64, device=device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(largest.item()) <= self.capacity  # type: ignore[operator]

    def dispatch(self, hidden_states: torch.Tensor, routing: Routing, quantize: Quantizer) -> DispatchOutput:
        """This rank's experts' rows in the plan's dtype (grouped by local expert, or masked) and their counts."""
        low_latency = self._low_latency_now(hidden_states.shape[0], hidden_states.device)
        self._last = DispatchFormat.EP_LOW_LATENCY if low_latency else DispatchFormat.EP_NORMAL
        extra = {"capacity": self.capacity} if low_latency else {}
        payload, counts, handle, *row_index = self._vendor.ep_dispatch(
            hidden_states,
            routing.topk_ids,
            name=self.name,
            dtype=self.plan.resolved,
            num_experts=self.num_experts,
            process_group=self.process_group,
            topk_weights=routing.topk_weights,
            layout=self.plan.scale_layout,
            **extra,
        )
        bound = None
        if low_latency:  # each received token holds at most min(k, L) of this rank's pairs
            bound = (
                self.capacity * self.world_size * min(routing.top_k, self.num_local_experts)  # type: ignore[operator]
            )
        return DispatchOutput(
            self._last, payload, counts, (handle, routing), row_index=(row_index or [None])[0], max_rows=bound
        )

    def combine(self, expert_output: torch.Tensor, dispatched: DispatchOutput, out_dtype: torch.dtype) -> torch.Tensor:
        """Each token's top-k weighted sum of its experts' outputs, on its own rank."""
        handle, routing = dispatched.handle
        return self._vendor.ep_combine(expert_output, routing.topk_weights, handle, name=self.name, out_dtype=out_dtype)

    def __repr__(self) -> str:
        return (
            f"VendorEpDispatcher({self.name}, mode={self.mode}, dtype={self.plan.resolved}, "
            f"experts={self.num_experts}, rank={self.rank}/{self.world_size})"
        )
