"""When the CUDA vendor hands a grouped GEMM to torch's own kernels: the device, the operands' layout and the
rows per group (no GPU needed: these read only shapes, strides and dtypes)."""

from __future__ import annotations

import logging

import pytest
import torch

from hal import DispatchDtype, GemmKind, QuantizedTensor, QuantizedWeight, ScaleLayout
from vendors.cuda.capabilities import cuda_capabilities
from vendors.cuda.torch_grouped import (
    GROUPED_MM_MIN_ROWS_PER_GROUP,
    SCALED_GROUPED_MM_MIN_ROWS_PER_GROUP,
    grouped_mm_by_default,
    log_unserved_choice,
    scaled_grouped_mm_available,
    scaled_grouped_mm_fits,
    torch_grouped_fits,
)


def _fp8_rows(rows: int, k: int) -> QuantizedTensor:
    data = torch.zeros(rows, k, dtype=torch.float8_e4m3fn)
    return QuantizedTensor(data, DispatchDtype.FP8, ScaleLayout.PER_TOKEN, torch.ones(rows))


def _fp8_weight(e: int, k: int, n: int, *, k_major: bool = True) -> QuantizedWeight:
    data = (
        torch.zeros(e, n, k, dtype=torch.float8_e4m3fn).transpose(1, 2)
        if k_major
        else torch.zeros(e, k, n).to(torch.float8_e4m3fn)
    )
    return QuantizedWeight(data, ScaleLayout.PER_CHANNEL, torch.ones(e, n))


@pytest.mark.parametrize("capability, available", [((9, 0), True), ((8, 9), False), ((10, 0), False), ((12, 0), False)])
def test_torch_scaled_grouped_mm_is_taken_on_sm90_only(capability, available):
    assert scaled_grouped_mm_available(capability) is (available and hasattr(torch, "_scaled_grouped_mm"))


def test_the_capability_notes_name_torch_scaled_grouped_mm_on_sm90_only():
    assert any("torch._scaled_grouped_mm" in note for note in cuda_capabilities("H100", (9, 0)).notes)
    assert not any("torch._scaled_grouped_mm" in note for note in cuda_capabilities("B200", (10, 0)).notes)


def test_row_wise_fp8_with_k_major_aligned_weights_fits_torch_scaled_grouped_mm():
    assert scaled_grouped_mm_fits(_fp8_rows(64, 2048), _fp8_weight(8, 2048, 1536), GemmKind.FP8_ROWWISE, torch.bfloat16)


@pytest.mark.parametrize(
    "why, x, weight, kind, out_dtype",
    [
        ("N-major weights", _fp8_rows(4, 256), _fp8_weight(2, 256, 128, k_major=False), GemmKind.FP8_ROWWISE, None),
        ("K off 16", _fp8_rows(4, 264), _fp8_weight(2, 264, 128), GemmKind.FP8_ROWWISE, None),
        ("N off 16", _fp8_rows(4, 256), _fp8_weight(2, 256, 136), GemmKind.FP8_ROWWISE, None),
        ("an fp16 output", _fp8_rows(4, 256), _fp8_weight(2, 256, 128), GemmKind.FP8_ROWWISE, torch.float16),
        ("block-128 kind", _fp8_rows(4, 256), _fp8_weight(2, 256, 128), GemmKind.FP8_BLOCK128, None),
        ("bf16 rows", torch.zeros(4, 256, dtype=torch.bfloat16), _fp8_weight(2, 256, 128), GemmKind.FP8_ROWWISE, None),
    ],
)
def test_other_operands_stay_with_the_triton_kernel(why, x, weight, kind, out_dtype):
    assert not scaled_grouped_mm_fits(x, weight, kind, out_dtype or torch.bfloat16), why
    assert not torch_grouped_fits(x, weight, kind, out_dtype or torch.bfloat16, bf16=True, fp8_rowwise=True), why


def test_a_device_without_it_keeps_row_wise_fp8_on_the_triton_kernel():
    x, w = _fp8_rows(64, 2048), _fp8_weight(8, 2048, 1536)
    assert torch_grouped_fits(x, w, GemmKind.FP8_ROWWISE, torch.bfloat16, bf16=True, fp8_rowwise=True)
    assert not torch_grouped_fits(x, w, GemmKind.FP8_ROWWISE, torch.bfloat16, bf16=True, fp8_rowwise=False)


@pytest.mark.parametrize(
    "kind, least",
    [(GemmKind.BF16, GROUPED_MM_MIN_ROWS_PER_GROUP), (GemmKind.FP8_ROWWISE, SCALED_GROUPED_MM_MIN_ROWS_PER_GROUP)],
)
def test_the_built_in_rule_counts_rows_per_group_for_each_kind(kind, least):
    assert grouped_mm_by_default(least * 128, 128, kind)
    assert not grouped_mm_by_default(least * 128 - 1, 128, kind)


def test_a_table_choice_torch_cannot_serve_is_logged_once_per_problem(caplog):
    logged: set = set()
    with caplog.at_level(logging.WARNING, logger="vendors.cuda.torch_grouped"):
        for _ in range(3):
            log_unserved_choice(logged, GemmKind.FP8_ROWWISE, _fp8_weight(8, 256, 128, k_major=False), torch.bfloat16)
        log_unserved_choice(logged, GemmKind.FP8_ROWWISE, _fp8_weight(8, 256, 256, k_major=False), torch.bfloat16)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "8x256x128" in messages[0] and "8x256x256" in messages[1]
    assert all("cannot run here" in m and "Triton" in m for m in messages)
