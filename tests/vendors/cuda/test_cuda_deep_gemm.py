"""fp8 block-128 grouped GEMMs on DeepGEMM (sm90, where it is installed) against float64 (GPU only).

The vendor takes DeepGEMM from `DEEP_GEMM_MIN_ROWS_PER_GROUP` rows per group on experts of at least
`DEEP_GEMM_MIN_WEIGHT_ELEMENTS`, or where a tuned table says so.
"""

from __future__ import annotations

import pytest
import torch

import moe
from hal import ActivationKind, DispatchDtype, GemmKind, Groups
from tests.support.moe_reference import TOLERANCE, random_weights, reference_moe, relative_error, softmax_topk
from vendors.cuda import CudaVendor
from vendors.cuda.deep_gemm_runner import DEEP_GEMM_MIN_ROWS_PER_GROUP
from vendors.cuda.tuning import DEEP_GEMM, Choice, TuningTable, problem_key


def _deep_gemm_vendor() -> CudaVendor | None:
    if not torch.cuda.is_available():
        return None
    vendor = CudaVendor()
    return vendor if getattr(vendor.ops, "deep_gemm", None) is not None else None


_VENDOR = _deep_gemm_vendor() if torch.cuda.is_available() else None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_VENDOR is None, reason="needs a CUDA sm90 device with DeepGEMM installed"),
]


def _dequantized(q) -> torch.Tensor:
    """float64 values of fp8 rows with per-128 scales, or of block-128 weights `[E, K, N]`."""
    data, scale = q.data.double().cpu(), q.scale.double().cpu()
    if data.dim() == 2:
        return data * scale.repeat_interleave(128, 1)[:, : data.shape[1]]
    k, n = data.shape[1:]
    return data * scale.repeat_interleave(128, 1)[:, :k].repeat_interleave(128, 2)[:, :, :n]


@pytest.mark.parametrize("gated", [True, False])
def test_a_block_fp8_grouped_gemm_on_deep_gemm_matches_float64(gated):
    experts, top_k, k, n = 32, 4, 2048, 2048 if gated else 4096  # K x N = 2**23: past the built-in rule
    tokens = DEEP_GEMM_MIN_ROWS_PER_GROUP * experts // top_k + 37  # past the rule, not a multiple of 128
    g = torch.Generator().manual_seed(3)
    picks = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices.reshape(-1)
    counts = torch.bincount(picks, minlength=experts)
    index = torch.sort(picks, stable=True).indices // top_k
    x = torch.randn(tokens if gated else tokens * top_k, k, generator=g)
    w = torch.randn(experts, k, 2 * n if gated else n, generator=g) / k**0.5
    vendor = _VENDOR
    xq = vendor.quantize(x.cuda(), DispatchDtype.FP8, layout="per-token-group-128")
    wq = vendor.quantize_weight(w.cuda(), "block-128x128", torch.float8_e4m3fn)
    groups = Groups.from_counts(counts.cuda())
    rows = _dequantized(xq)[index] if gated else _dequantized(xq)
    wd = _dequantized(wq)
    ref = torch.cat([part @ wd[e] for e, part in enumerate(rows.split(counts.tolist()))])
    if gated:
        ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
        y = vendor.grouped_matmul(xq, wq, groups, activation=ActivationKind.SILU_GLU, row_index=index.cuda())
    else:
        y = vendor.grouped_matmul(xq, wq, groups)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    assert relative_error(y.cpu(), ref) < 1e-2


