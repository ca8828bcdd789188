"""The CUDA vendor's Triton kernels run on the CPU through Triton's interpreter, on small
shapes, against the torch definitions. Skipped where Triton is not installed (CI installs
only the test extra). bf16 arithmetic and the fp8 cast are left to the GPU tests: the
interpreter emulates neither as the GPU computes them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.util import find_spec

import pytest
from tests.support.paths import REPO

ROOT = REPO

SCRIPT = textwrap.dedent("""
    import torch
    from hal import reference as ref
    from hal.reference import sort_by_expert, weighted_combine
    from vendors.cuda.kernels.activation import swiglu
    from vendors.cuda.kernels.combine import weighted_combine as triton_combine
    from vendors.cuda.kernels.gather import gather_rows
    from vendors.cuda.kernels.grouped_gemm import SCALE_BLOCK128, SCALE_ROWWISE, TileConfig, grouped_gemm
    from vendors.cuda.kernels.grouped_gemm_tma import tma_fits
    from vendors.cuda.kernels.quantize import dequantize_rows, quantize_rows
    from vendors.cuda.kernels.route_sort import fits, softmax_topk_sorted
    from vendors.cuda.kernels.routing import softmax_topk
    from vendors.cuda.kernels.sorting import sort_pairs, sort_pairs_spread

    def check_quantize(x, what):
        q, s = quantize_rows(x, torch.int8, None, qmax=127.0, rounds=True)
        r = ref.quantize(x, "int8")
        assert torch.equal(q, r.data) and torch.allclose(s, r.scale), "int8 quantize" + what
        for out_dtype in (torch.float32, torch.float16):
            back = dequantize_rows(r.data, r.scale, None, out_dtype)
            assert torch.equal(back, ref.dequantize(r, out_dtype)), "int8 dequantize" + what
        q, s = quantize_rows(x, torch.float8_e4m3fn, 128, qmax=448.0, rounds=False)
        r = ref.quantize(x, "fp8", "per-token-group-128")
        groups = -(-x.shape[1] // 128)  # the interpreter's fp8 cast is not the GPU's: scales only
        assert s.shape == (x.shape[0], groups) and torch.allclose(s, r.scale), "fp8 group scales" + what

    torch.manual_seed(0)
    x = torch.randn(5, 200).to(torch.float16)
    x[2] = 0
    check_quantize(x, "")

    counts = torch.tensor([3, 0, 9, 4])
    ends = counts.cumsum(0).tolist()
    a = torch.randn(16, 320)
    w = torch.randn(4, 320, 200)
    expected = torch.cat([a[e - c:e] @ w[g] for g, (c, e) in enumerate(zip(counts.tolist(), ends))])
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 5e-2)):
        y = grouped_gemm(a.to(dtype), w.to(dtype), counts, torch.float32)
        assert (y - expected).abs().max() <= tol * expected.abs().max(), dtype
    for tiles in (TileConfig(16, 32, 64, 4, 3, n_fastest=True), TileConfig(32, 64, 32, 4, 3, n_fastest=False),
                  TileConfig(16, 128, 128, 4, 3, n_fastest=True)):  # both grid orders, N not a multiple of BLOCK_N
        y = grouped_gemm(a, w, counts, torch.float32, config=tiles)
        assert (y - expected).abs().max() <= 1e-4 * expected.abs().max(), tiles
    # The grid's row-block bound is M // BLOCK_M + min(E, M): decode rows scattered over many
    # groups, and groups that each end in a partial block, fill it exactly.
    wide = torch.randn(40, 64, 48)
    for sizes in ({3: 1, 17: 1, 30: 1, 39: 1, 0: 1, 22: 1, 9: 1}, {2: 17, 11: 17, 38: 1, 5: 15}):
        many = torch.zeros(40, dtype=torch.int64)
        for g, c in sizes.items():
            many[g] = c
        rows = torch.randn(int(many.sum()), 64)
        ends_many = many.cumsum(0).tolist()
        want = torch.cat([rows[e - c:e] @ wide[g] for g, (c, e) in enumerate(zip(many.tolist(), ends_many)) if c])
        for tiles in (TileConfig(16, 32, 64, 4, 3, n_fastest=False), TileConfig(16, 32, 64, 4, 3, n_fastest=True)):
            y = grouped_gemm(rows, wide, many, torch.float32, config=tiles)
            assert (y - want).abs().max() <= 1e-4 * want.abs().max(), (sizes, tiles)
    qa, qw = ref.quantize(a, "int8"), ref.quantize_weight(w, "per-channel", torch.int8)
    y = grouped_gemm(qa.data, qw.data, counts, torch.float32, x_scale=qa.scale, w_scale=qw.scale,
                     scale_mode=SCALE_ROWWISE)
    exact = torch.cat([(qa.data[e - c:e].double() @ qw.data[g].double()) * qa.scale[e - c:e, None].double()
                       * qw.scale[g].double() for g, (c, e) in enumerate(zip(counts.tolist(), ends))])
    assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max(), "int8 gemm"
    qa, qw = ref.quantize(a, "fp8", "per-token-group-128"), ref.quantize_weight(w, "block-128x128")
    # One weight scale per program (block_n 64 and 128) and per-column scales (256), bands of row blocks.
    for tiles in (None, TileConfig(16, 64, 128, 4, 3, n_fastest=True), TileConfig(16, 128, 128, 4, 3, group_m=2),
                  TileConfig(16, 256, 128, 4, 3, n_fastest=True, group_m=3)):
        y = grouped_gemm(qa.data, qw.data, counts, torch.float32, x_scale=qa.scale, w_scale=qw.scale,
                         scale_mode=SCALE_BLOCK128, config=tiles)
        assert (y - expected).abs().max() <= 0.1 * expected.abs().max(), ("fp8 block gemm", tiles)

    # The gated epilogue: silu(x @ gate) * (x @ up) from the accumulators, a width that is not a
    # multiple of 128 (the up half's scale tiles start mid-tile), every scale mode, tiles halved.
    wg = torch.randn(4, 320, 300)
    full = torch.cat([a[e - c:e] @ wg[g] for g, (c, e) in enumerate(zip(counts.tolist(), ends))])
    glu = torch.nn.functional.silu(full[:, :150]) * full[:, 150:]
    for tiles in (None, TileConfig(16, 32, 64, 4, 3, n_fastest=True), TileConfig(32, 128, 32, 4, 3)):
        y = grouped_gemm(a, wg, counts, torch.float32, config=tiles, gated=True)
        assert y.shape == (16, 150) and (y - glu).abs().max() <= 1e-4 * glu.abs().max(), ("gated", tiles)
    qa, qw = ref.quantize(a, "int8"), ref.quantize_weight(wg, "per-channel", torch.int8)
    y = grouped_gemm(qa.data, qw.data, counts, torch.float32, x_scale=qa.scale, w_scale=qw.scale,
                     scale_mode=SCALE_ROWWISE, gated=True)
    exact = torch.cat([(qa.data[e - c:e].double() @ qw.data[g].double()) * qa.scale[e - c:e, None].double()
                       * qw.scale[g].double() for g, (c, e) in enumerate(zip(counts.tolist(), ends))])
    exact = torch.nn.functional.silu(exact[:, :150]) * exact[:, 150:]
    assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max(), "gated int8 gemm"
    qa, qw = ref.quantize(a, "fp8", "per-token-group-128"), ref.quantize_weight(wg, "block-128x128")
    for tiles in (None, TileConfig(16, 32, 128, 4, 3, group_m=2)):  # halves of 150: per-column scales either way
        y = grouped_gemm(qa.data, qw.data, counts, torch.float32, x_scale=qa.scale, w_scale=qw.scale,
                         scale_mode=SCALE_BLOCK128, gated=True, config=tiles)
        assert (y - glu).abs().max() <= 0.1 * glu.abs().max(), ("gated fp8 block gemm", tiles)
    wq = torch.randn(4, 320, 512)  # halves of 256: one weight scale per program and half
    fq = torch.cat([a[e - c:e] @ wq[g] for g, (c, e) in enumerate(zip(counts.tolist(), ends))])
    glu_q = torch.nn.functional.silu(fq[:, :256]) * fq[:, 256:]
    qwq = ref.quantize_weight(wq, "block-128x128")
    for tiles in (TileConfig(16, 64, 128, 4, 3), TileConfig(16, 128, 128, 4, 3, n_fastest=True, group_m=2)):
        y = grouped_gemm(qa.data, qwq.data, counts, torch.float32, x_scale=qa.scale, w_scale=qwq.scale,
                         scale_mode=SCALE_BLOCK128, gated=True, config=tiles)
        assert (y - glu_q).abs().max() <= 0.1 * glu_q.abs().max(), ("gated fp8 block gemm, scalar scales", tiles)
    # The TMA-fed kernel (tiles with `tma`): K-major weights as the vendor stores them, the plain and the gated product.
    for wt, want in ((w, expected), (wq, glu_q)):
        qwt = ref.quantize_weight(wt, "block-128x128")
        k_major = qwt.data.transpose(1, 2).contiguous().transpose(1, 2)
        assert tma_fits(qa.data, k_major, block_n=64, block_k=128, gated=wt is wq, gathered=False)
        assert not tma_fits(qa.data, qwt.data, block_n=64, block_k=128, gated=wt is wq, gathered=False)
        for tiles in (TileConfig(16, 64, 128, 4, 3, n_fastest=True, tma=True), TileConfig(32, 128, 128, 4, 3, group_m=2,
                                                                                          tma=True)):
            y = grouped_gemm(qa.data, k_major, counts, torch.float32, x_scale=qa.scale, w_scale=qwt.scale,
                             scale_mode=SCALE_BLOCK128, gated=wt is wq, config=tiles)
            assert (y - want).abs().max() <= 0.1 * want.abs().max(), ("tma fp8 block gemm", tiles)
    # Tiles of rows: more rows than one tile, a partial last tile, a zero row, widths of one group and several.
    wide_x = torch.randn(70, 300)
    wide_x[33] = 0
    check_quantize(wide_x, ", tiles of rows")

    h = torch.randn(4, 64).to(torch.float16)
    act = torch.nn.functional.silu(h[:, :32].float()) * h[:, 32:].float()
    assert (swiglu(h).float() - act).abs().max() <= 2e-3 * act.abs().max(), "swiglu"
    rows = torch.tensor([3, 0, 0, 2, 1, 3])  # a row read twice, rows out of order
    assert torch.equal(swiglu(h, rows), swiglu(h)[rows]), "swiglu through a row index"
    ids = torch.stack([torch.randperm(40)[:4] for _ in range(9)])
    assert all(torch.equal(m, e) for m, e in zip(sort_pairs(ids, 40), sort_by_expert(ids, 40))), "sort"
    for tokens, k, experts in ((9, 4, 40), (1, 8, 128), (3, 1, 1), (16, 8, 64)):  # both one-program sorts
        ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
        for by_rank in (True, False):
            got = sort_pairs(ids, experts, tokens=True, by_rank=by_rank)
            want = (*sort_by_expert(ids, experts), sort_by_expert(ids, experts)[0] // k)
            assert all(torch.equal(m, e) for m, e in zip(got, want)), ("sort", tokens, k, experts, by_rank)
    # The spread sort: spans of one chunk and of several, a last span cut short, idle experts,
    # one expert taking everything, int32 ids, more experts than one chunk row holds.
    for tokens, k, experts, spans in ((300, 8, 128, 64), (257, 3, 40, 4), (1000, 1, 7, 3), (64, 8, 1, 2),
                                      (129, 2, 600, 5), (200, 8, 16, None), (300, 4, 1000, None)):
        ids = torch.randint(0, experts, (tokens, k), dtype=torch.int32)
        got, want = sort_pairs_spread(ids, experts, max_spans=spans), sort_by_expert(ids.long(), experts)
        assert all(torch.equal(m, e) for m, e in zip(got, want)), ("spread sort", tokens, k, experts, spans)
    # Softmax top-k: a token per program (up to SMALL_BATCH tokens), tiles of tokens above with a partial
    # last tile, experts not a power of two, k = 1 and k = E.
    for tokens, experts, k, renorm in ((37, 60, 4, True), (5, 128, 8, False), (1, 8, 2, True), (40, 3, 3, True),
                                       (70, 1000, 1, False), (300, 60, 4, True), (270, 1000, 2, False)):
        logits = torch.randn(tokens, experts) * 3
        w, i = softmax_topk(logits, k, renorm)
        rw, ri = ref.softmax_topk(logits, k, renorm)
        assert torch.equal(i, ri) and torch.allclose(w, rw, rtol=1e-5, atol=1e-7), ("softmax top-k", tokens, experts, k)
    # Routing and the sort in one program (decode batches): the routing kernel's outputs and the rank sort's,
    # ids and sort bit for bit, weights within fp32 rounding; ties among the logits, k = E, experts not a power of two, the largest batch that fits.
    for tokens, experts, k, renorm in ((1, 128, 8, True), (3, 60, 4, False), (16, 128, 8, True), (5, 8, 2, True),
                                       (64, 128, 1, True), (2, 5, 5, False), (1, 512, 8, True), (8, 32, 8, True)):
        logits = torch.randn(tokens, experts) * 3
        logits[:, 1] = logits[:, 0]  # equal probabilities: the lower id first, as the routing kernel picks
        assert fits(tokens, experts, k), (tokens, experts, k)
        (w, i), got = softmax_topk_sorted(logits, k, renorm)
        rw, ri = softmax_topk(logits, k, renorm)
        assert torch.equal(i, ri) and torch.allclose(w, rw, rtol=1e-6, atol=0), ("routed and sorted: routing", tokens, experts, k)
        want = sort_pairs(ri, experts, tokens=True, by_rank=True)
        assert all(torch.equal(m, e) for m, e in zip(got, want)), ("routed and sorted: sort", tokens, experts, k)
    assert not fits(17, 128, 8) and not fits(0, 128, 8) and not fits(1, 1024, 8)
    rows, index, weights = torch.randn(36, 24), torch.randperm(36), torch.rand(9, 4)
    assert torch.allclose(triton_combine(rows, index, weights, torch.float32),
                          weighted_combine(rows, index, weights, torch.float32), atol=1e-6), "combine"
    # The dispatch's gather: one-byte rows as words and as bytes (odd width), fp32 scales, none taken, int32 index.
    for n, width, dtype in ((37, 7168, torch.uint8), (5, 2001, torch.int8), (64, 56, torch.float32), (3, 7, torch.uint8)):
        src = torch.randint(-100, 100, (n, width)).to(dtype)
        for count, index_dtype in ((200, torch.int64), (9, torch.int32), (0, torch.int64)):
            index = torch.randint(0, n, (count,), dtype=index_dtype)
            assert torch.equal(gather_rows(src, index), src[index.long()]), ("gather", n, width, dtype, count)
    print("interpreted kernels: ok")
""")


@pytest.mark.skipif(find_spec("triton") is None, reason="Triton is not installed (it is not a test dependency)")
def test_triton_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    if "only 0-dimensional arrays" in done.stderr:
        pytest.skip("this Triton's interpreter does not run with this NumPy (needs numpy < 2.4)")
    assert done.returncode == 0 and "interpreted kernels: ok" in done.stdout, done.stdout + done.stderr[-3000:]


@pytest.mark.skipif(find_spec("triton") is None, reason="Triton is not installed (it is not a test dependency)")
@pytest.mark.parametrize(
    "pairs, experts, method",
    [
        (8, 128, "one-program"),
        (128, 128, "one-program"),
        (129, 128, "spread"),
        (256, 8, "one-program"),
        (257, 8, "spread"),
        (32768, 128, "spread"),
        (131072, 32, "spread"),
        (131072, 128, "radix"),
        (32768, 256, "spread"),
        (10, 1025, "radix"),
        (0, 8, "radix"),
    ],
)
def test_the_sort_method_follows_the_measured_crossovers(pairs, experts, method):
    """One program up to two chunks, spans below 2**24 pairs x padded experts, torch's sort beyond
    (the H100 crossovers in `vendors/cuda/kernels/sorting.py`)."""
    from vendors.cuda.kernels import sorting

    assert sorting.sort_method(pairs, experts) == method
    assert sorting.spans_for(128) == 64 and sorting.spans_for(32) == 256
