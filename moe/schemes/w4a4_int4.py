"""W4A4-INT4: packed int4 weights, per-token int4 activations quantized after dispatch."""

from __future__ import annotations

import torch

from hal import KNOWN_SCHEMES, GemmKind, QuantizedTensor, ScaleLayout, Vendor
from moe.schemes.base import ExpertWeights, GemmOperand, QuantScheme


class W4A4Int4(QuantScheme):
    """int4 x int4 grouped GEMMs. No dispatcher carries int4, so rows travel as bf16 and are
    quantized to int4 on the expert's side; H and I must be multiples of 8 (the packing).
    """

    traits = KNOWN_SCHEMES["w4a4-int4"]

    def quantize_weights(self, vendor: Vendor, w13: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
        """Per-output-channel symmetric int4, eight values per int32 word."""
        return self.quantize_both(vendor, w13, w2, ScaleLayout.PER_CHANNEL, torch.quint4x2)

    def gemm_kind(self) -> GemmKind:
        """int4."""
        return GemmKind.INT4

    def first_operand(self, vendor: Vendor, x: QuantizedTensor, weights: ExpertWeights) -> GemmOperand:
        """Per-token int4 of the dispatched bf16 rows."""
        return vendor.quantize_int4(self.as_float(vendor, x))

    def second_operand(self, vendor: Vendor, h: torch.Tensor, weights: ExpertWeights) -> GemmOperand:
        """Per-token int4 of the swiglu output."""
        return vendor.quantize_int4(h)
