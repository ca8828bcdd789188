"""Softmax top-k routing in one launch (Triton): softmax over a token's experts in fp32, the k
largest probabilities picked by k rounds of argmax (the lowest expert id among equal ones),
optionally renormalized to sum to one. Up to `SMALL_BATCH` tokens a program takes one token
(2.7 µs at 128 experts on the H100, against 5.8 with tiles); above, a tile of tokens (about
`TILE_ELEMENTS` logits). torch makes four to six launches of the same work (cast, softmax,
top-k, sum, divide), which at decode cost more than the math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vendors.cuda.kernels.launch import cdiv, launch, next_power_of_2
from vendors.cuda.kernels.dependent import release_next, wait_for_previous

#: The most experts the kernel holds in one tile (more take the reference).
MAX_EXPERTS = 1024
#: Logits one program loads (tokens x padded experts) above `SMALL_BATCH` tokens.
TILE_ELEMENTS = 2048
#: Most tokens routed one per program.
SMALL_BATCH = 256


@triton.jit(do_not_specialize=["T"])  # T changes with every batch and only bounds a mask
def _softmax_topk(
    logits_ptr,
    w_ptr,
    ids_ptr,
    T,
    E,
    stride_l,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    release_next(PDL)
    route_rows(logits_ptr, w_ptr, ids_ptr, tl.program_id(0) * ROWS, T, E, stride_l, K, K_PAD, E_PAD, ROWS, RENORMALIZE)


@triton.jit
def route_rows(
    logits_ptr,
    w_ptr,
    ids_ptr,
    first,
    T,
    E,
    stride_l,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Softmax top-k of the `ROWS` logit rows from `first` (those from T on masked): their weights and ids
    stored at `[row, slot]` of the `[T, K]` outputs."""
    rows = (first + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < T
    inside = row_ok[:, None] & (cols < E)[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride_l + cols[None, :], mask=inside, other=float("-inf"))
    x = x.to(tl.float32)
    top = tl.max(x, axis=1)
    e = tl.where(inside, tl.exp(x - top[:, None]), 0.0)
    probs = e / tl.sum(e, axis=1)[:, None]
    work = tl.where(inside, probs, -1.0)  # padding never wins
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros((ROWS, K_PAD), dtype=tl.float32)
    ids = tl.zeros((ROWS, K_PAD), dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(work, axis=1)
        pick = tl.min(tl.where(work == best[:, None], cols[None, :], E_PAD), axis=1)
        pick = tl.minimum(pick, E - 1)  # a NaN row matches nothing: keep its ids in range
        weights = tl.where(slots[None, :] == j, best[:, None], weights)
        ids = tl.where(slots[None, :] == j, pick[:, None], ids)
        work = tl.where(cols[None, :] == pick[:, None], -1.0, work)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    out = rows[:, None] * K + slots[None, :]
    keep = row_ok[:, None] & (slots < K)[None, :]
    tl.store(w_ptr + out, weights, mask=keep)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=keep)


def softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, *, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights fp32 [T, k], ids int64 [T, k])` for float logits `[T, E]` (contiguous last dim), E <= MAX_EXPERTS."""
    t, e = logits.shape
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t:
        e_pad = next_power_of_2(e)
        rows, warps = launch_shape(t, e_pad)
        launch(
            _softmax_topk,
            (cdiv(t, rows),),
            logits,
            weights,
            ids,
            t,
            e,
            logits.stride(0),
            K=top_k,
            K_PAD=next_power_of_2(top_k),
            E_PAD=e_pad,
            ROWS=rows,
            RENORMALIZE=renormalize,
            PDL=pdl,
            num_warps=warps,
            launch_pdl=pdl,
        )
    return weights, ids


def launch_shape(tokens: int, e_pad: int) -> tuple[int, int]:
    """Rows per program and warps per program. Up to `SMALL_BATCH` tokens a program takes one token, so the
    tokens' k rounds of reductions run side by side, each within a warp or two. Above, a program takes a
    tile of `TILE_ELEMENTS` logits on four warps."""
    rows = 1 if tokens <= SMALL_BATCH else max(1, TILE_ELEMENTS // e_pad)
    return rows, max(1, min(4, rows * e_pad // 512))
