"""Grouped matmul for every declared kind: counts and offsets, empty groups, no rows, one group,
non-contiguous operands, output dtypes, the declared kernel limits, the experts' activation
applied by the same call, and rows read through a row index (a dispatch's gather), against float64."""

from __future__ import annotations

import pytest
import torch

from conformance.capability import (
    EXPERT_BIAS,
    activation_label,
    gemm_label,
    mark,
    require_activation,
    require_expert_bias,
    require_gemm,
)
from conformance.checks import K_GRANULARITY, run_activated_gemm_case, run_gemm_case
from hal import ActivationKind, GemmKind, HalError

#: case -> (rows per group, how the case changes the call)
CASES: dict[str, tuple[list[int], dict[str, object]]] = {
    "counts": ([5, 0, 9, 3], {}),
    "offsets": ([5, 0, 9, 3], {"offsets": True}),
    "empty-first-and-last": ([0, 7, 4, 0], {}),
    "no-rows": ([0, 0, 0, 0], {}),
    "one-group": ([13], {}),
    "int32-group-list": ([6, 2, 0, 8], {"group_dtype": torch.int32}),
    "offsets-int32": ([3, 0, 0, 11], {"offsets": True, "group_dtype": torch.int32}),
    "strided-activations": ([4, 6, 1, 5], {"strided_x": True}),
    "strided-weights": ([4, 6, 1, 5], {"strided_w": True}),
    "out-fp32": ([5, 0, 9, 3], {"out_dtype": torch.float32}),
    "out-bf16": ([2, 8, 3, 1], {"out_dtype": torch.bfloat16}),
    # rows read through row_index: each of T source rows taken by up to k groups, as a dispatch does
    "row-index": ([5, 0, 9, 3], {"gather_from": 7}),
    "row-index-int32": ([4, 6, 1, 5], {"gather_from": 16, "index_dtype": torch.int32}),
    "row-index-strided": ([4, 6, 1, 5], {"gather_from": 5, "strided_x": True}),
    "row-index-no-rows": ([0, 0, 0, 0], {"gather_from": 3}),
}


def _params():
    return [
        pytest.param(kind, case, id=f"{kind}-{case}", marks=mark(gemm_label(kind)))
        for kind in GemmKind
        for case in CASES
    ]


@pytest.mark.parametrize("kind, case", _params())
def test_grouped_matmul_matches_float64(hal_vendor, kind, case):
    require_gemm(hal_vendor, kind)
    counts, how = CASES[case]
    run_gemm_case(hal_vendor, kind, counts, **how)


#: case -> (rows per group, K, 2I): small groups with an empty one, and 64 experts with widths off 128.
ACTIVATED_CASES: dict[str, tuple[list[int], int, int]] = {
    "small": ([5, 0, 9, 3], 320, 400),
    "64-experts": ([(7 * g) % 23 for g in range(64)], 1024, 720),
}
#: case -> (rows per group, K, 2I, source rows): the first projection as a dispatch hands it over: 1 and
#: 100 tokens top-8 over 128 experts, I off a multiple of 128.
GATHERED_CASES: dict[str, tuple[list[int], int, int, int]] = {
    "decode-top8": ([1 if g in (3, 17, 40, 41, 77, 90, 101, 127) else 0 for g in range(128)], 1152, 400, 1),
    "100-tokens-top8": ([(5 * g + 3) % 12 for g in range(128)], 1152, 400, 100),
}


def _activated_params():
    silu_glu = [
        pytest.param(
            kind,
            ActivationKind.SILU_GLU,
            case,
            id=f"{kind}-silu-glu-{case}",
            marks=[mark(gemm_label(kind)), mark(activation_label(ActivationKind.SILU_GLU))],
        )
        for kind in GemmKind
        for case in ACTIVATED_CASES
    ]
    others = [
        pytest.param(
            GemmKind.BF16,
            act,
            "small",
            id=f"bf16-{act}-small",
            marks=[mark(gemm_label(GemmKind.BF16)), mark(activation_label(act))],
        )
        for act in ActivationKind
        if act is not ActivationKind.SILU_GLU
    ]
    return silu_glu + others


