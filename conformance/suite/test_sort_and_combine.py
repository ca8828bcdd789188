"""The permutation ops every dispatcher uses: `sort_by_expert` (stable, counts every expert, and the token
of each sorted row when asked) and
`weighted_combine` (each token's fp32 weighted sum of its rows), against plain references; and
the softmax top-k routing the default router asks the vendor for (`softmax_topk`), against float64."""

from __future__ import annotations

import pytest
import torch

from conformance.capability import SORT_AND_COMBINE, mark
from conformance.reference import generator, worst
from conformance.tolerances import OUTPUT_ROUNDING, SLACK

pytestmark = mark(SORT_AND_COMBINE)

#: (tokens, top_k, experts): decode, odd sizes, more pairs than a one-launch kernel may take, none.
SORT_CASES = {
    "decode": (1, 8, 128),
    "odd": (37, 3, 10),
    "many": (300, 8, 128),
    "no-tokens": (0, 2, 8),
    "one-expert": (5, 1, 1),
}


@pytest.mark.parametrize("case", SORT_CASES)
def test_sort_by_expert_is_a_stable_sort_with_counts(hal_vendor, case):
    tokens, top_k, experts = SORT_CASES[case]
    gen = generator("sort", case)
    ids = (
        torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
        if tokens
        else torch.zeros((0, top_k), dtype=torch.int64)
    )
    order, inverse, counts = hal_vendor.sort_by_expert(ids.to(hal_vendor.device), experts)
    flat = ids.reshape(-1)
    expected = sorted(range(flat.numel()), key=lambda p: (int(flat[p]), p))  # by expert, then pair order
    assert order.cpu().tolist() == expected, "order is not the stable sort by expert"
    assert torch.equal(inverse.cpu()[torch.tensor(expected, dtype=torch.int64)], torch.arange(flat.numel())), (
        "inverse does not undo order"
    )
    assert counts.dtype == torch.int64 and counts.cpu().tolist() == torch.bincount(flat, minlength=experts).tolist()
    assert order.device == inverse.device == counts.device == hal_vendor.device
    with_tokens = hal_vendor.sort_by_expert(ids.to(hal_vendor.device), experts, tokens=True)
    assert len(with_tokens) == 4, "sort_by_expert(tokens=True) must return (order, inverse, counts, tokens)"
    for name, plain, given in zip(("order", "inverse", "counts"), (order, inverse, counts), with_tokens):
        assert torch.equal(plain.cpu(), given.cpu()), f"{name} differs when the tokens are asked for too"
    token = with_tokens[3]
    assert token.dtype == torch.int64 and token.device == hal_vendor.device
    assert token.cpu().tolist() == [p // top_k for p in expected], "the token of a sorted row is not order // k"


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "in-pair-order"])
@pytest.mark.parametrize("tokens, top_k, hidden", [(1, 8, 2048), (33, 2, 200), (0, 4, 64)])
def test_weighted_combine_matches_float64(hal_vendor, tokens, top_k, hidden, indexed, rows_dtype, out_dtype):
    gen = generator("combine", tokens, top_k, hidden, indexed)
    rows = torch.randn(tokens * top_k, hidden, generator=gen).to(rows_dtype)
    weights = torch.rand(tokens, top_k, generator=gen)
    index = torch.randperm(tokens * top_k, generator=gen) if indexed else None
    device = hal_vendor.device
    out = hal_vendor.weighted_combine(
        rows.to(device), None if index is None else index.to(device), weights.to(device), out_dtype
    )
    assert tuple(out.shape) == (tokens, hidden) and out.dtype == out_dtype and out.device == device
    picked = rows.double() if index is None else rows.double()[index]
    terms = picked.view(tokens, top_k, hidden) * weights.double().unsqueeze(-1)
    ref = terms.sum(dim=1)
    bound = OUTPUT_ROUNDING[out_dtype] * ref.abs() + 4 * SLACK * terms.abs().sum(dim=1)
    error = (out.double().cpu() - ref).abs()
    assert bool((error <= bound).all()), worst(error, bound)


#: (tokens, experts, top_k, logits dtype): decode, Qwen3-MoE, OLMoE, DeepSeek-V2-Lite, experts off powers of two.
TOPK_CASES = {
    "decode": (1, 128, 8, torch.float32),
    "qwen3-prefill": (3000, 128, 8, torch.bfloat16),
    "mixtral": (257, 8, 2, torch.bfloat16),
    "olmoe": (100, 64, 8, torch.float32),
    "deepseek-v2-lite": (64, 66, 6, torch.float16),
    "top-1-of-1000": (33, 1000, 1, torch.float32),
    "all-experts": (9, 4, 4, torch.float32),
}


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "raw"])
@pytest.mark.parametrize("case", TOPK_CASES)
def test_softmax_topk_picks_the_largest_probabilities(hal_vendor, case, renormalize):
    """The k chosen experts are distinct and hold the k largest float64 probabilities (ties may go either
    way); their weights are those probabilities (renormalized over the k) within fp32 rounding."""
    tokens, experts, top_k, dtype = TOPK_CASES[case]
    gen = generator("softmax-topk", case)
    logits = (torch.randn(tokens, experts, generator=gen) * 2).to(dtype)
    weights, ids = hal_vendor.softmax_topk(logits.to(hal_vendor.device), top_k, renormalize=renormalize)
    assert tuple(weights.shape) == tuple(ids.shape) == (tokens, top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.device == ids.device == hal_vendor.device
    ids, weights = ids.cpu(), weights.cpu().double()
    assert bool(((ids >= 0) & (ids < experts)).all()), "an expert id out of range"
    assert all(len(set(row)) == top_k for row in ids.tolist()), "an expert chosen twice for one token"
    probs = torch.softmax(logits.double(), dim=-1)
    chosen = probs.gather(1, ids)
    kth = probs.topk(top_k, dim=-1).values[:, -1:]
    assert bool((chosen >= kth * (1 - 2.0**-18)).all()), "an expert below the k-th largest probability"
    want = chosen / chosen.sum(dim=-1, keepdim=True) if renormalize else chosen
    error, bound = (weights - want).abs(), 2.0**-18 * want.abs() + 2.0**-40  # fp32 softmax: a few ulp
    assert bool((error <= bound).all()), worst(error, bound)
