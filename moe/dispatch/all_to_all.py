"""Expert-parallel dispatch over `torch.distributed` all-to-all (any backend: gloo, NCCL, HCCL).

Per layer call: the per-expert counts travel first (fixed size), then every routed row
as one record (payload and scales, `plan.bytes_per_token` bytes) with variable splits;
combine sends the expert outputs back the same way and applies the top-k weights where
the tokens live. nvfp4's per-tensor global scale is not sent: the scheme quantizes with
its checkpoint constant, the same on every rank. The split sizes are read on the host, as variable-split all-to-all
requires; the low-latency dispatcher avoids that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hal import take_rows
from moe.dispatch.base import DispatchFormat, DispatchOutput, Dispatcher, sort_by_expert
from moe.dispatch.wire import as_bytes, from_bytes, pack, unpack
from moe.routing import Routing
from moe.schemes.base import Quantizer


@dataclass(frozen=True)
class _AllToAllHandle:
    routing: Routing
    inverse: torch.Tensor  #: sorted send row of each flat (token, slot) pair
    by_expert: torch.Tensor  #: received row (source-major) of each expert-sorted row
    send_splits: list[int]
    recv_splits: list[int]


class AllToAllDispatcher(Dispatcher):
    """Normal-mode expert parallelism: experts split evenly across the group's ranks."""

    format = DispatchFormat.EP_NORMAL

    def dispatch(self, hidden_states: torch.Tensor, routing: Routing, quantize: Quantizer) -> DispatchOutput:
        """Rows received for this rank's experts, sorted by local expert (source rank, then token)."""
        world, local = self.world_size, self.num_local_experts
        order, inverse, counts = sort_by_expert(routing.topk_ids, self.num_experts)
        token_of_row = torch.div(order, routing.top_k, rounding_mode="floor")
        quantized = quantize(hidden_states)
        send = pack(take_rows(quantized, token_of_row), self.plan)

        send_counts = counts.view(world, local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.process_group)
        send_splits = send_counts.sum(dim=1).tolist()
        recv_splits = recv_counts.sum(dim=1).tolist()
        received = send.new_empty((sum(recv_splits), send.shape[1]))
        dist.all_to_all_single(received, send, recv_splits, send_splits, group=self.process_group)

        # Received rows come grouped by source rank, each sorted by local expert; regroup
        # by expert, keeping source order (so the rows of an expert follow token order).
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=send.device).repeat(world), recv_counts.reshape(-1)
        )
        by_expert = torch.argsort(expert_of_row, stable=True)
        payload = unpack(received[by_expert], self.plan, quantized.global_scale)
        handle = _AllToAllHandle(routing, inverse, by_expert, send_splits, recv_splits)
        return DispatchOutput(self.format, payload, recv_counts.sum(dim=0), handle)

    def combine(self, expert_output: torch.Tensor, dispatched: DispatchOutput,
                out_dtype: torch.dtype) -> torch.Tensor:
        """Send each expert row back to its token's rank and take the weighted sums there."""
        handle: _AllToAllHandle = dispatched.handle
        source_major = torch.empty_like(expert_output)
        source_major[handle.by_expert] = expert_output
        outgoing = as_bytes(source_major)
        returned = outgoing.new_empty((sum(handle.send_splits), outgoing.shape[1]))
        dist.all_to_all_single(returned, outgoing, handle.send_splits, handle.recv_splits,
                               group=self.process_group)
        rows = from_bytes(returned, expert_output.dtype)
        return self.combine_rows(rows, handle.inverse, handle.routing, out_dtype)