@pytest.mark.parametrize("kind, activation, case", _activated_params())
def test_grouped_matmul_with_activation_matches_float64(hal_vendor, kind, activation, case):
    """`grouped_matmul(..., activation=...)`: the product's activation, `[M, I]` for gated kinds."""
    require_gemm(hal_vendor, kind)
    require_activation(hal_vendor, activation)
    counts, k, n = ACTIVATED_CASES[case]
    run_activated_gemm_case(hal_vendor, kind, counts, activation, k=k, n=n)


@pytest.mark.parametrize(
    "kind, case",
    [
        pytest.param(
            kind,
            case,
            id=f"{kind}-silu-glu-{case}",
            marks=[mark(gemm_label(kind)), mark(activation_label(ActivationKind.SILU_GLU))],
        )
        for kind in GemmKind
        for case in GATHERED_CASES
    ],
)
def test_grouped_matmul_through_row_index_with_activation_matches_float64(hal_vendor, kind, case):
    """The experts' first projection over rows read through `row_index` (`x[row_index]` never handed over)."""
    require_gemm(hal_vendor, kind)
    require_activation(hal_vendor, ActivationKind.SILU_GLU)
    counts, k, n, tokens = GATHERED_CASES[case]
    run_activated_gemm_case(hal_vendor, kind, counts, ActivationKind.SILU_GLU, k=k, n=n, gather_from=tokens)


@pytest.mark.parametrize(
    "kind, activation",
    [
        pytest.param(
            kind,
            act,
            id=f"{kind}-{act}",
            marks=[mark(gemm_label(kind)), mark(activation_label(act)), mark(EXPERT_BIAS)],
        )
        for kind in GemmKind
        for act in (ActivationKind.SILU_GLU, ActivationKind.SWIGLU_OAI)
    ],
)
def test_grouped_matmul_with_bias_through_row_index_matches_float64(hal_vendor, kind, activation):
    """gpt-oss's first projection: rows read through `row_index`, each expert's bias added to the product
    before the activation (a vendor may do both in its GEMM's epilogue)."""
    require_gemm(hal_vendor, kind)
    require_activation(hal_vendor, activation)
    require_expert_bias(hal_vendor)
    counts, k, n = ACTIVATED_CASES["small"]
    run_activated_gemm_case(hal_vendor, kind, counts, activation, k=k, n=n, gather_from=11, bias=True)


LIMITS = ["max_groups", "max_inner_dim", "max_group_rows"]
#: Limits larger than this are not reached in a conformance test (it would take too long).
REACHABLE = 1 << 17


def _limited_case(name: str, value: int, kind: GemmKind) -> tuple[list[int], int]:
    """(counts, K) of a call that reaches `value` for the limit `name` (for K: the largest
    multiple of the kind's granularity not above it)."""
    if name == "max_groups":
        return [1] * value, 32
    if name == "max_inner_dim":
        return [2, 1], value - value % K_GRANULARITY.get(kind, 1)
    return [value, 0], 32


@pytest.mark.parametrize("kind", [pytest.param(kind, marks=mark(gemm_label(kind))) for kind in GemmKind])
def test_declared_limits_hold(hal_vendor, kind):
    """A call at each declared limit computes right; one step beyond is refused, naming the limit."""
    require_gemm(hal_vendor, kind)
    limits = hal_vendor.capabilities().limits
    declared = {name: getattr(limits, name) for name in LIMITS if getattr(limits, name) is not None}
    if not declared:
        pytest.skip(f"vendor {hal_vendor.name} declares no kernel limits")
    checked = []
    for name, value in declared.items():
        if value > REACHABLE:
            continue
        counts, k = _limited_case(name, value, kind)
        run_gemm_case(hal_vendor, kind, counts, k=k, n=16)
        step = 16 if name == "max_inner_dim" else 1  # keep K a whole number of nvfp4 blocks
        counts, k = _limited_case(name, value + step, kind)
        with pytest.raises(HalError, match=name):
            run_gemm_case(hal_vendor, kind, counts, k=k, n=16)
        checked.append(name)
    if not checked:
        pytest.skip(f"vendor {hal_vendor.name} declares only limits above {REACHABLE}: {declared}")
