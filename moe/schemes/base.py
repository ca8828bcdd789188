"""The quant-scheme interface: weight format, dispatch dtype, and the operands of both GEMMs.

A scheme is a small object. It quantizes float expert weights into its format through
the vendor (`quantize_weights`), names the grouped-matmul kind its experts need
(`gemm_kind`), builds the quantizer the dispatcher applies before communication
(`dispatch_quantizer`), and turns the dispatched payload and the activation of the first
projection into the operands of the two grouped GEMMs (`first_operand`,
`second_operand`), re-quantizing where the carried dtype differs from what the GEMM
needs. It never asks which device it runs on: every device question goes to `hal`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from hal import (
    DispatchDtype,
    DispatchPlan,
    GemmKind,
    PackedInt4Tensor,
    QuantizedTensor,
    QuantizedWeight,
    ScaleLayout,
    SchemeTraits,
    Vendor,
)
from hal.errors import invalid

#: What a grouped GEMM takes as its activation operand.
GemmOperand = torch.Tensor | QuantizedTensor | PackedInt4Tensor
#: Quantizes `[..., H]` float activations into the planned dispatch dtype.
Quantizer = Callable[[torch.Tensor], QuantizedTensor]


@dataclass(frozen=True)
class ExpertWeights:
    """One rank's expert weights in a scheme's format.

    `w13` is `[E, H, 2I]` (gate projection first, then up), `w2` is `[E, I, H]`. NVFP4
    checkpoints also carry the fp32 global scales of the layer input and of the
    intermediate activation (one-element tensors).
    """

    w13: QuantizedWeight
    w2: QuantizedWeight
    input_global_scale: torch.Tensor | None = None
    intermediate_global_scale: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        """Experts held here."""
        return self.w13.num_experts

    @property
    def hidden_size(self) -> int:
        """H."""
        return self.w13.in_features

    @property
    def intermediate_size(self) -> int:
        """I (half the output channels of `w13`)."""
        return self.w2.in_features


class QuantScheme(abc.ABC):
    """A quantization scheme for the expert weights and activations of one MoE layer."""

    #: The dispatch-relevant facts `hal` resolves the plan from (design.md section 4, step 3).
    traits: ClassVar[SchemeTraits]

    @property
    def name(self) -> str:
        """The scheme's name, as `hal` knows it."""
        return self.traits.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # -- weights ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def quantize_weights(self, vendor: Vendor, w13: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
        """Quantize float weights (`[E, H, 2I]`, `[E, I, H]`, already on the vendor's device)."""

    @staticmethod
    def quantize_both(vendor: Vendor, w13: torch.Tensor, w2: torch.Tensor, layout: ScaleLayout,
                      dtype: torch.dtype | None = None) -> ExpertWeights:
        """Both projections through `vendor.quantize_weight` with one layout and storage dtype."""
        return ExpertWeights(vendor.quantize_weight(w13, layout, dtype), vendor.quantize_weight(w2, layout, dtype))

    @abc.abstractmethod
    def gemm_kind(self) -> GemmKind:
        """The grouped-matmul kind both projections run with."""

    def output_dtype(self) -> torch.dtype:
        """The dtype the grouped GEMMs produce (bf16 for quantized schemes)."""
        return torch.bfloat16

    # -- activations -----------------------------------------------------------------------------

    def dispatch_quantizer(self, vendor: Vendor, plan: DispatchPlan, weights: ExpertWeights) -> Quantizer:
        """The function the dispatcher applies to the layer input before communication."""
        dtype, layout = plan.resolved, plan.scale_layout

        def quantize(x: torch.Tensor) -> QuantizedTensor:
            return vendor.quantize(x, dtype, layout=layout)

        return quantize

    @abc.abstractmethod
    def first_operand(self, vendor: Vendor, x: QuantizedTensor, weights: ExpertWeights) -> GemmOperand:
        """The activation operand of the gate/up GEMM, from the dispatched rows `[M, H]`."""

    @abc.abstractmethod
    def second_operand(self, vendor: Vendor, h: torch.Tensor, weights: ExpertWeights) -> GemmOperand:
        """The activation operand of the down GEMM, from the swiglu output `[M, I]`."""

    # -- shared helpers --------------------------------------------------------------------------

    @staticmethod
    def as_float(vendor: Vendor, x: QuantizedTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Dispatched rows as floats: bf16 payloads as they are, others dequantized."""
        if x.dtype is DispatchDtype.BF16 and dtype == torch.bfloat16:
            return x.data
        return vendor.dequantize(x, dtype)


def check_float_weights(w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Raise `InvalidInput` unless `w13` `[E, H, 2I]` and `w2` `[E, I, H]` are float and agree."""
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, torch.Tensor):
            raise invalid(name, "a torch.Tensor", type(w).__name__)
        if w.dim() != 3 or not torch.is_floating_point(w) or w.dtype == torch.float64:
            raise invalid(name, "a 3-D bf16/fp16/fp32 tensor [experts, K, N]", f"{w.dtype} {tuple(w.shape)}")
    e, h, two_i = w13.shape
    if two_i % 2 or tuple(w2.shape) != (e, two_i // 2, h):
        raise invalid(
            "w13, w2", "w13 [E, H, 2I] (gate then up) and w2 [E, I, H]",
            f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)}",
        )
