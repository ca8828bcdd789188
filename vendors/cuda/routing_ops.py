"""The CUDA vendor's routing and sort ops: softmax top-k and the counting sorts by expert (Triton).

A decode batch routes and sorts in one launch (`kernels/route_sort.py`): `softmax_topk` keeps the sort of
the ids it returns (`presorted.py`) and the `sort_by_expert` of those ids that follows takes it, launching
nothing. Every other batch routes in one launch and sorts in one or two (`kernels/routing.py`,
`kernels/sorting.py`).
"""

from __future__ import annotations

import torch

from vendors.cuda.kernels import route_sort, routing, sorting
from vendors.cuda.presorted import PresortedIds


class RoutingOps:
    """`softmax_topk`, `sort_by_expert` and `sort_by_expert_tokens` on the device (a mixin of the CUDA vendor's
    ops; what the kernels do not take goes on to the next class). `route_and_sort`: a decode batch's routing
    also sorts its pairs (set False to route and sort in separate launches)."""

    pdl: bool
    notes = {
        "softmax_topk": "Triton, one launch (softmax, top-k, renormalization) up to 1024 experts; a decode batch "
        f"(at most {sorting.RANK_MAX_PAIRS} pairs) also sorts its pairs by expert in that launch",
        "sort_by_expert": "the sort the routing launch made, for its own ids; else Triton: one program at decode (a "
        "rank sort up to 128 pairs, else a counting sort over two chunks), a counting sort of two launches of "
        "spans above",
        "sort_by_expert_tokens": "the counting sorts write each sorted row's token in the same pass",
    }

    def __init__(self) -> None:
        super().__init__()
        self.route_and_sort = True
        self._presorted = PresortedIds()

    def softmax_topk(self, logits: torch.Tensor, *, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax, top-k and the renormalization in one Triton launch (up to 1024 experts; the reference above),
        with the sort of the pairs by expert where the batch is a decode batch (`route_sort.fits`)."""
        tokens, experts = logits.shape
        if experts > routing.MAX_EXPERTS:
            return super().softmax_topk(logits, top_k=top_k, renormalize=renormalize)  # type: ignore[misc]
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        if self.route_and_sort and route_sort.fits(tokens, experts, top_k):
            routed, sorted_pairs = route_sort.softmax_topk_sorted(logits, top_k, renormalize, pdl=self.pdl)
            self._presorted.keep(routed[1], experts, sorted_pairs)
            return routed
        return routing.softmax_topk(logits, top_k, renormalize, pdl=self.pdl)

    def sort_by_expert(
        self, topk_ids: torch.Tensor, *, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pairs sorted by expert: the routing's own sort of these ids, or a Triton counting sort (one
        launch for small batches, two above); torch's radix sort for more experts than the kernels hold and for
        the largest batches."""
        return self._sort(topk_ids, num_experts, tokens=False)  # type: ignore[return-value]

    def sort_by_expert_tokens(
        self, topk_ids: torch.Tensor, *, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The counting sorts write each sorted row's token in their own pass; the radix sort divides after."""
        return self._sort(topk_ids, num_experts, tokens=True)  # type: ignore[return-value]

    def _sort(self, topk_ids: torch.Tensor, num_experts: int, *, tokens: bool) -> tuple[torch.Tensor, ...]:
        kept = self._presorted.take(topk_ids, num_experts, tokens)
        if kept is not None:
            return kept
        method = sorting.sort_method(topk_ids.numel(), num_experts)
        if method == sorting.ONE_PROGRAM:
            return sorting.sort_pairs(topk_ids, num_experts, tokens=tokens, pdl=self.pdl)
        if method == sorting.SPREAD:
            return sorting.sort_pairs_spread(topk_ids, num_experts, tokens=tokens, pdl=self.pdl)
        if tokens:
            return super().sort_by_expert_tokens(topk_ids, num_experts=num_experts)  # type: ignore[misc]
        return super().sort_by_expert(topk_ids, num_experts=num_experts)  # type: ignore[misc]
