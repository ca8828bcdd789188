"""Softmax top-k routing and the sort of its pairs by expert in one launch (Triton), for decode batches.

At a decode step both halves are one small program each (`routing.py`, the rank sort of `sorting.py`), and
their cost is the host's: a launch, an allocation, an argument check. Here one program routes every token
(`routing.route_rows` over all rows at once), waits for its own stores of the ids (a block barrier: the
sort reads them in another layout, through memory), then rank-sorts the pairs (`sorting.rank_sort`). The
ids and the sort are those of `routing.softmax_topk` and `sorting.sort_pairs(..., tokens=True)` bit for bit;
the weights are within fp32 rounding of the routing kernel's (a program holding several tokens may sum a
token's probabilities in another order).

It serves batches where both halves fit one program: the rank sort's limits (`sorting.rank_sort_fits`)
and at most `MAX_TILE` logits (tokens x padded experts) in the routing tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vendors.cuda.kernels.dependent import release_next, wait_for_previous
from vendors.cuda.kernels.launch import launch, next_power_of_2
from vendors.cuda.kernels.routing import route_rows
from vendors.cuda.kernels.sorting import int64_parts, padded_and_chunk, rank_sort, rank_sort_fits

#: Most logits (padded tokens x padded experts) the one program routes: 64 tokens of 128 experts.
MAX_TILE = 8192


def fits(tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether `tokens` tokens over `num_experts` experts at top-`top_k` route and sort in one program."""
    return (
        tokens > 0
        and rank_sort_fits(tokens * top_k, num_experts)
        and next_power_of_2(tokens) * next_power_of_2(num_experts) <= MAX_TILE
    )


@triton.jit(do_not_specialize=["T", "P"])  # per-batch counts; they only bound masks
def _softmax_topk_sorted(
    logits_ptr,
    w_ptr,
    ids_ptr,
    order_ptr,
    inverse_ptr,
    counts_ptr,
    token_ptr,
    T,
    P,
    E,
    stride_l,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    P_PAD: tl.constexpr,
    SORT_E_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    release_next(PDL)
    route_rows(logits_ptr, w_ptr, ids_ptr, 0, T, E, stride_l, K, K_PAD, E_PAD, ROWS, RENORMALIZE)
    tl.debug_barrier()  # every thread's stores of the ids are seen by the sort's loads below
    rank_sort(ids_ptr, order_ptr, inverse_ptr, counts_ptr, token_ptr, P, E, P_PAD, SORT_E_PAD, K, True)


def _outputs(tokens: int, top_k: int, experts: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Uninitialised `(weights, ids, order, inverse, counts, token)` as views of one allocation (`int64_parts`;
    the fp32 weights two to an int64 word)."""
    pairs = tokens * top_k
    weights, ids, order, inverse, token, counts = int64_parts(
        [(pairs + 1) // 2, pairs, pairs, pairs, pairs, experts], device
    )
    weights = weights.view(torch.float32)[:pairs].view(tokens, top_k)
    return weights, ids.view(tokens, top_k), order, inverse, counts, token


def _warps(routing_tile: int, sort_tile: int) -> int:
    """One warp where both halves are small (a token's routing then reduces within a warp, as the routing
    kernel's one-token programs do), else the rank sort's four or eight."""
    if routing_tile <= 512 and sort_tile <= 4096:
        return 1
    return 8 if sort_tile >= 8192 else 4


def softmax_topk_sorted(
    logits: torch.Tensor, top_k: int, renormalize: bool, *, pdl: bool = False
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`(weights, ids)` as `routing.softmax_topk` returns them and `(order, inverse, counts, token)` as
    `sorting.sort_pairs(ids, E, tokens=True)` does, from one launch. The caller has checked that the batch
    `fits` (not checked again here: this runs on every decode step)."""
    t, e = logits.shape
    pairs = t * top_k
    weights, ids, order, inverse, counts, token = _outputs(t, top_k, e, logits.device)
    p_pad = max(16, next_power_of_2(pairs))
    sort_e_pad = padded_and_chunk(e)[0]
    launch(
        _softmax_topk_sorted,
        (1,),
        logits,
        weights,
        ids,
        order,
        inverse,
        counts,
        token,
        t,
        pairs,
        e,
        logits.stride(0),
        K=top_k,
        K_PAD=next_power_of_2(top_k),
        E_PAD=next_power_of_2(e),
        ROWS=next_power_of_2(t),
        RENORMALIZE=renormalize,
        P_PAD=p_pad,
        SORT_E_PAD=sort_e_pad,
        PDL=pdl,
        num_warps=_warps(next_power_of_2(t) * next_power_of_2(e), max(p_pad, sort_e_pad) * p_pad),
        launch_pdl=pdl,
    )
    return (weights, ids), (order, inverse, counts, token)
