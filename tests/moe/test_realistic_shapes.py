"""The reference ops and the layer on realistic shapes: many experts, hundreds to thousands of tokens
(rows read through a dispatch's index too),
dimensions that are not multiples of 128, top-1 and top-8, against float64 references built here."""

from __future__ import annotations

import pytest
import torch

from conformance.operands import random_codes_activation, random_codes_weight
from conformance.reference import grouped_matmul as reference_grouped_matmul
from conformance.reference import moe_features, relative_error, seed_of, softmax_topk
from conformance.tolerances import gemm_bound, layer_tolerance
from hal import GemmKind, Groups, take_rows
import moe
from moe import MoELayer
from vendors.cpu import CpuVendor

pytestmark = pytest.mark.slow  # realistic shapes: seconds to tens of seconds each on a CPU


def _counts(experts: int, rows: int, gen: torch.Generator) -> list[int]:
    """Uneven rows per expert, a quarter of the experts empty, summing to `rows`."""
    weights = torch.rand(experts, generator=gen) * (torch.rand(experts, generator=gen) > 0.25)
    counts = (weights / weights.sum() * rows).floor().long()
    counts[int(weights.argmax())] += rows - int(counts.sum())
    return counts.tolist()


@pytest.mark.parametrize("kind", [GemmKind.BF16, GemmKind.INT8, GemmKind.FP8_BLOCK128, GemmKind.NVFP4], ids=str)
def test_grouped_matmul_with_128_groups_and_unaligned_dims(kind):
    gen = torch.Generator().manual_seed(7)
    experts, k, n = 128, 1008, 200  # neither K nor N a multiple of 128 (K: whole nvfp4 blocks)
    counts = _counts(experts, 2000, gen)
    x = random_codes_activation(kind.value, sum(counts), k, gen)
    w = random_codes_weight(kind.value, experts, k, n, gen)
    y = CpuVendor().grouped_matmul(x, w, Groups.from_counts(torch.tensor(counts)))
    ref, magnitude = reference_grouped_matmul(x, w, counts)
    assert bool(((y.double() - ref).abs() <= gemm_bound(ref, magnitude, y.dtype)).all())


@pytest.mark.parametrize("kind", [GemmKind.BF16, GemmKind.INT8, GemmKind.FP8_BLOCK128, GemmKind.NVFP4], ids=str)
@pytest.mark.parametrize("top_k", [1, 8])
def test_grouped_matmul_through_a_dispatch_index_with_128_groups(kind, top_k):
    """The rows of a dispatch read through `row_index`: 2000 tokens' top-k pairs sorted by expert, unaligned
    K and N, against float64 over the gathered rows."""
    gen = torch.Generator().manual_seed(11 + top_k)
    experts, k, n, tokens = 128, 1008, 200, 2000
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=-1)[:, :top_k]
    order = torch.sort(ids.flatten(), stable=True).indices
    index = torch.div(order, top_k, rounding_mode="floor")
    counts = torch.bincount(ids.flatten(), minlength=experts)
    x = random_codes_activation(kind.value, tokens, k, gen)
    w = random_codes_weight(kind.value, experts, k, n, gen)
    y = CpuVendor().grouped_matmul(x, w, Groups.from_counts(counts), row_index=index)
    ref, magnitude = reference_grouped_matmul(take_rows(x, index), w, counts.tolist())
    assert y.shape == (tokens * top_k, n)
    assert bool(((y.double() - ref).abs() <= gemm_bound(ref, magnitude, y.dtype)).all())


def _float64_moe(x, ids, weights, w13, w2):  # type: ignore[no-untyped-def]
    """The float64 MoE (SiLU-GLU experts), vectorized per expert: the suite's reference."""
    return moe_features(x, ids, weights, w13, w2)


@pytest.mark.parametrize("scheme", ["unquantized", "w8a8-int8", "w8a8-fp8-block"])
@pytest.mark.parametrize("top_k", [1, 8])
def test_layer_with_128_experts_and_unaligned_dims(scheme, top_k):
    gen = torch.Generator().manual_seed(top_k)
    experts, hidden, inter, tokens = 128, 1000, 360, 600  # neither H nor I a multiple of 128
    w13 = torch.randn(experts, hidden, 2 * inter, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, inter, hidden, generator=gen) / inter**0.5
    layer = MoELayer.from_float(w13, w2, top_k, scheme=scheme, vendor=CpuVendor(), environ={})
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=gen)
    routing = layer.router(logits)
    ref = _float64_moe(x, routing.topk_ids, routing.topk_weights, w13, w2)
    y = layer(x, logits)
    error = float((y.double() - ref).norm() / ref.norm())
    assert error <= layer_tolerance(scheme, layer.plan.resolved.value), f"relative error {error:.4f}"


