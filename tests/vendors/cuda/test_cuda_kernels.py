"""The CUDA vendor's Triton kernels against the plain-torch definitions (GPU only).

The conformance suite checks quantize, grouped matmul and swiglu against float64; these
tests cover the ops it does not reach: the sort by expert, the weighted combine and the
K-major weight storage, at the sizes where the kernel or the torch path is chosen, and the
first projection with its activation (also through the dispatch's row index) and the fp8 quantize at a
real model's sizes.
"""

from __future__ import annotations

import pytest
import torch

from hal import reference
from hal.reference import sort_by_expert, weighted_combine
from vendors.cuda import CudaVendor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize(
    "tokens, top_k, experts",
    [
        (1, 8, 128),
        (2, 8, 128),
        (7, 2, 8),
        (128, 8, 128),
        (100, 4, 1000),
        (129, 8, 128),
        (600, 2, 7),
        (3000, 1, 1024),
        (4096, 8, 128),
        (4096, 8, 256),
        (16384, 8, 256),
    ],
)
def test_sort_by_expert_equals_the_stable_torch_sort(tokens, top_k, experts):
    """Both Triton sorts (one program for a few chunks, spans above) and the radix-sort fallback for the
    largest batches, against the torch sort; with the token of each sorted row written by the same launch."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.rand(tokens, experts, device="cuda", generator=g).argsort(dim=-1)[:, :top_k]
    vendor = CudaVendor()
    got = vendor.sort_by_expert(ids, experts)
    for mine, expected in zip(got, sort_by_expert(ids, experts)):
        assert torch.equal(mine, expected)
    *same, token = vendor.sort_by_expert(ids.to(torch.int32), experts, tokens=True)  # written by the sort itself
    assert all(torch.equal(a, b) for a, b in zip(same, got))
    assert token.dtype == torch.int64 and torch.equal(token, got[0] // top_k)


@pytest.mark.parametrize(
    "tokens, top_k, experts",
    [
        (1, 8, 128),
        (2, 8, 128),
        (16, 8, 128),
        (8, 8, 32),
        (5, 1, 60),
        (64, 1, 128),
        (3, 6, 257),
        (1, 8, 512),
        (13, 2, 8),
    ],
)
def test_a_decode_batch_routed_then_sorted_equals_the_reference_routing_and_sort(tokens, top_k, experts):
    """At decode one launch routes and sorts (the sort read back through memory inside the program): the
    routing equals the reference's, and sorting the returned ids equals the stable torch sort of them."""
    from vendors.cuda.kernels import route_sort

    assert route_sort.fits(tokens, experts, top_k)
    g = torch.Generator(device="cuda").manual_seed(tokens * experts + top_k)
    logits = torch.randn(tokens, experts, device="cuda", generator=g) * 3
    vendor = CudaVendor()
    weights, ids = vendor.softmax_topk(logits, top_k)
    ref_weights, ref_ids = reference.softmax_topk(logits, top_k)
    assert torch.equal(ids, ref_ids) and torch.allclose(weights, ref_weights, rtol=1e-5, atol=1e-7)
    *got, token = vendor.sort_by_expert(ids, experts, tokens=True)
    expected = sort_by_expert(ids, experts)
    assert all(torch.equal(mine, want) for mine, want in zip(got, expected))
    assert torch.equal(token, expected[0] // top_k)
    again = vendor.sort_by_expert(ids, experts)  # a second sort of the same ids sorts them again
    assert all(torch.equal(mine, want) for mine, want in zip(again, expected))


def test_ids_written_in_place_after_routing_are_sorted_as_they_are_now():
    """The sort the routing launch made is not handed out for ids changed since, nor for another expert count."""
    vendor = CudaVendor()
    logits = torch.randn(4, 128, device="cuda")
    _, ids = vendor.softmax_topk(logits, 8)
    ids[0, 0] = (ids[0, 0] + 1) % 128  # may repeat an expert of the token: the sort takes any ids
    for mine, want in zip(vendor.sort_by_expert(ids, 128), sort_by_expert(ids, 128)):
        assert torch.equal(mine, want)
    _, ids = vendor.softmax_topk(logits, 8)
    for mine, want in zip(vendor.sort_by_expert(ids, 200), sort_by_expert(ids, 200)):
        assert torch.equal(mine, want)


def test_the_one_launch_route_and_sort_equals_the_two_kernels():
    """`route_sort.softmax_topk_sorted` against the routing kernel and the rank sort run apart: the same ids and
    sort, bit for bit; weights within fp32 rounding (one program holds several tokens' sums in another layout)."""
    from vendors.cuda.kernels import route_sort, routing, sorting

    for tokens, experts, top_k, renormalize in (
        (1, 128, 8, True),
        (9, 60, 4, False),
        (32, 128, 4, True),
        (8, 32, 8, True),
    ):
        logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16) * 3
        (weights, ids), got = route_sort.softmax_topk_sorted(logits, top_k, renormalize)
        want_weights, want_ids = routing.softmax_topk(logits, top_k, renormalize)
        assert torch.equal(ids, want_ids) and torch.allclose(weights, want_weights, rtol=1e-6, atol=0)
        want = sorting.sort_pairs(want_ids, experts, tokens=True, by_rank=True)
        assert all(torch.equal(mine, expected) for mine, expected in zip(got, want))


