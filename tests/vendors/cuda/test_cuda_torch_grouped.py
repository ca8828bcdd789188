"""Row-wise fp8 grouped GEMMs through `torch._scaled_grouped_mm` (sm90) against float64 (GPU only).

The vendor takes torch's kernel from `SCALED_GROUPED_MM_MIN_ROWS_PER_GROUP` rows per group, or where a
tuned table says so; its weights are stored K-major (`prepare_weight`), as a layer's are.
"""

from __future__ import annotations

import logging

import pytest
import torch

import moe
from hal import ActivationKind, DispatchDtype, GemmKind, Groups
from tests.support.moe_reference import TOLERANCE, random_weights, reference_moe, relative_error, softmax_topk
from vendors.cuda import CudaVendor
from vendors.cuda.torch_grouped import SCALED_GROUPED_MM_MIN_ROWS_PER_GROUP, scaled_grouped_mm_available
from vendors.cuda.tuning import GROUPED_MM, Choice, TuningTable, problem_key

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        not torch.cuda.is_available() or not scaled_grouped_mm_available(torch.cuda.get_device_capability()),
        reason="torch._scaled_grouped_mm serves sm90 only",
    ),
]


def _case(tokens: int, top_k: int, experts: int, k: int, n: int, seed: int, vendor: CudaVendor):
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices.reshape(-1)
    counts = torch.bincount(picks, minlength=experts)
    index = torch.sort(picks, stable=True).indices // top_k
    x = torch.randn(tokens, k, generator=g)
    w = torch.randn(experts, k, n, generator=g) / k**0.5
    dev = vendor.device
    xq = vendor.quantize(x.to(dev), DispatchDtype.FP8, layout="per-token")
    wq = vendor.quantize_weight(w.to(dev), "per-channel", torch.float8_e4m3fn)
    return counts, index, xq, wq


def _reference(counts, index, xq, wq) -> torch.Tensor:
    """float64 `x[index] @ w[group]` of the quantized values, rows sorted by group."""
    x = (xq.data.double() * xq.scale.double()[:, None]).cpu()[index]
    w = (wq.data.double() * wq.scale.double()[:, None, :]).cpu()
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        out.append(x[start : start + c] @ w[e])
        start += c
    return torch.cat(out)


def _swiglu(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want).norm() / want.norm())


