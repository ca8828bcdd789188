"""Low-latency expert-parallel dispatch: fixed capacity, fixed-size collectives, masked layout.

Each rank may send at most `capacity` (`max_dispatch_tokens_per_rank`) tokens per call. Every
rank writes its tokens as records (`plan.bytes_per_token` bytes, `moe.dispatch.wire`) with their
routing into a send buffer of `capacity` slots, and one all-gather gives every rank every rank's
slots; each rank lays out the rows of its own experts, and after the experts one equal-split
all-to-all returns one partial sum per (token, rank) (`moe.dispatch.tokens`). Collective sizes
never depend on the routing, nothing waits on the host, so a forward can be captured in a CUDA
graph where the backend allows it. The communication buffers are allocated once per dispatcher
(two sets, so two micro-batches can be in flight) and sized from the plan; a capacity whose
buffers could never fit the vendor's device memory raises `InvalidInput` at construction.

The experts get every rank's slots as received tokens and, sorted by local expert, the row of
each (token, local expert) pair (`DispatchOutput.row_index`, `capacity * ranks * k` entries, the
valid ones first: the grouped GEMMs compute only the counts' rows, so the work follows the real
pairs, not the capacity). More tokens than the capacity raise `InvalidInput`; nothing is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from hal import DispatchPlan, InvalidInput, Vendor, invalid, positive_int
from hal.reference import ReceivedTokens
from moe.dispatch.base import DispatchFormat, DispatchOutput, Dispatcher, Pending
from moe.dispatch.tokens import all_to_all, destinations, partial_sums, receive, sum_partials
from moe.dispatch.wire import pack_into, unpack
from moe.routing import Routing
from moe.schemes.base import Quantizer


@dataclass(frozen=True)
class _LowLatencyHandle:
    received: ReceivedTokens
    home_index: torch.Tensor  #: `[T * ranks]`: row of each (token, rank) partial in the returned rows
    tokens: int
    buffers: _Buffers


class _Buffers:
    """One set of communication buffers: send and receive records and routing, returned partials.
    The receive buffers have one extra zero row that empty slots read."""

    def __init__(self, slots: int, world: int, record_bytes: int, top_k: int, device: torch.device) -> None:
        self.send = torch.empty((slots, record_bytes), dtype=torch.uint8, device=device)
        self.send_meta = torch.empty((slots, 2 * top_k), dtype=torch.int32, device=device)
        self.recv = torch.zeros((world * slots + 1, record_bytes), dtype=torch.uint8, device=device)
        self.recv_meta = torch.empty((world * slots, 2 * top_k), dtype=torch.int32, device=device)
        self.returned: dict[torch.dtype, torch.Tensor] = {}
        self.world, self.slots = world, slots

    def returned_rows(self, dtype: torch.dtype, hidden: int) -> torch.Tensor:
        """The `[world * slots + 1, hidden]` rows partial sums come back to (last row zero)."""
        rows = self.returned.get(dtype)
        if rows is None:
            rows = torch.zeros((self.world * self.slots + 1, hidden), dtype=dtype, device=self.send.device)
            self.returned[dtype] = rows
        return rows


class LowLatencyDispatcher(Dispatcher):
    """Masked-layout dispatch with a fixed per-rank token capacity (one rank or many)."""

    #: static shapes, but rows grouped by local expert with padding past the counts (not the masked layout)
    format = DispatchFormat.EP_NORMAL
    #: buffer sets per dispatcher: two micro-batches may be in flight at once
    IN_FLIGHT = 2

    def __init__(self, plan: DispatchPlan, num_experts: int, capacity: int | None,
                 process_group: Any = None, *, vendor: Vendor | None = None) -> None:
        super().__init__(plan, num_experts, process_group, vendor=vendor)
        self.capacity = positive_int("max_dispatch_tokens_per_rank", capacity,
                                     "a positive int for the low-latency dispatcher")
        self._check_fits()
        self._sets: list[_Buffers] = []
        self._exact_rows = vendor is None or vendor.capabilities().host_synchronous
        self._next = 0

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the records every rank's slots take on one rank (`capacity * ranks` tokens, as the
        plan sizes a token): the all-gathered receive buffer."""
        return self.plan.buffer_bytes(self.world_size * self.capacity)

    @property
    def last_mode(self) -> str:
        return "low-latency"

    def owns(self, dispatched: DispatchOutput) -> bool:
        """Whether `dispatched` came from this dispatcher's `dispatch`."""
        return isinstance(dispatched.handle, _LowLatencyHandle)

    @property
    def memory_bytes(self) -> int:
        """Device memory all of this dispatcher's buffer sets take: per set, the send records, every
        rank's received records and the returned partial sums (fp32 at most)."""
        per_set = (self.world_size + 1) * self.plan.bytes_per_token + self.world_size * 4 * self.plan.hidden_size
        return self.IN_FLIGHT * self.capacity * per_set

    def _check_fits(self) -> None:
        """Refuse a capacity whose buffers alone exceed the device's memory (as the vendor states it;
        an unknown size refuses nothing): better now than a huge allocation at the first forward."""
        vendor = self.vendor
        memory = None if vendor is None else vendor.device_memory_bytes()
        if vendor is None or memory is None or self.memory_bytes <= memory:
            return
        fits = memory * self.capacity // self.memory_bytes
        raise invalid("max_dispatch_tokens_per_rank",
                      f"a capacity whose buffers fit the device memory of vendor {vendor.name!r} "
                      f"({memory / 2**30:.1f} GiB; {self.memory_bytes // self.capacity} bytes per token of capacity: "
                      f"at most {fits} tokens)", self.capacity)

    def _buffers(self, device: torch.device, top_k: int) -> _Buffers:
        """The next buffer set: persistent on a group (its ranks call from one thread each, in order);
        fresh per call on one rank, where the layer may be called from several threads at once."""
        record = self.plan.bytes_per_token
        if self.process_group is None:
            return _Buffers(self.capacity, 1, record, top_k, device)
        if not self._sets or self._sets[0].send.device != device or self._sets[0].send_meta.shape[1] != 2 * top_k:
            self._sets = [_Buffers(self.capacity, self.world_size, record, top_k, device)
                          for _ in range(self.IN_FLIGHT)]
        buffers = self._sets[self._next]
        self._next = (self._next + 1) % len(self._sets)
        return buffers

    def dispatch(self, hidden_states: torch.Tensor, routing: Routing, quantize: Quantizer) -> DispatchOutput:
        """Masked payload `[L, capacity * ranks, H]` and per-local-expert counts."""
        return self.dispatch_async(hidden_states, routing, quantize).wait()  # type: ignore[return-value]

    def dispatch_async(self, hidden_states: torch.Tensor, routing: Routing, quantize: Quantizer) -> Pending:
        """Start the dispatch; `wait()` gives the masked output."""
        tokens, top_k = hidden_states.shape[0], routing.top_k
        if tokens > self.capacity:
            raise InvalidInput(
                f"hidden_states: expected at most max_dispatch_tokens_per_rank={self.capacity} tokens per "
                f"rank for low-latency dispatch, got {tokens}; raise the capacity in DispatchConfig or "
                "split the batch (tokens are never dropped)"
            )
        world, cap = self.world_size, self.capacity
        buffers = self._buffers(hidden_states.device, top_k)
        quantized = quantize(hidden_states)
        pack_into(buffers.send, quantized, self.plan)
        meta = buffers.send_meta
        meta[:tokens, :top_k].copy_(routing.topk_ids)
        meta[:tokens, top_k:].copy_(routing.topk_weights.to(torch.float32).view(torch.int32))
        meta[tokens:, :top_k].fill_(-1)  # empty slots route nowhere
        recv = buffers.recv[: world * cap]
        if self.process_group is None:
            recv.copy_(buffers.send)
            buffers.recv_meta.copy_(meta)
            works: list[object] = []
        else:
            works = [dist.all_gather_into_tensor(recv, buffers.send, group=self.process_group, async_op=True),
                     dist.all_gather_into_tensor(buffers.recv_meta, meta, group=self.process_group, async_op=True)]
        hit = destinations(routing.topk_ids, self.num_local_experts, world)
        slot = torch.arange(tokens, device=hit.device).unsqueeze(1) + torch.arange(world, device=hit.device) * cap
        home_index = torch.where(hit, slot, world * cap).reshape(-1)
        local = self.num_local_experts

        def finish() -> DispatchOutput:
            got = receive(buffers.recv_meta, top_k, self.first_expert, local, self.vendor)
            if self._exact_rows:  # reading the count back costs nothing here; such vendors want exact groups
                got = replace(got, row_index=got.row_index[: int(got.expert_counts.sum())])
            source = unpack(recv, self.plan, quantized.global_scale)
            return DispatchOutput(self.format, source, got.expert_counts,
                                  _LowLatencyHandle(got, home_index, tokens, buffers), row_index=got.row_index)

        return Pending(works, finish)

    def combine(self, expert_output: torch.Tensor, dispatched: DispatchOutput,
                out_dtype: torch.dtype) -> torch.Tensor:
        """Each token's partial sums come back from every rank (fixed size) and the ones it went to are added."""
        return self.combine_async(expert_output, dispatched, out_dtype).wait()  # type: ignore[return-value]

    def combine_async(self, expert_output: torch.Tensor, dispatched: DispatchOutput,
                      out_dtype: torch.dtype) -> Pending:
        """Start the combine; `wait()` gives the `[T, H]` result."""
        handle: _LowLatencyHandle = dispatched.handle
        partial = partial_sums(expert_output, handle.received, self.vendor)
        slots = self.world_size * self.capacity
        returned = handle.buffers.returned_rows(partial.dtype, partial.shape[-1])
        work = all_to_all(returned[:slots], partial, self.process_group, async_op=True)
        world = self.world_size
        return Pending([work], lambda: sum_partials(returned, handle.home_index, handle.tokens, world, out_dtype,
                                                    self.vendor))
