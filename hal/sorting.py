"""Sorting a layer's (token, slot) pairs by expert: the permutation every dispatcher starts from."""

from __future__ import annotations

import torch


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the flattened (token, slot) pairs by expert, keeping token order within an expert.

    Returns `order` (the flat pair index of each sorted row), `inverse` (the sorted row of
    each flat pair), both int64 `[T*k]`, and `counts` (int64 `[num_experts]`). No host
    synchronisation.
    """
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, inverse, counts
