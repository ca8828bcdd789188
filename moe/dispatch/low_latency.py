"""Low-latency expert-parallel dispatch: fixed capacity, fixed-size collectives, masked layout.

Each rank may send at most `capacity` (`max_dispatch_tokens_per_rank`) tokens per call. Every
rank writes its tokens as routed rows (a record of `plan.bytes_per_token` bytes and the token's
routing, `moe.dispatch.wire`) into a send buffer of `capacity` slots, and one all-gather gives
every rank every rank's slots; each rank lays out the rows of its own experts, and after the experts one equal-split
all-to-all returns one partial sum per (token, rank) (`moe.dispatch.tokens`). Collective sizes
never depend on the routing, nothing waits on the host, so a forward can be captured in a CUDA
graph where the backend allows it. The communication buffers are allocated once per dispatcher
(two sets, so two micro-batches can be in flight) and sized from the plan; a capacity whose
buffers could never fit the vendor's device memory (`hal.MAX_DEVICE_MEMORY_BYTES` where the vendor does not state
it) raises `InvalidInput` at construction.

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

from hal import MAX_DEVICE_MEMORY_BYTES, DispatchPlan, InvalidInput, QuantizedTensor, Vendor, invalid, positive_int
from hal.reference import ReceivedTokens
from moe.dispatch.base import DispatchFormat, DispatchOutput, Dispatcher, Pending, padded_counts
from moe.dispatch.tokens import Constants, all_to_all, partial_sums, receive, sum_partials
from moe.dispatch.wire import pack_into, routed_row_bytes, routing_offset, view_records, view_routing
from moe.routing import Routing
from moe.schemes.base import Quantizer


@dataclass(frozen=True)
class _LowLatencyHandle:
    received: ReceivedTokens
    home_index: torch.Tensor  #: `[T * ranks]`: row of each (token, rank) partial in the returned rows (0: none)
    tokens: int
    buffers: _Buffers


class _Buffers:
    """One set of communication buffers: the routed rows sent (`moe.dispatch.wire`), every rank's rows
    received, the partial sums returned, and the views of them every call reads."""

    def __init__(self, plan: DispatchPlan, slots: int, world: int, top_k: int, device: torch.device) -> None:
        width = routed_row_bytes(plan, top_k)
        # Zeros: a slot past the tokens sends what it held, finite (a runner may convert every received row).
        self.send = torch.zeros((slots, width), dtype=torch.uint8, device=device)
        self.recv = torch.zeros((world * slots, width), dtype=torch.uint8, device=device)
        start = routing_offset(plan, top_k)
        self.send_routing = self.send[:, start : start + 8 * top_k].view(torch.int32)  #: ids, then weights' bits
        self.send_ids = self.send_routing[:, :top_k]
        self.recv_ids, self.recv_weights = view_routing(self.recv, plan, top_k)
        self.plan, self.top_k, self.world, self.slots = plan, top_k, world, slots
        source = view_records(self.recv, plan)
        # A part whose offset does not fit its dtype is a copy, taken anew per call.
        self._source = source if _views_of(source, self.recv) else None
        self.returned: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def source(self, global_scale: torch.Tensor | None) -> QuantizedTensor:
        """The received rows as quantized rows (views of the receive buffer where the layout allows)."""
        if self._source is None:
            return view_records(self.recv, self.plan, global_scale)
        if global_scale is None:
            return self._source
        return QuantizedTensor(
            self._source.data, self._source.dtype, self._source.layout, self._source.scale, global_scale
        )

    def returned_rows(self, dtype: torch.dtype, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(`[1 + world * slots, hidden]` rows whose row 0 stays zero, the rows after it partial sums come back to)."""
        rows = self.returned.get(dtype)
        if rows is None:
            full = torch.zeros((1 + self.world * self.slots, hidden), dtype=dtype, device=self.send.device)
            rows = self.returned[dtype] = (full, full[1:])
        return rows


def _views_of(q: QuantizedTensor, buffer: torch.Tensor) -> bool:
    """Whether every tensor of `q` is a view of `buffer`."""
    storage = buffer.untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() == storage for t in (q.data, q.scale) if t is not None)


