"""Normal-mode expert parallelism over `torch.distributed` all-to-all (any backend: gloo, NCCL, HCCL).

Token-wise (`moe.dispatch.tokens`): each token travels once to every rank holding any of its
experts, as one routed row: its record of `plan.bytes_per_token` bytes (payload and scales) and its
routing (`moe.dispatch.wire`); each rank returns one partial sum per token it received.

Per call: one small all-to-all of counts (tokens and pairs per destination), **one** host
synchronisation to read them (variable-split all-to-all needs the split sizes on the host), then
one all-to-all of the routed rows; the combine needs none. Nothing else waits for the device.
The receiving rank hands its experts the received tokens and the row of each (token, local
expert) pair, sorted by expert (`DispatchOutput.row_index`), so the first GEMM reads the rows
where they arrived.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hal import DispatchPlan, Vendor
from hal.reference import ReceivedTokens
from moe.dispatch.base import DispatchFormat, DispatchOutput, Dispatcher, Pending
from moe.dispatch.tokens import Constants, all_to_all, partial_sums, receive, sum_partials
from moe.dispatch.wire import pack_routed, view_records, view_routing
from moe.routing import Routing
from moe.schemes.base import Quantizer


@dataclass(frozen=True)
class _AllToAllHandle:
    received: ReceivedTokens
    home_index: torch.Tensor  #: `[T * ranks]`: row of each (token, rank) partial in the returned rows (0: none)
    send_splits: list[int]
    recv_splits: list[int]
    tokens: int


@dataclass(frozen=True)
class _Sizes:
    send: list[int]  #: tokens sent to each rank
    recv: list[int]  #: tokens received from each rank
    pairs: int  #: (token, expert) pairs this rank's experts receive
    max_tokens: int  #: the most tokens any rank routes in this call
    hit: torch.Tensor  #: bool `[ranks, T]`: whether token t goes to rank r


class AllToAllDispatcher(Dispatcher):
    """Normal-mode expert parallelism: experts split evenly across the group's ranks."""

    format = DispatchFormat.EP_NORMAL
    capturable = False  # the receive counts are read back once per call

    def __init__(
        self, plan: DispatchPlan, num_experts: int, process_group: Any = None, *, vendor: Vendor | None = None
    ) -> None:
        super().__init__(plan, num_experts, process_group, vendor=vendor)
        self._constants = Constants()

    def exchange_sizes(self, topk_ids: torch.Tensor) -> _Sizes:
        """Tell every rank what it receives; the one host synchronisation of a normal-mode call."""
        world, tokens, device = self.world_size, topk_ids.shape[0], topk_ids.device
        ranks = self._constants.get(
            ("ranks", device, world), lambda: torch.arange(world, device=device).view(world, 1, 1)
        )
        owner = torch.div(topk_ids, self.num_local_experts, rounding_mode="floor")
        pairs = owner.unsqueeze(0) == ranks  # [world, T, k]: pair (t, j) goes to rank r
        hit = pairs.any(2)
        # Sent counts, then received ones, in one tensor: one host read. Per rank: tokens, pairs, batch size.
        counts = torch.empty((2 * world, 3), dtype=torch.int64, device=device)
        mine = torch.full((world,), tokens, dtype=torch.int64, device=device)
        torch.stack([hit.sum(1), pairs.sum((1, 2)), mine], dim=1, out=counts[:world])
        all_to_all(counts[world:], counts[:world], self.process_group)
        rows = counts.tolist()
        sent, got = rows[:world], rows[world:]
        return _Sizes(
            [r[0] for r in sent], [r[0] for r in got], sum(r[1] for r in got), max([tokens, *(r[2] for r in got)]), hit
        )

    def _send_rows(self, hit: torch.Tensor, sent: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(home index `[T * ranks]`: 1 + the send row of each (token, rank), 0 where the token does not go;
        the token of each send row `[sent]`). Send rows go rank by rank, token order within one."""
        world, tokens = hit.shape
        flat = hit.view(-1)
        row = torch.cumsum(flat, 0).mul_(flat).view(world, tokens)
        token = self._constants.arange(tokens, hit.device)
        send_token = row.new_empty(sent + 1).index_put_((row,), token)[1:]  # row 0 takes every miss
        return row.t().reshape(-1), send_token

    def dispatch(self, hidden_states: torch.Tensor, routing: Routing, quantize: Quantizer) -> DispatchOutput:
        """The received tokens and, sorted by local expert, the row of each pair (`row_index`)."""
        pending = self.dispatch_async(hidden_states, routing, quantize, async_op=False)
        return pending.wait()  # type: ignore[return-value]

    def dispatch_async(
        self,
        hidden_states: torch.Tensor,
        routing: Routing,
        quantize: Quantizer,
        sizes: _Sizes | None = None,
        *,
        async_op: bool = True,
    ) -> Pending:
        """Start the dispatch (the counts are exchanged before this returns); `wait()` gives the output.
        `async_op` False: the records travel before this returns (`dispatch`)."""
        tokens = hidden_states.shape[0]
        if sizes is None:
            sizes = self.exchange_sizes(routing.topk_ids)
        home_index, send_token = self._send_rows(sizes.hit, sum(sizes.send))
        quantized = quantize(hidden_states)
        rows = pack_routed(quantized, routing.topk_ids, routing.topk_weights, self.plan).index_select(0, send_token)
        recv = rows.new_empty((sum(sizes.recv), rows.shape[1]))
        work = all_to_all(recv, rows, self.process_group, sizes.recv, sizes.send, async_op=async_op)

        def finish() -> DispatchOutput:
            ids, weights = view_routing(recv, self.plan, routing.top_k)
            got = receive(
                ids,
                weights,
                self.first_expert,
                self.num_local_experts,
                self._constants.sort(self.vendor),
                rows=sizes.pairs,
            )
            source = view_records(recv, self.plan, quantized.global_scale)
            handle = _AllToAllHandle(got, home_index, sizes.send, sizes.recv, tokens)
            return DispatchOutput(self.format, source, got.expert_counts, handle, row_index=got.row_index)

        return Pending([work], finish)

    def combine(self, expert_output: torch.Tensor, dispatched: DispatchOutput, out_dtype: torch.dtype) -> torch.Tensor:
        """Each token's partial sums come back from the ranks it went to and are added in rank order."""
        pending = self.combine_async(expert_output, dispatched, out_dtype, async_op=False)
        return pending.wait()  # type: ignore[return-value]

    def combine_async(
        self, expert_output: torch.Tensor, dispatched: DispatchOutput, out_dtype: torch.dtype, *, async_op: bool = True
    ) -> Pending:
        """Start the combine; `wait()` gives the `[T, H]` result (`async_op` False: as `combine`)."""
        handle: _AllToAllHandle = dispatched.handle
        partial = partial_sums(expert_output, handle.received, self.vendor)
        returned = partial.new_empty((sum(handle.send_splits) + 1, partial.shape[-1]))
        returned[0].zero_()  # the row of every (token, rank) the token did not go to
        work = all_to_all(
            returned[1:], partial, self.process_group, handle.send_splits, handle.recv_splits, async_op=async_op
        )
        world, tokens = self.world_size, handle.tokens
        ones = self._constants.ones(tokens * world, partial.device).view(tokens, world)
        return Pending([work], lambda: sum_partials(returned, handle.home_index, ones, out_dtype, self.vendor))
