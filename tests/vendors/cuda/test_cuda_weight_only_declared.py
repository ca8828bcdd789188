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


def test_nvfp4_layers_run_weight_only_without_fp4_tensor_cores_and_are_refused_before_sm89():
    """sm89-sm90 convert the nvfp4 scheme to w4a16-nvfp4 (its weights as stored); sm80 refuses it; sm100 runs it."""
    for model in ("H100", "H200", "L40S"):
        name, cc = DECLARED_MODELS[model]
        fallback = cuda_capabilities(name, cc).scheme_fallbacks["nvfp4"]
        assert fallback.target == "w4a16-nvfp4" and fallback.max_error is not None, model
        assert "sm100+" in fallback.reason and "weight-only" in fallback.reason
    name, cc = DECLARED_MODELS["A100"]
    refusal = cuda_capabilities(name, cc).scheme_fallbacks["nvfp4"]
    assert refusal.target is None and "sm89+" in refusal.reason
    name, cc = DECLARED_MODELS["B200"]
    assert "nvfp4" not in cuda_capabilities(name, cc).scheme_fallbacks
