"""The weighted combine of a MoE layer: each token's routing-weighted sum of its experts' rows."""

from __future__ import annotations

import torch

from hal.errors import invalid


def weighted_combine(rows: torch.Tensor, index: torch.Tensor | None, topk_weights: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """`out[t] = sum_j topk_weights[t, j] * rows[index[t*k + j]]`, in fp32, cast to `out_dtype`: `[T, H]`.

    `rows` is `[R, H]`; `index` (int64 `[T*k]`) picks the row of each (token, slot) pair, or is
    None when `rows` is already in pair order (`R == T*k`). `topk_weights` is `[T, k]`.
    """
    t, k = check_combine(rows, index, topk_weights)
    picked = rows if index is None else rows.index_select(0, index)
    weighted = picked.to(torch.float32).view(t, k, rows.shape[-1]) * topk_weights.to(torch.float32).unsqueeze(-1)
    return weighted.sum(dim=1).to(out_dtype)


def check_combine(rows: torch.Tensor, index: torch.Tensor | None, topk_weights: torch.Tensor) -> tuple[int, int]:
    """Check the combine's shapes (no values); return `(T, k)`."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise invalid("rows", "a 2-D tensor [R, H]", getattr(rows, "shape", type(rows).__name__))
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dim() != 2:
        raise invalid("topk_weights", "a 2-D tensor [T, k]", getattr(topk_weights, "shape", type(topk_weights).__name__))
    t, k = topk_weights.shape
    pairs = t * k
    if index is None:
        if rows.shape[0] != pairs:
            raise invalid("rows", f"{pairs} rows (one per token and slot) when index is None", tuple(rows.shape))
    elif not isinstance(index, torch.Tensor) or index.dim() != 1 or index.numel() != pairs:
        raise invalid("index", f"a 1-D tensor of {pairs} row indices", getattr(index, "shape", type(index).__name__))
    return t, k
