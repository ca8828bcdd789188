"""The permutation ops every dispatcher uses: `sort_by_expert` (stable, counts every expert) and
`weighted_combine` (each token's fp32 weighted sum of its rows), against plain references."""

from __future__ import annotations

import pytest
import torch

from conformance.capability import SORT_AND_COMBINE, mark
from conformance.reference import generator, worst
from conformance.tolerances import OUTPUT_ROUNDING, SLACK

pytestmark = mark(SORT_AND_COMBINE)

#: (tokens, top_k, experts): decode, odd sizes, more pairs than a one-launch kernel may take, none.
SORT_CASES = {"decode": (1, 8, 128), "odd": (37, 3, 10), "many": (300, 8, 128), "no-tokens": (0, 2, 8),
              "one-expert": (5, 1, 1)}


@pytest.mark.parametrize("case", SORT_CASES)
def test_sort_by_expert_is_a_stable_sort_with_counts(hal_vendor, case):
    tokens, top_k, experts = SORT_CASES[case]
    gen = generator("sort", case)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]) if tokens else \
        torch.zeros((0, top_k), dtype=torch.int64)
    order, inverse, counts = hal_vendor.sort_by_expert(ids.to(hal_vendor.device), experts)
    flat = ids.reshape(-1)
    expected = sorted(range(flat.numel()), key=lambda p: (int(flat[p]), p))  # by expert, then pair order
    assert order.cpu().tolist() == expected, "order is not the stable sort by expert"
    assert torch.equal(inverse.cpu()[torch.tensor(expected, dtype=torch.int64)], torch.arange(flat.numel())), \
        "inverse does not undo order"
    assert counts.dtype == torch.int64 and counts.cpu().tolist() == torch.bincount(flat, minlength=experts).tolist()
    assert order.device == inverse.device == counts.device == hal_vendor.device


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
    out = hal_vendor.weighted_combine(rows.to(device), None if index is None else index.to(device),
                                      weights.to(device), out_dtype)
    assert tuple(out.shape) == (tokens, hidden) and out.dtype == out_dtype and out.device == device
    picked = rows.double() if index is None else rows.double()[index]
    terms = picked.view(tokens, top_k, hidden) * weights.double().unsqueeze(-1)
    ref = terms.sum(dim=1)
    bound = OUTPUT_ROUNDING[out_dtype] * ref.abs() + 4 * SLACK * terms.abs().sum(dim=1)
    error = (out.double().cpu() - ref).abs()
    assert bool((error <= bound).all()), worst(error, bound)
