"""Softmax top-k routing: the reference the vendors' `softmax_topk` kernels are held to."""

from __future__ import annotations

import torch

from hal import checks


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights, ids)` `[T, k]`: the k largest of `softmax(logits)` over the experts (fp32), fp32 and int64,
    the weights divided by their sum when `renormalize` (Mixtral, Qwen-MoE, OLMoE routing)."""
    checks.router_logits(logits, top_k)
    return topk_of_softmax(logits, top_k, renormalize)


def topk_of_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`softmax_topk` of checked logits."""
    probs = torch.softmax(logits if logits.dtype == torch.float32 else logits.to(torch.float32), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:  # the k largest probabilities sum to at least k / E: no guard needed
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
