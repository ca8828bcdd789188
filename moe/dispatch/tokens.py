"""What token-wise expert-parallel dispatchers share: where each token goes, its routing on the wire,
the receiving rank's expert rows, and the sum of the partial results that come back.

A token travels once to every rank that holds any of its experts (not once per expert), with
its top-k ids and weights; the receiving rank computes each of its experts' rows and sends back
one partial result per token: the weighted sum over its local experts
(`hal.reference.sort_received` / `reduce_received`). The token's home rank adds the partials of
the ranks it went to, in rank order, in fp32. With top-8 over two ranks this moves a quarter of
the bytes of one row per (token, expert) each way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from hal import Vendor
from hal.reference import ReceivedTokens, reduce_received, sort_received, weighted_combine
from moe.routing import Routing


def destinations(topk_ids: torch.Tensor, num_local: int, world: int) -> torch.Tensor:
    """bool `[T, world]`: whether token t has an expert on rank r (experts split evenly, contiguously)."""
    rank_of_pair = torch.div(topk_ids, num_local, rounding_mode="floor").to(torch.int64)
    hit = torch.zeros((topk_ids.shape[0], world), dtype=torch.bool, device=topk_ids.device)
    return hit.scatter_(1, rank_of_pair, True)


def pack_routing(routing: Routing) -> torch.Tensor:
    """int32 `[T, 2k]`: each token's global expert ids, then its weights (fp32 bits)."""
    ids = routing.topk_ids.to(torch.int32)
    weights = routing.topk_weights.to(torch.float32).view(torch.int32)
    return torch.cat([ids, weights], dim=1)


def unpack_routing(meta: torch.Tensor, top_k: int, first_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(local expert ids int64 `[R, k]` (outside `[0, L)`: another rank's), weights fp32 `[R, k]`)."""
    local = meta[:, :top_k].to(torch.int64) - first_expert
    return local, meta[:, top_k:].contiguous().view(torch.float32)


def receive(meta: torch.Tensor, top_k: int, first_expert: int, num_local: int, vendor: Vendor | None, *,
            rows: int | None = None, slots: int | None = None, empty_row: int = 0) -> ReceivedTokens:
    """The expert rows of received tokens (see `hal.reference.sort_received`), sorted by the vendor."""
    local, weights = unpack_routing(meta, top_k, first_expert)
    sort = None if vendor is None else vendor.sort_by_expert
    return sort_received(local, weights, num_local, rows=rows, slots=slots, empty_row=empty_row, sort=sort)


def partial_sums(expert_output: torch.Tensor, received: ReceivedTokens, vendor: Vendor | None) -> torch.Tensor:
    """Each received token's weighted sum over this rank's experts, in the experts' output dtype."""
    combine = None if vendor is None else vendor.weighted_combine
    return reduce_received(expert_output, received, expert_output.dtype, combine=combine)


def sum_partials(returned: torch.Tensor, index: torch.Tensor, tokens: int, world: int, out_dtype: torch.dtype,
                 vendor: Vendor | None) -> torch.Tensor:
    """`out[t] = sum_r returned[index[t, r]]` in fp32, rank order (`index` `[T * world]`; a rank the token
    did not go to points at a zero row of `returned`)."""
    ones = torch.ones((tokens, world), dtype=torch.float32, device=returned.device)
    if vendor is not None:
        return vendor.weighted_combine(returned, index, ones, out_dtype)
    return weighted_combine(returned, index, ones, out_dtype)


class Pending:
    """A result on its way: `wait()` makes the caller's stream wait for the communication still in
    flight (never the host, on a device with streams) and returns the result."""

    def __init__(self, works: list[object], finish: Callable[[], object]) -> None:
        self._works = works
        self._finish = finish
        self._result: object = None
        self._done = False

    @classmethod
    def done(cls, result: object) -> Pending:
        """A result that is already there."""
        return cls([], lambda: result)

    def wait(self) -> object:
        """The result (the same object on every call)."""
        if not self._done:
            for work in self._works:
                if work is not None:
                    work.wait()  # type: ignore[attr-defined]
            self._result = self._finish()
            self._done = True
        return self._result


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: object, output_splits: list[int] | None = None,
               input_splits: list[int] | None = None, *, async_op: bool = False) -> object:
    """`dist.all_to_all_single` (equal splits where none are given); a copy without a group."""
    if group is None:
        output.copy_(input)
        return None
    return dist.all_to_all_single(output, input, output_splits, input_splits, group=group, async_op=async_op)


__all__ = ["Pending", "all_to_all", "destinations", "pack_routing", "partial_sums", "receive", "sum_partials",
           "unpack_routing"]