@pytest.mark.parametrize(
    "activation, top_k, bias, shared, scheme",
    [
        ("swiglu-oai", 4, True, False, "fp32"),  # gpt-oss
        ("silu-glu", 8, False, True, "fp32"),  # DeepSeek / Qwen2-MoE (gated shared expert)
        ("gelu-tanh-glu", 1, True, True, "w8a8-fp8-block"),
    ],
    ids=["swiglu-oai-top4-bias", "silu-top8-shared", "gelu-top1-bias-shared-fp8"],
)
def test_model_features_with_128_experts_and_unaligned_dims(activation, top_k, bias, shared, scheme):
    """Activations, biases and gated shared experts at 128 experts, H 1000, I 352, 1500 tokens."""
    import moe

    e, h, i, s, tokens = 128, 1000, 352, 704, 1500
    g = torch.Generator().manual_seed(seed_of("features", activation, top_k))
    w13, w2 = torch.randn(e, h, 2 * i, generator=g) / h**0.5, torch.randn(e, i, h, generator=g) / i**0.5
    b13 = torch.randn(e, 2 * i, generator=g) * 0.3 if bias else None
    b2 = torch.randn(e, h, generator=g) * 0.3 if bias else None
    parts = (
        (
            torch.randn(h, 2 * s, generator=g) / h**0.5,
            torch.randn(s, h, generator=g) / s**0.5,
            torch.randn(h, generator=g) / h**0.5,
        )
        if shared
        else None
    )
    quant = moe.Unquantized(torch.float32) if scheme == "fp32" else scheme
    layer = moe.MoELayer.from_float(
        w13,
        w2,
        top_k,
        w13_bias=b13,
        w2_bias=b2,
        scheme=quant,
        vendor=CpuVendor(),
        activation=activation,
        environ={},
        shared_experts=moe.SharedExperts(s, gated=True) if shared else None,
    )
    if parts is not None:
        layer.load_shared_experts(*parts)
    x = torch.randn(tokens, h, generator=g)
    logits = torch.randn(tokens, e, generator=g)
    logits[: tokens // 4, :3] += 4.0  # a few popular experts, many nearly idle ones
    if scheme != "fp32":
        x = x.to(torch.bfloat16)
    ids, weights = softmax_topk(logits, top_k)
    ref = moe_features(x, ids, weights, w13, w2, kind=activation, b13=b13, b2=b2, shared=parts)
    bound = 1e-5 if scheme == "fp32" else layer_tolerance(scheme, "fp8")
    assert relative_error(layer(x, logits), ref) <= bound


@pytest.mark.parametrize("tokens, top_k, experts", [(3000, 1, 128), (3000, 8, 128), (1500, 4, 1000), (2049, 6, 257)])
def test_the_sorted_rows_tokens_at_realistic_sizes(tokens, top_k, experts):
    """`sort_by_expert(tokens=True)` and the reference sort with the dispatcher's own division give the stable sort
    and each sorted row's token, against a plain argsort, at thousands of tokens."""
    gen = torch.Generator().manual_seed(tokens + top_k)
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=-1)[:, :top_k]
    order = torch.sort(ids.reshape(-1), stable=True).indices
    want = (order, torch.argsort(order), torch.bincount(ids.reshape(-1), minlength=experts), order // top_k)
    for got in (
        CpuVendor().sort_by_expert(ids, experts, tokens=True),
        moe.LocalDispatcher(_plan(), experts, vendor=None).sort_pairs(ids, tokens=True),
    ):
        assert len(got) == 4 and all(torch.equal(a, b) for a, b in zip(got, want))


def _plan():
    from hal import DispatchConfig, parse_scheme, resolve_dispatch_plan

    return resolve_dispatch_plan(
        CpuVendor(), 1000, config=DispatchConfig(dtype="bf16"), scheme=parse_scheme("unquantized"), environ={}
    )
