"""The sort a decode batch's routing already made, kept for the `sort_by_expert` call that follows it.

A layer routes (`softmax_topk`), then its dispatcher sorts the ids it got (`sort_by_expert`). Where one
program does both (`kernels/route_sort.py`), the routing call keeps the sort here, and the sort call takes
it back instead of launching again: only for the very ids tensor the routing returned, unchanged since
(its version counter), asked with the same number of experts, and once. Anything else (another tensor, ids
written in place, a second sort of the same ids) sorts as usual.
"""

from __future__ import annotations

import weakref

import torch

#: `(order, inverse, counts, token of each sorted row)`, as `sorting.sort_pairs(..., tokens=True)` returns them.
Sorted = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class PresortedIds:
    """One slot: the last routing's ids (weakly held) and their sort. Reads and writes replace whole tuples,
    so threads sharing the vendor at worst miss each other's sort."""

    def __init__(self) -> None:
        self._slot: tuple[weakref.ref[torch.Tensor], int, int, Sorted] | None = None

    def keep(self, ids: torch.Tensor, num_experts: int, sorted_pairs: Sorted) -> None:
        """Keep the sort of `ids` by `num_experts` experts for the next `take` of them (dropped with the ids)."""
        self._slot = (weakref.ref(ids, self._forget), ids._version, num_experts, sorted_pairs)

    def _forget(self, ref: weakref.ref[torch.Tensor]) -> None:
        # the ids died: their sort goes too (it may hold memory of a captured graph's pool)
        slot = self._slot
        if slot is not None and slot[0] is ref:
            self._slot = None

    def take(self, ids: torch.Tensor, num_experts: int, tokens: bool) -> tuple[torch.Tensor, ...] | None:
        """The kept sort of `ids` (with the token of each row where `tokens`), once; None where none is kept
        for exactly this tensor, unchanged, and `num_experts`."""
        slot = self._slot
        if slot is None:
            return None
        ref, version, experts, sorted_pairs = slot
        if ref() is not ids or ids._version != version or experts != num_experts:
            return None
        self._slot = None
        return sorted_pairs if tokens else sorted_pairs[:3]
