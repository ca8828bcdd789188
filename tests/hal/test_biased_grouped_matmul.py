"""A biased grouped matmul through `hal.Vendor` (each expert's bias, then the activation, over a dispatch's rows:
gpt-oss's first projection) at a realistic size: 128 experts, 1000 tokens at top-1 and top-8, K and I that
are not multiples of 128, against float64, on the vendors every machine has."""

from __future__ import annotations

import pytest
import torch

from conformance.reference import activation as float64_activation
from hal import Activation, Groups, QuantizedWeight, get_vendor

EXPERTS, TOKENS, K, I = 128, 1000, 704, 360


def _dispatch(top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """The token of each (token, slot) pair sorted by expert, and the rows per expert, of a random routing."""
    ids = torch.rand(TOKENS, EXPERTS, generator=gen).topk(top_k, dim=1).indices.flatten()
    order = torch.argsort(ids, stable=True)
    return order // top_k, torch.bincount(ids, minlength=EXPERTS).tolist()


@pytest.mark.parametrize("vendor_name", ["cpu", "ascend-emulated"])
@pytest.mark.parametrize("top_k", [1, 8])
@pytest.mark.parametrize("activation", [None, "silu-glu", "swiglu-oai"])
def test_biased_grouped_matmul_through_row_index_matches_float64(vendor_name, top_k, activation):
    vendor = get_vendor(vendor_name, environ={})
    gen = torch.Generator().manual_seed(top_k)
    width = 2 * I if activation else I
    x = torch.randn(TOKENS, K, generator=gen).to(torch.bfloat16)
    w = (torch.randn(EXPERTS, K, width, generator=gen) / K**0.5).to(torch.bfloat16)
    bias = torch.randn(EXPERTS, width, generator=gen).to(torch.bfloat16)
    rows, counts = _dispatch(top_k, gen)
    act = None if activation is None else Activation(activation, limit=1.5)  # the clamps bite at this size
    y = vendor.grouped_matmul(
        x.to(vendor.device),
        QuantizedWeight(w.to(vendor.device)),
        Groups.from_counts(torch.tensor(counts).to(vendor.device)),
        bias=bias.to(vendor.device),
        activation=act,
        row_index=rows.to(vendor.device),
    )
    gathered, ends = x.double()[rows], torch.tensor(counts).cumsum(0).tolist()
    product = torch.cat(
        [gathered[end - c : end] @ w[g].double() + bias[g].double() for g, (c, end) in enumerate(zip(counts, ends))]
    )
    expected = product if act is None else float64_activation(product, activation, act.alpha, act.limit)[0]
    assert y.shape == expected.shape and y.dtype == torch.bfloat16
    error = (y.double().cpu() - expected).abs()
    # two bf16 roundings (the product, then the biased product) before the activation's own
    assert torch.linalg.norm(error) <= 8e-3 * torch.linalg.norm(expected)
    assert error.max() <= 3e-2 * expected.abs().max()
