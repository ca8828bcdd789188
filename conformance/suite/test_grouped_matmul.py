"""Grouped matmul for every declared kind: counts and offsets, empty groups, no rows, one group,
non-contiguous operands, output dtypes, and the declared kernel limits, against float64."""

from __future__ import annotations

import pytest
import torch

from conformance.capability import gemm_label, mark, require_gemm
from conformance.checks import K_GRANULARITY, run_gemm_case
from hal import GemmKind, HalError

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
}


def _params():
    return [pytest.param(kind, case, id=f"{kind}-{case}", marks=mark(gemm_label(kind)))
            for kind in GemmKind for case in CASES]


@pytest.mark.parametrize("kind, case", _params())
def test_grouped_matmul_matches_float64(hal_vendor, kind, case):
    require_gemm(hal_vendor, kind)
    counts, how = CASES[case]
    run_gemm_case(hal_vendor, kind, counts, **how)


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
