"""The CUDA vendor declares the weight-only 4-bit kinds where its Triton GEMM computes them (no GPU needed)."""

from __future__ import annotations

from hal import GemmKind
from vendors.cuda.capabilities import DECLARED_MODELS, cuda_capabilities


def test_weight_only_kinds_follow_the_compute_capability():
    """bf16 x mxfp4 wherever bf16 runs; bf16 x nvfp4 from sm89, whose fp8 hardware converts the e4m3 scales."""
    ampere, ada, hopper = (cuda_capabilities("x", cc) for cc in ((8, 0), (8, 9), (9, 0)))
    assert GemmKind.BF16_MXFP4 in ampere.grouped_matmul and GemmKind.BF16_NVFP4 not in ampere.grouped_matmul
    for caps in (ada, hopper):
        assert {GemmKind.BF16_MXFP4, GemmKind.BF16_NVFP4} <= caps.grouped_matmul


def test_hopper_points_nvfp4_checkpoints_at_the_weight_only_scheme():
    """Without fp4 tensor cores the nvfp4 scheme is refused, naming the weight-only scheme that runs its weights."""
    name, cc = DECLARED_MODELS["H100"]
    refusal = cuda_capabilities(name, cc).scheme_fallbacks["nvfp4"]
    assert refusal.target is None and "w4a16-nvfp4" in refusal.reason
