"""Sorting (token, slot) pairs by expert (Triton): a counting sort, stable, with no host sync.

Small batches (decode): one program makes two passes over the pairs in chunks. The first
counts the pairs of each expert; the second places each pair at its expert's offset plus
the number of earlier pairs of that expert (a running count per expert, and a prefix sum
inside the chunk), so token order is kept within an expert, as a stable sort keeps it. It
replaces the six launches of the torch version (argsort, arange, scatter, zeros, ones,
scatter-add), which dominate a decode step's small kernels.

The smallest batches (up to `RANK_MAX_PAIRS` pairs) take no pass at all: a pair's row is the
number of pairs of lower experts plus the earlier pairs of its own expert, one reduction over a
`[pairs, pairs]` comparison, and the counts one reduction over `[experts, pairs]`. No scan,
no loop: at a decode step this is the whole sort.

Larger batches: the same two passes, spread over up to `spans_for(E)` programs, each owning a
contiguous span of pairs. The first launch writes each span's per-expert counts to a
`[spans, E]` table; in the second, each program reads the table, so that its pairs of
expert e start after all pairs of earlier experts and after the pairs of e in earlier
spans, then places its span as above. (torch's radix sort took 34 us for 4096 pairs on an
H100, a third of a 512-token qwen3 layer's non-GEMM time.) The largest batches of many experts
still go to the radix sort (`sort_method`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from vendors.cuda.kernels.launch import cdiv, launch, next_power_of_2
from vendors.cuda.kernels.dependent import release_next, wait_for_previous

#: Most chunks of pairs sorted by one program (`sort_method`); more go to `sort_pairs_spread`. On an
#: H100 one program took 52 us for 16 chunks (1024 pairs, 128 experts), the spread sort 11 us.
ONE_PROGRAM_CHUNKS = 2
#: Most programs of the spread sort; fewer where experts are many (`spans_for`). Each program reads
#: the whole `[spans, E]` table, so with 128 experts 256 spans cost more than they save: 32768 pairs
#: sorted in 58 us with 256 spans, 45 us with 64 (H100); with 32 experts, 11 against 16 us.
MAX_SPANS = 256
#: The `[spans, E]` table a spread sort aims at: spans are capped at max(64, TABLE // padded E).
TABLE = 8192
#: Pairs x padded experts from which torch's radix sort is faster (H100: 131072 pairs of 128
#: experts, 122 us against 148 us with 64 spans; of 256 experts, 107 against 127 us).
MAX_SPREAD_WORK = 1 << 24
#: Most experts the kernel holds in one block.
MAX_EXPERTS = 1024
#: Most pairs and most experts (each padded to a power of two) the rank sort takes; it also takes no more
#: than twice as many padded pairs as padded experts. Measured on an H100 (µs per sort, rank against
#: counting): 128 experts 1.5 / 1.9 at 8 pairs, 3.7 / 5.8 at 64, 5.7 / 9.0 at 128; 256 experts 3.0 / 4.6
#: at 32 pairs; but 8 experts 4.6 / 4.1 at 128 pairs and 1000 experts 4.6 / 4.5 at 16, where the
#: `[pairs, pairs]` or the `[experts, pairs]` comparison outgrows the passes.
RANK_MAX_PAIRS = 128
RANK_MAX_EXPERTS = 512


@triton.jit(do_not_specialize=["P", "E"])  # per-batch counts; they only bound loops and masks
def _sort_pairs(
    ids_ptr,
    order_ptr,
    inverse_ptr,
    counts_ptr,
    token_ptr,
    P,
    E,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    TOPK: tl.constexpr,
    TOKENS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    release_next(PDL)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(0, P, CHUNK):
        pairs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < P, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + experts, counts.to(tl.int64), mask=experts < E)
    running = tl.cumsum(counts, axis=0) - counts  # each expert's first row
    for start in range(0, P, CHUNK):
        pairs = start + tl.arange(0, CHUNK)
        valid = pairs < P
        ids = tl.load(ids_ptr + pairs, mask=valid, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        earlier = tl.cumsum(onehot, axis=0) - onehot  # same-expert pairs before this one in the chunk
        row = tl.sum(onehot * (running[None, :] + earlier), axis=1)
        tl.store(inverse_ptr + pairs, row.to(tl.int64), mask=valid)
        tl.store(order_ptr + row, pairs.to(tl.int64), mask=valid)
        if TOKENS:  # the token of each sorted row, in the same pass (no division launch after the sort)
            tl.store(token_ptr + row, (pairs // TOPK).to(tl.int64), mask=valid)
        running += tl.sum(onehot, axis=0)


@triton.jit(do_not_specialize=["P", "E"])
def _sort_by_rank(
    ids_ptr,
    order_ptr,
    inverse_ptr,
    counts_ptr,
    token_ptr,
    P,
    E,
    P_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    TOPK: tl.constexpr,
    TOKENS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    release_next(PDL)
    rank_sort(ids_ptr, order_ptr, inverse_ptr, counts_ptr, token_ptr, P, E, P_PAD, E_PAD, TOPK, TOKENS)


@triton.jit
def rank_sort(
    ids_ptr,
    order_ptr,
    inverse_ptr,
    counts_ptr,
    token_ptr,
    P,
    E,
    P_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    TOPK: tl.constexpr,
    TOKENS: tl.constexpr,
):
    """The rank sort of the `P` ids at `ids_ptr` (see the module) by one program: the outputs of `sort_pairs`."""
    pairs = tl.arange(0, P_PAD)
    valid = pairs < P
    # Padding takes an id above every expert: it is never below a real pair nor counted.
    ids = tl.load(ids_ptr + pairs, mask=valid, other=E_PAD).to(tl.int32)
    mine, other = ids[:, None], ids[None, :]
    ahead = (other < mine) | ((other == mine) & (pairs[None, :] < pairs[:, None]))
    row = tl.sum(ahead.to(tl.int32), axis=1)  # always inside [0, P): the rows form a permutation
    tl.store(inverse_ptr + pairs, row.to(tl.int64), mask=valid)
    tl.store(order_ptr + row, pairs.to(tl.int64), mask=valid)
    if TOKENS:
        tl.store(token_ptr + row, (pairs // TOPK).to(tl.int64), mask=valid)
    experts = tl.arange(0, E_PAD)
    counts = tl.sum((experts[:, None] == ids[None, :]).to(tl.int32), axis=1)
    tl.store(counts_ptr + experts, counts.to(tl.int64), mask=experts < E)


#: The ways `sort_method` picks from.
ONE_PROGRAM, SPREAD, RADIX = "one-program", "spread", "radix"


def sort_method(pairs: int, num_experts: int) -> str:
    """How to sort `pairs` pairs over `num_experts` experts: `ONE_PROGRAM` (`sort_pairs`) for at most
    `ONE_PROGRAM_CHUNKS` chunks, `SPREAD` (`sort_pairs_spread`) below `MAX_SPREAD_WORK` pairs x padded
    experts, else `RADIX` (torch's sort; also for none, or more experts than `MAX_EXPERTS`)."""
    if pairs == 0 or num_experts > MAX_EXPERTS:
        return RADIX
    e_pad, chunk = padded_and_chunk(num_experts)
    if pairs <= ONE_PROGRAM_CHUNKS * chunk:
        return ONE_PROGRAM
    return SPREAD if pairs * e_pad < MAX_SPREAD_WORK else RADIX


def spans_for(num_experts: int) -> int:
    """Most programs of a spread sort over `num_experts` experts."""
    return min(MAX_SPANS, max(64, TABLE // padded_and_chunk(num_experts)[0]))


def padded_and_chunk(num_experts: int) -> tuple[int, int]:
    """The expert axis padded to a power of two, and the pairs per chunk (a chunk's one-hot
    `[chunk, E]` block stays near 8192 values)."""
    e_pad = max(16, next_power_of_2(num_experts))
    return e_pad, max(16, min(128, 8192 // e_pad))


def int64_parts(lengths: Sequence[int], device: torch.device) -> list[torch.Tensor]:
    """Uninitialised int64 tensors of `lengths`, views of one allocation (one allocator call instead of
    several: host time decode pays on every call), each starting on a 16-byte boundary, as separate
    allocations would."""
    sizes: list[int] = []
    for n in lengths:
        sizes.append(n)
        if n & 1:
            sizes.append(1)  # a spare element keeps the next part 16-byte aligned
    parts = torch.empty(sum(sizes), dtype=torch.int64, device=device).split_with_sizes(sizes)
    if len(parts) == len(lengths):
        return list(parts)
    picked, i = [], 0
    for n in lengths:
        picked.append(parts[i])
        i += 1 + (n & 1)
    return picked


def flat_and_outputs(
    topk_ids: torch.Tensor, num_experts: int, tokens: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ids as one contiguous row, and the uninitialised `(order, inverse, counts, token)` the kernels fill
    (`token` is `order` itself without `tokens`), views of one allocation (`int64_parts`)."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    pairs = flat.numel()
    parts = int64_parts([pairs] * (3 if tokens else 2) + [num_experts], flat.device)
    order, inverse, counts = parts[0], parts[1], parts[-1]
    return flat, order, inverse, counts, parts[2] if tokens else order


def sort_pairs(
    topk_ids: torch.Tensor, num_experts: int, *, tokens: bool = False, pdl: bool = False, by_rank: bool | None = None
) -> tuple[torch.Tensor, ...]:
    """`(order, inverse, counts)` as `hal.reference.sort_by_expert` returns them, in one launch; with `tokens`
    also the token of each sorted row (`order // k`), written by the same launch. `by_rank`: the rank
    sort (True) or the counting passes (False); None: the rank sort where `rank_sort_fits`."""
    flat, order, inverse, counts, token = flat_and_outputs(topk_ids, num_experts, tokens)
    pairs = flat.numel()
    e_pad, chunk = padded_and_chunk(num_experts)
    p_pad = max(16, next_power_of_2(pairs))
    if by_rank is None:
        by_rank = rank_sort_fits(pairs, num_experts)
    elif by_rank and p_pad > RANK_MAX_PAIRS:
        raise ValueError(f"sort_pairs: the rank sort takes at most {RANK_MAX_PAIRS} pairs, got {pairs}")
    if by_rank:
        launch(
            _sort_by_rank,
            (1,),
            flat,
            order,
            inverse,
            counts,
            token,
            pairs,
            num_experts,
            P_PAD=p_pad,
            E_PAD=e_pad,
            TOPK=_top_k(topk_ids),
            TOKENS=tokens,
            PDL=pdl,
            num_warps=8 if max(p_pad, e_pad) * p_pad >= 8192 else 4,
            launch_pdl=pdl,
        )
        return (order, inverse, counts, token) if tokens else (order, inverse, counts)
    chunk = min(chunk, max(16, next_power_of_2(pairs)))  # decode: a one-hot block no larger than the pairs
    launch(
        _sort_pairs,
        (1,),
        flat,
        order,
        inverse,
        counts,
        token,
        pairs,
        num_experts,
        E_PAD=e_pad,
        CHUNK=chunk,
        TOPK=_top_k(topk_ids),
        TOKENS=tokens,
        PDL=pdl,
        num_warps=8 if chunk * e_pad >= 8192 else 4,
        launch_pdl=pdl,
    )
    return (order, inverse, counts, token) if tokens else (order, inverse, counts)


def rank_sort_fits(pairs: int, num_experts: int) -> bool:
    """Whether the rank sort takes these pairs (`RANK_MAX_PAIRS`, `RANK_MAX_EXPERTS`)."""
    p_pad = max(16, next_power_of_2(pairs))
    e_pad = padded_and_chunk(num_experts)[0]
    return 0 < pairs and p_pad <= RANK_MAX_PAIRS and e_pad <= RANK_MAX_EXPERTS and p_pad <= 2 * e_pad


def _top_k(topk_ids: torch.Tensor) -> int:
    return topk_ids.shape[-1] if topk_ids.dim() == 2 else 1


@triton.jit(do_not_specialize=["P", "E", "SPAN"])
def _count_spans(ids_ptr, table_ptr, P, E, SPAN, E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    release_next(PDL)
    span = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    first = span * SPAN
    end = tl.minimum(first + SPAN, P)
    for start in range(first, end, CHUNK):
        pairs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < end, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(table_ptr + span * E_PAD + experts, counts)


@triton.jit(do_not_specialize=["P", "E", "SPAN", "SPANS"])
def _place_spans(
    ids_ptr,
    table_ptr,
    order_ptr,
    inverse_ptr,
    counts_ptr,
    token_ptr,
    P,
    E,
    SPAN,
    SPANS,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS: tl.constexpr,
    TOPK: tl.constexpr,
    TOKENS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    release_next(PDL)
    span = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    total = tl.zeros((E_PAD,), dtype=tl.int32)
    before = tl.zeros((E_PAD,), dtype=tl.int32)  # pairs of each expert in earlier spans
    for row0 in range(0, SPANS, ROWS):
        rows = row0 + tl.arange(0, ROWS)
        table = tl.load(table_ptr + rows[:, None] * E_PAD + experts[None, :], mask=(rows < SPANS)[:, None], other=0)
        total += tl.sum(table, axis=0)
        before += tl.sum(tl.where((rows < span)[:, None], table, 0), axis=0)
    if span == 0:
        tl.store(counts_ptr + experts, total.to(tl.int64), mask=experts < E)
    running = tl.cumsum(total, axis=0) - total + before
    first = span * SPAN
    end = tl.minimum(first + SPAN, P)
    for start in range(first, end, CHUNK):
        pairs = start + tl.arange(0, CHUNK)
        valid = pairs < end
        ids = tl.load(ids_ptr + pairs, mask=valid, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        earlier = tl.cumsum(onehot, axis=0) - onehot
        row = tl.sum(onehot * (running[None, :] + earlier), axis=1)
        tl.store(inverse_ptr + pairs, row.to(tl.int64), mask=valid)
        tl.store(order_ptr + row, pairs.to(tl.int64), mask=valid)
        if TOKENS:  # the token of each sorted row, in the same pass (no division launch after the sort)
            tl.store(token_ptr + row, (pairs // TOPK).to(tl.int64), mask=valid)
        running += tl.sum(onehot, axis=0)


def sort_pairs_spread(
    topk_ids: torch.Tensor, num_experts: int, max_spans: int | None = None, *, tokens: bool = False, pdl: bool = False
) -> tuple[torch.Tensor, ...]:
    """`sort_pairs` for any number of pairs, in two launches of up to `max_spans` programs (default:
    `spans_for(num_experts)`)."""
    flat, order, inverse, counts, token = flat_and_outputs(topk_ids, num_experts, tokens)
    pairs = flat.numel()
    if pairs == 0:
        counts.zero_()
        return (order, inverse, counts, token) if tokens else (order, inverse, counts)
    e_pad, chunk = padded_and_chunk(num_experts)
    span = cdiv(cdiv(pairs, max_spans or spans_for(num_experts)), chunk) * chunk
    spans = cdiv(pairs, span)
    table = torch.empty((spans, e_pad), dtype=torch.int32, device=flat.device)
    launch(
        _count_spans,
        (spans,),
        flat,
        table,
        pairs,
        num_experts,
        span,
        E_PAD=e_pad,
        CHUNK=chunk,
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    launch(
        _place_spans,
        (spans,),
        flat,
        table,
        order,
        inverse,
        counts,
        token,
        pairs,
        num_experts,
        span,
        spans,
        E_PAD=e_pad,
        CHUNK=chunk,
        ROWS=max(1, 4096 // e_pad),
        TOPK=_top_k(topk_ids),
        TOKENS=tokens,
        PDL=pdl,
        num_warps=8,
        launch_pdl=pdl,
    )
    return (order, inverse, counts, token) if tokens else (order, inverse, counts)