@pytest.mark.parametrize(
    "tokens, top_k, experts, rank_by_default",
    [
        (1, 1, 1, True),
        (1, 8, 128, True),
        (3, 5, 9, True),
        (8, 8, 128, True),
        (16, 8, 128, True),
        (13, 2, 8, True),
        (64, 2, 8, False),
        (2, 8, 1000, False),
        (4, 4, 60, True),
        (10, 6, 257, True),
    ],
)
@pytest.mark.parametrize("by_rank", [True, False])
def test_both_one_program_sorts_equal_the_stable_torch_sort(tokens, top_k, experts, rank_by_default, by_rank):
    """The rank sort and the counting passes, each forced, at decode sizes: pairs not a power of two,
    experts repeated across tokens, one expert, more experts than pairs, int32 and int64 ids."""
    from vendors.cuda.kernels import sorting

    g = torch.Generator(device="cuda").manual_seed(tokens * experts)
    ids = torch.rand(tokens, experts, device="cuda", generator=g).argsort(dim=-1)[:, :top_k]
    expected = sort_by_expert(ids, experts)
    for dtype in (torch.int64, torch.int32):
        *got, token = sorting.sort_pairs(ids.to(dtype), experts, tokens=True, by_rank=by_rank)
        assert all(torch.equal(mine, want) for mine, want in zip(got, expected)), dtype
        assert torch.equal(token, expected[0] // top_k)
    assert sorting.rank_sort_fits(tokens * top_k, experts) == rank_by_default  # the measured crossovers


@pytest.mark.parametrize("indexed", [True, False])
@pytest.mark.parametrize("tokens, top_k, hidden", [(1, 8, 2048), (33, 2, 200), (512, 8, 7168)])
def test_weighted_combine_matches_the_fp32_sum(tokens, top_k, hidden, indexed):
    g = torch.Generator(device="cuda").manual_seed(hidden)
    rows = torch.randn(tokens * top_k, hidden, device="cuda", generator=g).to(torch.bfloat16)
    weights = torch.rand(tokens, top_k, device="cuda", generator=g)
    index = torch.randperm(tokens * top_k, device="cuda", generator=g) if indexed else None
    got = CudaVendor().weighted_combine(rows, index, weights, torch.float32)
    torch.testing.assert_close(got, weighted_combine(rows, index, weights, torch.float32), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    "layout, dtype", [("per-channel", torch.int8), ("per-channel", torch.float8_e4m3fn), ("block-128x128", None)]
)
def test_eight_bit_weights_are_stored_k_major_with_the_reference_values(layout, dtype):
    w = torch.randn(4, 320, 200, device="cuda")
    mine = CudaVendor().quantize_weight(w, layout, dtype)
    ref = reference.quantize_weight(w, layout, dtype)
    assert mine.data.shape == ref.data.shape and mine.data.stride(1) == 1  # K contiguous
    assert torch.equal(mine.data.float(), ref.data.float()) and torch.equal(mine.scale, ref.scale)


@pytest.mark.parametrize("kind", ["bf16", "fp8-block128", "int8"])
@pytest.mark.parametrize("tokens, top_k, experts", [(1, 8, 128), (37, 8, 128), (256, 8, 128), (300, 2, 8)])
def test_the_first_projection_with_its_activation_matches_float64(kind, tokens, top_k, experts):
    """qwen3-30b-a3b's gate/up projection (K 2048, 2I 1536) with SiLU-GLU applied by the same call: the
    Triton epilogue, and for bf16 at 300 rows per group torch._grouped_mm then the swiglu pass."""
    from conformance.checks import run_activated_gemm_case
    from hal import ActivationKind, GemmKind

    g = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, experts, generator=g).argsort(dim=-1)[:, :top_k]
    counts = torch.bincount(ids.flatten(), minlength=experts).tolist()
    run_activated_gemm_case(CudaVendor(), GemmKind(kind), counts, ActivationKind.SILU_GLU, k=2048, n=1536)


