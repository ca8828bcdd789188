"""The weighted combine in one pass (Triton): each token gathers its k expert rows, weighs
them in fp32 and writes its sum once (the torch version makes five passes over the rows)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vendors.cuda.kernels.launch import cdiv, launch, next_power_of_2
from vendors.cuda.kernels.dependent import release_next, wait_for_previous


@triton.jit(do_not_specialize=["R"])  # R (rows) changes per batch and only bounds a mask
def _combine(
    rows_ptr,
    index_ptr,
    w_ptr,
    out_ptr,
    H,
    R,
    stride_r,
    stride_o,
    TOPK: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    release_next(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pair = t * TOPK + j
        if HAS_INDEX:
            row = tl.load(index_ptr + pair).to(tl.int64)
        else:
            row = pair
        weight = tl.load(w_ptr + pair).to(tl.float32)
        inside = (row >= 0) & (row < R)  # an index outside rows (unchecked on the device) reads nothing
        acc += weight * tl.load(rows_ptr + row * stride_r + cols, mask=mask & inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def weighted_combine(
    rows: torch.Tensor,
    index: torch.Tensor | None,
    topk_weights: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """`out[t] = sum_j w[t, j] * rows[index[t*k + j]]` for rows `[R, H]` (contiguous last dim); an index
    outside `[0, R)` contributes nothing (never a read outside `rows`)."""
    t, k = topk_weights.shape
    h = rows.shape[-1]
    out = torch.empty((t, h), dtype=out_dtype, device=rows.device)
    if t and h:
        weights = topk_weights.contiguous()
        block = min(1024, next_power_of_2(h))
        launch(
            _combine,
            (t, cdiv(h, block)),
            rows,
            index if index is not None else weights,
            weights,
            out,
            h,
            rows.shape[0],
            rows.stride(0),
            out.stride(0),
            TOPK=k,
            HAS_INDEX=index is not None,
            BLOCK=block,
            PDL=pdl,
            num_warps=4,
            launch_pdl=pdl,
        )
    return out
