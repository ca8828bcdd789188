"""Weight-only 4-bit schemes: e2m1 expert weights (mxfp4 or nvfp4) times bf16 activations.

The activations are never quantized: rows are dispatched as bf16 (the plan's dtype; fp8 or int8
rows are dequantized to bf16 after dispatch) and both grouped GEMMs dequantize the weights as they
multiply (`hal.GemmKind.BF16_MXFP4`, `hal.GemmKind.BF16_NVFP4`). This is how a GPU without FP4
tensor cores runs FP4 checkpoints: 4-bit weights in memory, bf16 arithmetic.
"""

from __future__ import annotations

import torch

from hal import KNOWN_SCHEMES, GemmKind
from moe.schemes.base import QuantScheme


class W4A16MxFp4(QuantScheme):
    """mxfp4 weights (e8m0 scales per 32 values along K) with bf16 activations: gpt-oss's experts.
    H and I must be multiples of 32."""

    traits = KNOWN_SCHEMES["w4a16-mxfp4"]
    gemm_kinds = (GemmKind.BF16_MXFP4,)
    staging_dtype = torch.bfloat16


class W4A16NvFp4(QuantScheme):
    """nvfp4 weights (e4m3 scales per 16 values along K, an fp32 global scale per expert) with bf16
    activations: NVFP4 checkpoints where activations cannot be FP4. H and I must be multiples of 16."""

    traits = KNOWN_SCHEMES["w4a16-nvfp4"]
    gemm_kinds = (GemmKind.BF16_NVFP4,)
    staging_dtype = torch.bfloat16