def low_latency_memory_bytes(plan: DispatchPlan, capacity: int, world_size: int) -> int:
    """Device memory the low-latency buffer sets take for `capacity` tokens per rank among `world_size`
    ranks: per set, the send records, every rank's received records and the returned partial sums."""
    per_set = (world_size + 1) * plan.bytes_per_token + world_size * 4 * plan.hidden_size
    return LowLatencyDispatcher.IN_FLIGHT * capacity * per_set


def capacity_problem(plan: DispatchPlan, capacity: int, world_size: int, vendor: Vendor | None) -> str | None:
    """Why a low-latency capacity cannot be built (its buffers alone exceed the device memory the vendor
    states, or `hal.MAX_DEVICE_MEMORY_BYTES` where it states none), or None."""
    memory = None if vendor is None else vendor.stated_memory_bytes()
    if memory is None:
        memory, whose = MAX_DEVICE_MEMORY_BYTES, "hal.MAX_DEVICE_MEMORY_BYTES (the device memory is not stated)"
    else:
        whose = f"the device memory of vendor {vendor.name!r}"  # type: ignore[union-attr]
    needed = low_latency_memory_bytes(plan, capacity, world_size)
    if needed <= memory:
        return None
    return (
        f"max_dispatch_tokens_per_rank: expected a capacity whose buffers fit {whose} "
        f"({memory / 2**30:.1f} GiB; {needed // capacity} bytes per token of capacity: "
        f"at most {memory * capacity // needed} tokens), got {capacity}"
    )


