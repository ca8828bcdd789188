"""W8A8-INT8: per-channel int8 weights, dynamic per-token int8 activations; dispatch int8."""

from __future__ import annotations

import torch

from hal import KNOWN_SCHEMES, DispatchDtype, GemmKind, QuantizedTensor, ScaleLayout, Vendor
from moe.schemes.base import ExpertWeights, GemmOperand, QuantScheme


class W8A8Int8(QuantScheme):
    """int8 x int8 grouped GEMMs with per-token activation and per-channel weight scales.

    Where the vendor carries int8 as another dtype (CUDA carries it as fp8), the
    dispatched rows are dequantized and quantized to int8 again before the GEMM.
    """

    traits = KNOWN_SCHEMES["w8a8-int8"]

    def quantize_weights(self, vendor: Vendor, w13: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
        """Per-output-channel symmetric int8."""
        return self.quantize_both(vendor, w13, w2, ScaleLayout.PER_CHANNEL, torch.int8)

    def gemm_kind(self) -> GemmKind:
        """int8."""
        return GemmKind.INT8

    def first_operand(self, vendor: Vendor, x: QuantizedTensor, weights: ExpertWeights) -> GemmOperand:
        """int8 rows as carried; any other carried dtype is re-quantized to int8."""
        if x.dtype is DispatchDtype.INT8:
            return x
        return vendor.quantize(self.as_float(vendor, x, torch.float32), DispatchDtype.INT8)

    def second_operand(self, vendor: Vendor, h: torch.Tensor, weights: ExpertWeights) -> GemmOperand:
        """Per-token dynamic int8 of the swiglu output."""
        return vendor.quantize(h, DispatchDtype.INT8)
