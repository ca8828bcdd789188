"""NVFP4: e2m1 weights and activations with 16-value e4m3 block scales and fp32 global scales."""

from __future__ import annotations

import dataclasses

import torch

from hal import FP4_MAX, FP8_MAX, KNOWN_SCHEMES, Activation, GemmKind, Vendor, positive_fp32
from moe.schemes.base import ExpertWeights, QuantScheme


def nvfp4_global_scale(amax: float) -> float:
    """The global scale a calibration maximum `amax` calls for: `448 * 6 / amax`."""
    return positive_fp32("global scale 448 * 6 / amax", FP8_MAX * FP4_MAX / positive_fp32("amax", amax))


class NvFp4(QuantScheme):
    """NVFP4 checkpoints: the layer input and the intermediate activation have calibrated
    global scales (`input_global_scale`, `intermediate_global_scale`, as stored in the
    checkpoint; `nvfp4_global_scale(amax)` computes one from a calibration maximum).

    The plan asks for nvfp4 dispatch; where the vendor rejects it the plan raises, and an
    explicit bf16 dispatch quantizes to nvfp4 on the expert's side instead.
    """

    traits = KNOWN_SCHEMES["nvfp4"]
    gemm_kinds = (GemmKind.NVFP4,)
    staging_dtype = torch.bfloat16

    def __init__(self, input_global_scale: float, intermediate_global_scale: float) -> None:
        for name, value in (
            ("input_global_scale", input_global_scale),
            ("intermediate_global_scale", intermediate_global_scale),
        ):
            positive_fp32(name, value)
        self.input_global_scale = float(input_global_scale)
        self.intermediate_global_scale = float(intermediate_global_scale)

    def __repr__(self) -> str:
        return (
            f"NvFp4(input_global_scale={self.input_global_scale}, "
            f"intermediate_global_scale={self.intermediate_global_scale})"
        )

    def quantize_weights(
        self, vendor: Vendor, w13: torch.Tensor, w2: torch.Tensor, *, activation: Activation = Activation()
    ) -> ExpertWeights:
        """nvfp4 weights (per-expert global scales) plus the checkpoint's activation scales."""
        device = w13.device
        weights = super().quantize_weights(vendor, w13, w2, activation=activation)
        return dataclasses.replace(
            weights,
            input_global_scale=torch.tensor([self.input_global_scale], dtype=torch.float32, device=device),
            intermediate_global_scale=torch.tensor(
                [self.intermediate_global_scale], dtype=torch.float32, device=device
            ),
        )