class LowLatencyDispatcher(Dispatcher):
    """Masked-layout dispatch with a fixed per-rank token capacity (one rank or many)."""

    #: static shapes, but rows grouped by local expert with padding past the counts (not the masked layout)
    format = DispatchFormat.EP_NORMAL
    #: buffer sets per dispatcher: two micro-batches may be in flight at once
    IN_FLIGHT = 2

    def __init__(
        self,
        plan: DispatchPlan,
        num_experts: int,
        capacity: int | None,
        process_group: Any = None,
        *,
        vendor: Vendor | None = None,
    ) -> None:
        super().__init__(plan, num_experts, process_group, vendor=vendor)
        self.capacity = positive_int(
            "max_dispatch_tokens_per_rank", capacity, "a positive int for the low-latency dispatcher"
        )
        self._check_fits()
        self._sets: list[_Buffers] = []
        self._exact_rows = vendor is None or vendor.capabilities().host_synchronous
        self._padding = vendor is not None and vendor.capabilities().grouped_matmul_padding
        self._next = 0
        self._constants = Constants()

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
        return low_latency_memory_bytes(self.plan, self.capacity, self.world_size)

    def _check_fits(self) -> None:
        """Refuse a capacity whose buffers alone exceed the device's memory: better now than a huge
        allocation at the first forward."""
        problem = capacity_problem(self.plan, self.capacity, self.world_size, self.vendor)
        if problem is not None:
            raise InvalidInput(problem)

    def _buffers(self, device: torch.device, top_k: int) -> _Buffers:
        """The next buffer set: persistent on a group (its ranks call from one thread each, in order);
        fresh per call on one rank, where the layer may be called from several threads at once."""
        if self.process_group is None:
            return _Buffers(self.plan, self.capacity, 1, top_k, device)
        if not self._sets or self._sets[0].send.device != device or self._sets[0].top_k != top_k:
            self._sets = [
                _Buffers(self.plan, self.capacity, self.world_size, top_k, device) for _ in range(self.IN_FLIGHT)
            ]
        buffers = self._sets[self._next]
        self._next = (self._next + 1) % len(self._sets)
        return buffers

    def dispatch(self, hidden_states: torch.Tensor, routing: Routing, quantize: Quantizer) -> DispatchOutput:
        """Every rank's tokens and, grouped by local expert, the row of each pair (`row_index`)."""
        pending = self.dispatch_async(hidden_states, routing, quantize, async_op=False)
        return pending.wait()  # type: ignore[return-value]

    def dispatch_async(
        self, hidden_states: torch.Tensor, routing: Routing, quantize: Quantizer, *, async_op: bool = True
    ) -> Pending:
        """Start the dispatch; `wait()` gives the output (`async_op` False: as `dispatch`)."""
        tokens = hidden_states.shape[0]
        if tokens > self.capacity:
            raise InvalidInput(
                f"hidden_states: expected at most max_dispatch_tokens_per_rank={self.capacity} tokens per "
                f"rank for low-latency dispatch, got {tokens}; raise the capacity in DispatchConfig or "
                "split the batch (tokens are never dropped)"
            )
        buffers = self._buffers(hidden_states.device, routing.top_k)
        quantized = quantize(hidden_states)
        self._write(buffers, quantized, routing)
        if self.process_group is None:
            buffers.recv.copy_(buffers.send)
            work = None
        else:
            work = dist.all_gather_into_tensor(buffers.recv, buffers.send, group=self.process_group, async_op=async_op)
        home_index = self._home_index(routing.topk_ids)

        def finish() -> DispatchOutput:
            got = receive(
                buffers.recv_ids,
                buffers.recv_weights,
                self.first_expert,
                self.num_local_experts,
                self._constants.sort(self.vendor),
            )
            gemm_counts = None
            if self._exact_rows:  # reading the count back costs nothing here; such vendors want exact groups
                got = replace(got, row_index=got.row_index[: int(got.expert_counts.sum())])
            elif not self._padding:  # the GEMMs must cover every row: the tail is computed as the last expert's
                gemm_counts = padded_counts(got.expert_counts, got.row_index.numel())
            source = buffers.source(quantized.global_scale)
            return DispatchOutput(
                self.format,
                source,
                got.expert_counts,
                _LowLatencyHandle(got, home_index, tokens, buffers),
                row_index=got.row_index,
                gemm_counts=gemm_counts,
            )

        return Pending([work], finish)

    def _write(self, buffers: _Buffers, quantized: QuantizedTensor, routing: Routing) -> None:
        """This rank's routed rows into the send buffer; the slots past its tokens route nowhere (id -1)."""
        tokens = quantized.data.shape[0]
        pack_into(buffers.send, quantized, self.plan)
        weights = routing.topk_weights.to(torch.float32).view(torch.int32)
        torch.cat([routing.topk_ids, weights], dim=1, out=buffers.send_routing[:tokens])  # ids cast to int32
        if tokens < self.capacity:
            buffers.send_ids[tokens:].fill_(-1)

    def _home_index(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """`[T * ranks]`: 1 + the returned row of each (token, rank) partial (rank r's slot t), 0 where the
        token did not go."""
        tokens, world, cap, device = topk_ids.shape[0], self.world_size, self.capacity, topk_ids.device
        owner = torch.div(topk_ids, self.num_local_experts, rounding_mode="floor").to(torch.int64)
        hit = torch.zeros((tokens, world), dtype=torch.bool, device=device).scatter_(1, owner, True)
        slots = self._constants.get(
            ("slots", device, cap, world),
            lambda: torch.arange(1, 1 + cap, device=device).unsqueeze(1) + torch.arange(world, device=device) * cap,
        )  # [cap, world]
        return (slots[:tokens] * hit).view(-1)

    def combine(self, expert_output: torch.Tensor, dispatched: DispatchOutput, out_dtype: torch.dtype) -> torch.Tensor:
        """Each token's partial sums come back from every rank (fixed size) and the ones it went to are added."""
        pending = self.combine_async(expert_output, dispatched, out_dtype, async_op=False)
        return pending.wait()  # type: ignore[return-value]

    def combine_async(
        self, expert_output: torch.Tensor, dispatched: DispatchOutput, out_dtype: torch.dtype, *, async_op: bool = True
    ) -> Pending:
        """Start the combine; `wait()` gives the `[T, H]` result (`async_op` False: as `combine`)."""
        handle: _LowLatencyHandle = dispatched.handle
        partial = partial_sums(expert_output, handle.received, self.vendor)
        returned, tail = handle.buffers.returned_rows(partial.dtype, partial.shape[-1])
        work = all_to_all(tail, partial, self.process_group, async_op=async_op)
        world, cap, device = self.world_size, self.capacity, partial.device
        ones = self._constants.get(
            ("ones rows", device, cap, world), lambda: torch.ones((cap, world), dtype=torch.float32, device=device)
        )
        return Pending(
            [work], lambda: sum_partials(returned, handle.home_index, ones[: handle.tokens], out_dtype, self.vendor)
        )
