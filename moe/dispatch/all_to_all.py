"""Normal-mode expert parallelism over `torch.distributed` all-to-all (any backend: gloo, NCCL, HCCL).

Token-wise (`moe.dispatch.tokens`): each token travels once to every rank holding any of its
experts, as one record of `plan.bytes_per_token` bytes (payload and scales, `moe.dispatch.wire`),
with its routing beside it; each rank returns one partial sum per token it received.

Per call: one small all-to-all of counts (tokens and pairs per destination), **one** host
synchronisation to read them (variable-split all-to-all needs the split sizes on the host), then
the records and their routing; the combine needs none. Nothing else waits for the device.
The receiving rank hands its experts the received tokens and the row of each (token, local
expert) pair, sorted by expert (`DispatchOutput.row_index`), so the first GEMM reads the rows
where they arrived.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hal.reference import ReceivedTokens
from moe.dispatch.base import DispatchFormat, DispatchOutput, Dispatcher, Pending
from moe.dispatch.tokens import all_to_all, destinations, pack_routing, partial_sums, receive, sum_partials
from moe.dispatch.wire import pack, unpack
from moe.routing import Routing
from moe.schemes.base import Quantizer


@dataclass(frozen=True)
class _AllToAllHandle:
    received: ReceivedTokens
    home_index: torch.Tensor  #: `[T * ranks]`: row of each (token, rank) partial in the returned rows
    send_splits: list[int]
    recv_splits: list[int]
    tokens: int


@dataclass(frozen=True)
class _Sizes:
    send: list[int]  #: tokens sent to each rank
    recv: list[int]  #: tokens received from each rank
    pairs: int  #: (token, expert) pairs this rank's experts receive
    max_tokens: int  #: the most tokens any rank routes in this call


class AllToAllDispatcher(Dispatcher):
    """Normal-mode expert parallelism: experts split evenly across the group's ranks."""

    format = DispatchFormat.EP_NORMAL

    def exchange_sizes(self, hit: torch.Tensor, topk_ids: torch.Tensor) -> _Sizes:
        """Tell every rank what it receives; the one host synchronisation of a normal-mode call."""
        world, tokens = self.world_size, topk_ids.shape[0]
        rank_of_pair = torch.div(topk_ids, self.num_local_experts, rounding_mode="floor").reshape(-1)
        pairs = torch.zeros(world, dtype=torch.int64, device=hit.device)
        pairs.scatter_add_(0, rank_of_pair.to(torch.int64), torch.ones_like(rank_of_pair, dtype=torch.int64))
        mine = torch.full((world,), tokens, dtype=torch.int64, device=hit.device)
        send = torch.stack([hit.sum(0, dtype=torch.int64), pairs, mine], dim=1)  # [world, 3]
        recv = torch.empty_like(send)
        all_to_all(recv, send, self.process_group)
        sizes = torch.cat([send[:, 0], recv.reshape(-1)]).tolist()
        recv_rows = [sizes[world:][3 * r: 3 * r + 3] for r in range(world)]
        return _Sizes(sizes[:world], [r[0] for r in recv_rows], sum(r[1] for r in recv_rows),
                      max([tokens, *(r[2] for r in recv_rows)]))

    def dispatch(self, hidden_states: torch.Tensor, routing: Routing, quantize: Quantizer) -> DispatchOutput:
        """The received tokens and, sorted by local expert, the row of each pair (`row_index`)."""
        return self.dispatch_async(hidden_states, routing, quantize).wait()  # type: ignore[return-value]

    def dispatch_async(self, hidden_states: torch.Tensor, routing: Routing, quantize: Quantizer,
                       sizes: _Sizes | None = None, hit: torch.Tensor | None = None) -> Pending:
        """Start the dispatch (the counts are exchanged before this returns); `wait()` gives the output."""
        world, tokens = self.world_size, hidden_states.shape[0]
        if hit is None:
            hit = destinations(routing.topk_ids, self.num_local_experts, world)
        if sizes is None:
            sizes = self.exchange_sizes(hit, routing.topk_ids)
        sent = sum(sizes.send)
        device = hidden_states.device
        # Send rows go rank by rank, token order within one: token t's row for rank r.
        position = torch.cumsum(hit, 0, dtype=torch.int64)
        counts = position[-1] if tokens else torch.zeros(world, dtype=torch.int64, device=device)
        position = position - 1 + (torch.cumsum(counts, 0) - counts)
        home_index = torch.where(hit, position, sent).reshape(-1)
        token = torch.arange(tokens, device=device).repeat_interleave(world)
        send_token = torch.empty(sent + 1, dtype=torch.int64, device=device).scatter_(0, home_index, token)[:sent]

        quantized = quantize(hidden_states)
        records = pack(quantized, self.plan).index_select(0, send_token)
        meta = pack_routing(routing).index_select(0, send_token)
        received = sum(sizes.recv)
        recv_records = records.new_empty((received, records.shape[1]))
        recv_meta = meta.new_empty((received, meta.shape[1]))
        works = [all_to_all(recv_records, records, self.process_group, sizes.recv, sizes.send, async_op=True),
                 all_to_all(recv_meta, meta, self.process_group, sizes.recv, sizes.send, async_op=True)]

        def finish() -> DispatchOutput:
            got = receive(recv_meta, routing.top_k, self.first_expert, self.num_local_experts, self.vendor,
                          rows=sizes.pairs)
            source = unpack(recv_records, self.plan, quantized.global_scale)
            handle = _AllToAllHandle(got, home_index, sizes.send, sizes.recv, tokens)
            return DispatchOutput(self.format, source, got.expert_counts, handle, row_index=got.row_index)

        return Pending(works, finish)

    def combine(self, expert_output: torch.Tensor, dispatched: DispatchOutput,
                out_dtype: torch.dtype) -> torch.Tensor:
        """Each token's partial sums come back from the ranks it went to and are added in rank order."""
        return self.combine_async(expert_output, dispatched, out_dtype).wait()  # type: ignore[return-value]

    def combine_async(self, expert_output: torch.Tensor, dispatched: DispatchOutput,
                      out_dtype: torch.dtype) -> Pending:
        """Start the combine; `wait()` gives the `[T, H]` result."""
        handle: _AllToAllHandle = dispatched.handle
        partial = partial_sums(expert_output, handle.received, self.vendor)
        sent = sum(handle.send_splits)
        returned = partial.new_empty((sent + 1, partial.shape[-1]))
        returned[sent].zero_()
        work = all_to_all(returned[:sent], partial, self.process_group, handle.send_splits, handle.recv_splits,
                          async_op=True)
        world = self.world_size
        return Pending([work], lambda: sum_partials(returned, handle.home_index, handle.tokens, world, out_dtype,
                                                    self.vendor))
