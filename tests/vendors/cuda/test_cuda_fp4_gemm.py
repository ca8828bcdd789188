"""The weight-only 4-bit grouped GEMM (bf16 activations x MXFP4 / NVFP4 weights decoded in the kernel)
against float64, on the GPU: K a multiple of 32 but not of 128, many experts, top-1 to top-8 routings,
both tile families (decode and prefill), the SiLU-GLU epilogue and the read through the dispatch's index.

The dequantized weights are exact in bf16 and x is bf16, so the only errors are the fp32 accumulation
and the bf16 output's rounding (2**-9 relative)."""

from __future__ import annotations

import pytest
import torch

from tests.support.fp4_weights import grouped_reference, random_fp4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _routing(tokens: int, top_k: int, experts: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """The token of each row sorted by expert, and the rows per expert, of a random top-k routing."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    order = torch.argsort(ids.flatten(), stable=True)
    counts = torch.bincount(ids.flatten(), minlength=experts).tolist()
    return (order // top_k).to(torch.int32), counts


def _check(y: torch.Tensor, expected: torch.Tensor) -> None:
    err = (y.double().cpu() - expected).abs()
    scale = expected.abs().max().item()
    assert err.max().item() <= 8e-3 * scale, (err.max().item(), scale)
    assert torch.linalg.norm(err) <= 4e-3 * torch.linalg.norm(expected)


@pytest.mark.parametrize("mx", [True, False], ids=["mxfp4", "nvfp4"])
@pytest.mark.parametrize(
    "tokens, top_k, experts, k, n", [(1, 1, 40, 2880, 360), (17, 4, 32, 2880, 200), (700, 8, 40, 96, 136)]
)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "silu-glu"])
@pytest.mark.parametrize("asm", [False, True], ids=["triton-decode", "ptx-decode"])
@pytest.mark.parametrize("interleave", [None, False, True], ids=["default-step", "per-nibble", "interleaved"])
def test_fp4_weight_only_grouped_gemm_matches_float64(mx, tokens, top_k, experts, k, n, gated, asm, interleave):
    """Rows gathered through the dispatch's index and rows already sorted give the float64 product, with the
    default K step and with each of the two forced (one product per nibble, or over both nibbles in k order)."""
    from vendors.cuda.kernels.grouped_gemm_fp4 import grouped_gemm_fp4

    w = random_fp4(experts, k, 2 * n if gated else n, mx=mx, per_column_global=gated, device="cuda", seed=tokens)
    index, counts = _routing(tokens, top_k, experts, seed=k)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    expected = grouped_reference(x, w.values(), counts, gated=gated, row_index=index)
    dev_counts = torch.tensor(counts, device="cuda", dtype=torch.int32)
    xc, ic = x.cuda(), index.cuda()
    common = {"mx": mx, "global_scale": w.global_scale, "gated": gated, "asm_decode": asm, "interleave": interleave}
    y = grouped_gemm_fp4(xc, w.data, w.scale, dev_counts, torch.bfloat16, row_index=ic, **common)
    _check(y, expected)
    y = grouped_gemm_fp4(xc[ic.long()], w.data, w.scale, dev_counts, torch.bfloat16, **common)
    _check(y, expected)


@pytest.mark.parametrize("mx", [True, False], ids=["mxfp4", "nvfp4"])
@pytest.mark.parametrize(
    "tokens, top_k, experts, k, n", [(1, 1, 40, 2880, 360), (3, 4, 32, 2880, 200), (700, 8, 40, 96, 136)]
)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "silu-glu"])
@pytest.mark.parametrize("split_k", [2, 3, 8])
def test_fp4_weight_only_split_k_matches_float64(mx, tokens, top_k, experts, k, n, gated, split_k):
    """K split into shares summed in fp32 before the epilogue gives the float64 product, with shares that
    end mid-tile or hold no K at all (K = 96 in 8 shares); repeats give the same bits (the shares are
    summed in a fixed order)."""
    from vendors.cuda.kernels.grouped_gemm_fp4 import grouped_gemm_fp4

    w = random_fp4(experts, k, 2 * n if gated else n, mx=mx, per_column_global=gated, device="cuda", seed=tokens)
    index, counts = _routing(tokens, top_k, experts, seed=k)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    expected = grouped_reference(x, w.values(), counts, gated=gated, row_index=index)
    dev_counts = torch.tensor(counts, device="cuda", dtype=torch.int32)
    runs = [
        grouped_gemm_fp4(
            x.cuda(),
            w.data,
            w.scale,
            dev_counts,
            torch.bfloat16,
            mx=mx,
            global_scale=w.global_scale,
            gated=gated,
            row_index=index.cuda(),
            split_k=split_k,
        )
        for _ in range(3)
    ]
    _check(runs[0], expected)
    assert all(torch.equal(runs[0], again) for again in runs[1:])


@pytest.mark.parametrize("mx", [True, False], ids=["mxfp4", "nvfp4"])
def test_fp4_split_k_reuses_kept_scratch_and_leaves_its_counts_at_zero(mx):
    """Split calls of several shapes and share counts, one after another on one stream through one kept
    scratch (which grows between them), equal calls on fresh zeroed scratch bit for bit; every count is
    zero afterwards; a second stream gets buffers of its own; a call captured in a CUDA graph takes fresh
    buffers, and its replay equals the eager call."""
    from vendors.cuda.kernels.grouped_gemm_fp4 import grouped_gemm_fp4
    from vendors.cuda.kernels.split_scratch import SplitScratch

    kept = SplitScratch()
    cases = [(1, 4, 32, 2880, 360, True, 4), (3, 4, 32, 2880, 200, False, 2), (9, 8, 40, 1056, 720, True, 3)]
    for tokens, top_k, experts, k, n, gated, split_k in cases * 2:
        w = random_fp4(experts, k, 2 * n if gated else n, mx=mx, per_column_global=gated, device="cuda", seed=tokens)
        index, counts = _routing(tokens, top_k, experts, seed=k)
        x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16).cuda()
        args = (x, w.data, w.scale, torch.tensor(counts, device="cuda", dtype=torch.int32), torch.bfloat16)
        common = {"mx": mx, "global_scale": w.global_scale, "gated": gated, "row_index": index.cuda()}
        fresh = grouped_gemm_fp4(*args, split_k=split_k, **common)
        reused = [grouped_gemm_fp4(*args, split_k=split_k, scratch=kept, **common) for _ in range(2)]
        _check(fresh, grouped_reference(x.cpu(), w.values(), counts, gated=gated, row_index=index))
        assert all(torch.equal(fresh, y) for y in reused)
    part, done = kept.buffers(torch.device("cuda"), 0, 0)
    assert done.numel() > 0 and not done.any()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert kept.buffers(torch.device("cuda"), 0, 0)[0].data_ptr() != part.data_ptr()
    side.synchronize()

    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        grouped_gemm_fp4(*args, split_k=split_k, scratch=kept, **common)  # warm: compiled before capture
        with torch.cuda.graph(graph, stream=capture):
            captured = grouped_gemm_fp4(*args, split_k=split_k, scratch=kept, **common)
    torch.cuda.current_stream().wait_stream(capture)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, fresh)
    assert not kept.buffers(torch.device("cuda"), 0, 0)[1].any()


@pytest.mark.parametrize("asm", [False, True], ids=["triton-decode", "ptx-decode"])
@pytest.mark.parametrize("interleave", [False, True], ids=["per-nibble", "interleaved"])
@pytest.mark.parametrize("mx", [True, False], ids=["mxfp4", "nvfp4"])
def test_fp4_weight_only_every_code_and_extreme_scales(mx, asm, interleave):
    """Every one of the 16 codes in both nibbles, MXFP4 scales from 2**-20 to 2**20 (e4m3 scales across
    their range for NVFP4), a one-hot x picking single weights out: each output equals one weight exactly."""
    from vendors.cuda.kernels.grouped_gemm_fp4 import grouped_gemm_fp4

    k, n = 64, 256
    w = random_fp4(1, k, n, mx=mx, device="cuda")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 1, 256).expand(1, k // 2, n).contiguous()
    blocks = k // (32 if mx else 16)
    if mx:
        scale = torch.arange(107, 148, dtype=torch.int32).repeat(30)[: blocks * n].reshape(1, blocks, n)
        scale = scale.to(torch.uint8)
    else:
        scale = torch.linspace(2.0**-6, 448.0, blocks * n).reshape(1, blocks, n).to(torch.float8_e4m3fn)
    w = type(w)(codes.cuda(), scale.cuda(), w.global_scale, mx)
    x = torch.eye(k, dtype=torch.bfloat16)
    expected = grouped_reference(x, w.values(), [k])
    y = grouped_gemm_fp4(
        x.cuda(),
        w.data,
        w.scale,
        torch.tensor([k], device="cuda"),
        torch.float32,
        mx=mx,
        global_scale=w.global_scale,
        asm_decode=asm,
        interleave=interleave,
    )
    torch.testing.assert_close(y.double().cpu(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("layout, kind", [("block-32", "bf16-mxfp4"), ("block-16", "bf16-nvfp4")])
@pytest.mark.parametrize("top_k, activation", [(1, "silu-glu"), (4, "swiglu-oai"), (8, "silu-glu")])
@pytest.mark.parametrize("split", [False, True], ids=["one-share", "split-at-decode"])
def test_cuda_vendor_computes_the_weight_only_kinds_it_declares(layout, kind, top_k, activation, split):
    """Through the vendor: weights quantized on the device by the reference, the first projection with its
    activation reading the dispatch's rows through the index (SiLU-GLU in the epilogue, swiglu-oai after)
    and the second projection, each against float64 on the dequantized weights; with K split at decode
    (`split_fp4_decode`: 37 tokens over 24 experts run in shares) too, and a repeat gives the same bits."""
    from conformance.reference import activation as float64_activation
    from hal import GemmKind, Groups
    from hal.reference import weight_value
    from vendors.cuda import CudaVendor

    vendor = CudaVendor(split_fp4_decode=split)
    assert GemmKind(kind) in vendor.capabilities().grouped_matmul
    experts, tokens, k, n = 24, 37, 2880, 416
    gen = torch.Generator().manual_seed(top_k)
    w1 = vendor.quantize_weight(torch.randn(experts, k, 2 * n, generator=gen).cuda() * 0.05, layout)
    w2 = vendor.quantize_weight(torch.randn(experts, n, k, generator=gen).cuda() * 0.05, layout)
    index, counts = _routing(tokens, top_k, experts, seed=top_k)
    groups = Groups.from_counts(torch.tensor(counts, device="cuda"))
    x = torch.randn(tokens, k, generator=gen).to(torch.bfloat16)
    h = vendor.grouped_matmul(x.cuda(), w1, groups, activation=activation, row_index=index.cuda())
    product = grouped_reference(x, weight_value(w1), counts, row_index=index)
    _check(h, float64_activation(product, activation)[0])
    assert torch.equal(h, vendor.grouped_matmul(x.cuda(), w1, groups, activation=activation, row_index=index.cuda()))
    y = vendor.grouped_matmul(h, w2, groups)
    _check(y, grouped_reference(h.cpu(), weight_value(w2), counts))


def _group_rows(bias: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """float64 `[M, N]`: each row's group's bias row."""
    return torch.repeat_interleave(bias.double().cpu(), torch.tensor(counts), dim=0)


@pytest.mark.parametrize("mx", [True, False], ids=["mxfp4", "nvfp4"])
@pytest.mark.parametrize("activation", [None, "silu-glu", "swiglu-oai"])
@pytest.mark.parametrize("tokens, top_k", [(1, 4), (300, 4)])
@pytest.mark.parametrize("split_k", [None, 4], ids=["default-split", "k-in-4"])
def test_fp4_weight_only_bias_and_activation_in_the_epilogue(mx, activation, tokens, top_k, split_k):
    """The experts' bias added to the product and gpt-oss's swiglu-oai (or SiLU-GLU) applied in the kernel's
    epilogue, rows read through the index: against float64 `act(x @ w + bias)`, at gpt-oss's K (2880) with an
    output width that is not a multiple of 128 and a limit small enough that the clamps bite."""
    from conformance.reference import activation as float64_activation
    from vendors.cuda.kernels.grouped_gemm_fp4 import grouped_gemm_fp4

    experts, k, n = 32, 2880, 360
    gated = activation is not None
    w = random_fp4(experts, k, 2 * n if gated else n, mx=mx, per_column_global=True, device="cuda", seed=tokens)
    index, counts = _routing(tokens, top_k, experts, seed=7)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(tokens, k, generator=gen).to(torch.bfloat16)
    bias = (torch.randn(experts, w.data.shape[2], generator=gen) * 2).to(torch.bfloat16)
    product = grouped_reference(x, w.values(), counts, row_index=index) + _group_rows(bias, counts)
    alpha, limit = 1.702, 3.0
    expected = product if activation is None else float64_activation(product, activation, alpha, limit)[0]
    y = grouped_gemm_fp4(
        x.cuda(),
        w.data,
        w.scale,
        torch.tensor(counts, device="cuda", dtype=torch.int32),
        torch.bfloat16,
        mx=mx,
        global_scale=w.global_scale,
        gated=gated,
        row_index=index.cuda(),
        bias=bias.cuda(),
        swiglu_oai=(alpha, limit) if activation == "swiglu-oai" else None,
        split_k=split_k,
    )
    _check(y, expected)


@pytest.mark.parametrize("layout", ["block-32", "block-16"])
@pytest.mark.parametrize("activation", ["swiglu-oai", "silu-glu", "gelu-glu"])
def test_cuda_vendor_adds_expert_biases_in_the_weight_only_epilogue(layout, activation):
    """Through the vendor, as a gpt-oss layer calls it: the first projection with its bias and activation over
    the dispatch's rows, the second with its bias; each against float64 (gelu-glu: the bias in the epilogue,
    the activation after it)."""
    from conformance.reference import activation as float64_activation
    from hal import Activation, Groups
    from hal.reference import weight_value
    from vendors.cuda import CudaVendor

    vendor = CudaVendor()
    experts, tokens, top_k, k, n = 32, 45, 4, 2880, 416
    gen = torch.Generator().manual_seed(5)
    w1 = vendor.quantize_weight(torch.randn(experts, k, 2 * n, generator=gen).cuda() * 0.05, layout)
    w2 = vendor.quantize_weight(torch.randn(experts, n, k, generator=gen).cuda() * 0.05, layout)
    b1 = torch.randn(experts, 2 * n, generator=gen).to(torch.bfloat16)
    b2 = torch.randn(experts, k, generator=gen).to(torch.bfloat16)
    index, counts = _routing(tokens, top_k, experts, seed=3)
    groups = Groups.from_counts(torch.tensor(counts, device="cuda"))
    x = torch.randn(tokens, k, generator=gen).to(torch.bfloat16)
    act = Activation(activation, limit=2.0) if activation == "swiglu-oai" else Activation(activation)
    h = vendor.grouped_matmul(x.cuda(), w1, groups, activation=act, bias=b1.cuda(), row_index=index.cuda())
    product = grouped_reference(x, weight_value(w1), counts, row_index=index) + _group_rows(b1, counts)
    _check(h, float64_activation(product, activation, act.alpha, act.limit)[0])
    y = vendor.grouped_matmul(h, w2, groups, bias=b2.cuda())
    _check(y, grouped_reference(h.cpu(), weight_value(w2), counts) + _group_rows(b2, counts))
