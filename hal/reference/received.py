"""The experts' side of token-wise expert parallelism, shared by every dispatcher that moves tokens.

A token-wise dispatcher (moe-hal's torch.distributed path, DeepEP's normal mode) sends each token
once to every rank that holds at least one of its experts, with its top-k ids and weights. The
receiving rank then needs:

- the rows its experts compute: each (received token, slot) pair whose expert is local, sorted by
  local expert (source order kept within one), as a row index into the received tokens, and the
  per-expert counts; or, for the masked low-latency layout, each pair's slot in `[L, slots]`;
- after the experts, each received token's weighted sum over its local pairs (the partial result
  sent back; the token's home rank adds the partials of the ranks it went to).

`sort_received` computes both index sets in one sort, on the device, without a host
synchronisation. `reduce_received` is the weighted sum, through a `weighted_combine` of the
caller's choosing (a vendor's kernel or the reference).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hal.reference.permute import combine_rows, sort_pairs

#: `sort(ids [N, k], num_experts) -> (order, inverse, counts)`, as `hal.Vendor.sort_by_expert`.
SortFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]]
#: `combine(rows, index, weights, out_dtype) -> [T, H]`, as `hal.Vendor.weighted_combine`.
CombineFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class ReceivedTokens:
    """Where a rank's received tokens go among its experts' rows, and how they come back."""

    #: the received token of each expert row: `[P]` sorted by local expert (`slots` None), or `[L * slots]`
    #: in the masked layout, where an empty slot holds `empty_row`
    row_index: torch.Tensor
    #: int64 `[L]`: the rows (pairs) each local expert received
    expert_counts: torch.Tensor
    #: int64 `[R * k]`: the expert row of each (received token, slot) pair; a slot whose expert is not
    #: local points at a row of the same token (its weight is 0), or row 0 for a token with no local pair
    combine_index: torch.Tensor
    #: fp32 `[R, k]`: each pair's routing weight where its expert is local, else 0
    combine_weights: torch.Tensor


def sort_received(
    local_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_local: int,
    *,
    rows: int | None = None,
    slots: int | None = None,
    empty_row: int = 0,
    sort: SortFn | None = None,
) -> ReceivedTokens:
    """The expert rows of received tokens whose top-k experts are `local_ids` `[R, k]` (this rank's
    local expert ids; anything outside `[0, num_local)` is another rank's expert or an empty slot).

    - `rows`: the number of local pairs when the caller knows it (normal mode learns it with the
      counts); the row index then has exactly that length. None: `R * k` entries, the tail padding.
    - `slots`: the masked low-latency layout with `slots` rows per expert (`capacity * ranks`); each
      expert may receive at most `slots` pairs.
    - `sort`: the vendor's `sort_by_expert` (default: the reference).
    """
    r, k = local_ids.shape
    sort = sort or sort_pairs
    # Another rank's expert or an empty slot sorts after the local ones, as key num_local (in the ids' dtype:
    # the sort takes int32 and int64 alike).
    key = local_ids.clamp(-1, num_local).remainder_(num_local + 1)
    sorted_pairs = sort(key, num_local + 1)
    order, inverse, counts = sorted_pairs[:3]
    counts = counts[:num_local]
    token_of_row = sorted_pairs[3] if len(sorted_pairs) > 3 else torch.div(order, k, rounding_mode="floor")
    if slots is None:
        row_index = token_of_row if rows is None else token_of_row[:rows]
        position = inverse
    else:
        row_index, position = _masked_rows(key, order, inverse, counts, token_of_row, slots, empty_row)
    away = key == num_local
    return ReceivedTokens(
        row_index,
        counts,
        _combine_index(position.view(r, k), away),
        topk_weights.to(torch.float32).masked_fill(away, 0.0),
    )


def _masked_rows(
    key: torch.Tensor,
    order: torch.Tensor,
    inverse: torch.Tensor,
    counts: torch.Tensor,
    token_of_row: torch.Tensor,
    slots: int,
    empty_row: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index `[L * slots]`, the masked row of each pair) of the masked layout."""
    num_local = counts.numel()
    starts = torch.cumsum(counts, 0) - counts
    expert_of_row = key.reshape(-1).index_select(0, order).to(torch.int64)
    valid = expert_of_row < num_local
    expert = expert_of_row.clamp(max=num_local - 1)
    rank_in_expert = torch.arange(order.numel(), device=key.device) - starts.index_select(0, expert)
    masked = expert * slots + rank_in_expert
    dump = num_local * slots
    index = torch.full((dump + 1,), empty_row, dtype=torch.int64, device=key.device)
    index.scatter_(0, masked.masked_fill(~valid, dump), token_of_row)
    return index[:dump], masked.index_select(0, inverse)


def _combine_index(position: torch.Tensor, away: torch.Tensor) -> torch.Tensor:
    """int64 `[R * k]`: each pair's expert row; a pair `away` (not local) takes its token's first local row,
    or row 0 for a token without one."""
    unset = torch.iinfo(torch.int64).max
    # The remainder turns `unset` (no local pair) into 0 and leaves every real row as it is.
    first = position.masked_fill(away, unset).amin(dim=1, keepdim=True).remainder(unset)
    return torch.where(away, first, position).reshape(-1)


def reduce_received(
    expert_rows: torch.Tensor, received: ReceivedTokens, out_dtype: torch.dtype, *, combine: CombineFn | None = None
) -> torch.Tensor:
    """Each received token's weighted sum over its local experts' rows `[R, H]` in `out_dtype`
    (`expert_rows` `[P, H]`, or the masked `[L, slots, H]`)."""
    rows = expert_rows.reshape(-1, expert_rows.shape[-1])
    weights = received.combine_weights
    if weights.shape[0] == 0 or rows.shape[0] == 0:
        return rows.new_zeros((weights.shape[0], rows.shape[-1]), dtype=out_dtype)
    if combine is None:
        return combine_rows(rows, received.combine_index, weights, out_dtype)
    return combine(rows, received.combine_index, weights, out_dtype)


__all__ = ["CombineFn", "ReceivedTokens", "SortFn", "reduce_received", "sort_received"]