@pytest.mark.parametrize(
    "tokens, top_k, experts, k, n, gated",
    [
        (4096, 8, 128, 2048, 1536, True),  # qwen3-30b-a3b's gate/up projection: 256 rows per expert
        (4096, 8, 128, 768, 2048, False),  # its down projection
        (1024, 4, 32, 2880, 720, True),  # K and N off multiples of 128
        (4096, 1, 16, 1024, 512, False),  # top-1
        (640, 2, 8, 4096, 1024, True),  # few experts, many rows each
    ],
)
def test_fp8_rowwise_products_through_torch_scaled_grouped_mm_match_float64(tokens, top_k, experts, k, n, gated):
    """At many rows per expert the vendor's row-wise fp8 product (gathered through the dispatch's index
    where it is the first projection) is torch's fast-accumulating kernel's, within 1 % of float64."""
    vendor = CudaVendor()
    counts, index, xq, wq = _case(tokens, top_k, experts, k, n, tokens + k, vendor)
    assert tokens * top_k >= SCALED_GROUPED_MM_MIN_ROWS_PER_GROUP * experts  # the built-in rule takes torch's kernel
    groups = Groups.from_counts(counts.to(vendor.device))
    ref = _reference(counts, index, xq, wq)
    if gated:
        y = vendor.grouped_matmul(xq, wq, groups, activation=ActivationKind.SILU_GLU, row_index=index.to(vendor.device))
        assert y.shape == (tokens * top_k, n // 2) and y.dtype == torch.bfloat16
        assert _relative(y, _swiglu(ref)) < 1e-2
    else:
        sorted_rows = (xq.data.float() * xq.scale[:, None]).bfloat16()[index.to(vendor.device)]
        rows = vendor.quantize(sorted_rows, DispatchDtype.FP8, layout="per-token")  # a second projection's operand
        ref = _reference(counts, torch.arange(tokens * top_k), rows, wq)
        y = vendor.grouped_matmul(rows, wq, groups)
        assert y.shape == (tokens * top_k, n) and y.dtype == torch.bfloat16
        assert _relative(y, ref) < 1e-2
        offsets = torch.cumsum(counts, 0).to(torch.int32).to(vendor.device)
        direct = torch._scaled_grouped_mm(
            rows.data, wq.data, rows.scale, wq.scale, offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=True
        )
        assert torch.equal(y, direct)  # torch's kernel ran, not the Triton one


@pytest.mark.parametrize("gated", [True, False])
def test_a_table_entry_sends_few_rows_with_empty_experts_to_torch_scaled_grouped_mm(gated):
    """A tuned entry choosing torch's kernel at 9 tokens over 256 experts (most of them empty) computes
    the same product, within 1 % of float64."""
    tokens, top_k, experts, k, n = 9, 8, 256, 2048, 1536 if gated else 2048
    key = problem_key("fp8-rowwise", experts, k, n, ActivationKind.SILU_GLU.value if gated else None)
    table = TuningTable("any", {key: {tokens * top_k: Choice(GROUPED_MM)}}, {})
    vendor = CudaVendor(tuning=table)
    counts, index, xq, wq = _case(tokens, top_k, experts, k, n, 7, vendor)
    assert int((counts == 0).sum()) > experts // 2
    groups = Groups.from_counts(counts.to(vendor.device))
    ref = _reference(counts, index, xq, wq)
    dev_index = index.to(vendor.device)
    if gated:
        y = vendor.grouped_matmul(xq, wq, groups, activation=ActivationKind.SILU_GLU, row_index=dev_index)
        assert _relative(y, _swiglu(ref)) < 1e-2
    else:
        y = vendor.grouped_matmul(xq, wq, groups, row_index=dev_index)
        assert _relative(y, ref) < 1e-2


def test_a_table_entry_torch_cannot_serve_runs_the_triton_kernel_and_says_so_once(caplog):
    """fp8 block-128 has no torch grouped GEMM: an entry naming one runs the Triton kernel (still within the
    conformance bound against float64) and logs it once for the problem, not once per call."""
    from conformance.checks import run_gemm_case

    experts, k, n, counts = 8, 256, 128, [16] * 8
    table = TuningTable("any", {problem_key("fp8-block128", experts, k, n): {sum(counts): Choice(GROUPED_MM)}}, {})
    vendor = CudaVendor(tuning=table)
    with caplog.at_level(logging.WARNING, logger="vendors.cuda.torch_grouped"):
        for _ in range(2):
            run_gemm_case(vendor, GemmKind.FP8_BLOCK128, counts, k=k, n=n)
    assert sum("cannot run here" in r.getMessage() for r in caplog.records) == 1


def test_a_row_wise_fp8_layer_on_torch_scaled_grouped_mm_matches_float64():
    """A `w8a8-fp8` layer with 256 rows per expert (both projections on torch's kernel) within the scheme's
    layer tolerance of the float64 MoE, and not the same output as its Triton-only run (the path was taken)."""
    experts, hidden, inter, top_k, tokens = 16, 1024, 512, 2, 2048
    vendor = CudaVendor()
    w13, w2 = random_weights(experts, hidden, inter, 11)
    layer = moe.MoELayer.from_float(w13.cuda(), w2.cuda(), top_k, scheme="w8a8-fp8", vendor=vendor)
    assert layer.plan.resolved is DispatchDtype.FP8
    g = torch.Generator().manual_seed(12)
    x, logits = torch.randn(tokens, hidden, generator=g).bfloat16(), torch.randn(tokens, experts, generator=g)
    y = layer(x.cuda(), logits.cuda()).cpu()
    ids, weights = softmax_topk(logits, top_k)
    assert relative_error(y, reference_moe(x, ids, weights, w13, w2)) < TOLERANCE[("w8a8-fp8", "fp8")]
    vendor.ops.torch_scaled_grouped_mm = False
    try:
        triton_only = layer(x.cuda(), logits.cuda()).cpu()
    finally:
        vendor.ops.torch_scaled_grouped_mm = True
    assert not torch.equal(y, triton_only) and relative_error(y, triton_only) < 0.05
