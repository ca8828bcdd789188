"""Low-latency expert-parallel dispatch: fixed capacity, fixed-size collectives, masked layout.

Each rank may send at most `capacity` (`max_dispatch_tokens_per_rank`) tokens per call,
so expert e can receive at most `capacity` rows from each rank and every buffer has a
fixed size: the send and receive buffers hold `ranks * local_experts * capacity` token
records of `plan.bytes_per_token` bytes each. They are allocated per call (from the
device's caching allocator where it has one), so one dispatcher serves several threads
(or streams) at once; a construction whose buffers could never fit the vendor's device
memory raises `InvalidInput`. Slots no token fills are never read as rows, so the
buffers are not cleared. All index arithmetic stays on the device (no host
synchronisation), so the layer can be captured in a CUDA graph where the backend allows it.

The payload handed to the experts is `[local_experts, capacity * ranks, H]`; the first
`expert_counts[e]` rows of expert e are valid (source rank order, then token order) and
the rest are zero. More tokens than the capacity raise `InvalidInput`; nothing is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hal import DispatchPlan, InvalidInput, Vendor, invalid, positive_int
from moe.dispatch.base import DispatchFormat, DispatchOutput, Dispatcher, sort_by_expert
from moe.dispatch.wire import as_bytes, from_bytes, pack, unpack
from moe.routing import Routing
from moe.schemes.base import Quantizer


@dataclass(frozen=True)
class _LowLatencyHandle:
    routing: Routing
    slot: torch.Tensor  #: slot of each flat (token, k) pair in its expert's send block
    masked_row: torch.Tensor  #: row of the flat masked payload each received slot went to


class LowLatencyDispatcher(Dispatcher):
    """Masked-layout dispatch with a fixed per-rank token capacity (one rank or many)."""

    format = DispatchFormat.EP_LOW_LATENCY

    def __init__(self, plan: DispatchPlan, num_experts: int, capacity: int | None,
                 process_group: Any = None, *, vendor: Vendor | None = None) -> None:
        super().__init__(plan, num_experts, process_group, vendor=vendor)
        self.capacity = positive_int("max_dispatch_tokens_per_rank", capacity,
                                     "a positive int for the low-latency dispatcher")
        self._check_fits()

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one of the two dispatch buffers: every expert's capacity, as the plan sizes a token."""
        return self.plan.buffer_bytes(self.num_experts * self.capacity)

    def _check_fits(self) -> None:
        """Refuse a capacity whose two buffers alone exceed the device's memory (as the vendor states it;
        an unknown size refuses nothing): better now than a huge allocation at the first forward."""
        vendor = self.vendor
        memory = None if vendor is None else vendor.device_memory_bytes()
        if vendor is None or memory is None or 2 * self.buffer_bytes <= memory:
            return
        fits = memory // (2 * self.num_experts * self.plan.bytes_per_token)
        raise invalid("max_dispatch_tokens_per_rank",
                      f"a capacity whose send and receive buffers fit the device memory of vendor {vendor.name!r} "
                      f"({memory / 2**30:.1f} GiB; 2 x {self.num_experts} experts x {self.plan.bytes_per_token} "
                      f"bytes per token: at most {fits} tokens)", self.capacity)

    def _buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This call's send and receive buffers; on one rank the send buffer is the receive buffer."""
        send = torch.empty((self.num_experts, self.capacity, self.plan.bytes_per_token), dtype=torch.uint8,
                           device=device)
        return send, (send if self.process_group is None else torch.empty_like(send))

    def dispatch(self, hidden_states: torch.Tensor, routing: Routing, quantize: Quantizer) -> DispatchOutput:
        """Masked payload `[L, capacity * ranks, H]` and per-local-expert counts."""
        tokens = hidden_states.shape[0]
        if tokens > self.capacity:
            raise InvalidInput(
                f"hidden_states: expected at most max_dispatch_tokens_per_rank={self.capacity} tokens per "
                f"rank for low-latency dispatch, got {tokens}; raise the capacity in DispatchConfig or "
                "split the batch (tokens are never dropped)"
            )
        world, local, cap = self.world_size, self.num_local_experts, self.capacity
        order, _, counts = sort_by_expert(routing.topk_ids, self.num_experts)
        flat = routing.topk_ids.reshape(-1)
        # Slot of a pair = its position among this rank's pairs for the same expert.
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.empty_like(order)
        slot[order] = torch.arange(order.numel(), device=order.device) - starts[flat[order]]

        quantized = quantize(hidden_states)
        records = pack(quantized, self.plan)
        send, recv = self._buffers(hidden_states.device)
        token = torch.div(torch.arange(flat.numel(), device=flat.device), routing.top_k, rounding_mode="floor")
        send[flat, slot] = records[token]

        recv_counts = torch.empty_like(counts)
        dist_all_to_all(recv_counts, counts, self.process_group)
        if recv is not send:
            dist_all_to_all(recv.view(-1), send.view(-1), self.process_group)

        # Compact each expert's rows: source s's rows start after those of sources < s.
        recv_counts = recv_counts.view(world, local)
        before = torch.cumsum(recv_counts, 0) - recv_counts
        position = torch.arange(cap, device=flat.device)
        valid = position.view(1, 1, cap) < recv_counts.unsqueeze(-1)
        rows_per_expert = world * cap
        masked_row = (torch.arange(local, device=flat.device).view(1, local, 1) * rows_per_expert
                      + before.unsqueeze(-1) + position.view(1, 1, cap))
        dump = local * rows_per_expert  # one extra row absorbs the empty slots
        masked_row = torch.where(valid, masked_row, torch.full_like(masked_row, dump))
        masked = recv.new_zeros((dump + 1, recv.shape[-1]))
        masked[masked_row.reshape(-1)] = recv.view(world * local * cap, -1)
        masked[dump] = 0
        payload = unpack(masked[:dump].view(local, rows_per_expert, -1), self.plan, quantized.global_scale)
        handle = _LowLatencyHandle(routing, slot, masked_row.reshape(-1))
        return DispatchOutput(self.format, payload, recv_counts.sum(dim=0), handle)

    def combine(self, expert_output: torch.Tensor, dispatched: DispatchOutput,
                out_dtype: torch.dtype) -> torch.Tensor:
        """Return every valid row to its source slot, send back, and take the weighted sums."""
        handle: _LowLatencyHandle = dispatched.handle
        local, rows_per_expert, hidden = expert_output.shape
        flat_rows = expert_output.reshape(local * rows_per_expert, hidden)
        padded = torch.cat([flat_rows, flat_rows.new_zeros((1, hidden))])
        outgoing = as_bytes(padded[handle.masked_row])  # [ranks * local * capacity, bytes]
        returned = torch.empty_like(outgoing)
        dist_all_to_all(returned.view(-1), outgoing.view(-1), self.process_group)
        results = from_bytes(returned, expert_output.dtype).view(self.num_experts, self.capacity, hidden)
        flat = handle.routing.topk_ids.reshape(-1)
        return self.combine_rows(results.view(-1, hidden), flat * self.capacity + handle.slot, handle.routing,
                                 out_dtype)


def dist_all_to_all(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """Equal-split all-to-all over `group`; a plain copy on one rank (no group)."""
    if group is None:
        output.copy_(input)
    else:
        dist.all_to_all_single(output, input, group=group)