@pytest.mark.parametrize("kind", ["bf16", "fp8-block128", "fp8-rowwise", "int8"])
@pytest.mark.parametrize("tokens, top_k, experts", [(1, 8, 128), (37, 8, 128), (512, 8, 128), (300, 2, 8)])
def test_the_first_projection_through_the_dispatch_index_matches_float64(kind, tokens, top_k, experts):
    """The gate/up projection reading the tokens through the dispatch's row index (the gather inside the
    Triton GEMM; for bf16 at 300 rows per group torch._grouped_mm after a gather), against float64."""
    from conformance.checks import run_activated_gemm_case
    from hal import ActivationKind, GemmKind

    g = torch.Generator().manual_seed(tokens + 1)
    ids = torch.rand(tokens, experts, generator=g).argsort(dim=-1)[:, :top_k]
    counts = torch.bincount(ids.flatten(), minlength=experts).tolist()
    run_activated_gemm_case(
        CudaVendor(), GemmKind(kind), counts, ActivationKind.SILU_GLU, k=2048, n=1536, gather_from=tokens
    )


@pytest.mark.parametrize("scheme", ["unquantized", "w8a8-fp8-block"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_reading_through_the_row_index_equals_the_gathered_rows_bit_for_bit(scheme, gated, tokens):
    """The GEMM's gathered loads compute exactly what the gathered copy does (same tiles, same sums)."""
    from hal import Groups

    vendor = CudaVendor()
    g = torch.Generator(device="cuda").manual_seed(tokens)
    experts, top_k, hidden, width = 128, 8, 2048, 1536
    ids = torch.rand(tokens, experts, device="cuda", generator=g).argsort(dim=-1)[:, :top_k]
    order, _, counts = vendor.sort_by_expert(ids, experts)
    index = torch.div(order, top_k, rounding_mode="floor")
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(experts, hidden, width, device="cuda", generator=g) / hidden**0.5
    if scheme == "unquantized":
        rows, weight = x, vendor.quantize_weight(w, "none", torch.bfloat16)
    else:
        rows, weight = (
            vendor.quantize(x, "fp8", layout="per-token-group-128"),
            vendor.quantize_weight(w, "block-128x128"),
        )
    activation = {"activation": "silu-glu"} if gated else {}
    groups = Groups.from_counts(counts)
    gathered = rows.index_select(0, index) if isinstance(rows, torch.Tensor) else rows.rows(index)
    through_index = vendor.grouped_matmul(rows, weight, groups, row_index=index, **activation)
    assert torch.equal(through_index, vendor.grouped_matmul(gathered, weight, groups, **activation))


@pytest.mark.parametrize(
    "tiles",
    [
        (64, 32, 128, 4, 3, 1),  # columns inside one scale block: one weight scale per K step
        (128, 128, 128, 8, 3, 1, 32),  # the same, in bands of 32 row blocks
        (128, 64, 128, 8, 3, 0, 8),  # bands of 8, M-fastest otherwise
        (64, 256, 128, 8, 3, 1),  # columns across two scale blocks: per-column scales
        (128, 64, 128, 4, 3, 1, 1, 1),  # the TMA kernel where the call fits it (K a multiple of 16, gated: halves
        (64, 128, 128, 4, 3, 0, 8, 1),  # of whole scale blocks), else the same tiles with pointer loads
    ],
)
@pytest.mark.parametrize("k, n, gated", [(640, 896, False), (600, 900, False), (640, 768, True), (600, 640, True)])
def test_block_scaled_fp8_gemm_tiles_match_float64(tiles, k, n, gated):
    """The fp8 block-128 Triton GEMM under explicit tiles (one weight scale per program where its columns
    lie in one 128-column block, per-column scales otherwise; the grid in bands of row blocks), with
    empty, one-row, partial and many-block groups, K and N (gated: each half) not multiples of 128,
    against float64 on the dequantized operands."""
    from hal.reference.weights import dequantize_weight
    from vendors.cuda.kernels import grouped_gemm as gg

    g = torch.Generator(device="cuda").manual_seed(k + n)
    counts = torch.tensor([0, 1, 200, 700, 0, 1500, 37], device="cuda")
    m, e = int(counts.sum()), counts.numel()
    x = CudaVendor().quantize(
        torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16), "fp8", layout="per-token-group-128"
    )
    w = torch.randn(e, k, n, device="cuda", generator=g) / k**0.5
    weight = CudaVendor().quantize_weight(w, "block-128x128")  # stored K-major; the reference's values
    y = gg.grouped_gemm(
        x.data,
        weight.data,
        counts,
        torch.float32,
        x_scale=x.scale,
        w_scale=weight.scale,
        scale_mode=gg.SCALE_BLOCK128,
        config=gg.TileConfig.from_list(list(tiles)),
        gated=gated,
    )
    xd = reference.dequantize(x, torch.float32).double()
    wd = dequantize_weight(reference.quantize_weight(w, "block-128x128")).double()
    ends = counts.cumsum(0).tolist()
    exact = torch.cat([xd[end - c : end] @ wd[i] for i, (c, end) in enumerate(zip(counts.tolist(), ends))])
    if gated:
        exact = torch.nn.functional.silu(exact[:, : n // 2]) * exact[:, n // 2 :]
    assert y.shape == exact.shape
    assert gg.tma_fits(x.data, weight.data, block_n=tiles[1], block_k=128, gated=gated, gathered=False) == (
        k % 16 == 0 and 128 % tiles[1] == 0 and (not gated or n // 2 % 128 == 0)
    )
    # Hopper fp8 MMAs accumulate a K block with about 14 mantissa bits: 2.4e-4 was seen, a wrong scale is O(1).
    assert (y.double() - exact).abs().max() <= 1e-3 * exact.abs().max(), tiles


@pytest.mark.parametrize(
    "rows, width, layout",
    [
        (4099, 2000, "per-token-group-128"),
        (33, 7168, "per-token-group-128"),
        (5000, 768, "per-token"),
        (3, 20000, "per-token"),
    ],
)
def test_fp8_quantize_in_tiles_of_rows_matches_the_reference(rows, width, layout):
    """Tiles of rows (a partial last tile, zero rows) and the two-pass loop for very long rows: the reference's
    scales, and values at most one e4m3 step from the reference's."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, width, device="cuda", generator=g) * 3).to(torch.bfloat16)
    x[rows // 2] = 0
    mine = CudaVendor().quantize(x, "fp8", layout=layout)
    ref = reference.quantize(x, "fp8", layout)
    torch.testing.assert_close(mine.scale, ref.scale, rtol=1e-6, atol=0)
    step = ref.data.float().abs() * 2.0**-3 + 2.0**-9
    assert bool(((mine.data.float() - ref.data.float()).abs() <= step).all())


@pytest.mark.parametrize("rows, intermediate", [(33000, 768), (5000, 2048), (7, 1408)])
def test_swiglu_through_a_row_index_equals_the_activation_of_the_gathered_rows(rows, intermediate):
    """The pass that activates DeepGEMM's aligned gate/up product and puts it back in row order at once: it
    equals the float64 activation of the rows read through the index (rows read twice, gap rows never)."""
    from vendors.cuda.kernels.activation import swiglu

    g = torch.Generator(device="cuda").manual_seed(rows)
    product = torch.randn(rows + 500, 2 * intermediate, device="cuda", generator=g).bfloat16()
    place = torch.randperm(rows + 500, device="cuda", generator=g)[:rows]
    place[-1] = place[0]
    got = swiglu(product, place)
    gate, up = product[place].double().chunk(2, dim=-1)
    want = gate * torch.sigmoid(gate) * up
    assert got.shape == (rows, intermediate) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize(
    "shape, dtype, layout",
    [
        ((4099, 2000), "fp8", "per-token-group-128"),
        ((2, 16, 7168), "fp8", "per-token-group-128"),
        ((1, 2880), "fp8", "per-token"),
        ((5000, 768), "int8", "per-token"),
        ((3, 20000), "int8", "per-token"),
        ((0, 2048), "fp8", "per-token-group-128"),
    ],
)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantized_rows_equal_the_reference_bit_for_bit(shape, dtype, layout, out_dtype):
    """`data * scale` in fp32, rounded once: the Triton kernel and the reference agree exactly (any row count,
    widths not a multiple of 128, a zero row, leading dimensions kept)."""
    g = torch.Generator(device="cuda").manual_seed(shape[-1])
    x = (torch.randn(*shape, device="cuda", generator=g) * 3).to(torch.bfloat16)
    if x.shape[0] > 1:
        x[x.shape[0] // 2] = 0
    q = reference.quantize(x, dtype, layout)
    mine = CudaVendor().dequantize(q, out_dtype)
    assert mine.shape == x.shape and mine.dtype == out_dtype
    assert torch.equal(mine, reference.dequantize(q, out_dtype))


@pytest.mark.parametrize(
    "rows, width, dtype",
    [
        (4096, 7168, torch.float8_e4m3fn),  # deepseek-v3's one-byte rows: 4-byte words
        (700, 2001, torch.int8),  # a width that is not a multiple of 4: bytes
        (300, 56, torch.float32),  # block-128 scales of 7168 channels
        (65, 2880, torch.bfloat16),
        (9, 1, torch.float32),  # per-token scales as a column
    ],
)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gathered_rows_equal_index_select_bit_for_bit(rows, width, dtype, index_dtype):
    from vendors.cuda.kernels.gather import gather_rows

    g = torch.Generator(device="cuda").manual_seed(rows)
    src = torch.randn(rows, width, device="cuda", generator=g).mul(8).to(dtype)
    for count in (0, 1, rows, 3 * rows + 5):  # none, one, a permutation's length, rows taken many times
        index = torch.randint(0, rows, (count,), device="cuda", generator=g).to(index_dtype)
        want = src.index_select(0, index)
        assert torch.equal(gather_rows(src, index).view(torch.uint8), want.view(torch.uint8)), count
        assert torch.equal(gather_rows(src[:, 0].contiguous(), index), src[:, 0].index_select(0, index)), count
    strided = src.t()  # not contiguous: index_select's copy
    assert torch.equal(gather_rows(strided, index[:width] % width), strided.index_select(0, index[:width] % width))
