"""The permutation around the experts: pairs sorted by expert before, the weighted combine after."""

from __future__ import annotations

import torch

from hal import checks


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the flattened (token, slot) pairs by expert, keeping token order within an expert.

    Returns `order` (the flat pair index of each sorted row), `inverse` (the sorted row of
    each flat pair), both int64 `[T*k]`, and `counts` (int64 `[num_experts]`). No host
    synchronisation.
    """
    checks.expert_ids(topk_ids, num_experts)
    return sort_pairs(topk_ids, num_experts)


def sort_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sort_by_expert` of checked ids."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, inverse, counts


def weighted_combine(
    rows: torch.Tensor, index: torch.Tensor | None, topk_weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """`out[t] = sum_j topk_weights[t, j] * rows[index[t*k + j]]`, in fp32, cast to `out_dtype`: `[T, H]`.

    `rows` is `[R, H]`; `index` (int64 `[T*k]`) picks the row of each (token, slot) pair, or is
    None when `rows` is already in pair order (`R == T*k`). `topk_weights` is `[T, k]`.
    """
    checks.combine_operands(rows, index, topk_weights)
    checks.out_dtype("out_dtype", out_dtype)
    return combine_rows(rows, index, topk_weights, out_dtype)


def combine_rows(
    rows: torch.Tensor, index: torch.Tensor | None, topk_weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """`weighted_combine` of checked operands."""
    t, k = topk_weights.shape
    picked = rows if index is None else rows.index_select(0, index)
    weighted = picked.to(torch.float32).reshape(t, k, rows.shape[-1]) * topk_weights.to(torch.float32).unsqueeze(-1)
    return weighted.sum(dim=1).to(out_dtype)
