"""What token-wise expert-parallel dispatchers share: the receiving rank's expert rows, the sum of the
partial results that come back, the collectives, and the constants a dispatcher keeps between calls.

A token travels once to every rank that holds any of its experts (not once per expert), with
its top-k ids and weights; the receiving rank computes each of its experts' rows and sends back
one partial result per token: the weighted sum over its local experts
(`hal.reference.sort_received` / `reduce_received`). The token's home rank adds the partials of
the ranks it went to, in rank order, in fp32. With top-8 over two ranks this moves a quarter of
the bytes of one row per (token, expert) each way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable

import torch
import torch.distributed as dist

from hal import Vendor
from hal.reference import ReceivedTokens, reduce_received, sort_received, weighted_combine

#: `sort(ids, num_experts) -> (order, inverse, counts[, token of each row])`, as `hal.Vendor.sort_by_expert`.
SortFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]]


class Constants:
    """Tensors a dispatcher reuses on every call and never writes, keyed by device and size, and the
    vendor's sort it calls. One per dispatcher: nothing is shared between layers."""

    def __init__(self) -> None:
        self._tensors: dict[Hashable, torch.Tensor] = {}
        self._sort: tuple[Vendor | None, SortFn | None] | None = None

    def get(self, key: Hashable, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The tensor cached under `key` (which must name its device and shape), made on first use."""
        found = self._tensors.get(key)
        if found is None:
            found = self._tensors[key] = make()
        return found

    def _prefix(self, name: str, n: int, device: torch.device, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """The first n entries of the longest `make(size)` made so far on `device` (grown when too short)."""
        key = (name, device)
        found = self._tensors.get(key)
        if found is None or found.numel() < n:
            found = self._tensors[key] = make(n if found is None else max(n, 2 * found.numel()))
        return found if found.numel() == n else found[:n]

    def arange(self, n: int, device: torch.device) -> torch.Tensor:
        """int64 `[n]`: 0, 1, ..., n - 1."""
        return self._prefix("arange", n, device, lambda size: torch.arange(size, device=device))

    def ones(self, n: int, device: torch.device) -> torch.Tensor:
        """fp32 `[n]` of ones (contiguous)."""
        return self._prefix("ones", n, device, lambda size: torch.ones(size, dtype=torch.float32, device=device))

    def sort(self, vendor: Vendor | None) -> SortFn | None:
        """The sort `receive` takes: the vendor's `sort_by_expert`, with the token of each sorted row
        (None: the reference)."""
        cached = self._sort
        if cached is None or cached[0] is not vendor:
            fn = None if vendor is None else functools.partial(vendor.sort_by_expert, tokens=True)
            cached = self._sort = (vendor, fn)
        return cached[1]


def receive(
    ids: torch.Tensor,
    weights: torch.Tensor,
    first_expert: int,
    num_local: int,
    sort: SortFn | None,
    *,
    rows: int | None = None,
) -> ReceivedTokens:
    """The expert rows of received tokens with global expert ids `ids` `[R, k]` (int32; -1: an empty slot) and
    their weights (see `hal.reference.sort_received`)."""
    return sort_received(ids - first_expert, weights, num_local, rows=rows, sort=sort)


def partial_sums(expert_output: torch.Tensor, received: ReceivedTokens, vendor: Vendor | None) -> torch.Tensor:
    """Each received token's weighted sum over this rank's experts, in the experts' output dtype."""
    combine = None if vendor is None else vendor.weighted_combine
    return reduce_received(expert_output, received, expert_output.dtype, combine=combine)


def sum_partials(
    returned: torch.Tensor, index: torch.Tensor, ones: torch.Tensor, out_dtype: torch.dtype, vendor: Vendor | None
) -> torch.Tensor:
    """`out[t] = sum_r returned[index[t, r]]` in fp32, rank order (`index` `[T * world]`, `ones` fp32
    `[T, world]`; a rank the token did not go to points at a zero row of `returned`)."""
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


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: object,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
    *,
    async_op: bool = False,
) -> object:
    """`dist.all_to_all_single` (equal splits where none are given); a copy without a group."""
    if group is None:
        output.copy_(input)
        return None
    return dist.all_to_all_single(output, input, output_splits, input_splits, group=group, async_op=async_op)


__all__ = ["Constants", "Pending", "all_to_all", "partial_sums", "receive", "sum_partials"]
