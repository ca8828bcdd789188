"""Sorting (token, slot) pairs by expert in one launch (Triton), for small batches.

One program makes two passes over the pairs in chunks: the first counts the pairs of
each expert, the second places each pair at its expert's offset plus the number of
earlier pairs of that expert (a running count per expert, and a prefix sum inside the
chunk), so token order is kept within an expert, as a stable sort keeps it. It replaces
the six launches of the torch version (argsort, arange, scatter, zeros, ones, scatter-add),
which dominate a decode step's small kernels; large batches keep the torch radix sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Most pairs (tokens x top-k) sorted in one program; above it the torch version is faster.
MAX_PAIRS = 1024
#: Most experts the kernel holds in one block.
MAX_EXPERTS = 1024


@triton.jit
def _sort_pairs(ids_ptr, order_ptr, inverse_ptr, counts_ptr, P, E, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
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
        running += tl.sum(onehot, axis=0)


def sort_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(order, inverse, counts)` as `hal.reference.sort_by_expert` returns them, in one launch."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    pairs = flat.numel()
    order = torch.empty(pairs, dtype=torch.int64, device=flat.device)
    inverse = torch.empty_like(order)
    counts = torch.empty(num_experts, dtype=torch.int64, device=flat.device)
    e_pad = max(16, triton.next_power_of_2(num_experts))
    chunk = max(16, min(128, 8192 // e_pad))
    _sort_pairs[(1,)](flat, order, inverse, counts, pairs, num_experts, E_PAD=e_pad, CHUNK=chunk, num_warps=8)
    return order, inverse, counts
