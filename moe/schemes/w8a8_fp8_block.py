"""W8A8-FP8 block scaled (DeepSeek-V3 checkpoints): 128x128 weight tiles, 128-channel activation groups."""

from __future__ import annotations

import torch

from hal import KNOWN_SCHEMES, DispatchDtype, GemmKind, QuantizedTensor, ScaleLayout, Vendor
from moe.schemes.base import ExpertWeights, GemmOperand, QuantScheme


class W8A8Fp8Block(QuantScheme):
    """fp8 e4m3 grouped GEMMs: weights with one scale per 128x128 tile, activations per 128 channels.

    Rows carried in another dtype (int8 on Ascend, or fp8 with per-token scales) are
    dequantized and quantized again in the 128-channel-group layout.
    """

    traits = KNOWN_SCHEMES["w8a8-fp8-block"]

    def quantize_weights(self, vendor: Vendor, w13: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
        """fp8 e4m3 with 128x128 block scales."""
        return self.quantize_both(vendor, w13, w2, ScaleLayout.BLOCK_128X128, torch.float8_e4m3fn)

    def gemm_kind(self) -> GemmKind:
        """fp8 block-128."""
        return GemmKind.FP8_BLOCK128

    def first_operand(self, vendor: Vendor, x: QuantizedTensor, weights: ExpertWeights) -> GemmOperand:
        """fp8 group-128 rows as carried; anything else re-quantized into that layout."""
        if x.dtype is DispatchDtype.FP8 and x.layout is ScaleLayout.GROUP_128:
            return x
        return vendor.quantize(self.as_float(vendor, x, torch.float32), DispatchDtype.FP8, layout=ScaleLayout.GROUP_128)

    def second_operand(self, vendor: Vendor, h: torch.Tensor, weights: ExpertWeights) -> GemmOperand:
        """fp8 group-128 quantization of the swiglu output."""
        return vendor.quantize(h, DispatchDtype.FP8, layout=ScaleLayout.GROUP_128)
