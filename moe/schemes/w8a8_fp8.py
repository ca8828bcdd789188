"""W8A8-FP8 per channel: fp8 e4m3 weights with one scale per output channel, fp8 activations per token.

Checkpoints with per-tensor weight scales load as per-channel (the tensor's scale repeated
over its channels, which is exact). Activations are quantized dynamically per token by
default. A checkpoint calibrated with static activation scales (`input_scale`) gives them
here: the layer input is then quantized with the fixed scale `s = input_scale`
(`clamp(x / s, -448, 448)` cast to e4m3, every token's scale `s`), and the intermediate
activation with `intermediate_scale` where one is given (dynamically otherwise).
"""

from __future__ import annotations

import torch

from hal import FP8_MAX, KNOWN_SCHEMES, DispatchDtype, DispatchPlan, GemmKind, QuantizedTensor, ScaleLayout, Vendor
from hal import positive_fp32
from moe.schemes.base import ExpertWeights, GemmOperand, QuantScheme, Quantizer


def static_fp8(x: torch.Tensor, scale: float) -> QuantizedTensor:
    """`x` `[..., H]` as fp8 per-token rows with one fixed scale: `clamp(x / scale, -448, 448)` in e4m3."""
    data = (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scales = torch.full(tuple(x.shape[:-1]), scale, dtype=torch.float32, device=x.device)
    return QuantizedTensor(data, DispatchDtype.FP8, ScaleLayout.PER_TOKEN, scales)


class W8A8Fp8(QuantScheme):
    """fp8 x fp8 grouped GEMMs (`fp8-rowwise`): per-token activation scales, per-channel weight scales.

    `input_scale` / `intermediate_scale`: the checkpoint's static activation scales of the
    gate/up and the down projection (None: dynamic per-token quantization).
    """

    traits = KNOWN_SCHEMES["w8a8-fp8"]
    gemm_kinds = (GemmKind.FP8_ROWWISE,)

    def __init__(self, input_scale: float | None = None, intermediate_scale: float | None = None) -> None:
        for name, value in (("input_scale", input_scale), ("intermediate_scale", intermediate_scale)):
            if value is not None:
                positive_fp32(name, value, "None or a finite positive number")
        self.input_scale = None if input_scale is None else float(input_scale)
        self.intermediate_scale = None if intermediate_scale is None else float(intermediate_scale)

    def __repr__(self) -> str:
        return f"W8A8Fp8(input_scale={self.input_scale}, intermediate_scale={self.intermediate_scale})"

    def dispatch_quantizer(self, vendor: Vendor, plan: DispatchPlan, weights: ExpertWeights) -> Quantizer:
        """The static quantizer where the plan carries fp8 per token and an input scale is set."""
        scale = self.input_scale
        if scale is None or plan.resolved is not DispatchDtype.FP8 or plan.scale_layout is not ScaleLayout.PER_TOKEN:
            return super().dispatch_quantizer(vendor, plan, weights)
        return lambda x: static_fp8(x, scale)

    def first_operand(self, vendor: Vendor, x: QuantizedTensor, weights: ExpertWeights) -> GemmOperand:
        """The gate/up GEMM's operand: with the static input scale where there is one."""
        if self.input_scale is None:
            return super().first_operand(vendor, x, weights)
        return self._static(vendor, x, self.input_scale)

    def second_operand(self, vendor: Vendor, h: torch.Tensor, weights: ExpertWeights) -> GemmOperand:
        """The down GEMM's operand: with the static intermediate scale where there is one."""
        if self.intermediate_scale is None:
            return super().second_operand(vendor, h, weights)
        return self._static(vendor, h, self.intermediate_scale)

    def _static(self, vendor: Vendor, x: torch.Tensor | QuantizedTensor, scale: float) -> GemmOperand:
        """Rows already fp8 per token (the static dispatch quantizer made them) pass; others are quantized."""
        if isinstance(x, QuantizedTensor):
            if x.dtype is DispatchDtype.FP8 and x.layout is ScaleLayout.PER_TOKEN:
                return x
            x = self.as_float(vendor, x, self.staging_dtype)
        return static_fp8(x, scale)