def test_a_block_fp8_layer_on_deep_gemm_matches_float64_and_differs_from_the_triton_run():
    experts, hidden, inter, top_k, tokens = 16, 4096, 2048, 2, 2048  # 256 rows per expert, K x N >= 2**23
    w13, w2 = random_weights(experts, hidden, inter, 21)
    layer = moe.MoELayer.from_float(w13.cuda(), w2.cuda(), top_k, scheme="w8a8-fp8-block", vendor=_VENDOR)
    triton = moe.MoELayer.from_float(
        w13.cuda(), w2.cuda(), top_k, scheme="w8a8-fp8-block", vendor=CudaVendor(deep_gemm=False)
    )
    g = torch.Generator().manual_seed(22)
    x, logits = torch.randn(tokens, hidden, generator=g).bfloat16(), torch.randn(tokens, experts, generator=g)
    y = layer(x.cuda(), logits.cuda()).cpu()
    ids, weights = softmax_topk(logits, top_k)
    reference = reference_moe(x, ids, weights, w13, w2)
    assert relative_error(y, reference) < TOLERANCE[("w8a8-fp8-block", "fp8")]
    other = triton(x.cuda(), logits.cuda()).cpu()
    assert not torch.equal(y, other) and relative_error(y, other) < 0.05


def test_a_table_entry_naming_deep_gemm_takes_it_below_the_built_in_rows():
    """At 16 rows per expert the built-in rule runs Triton; a table entry sends the call to DeepGEMM (within
    the conformance bound against float64)."""
    from conformance.checks import run_gemm_case

    experts, k, n, counts = 8, 256, 256, [16] * 8
    table = TuningTable("any", {problem_key("fp8-block128", experts, k, n): {sum(counts): Choice(DEEP_GEMM)}}, {})
    vendor = CudaVendor(tuning=table)
    assert vendor.ops.deep_gemm is not None
    run_gemm_case(vendor, GemmKind.FP8_BLOCK128, counts, k=k, n=n)


def test_tune_times_deep_gemm_beside_triton_and_the_table_it_writes_runs_the_winner(tmp_path):
    """`hal tune` times DeepGEMM for an fp8 block-128 gate/up problem (with the activation pass reading its
    aligned product) next to the Triton candidates; the vendor running the written table matches float64."""
    import json

    from hal import GemmProblem
    from vendors.cuda import tuner
    from vendors.cuda.tune_case import TuneCase

    problem = GemmProblem(GemmKind.FP8_BLOCK128, 16, 3072, 2 * 1408, 4, (1100,), ActivationKind.SILU_GLU)
    case = TuneCase(problem, 1100, torch.device("cuda"), torch.Generator().manual_seed(0), _VENDOR.ops.deep_gemm)
    timed = tuner._search(case, problem, 3, True, False)
    assert (DEEP_GEMM, None, True) in timed and any(backend != DEEP_GEMM for backend, _, _ in timed)
    assert tuner._builtin(case, problem, True, False)[0] == DEEP_GEMM  # 275 rows per expert, K x N 8.7M >= 2**23

    table = _VENDOR.tune([problem])
    assert "deep_gemm" in table
    (entry,) = next(iter(table["entries"].values())).values()
    assert entry["backend"] != "deep-gemm" or entry["fallback"]["backend"] != "deep-gemm"  # where it is absent
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    vendor = CudaVendor(tuning=path)
    x = torch.randn(1100, 3072, generator=torch.Generator().manual_seed(1))
    w = torch.randn(16, 3072, 2 * 1408, generator=torch.Generator().manual_seed(2)) / 3072**0.5
    xq = vendor.quantize(x.cuda(), DispatchDtype.FP8, layout="per-token-group-128")
    wq = vendor.quantize_weight(w.cuda(), "block-128x128", torch.float8_e4m3fn)
    picks = torch.rand(1100, 16, generator=torch.Generator().manual_seed(3)).topk(4, dim=1).indices.reshape(-1)
    counts = torch.bincount(picks, minlength=16)
    index = torch.sort(picks, stable=True).indices // 4
    y = vendor.grouped_matmul(
        xq, wq, Groups.from_counts(counts.cuda()), activation=ActivationKind.SILU_GLU, row_index=index.cuda()
    )
    wd = _dequantized(wq)
    full = torch.cat([part @ wd[e] for e, part in enumerate(_dequantized(xq)[index].split(counts.tolist()))])
    ref = torch.nn.functional.silu(full[:, :1408]) * full[:, 1408:]
    assert relative_error(y.cpu(), ref) < 1e-2
