"""Unquantized experts: bf16, fp16 or fp32 weights; dispatch bf16 unless configured otherwise."""

from __future__ import annotations

import torch

from hal import KNOWN_SCHEMES, GemmKind, QuantizedTensor, ScaleLayout, Vendor
from hal.errors import invalid
from moe.schemes.base import ExpertWeights, GemmOperand, QuantScheme

_KINDS = {torch.bfloat16: GemmKind.BF16, torch.float16: GemmKind.FP16, torch.float32: GemmKind.FP32}


class Unquantized(QuantScheme):
    """Float expert weights stored in `dtype`; dispatched rows are brought to that dtype."""

    traits = KNOWN_SCHEMES["unquantized"]

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        if dtype not in _KINDS:
            raise invalid("dtype", "torch.bfloat16, torch.float16 or torch.float32", dtype)
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"Unquantized(dtype={self.dtype})"

    def quantize_weights(self, vendor: Vendor, w13: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
        """Cast both projections to the scheme's dtype."""
        return self.quantize_both(vendor, w13, w2, ScaleLayout.NONE, self.dtype)

    def gemm_kind(self) -> GemmKind:
        """bf16, fp16 or fp32, after the weight dtype."""
        return _KINDS[self.dtype]

    def output_dtype(self) -> torch.dtype:
        """The weight dtype."""
        return self.dtype

    def first_operand(self, vendor: Vendor, x: QuantizedTensor, weights: ExpertWeights) -> GemmOperand:
        """The dispatched rows in the weight dtype (dequantized if they travelled quantized)."""
        return self.as_float(vendor, x, self.dtype)

    def second_operand(self, vendor: Vendor, h: torch.Tensor, weights: ExpertWeights) -> GemmOperand:
        """The swiglu output in the weight dtype."""
        return h.to(self.dtype)
