"""The quant-scheme interface: weight format, dispatch dtype, and the operands of both GEMMs.

A scheme is mostly a declaration: its `traits` (what dispatch-dtype resolution needs) and
the grouped-matmul kind its experts run (`gemm_kind`). Everything else follows from that
kind's row of `hal.GEMM_KINDS`: the weight format `quantize_weights` produces, and the
activation format both GEMM operands are brought to (`first_operand`, `second_operand`:
rows carried in that format pass as they are; others are dequantized to
`staging_dtype` and quantized again). The dispatch quantizer quantizes to the plan's
dtype and layout, with the checkpoint's input global scale where the dtype has one. A
scheme never asks which device it runs on: every device question goes to `hal`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from hal import (
    Activation,
    ActivationFormat,
    Codec,
    DispatchPlan,
    GemmKind,
    PackedInt4Tensor,
    QuantizedTensor,
    QuantizedWeight,
    ScaleLayout,
    SchemeTraits,
    Vendor,
    invalid,
)
from moe.arguments import with_data

#: What a grouped GEMM takes as its activation operand.
GemmOperand = torch.Tensor | QuantizedTensor | PackedInt4Tensor
#: Quantizes `[..., H]` float activations into the planned dispatch dtype.
Quantizer = Callable[[torch.Tensor], QuantizedTensor]


@dataclass(frozen=True)
class ExpertWeights:
    """One rank's experts in a scheme's format: weights, optional biases, and their activation.

    `w13` is `[E, H, 2I]` (gate projection first, then up; `[E, H, I]` for a plain
    activation), `w2` is `[E, I, H]`. `w13_bias` `[E, 2I]` and `w2_bias` `[E, H]` (fp32) are
    added to each projection's output. NVFP4 checkpoints also carry the fp32 global scales
    of the layer input and of the intermediate activation (one-element tensors).
    """

    w13: QuantizedWeight
    w2: QuantizedWeight
    input_global_scale: torch.Tensor | None = None
    intermediate_global_scale: torch.Tensor | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    activation: Activation = Activation()

    def __post_init__(self) -> None:
        for name in ("w13", "w2"):
            if not isinstance(getattr(self, name), QuantizedWeight):
                raise invalid(f"ExpertWeights.{name}", "a hal.QuantizedWeight", type(getattr(self, name)).__name__)
        object.__setattr__(self, "activation", Activation.parse(self.activation))
        e, h = self.w13.num_experts, self.w13.in_features
        width = self.w13.out_features
        if self.activation.gated and width % 2:
            raise invalid(
                "ExpertWeights.w13", f"an even number of output channels [gate | up] for {self.activation}", width
            )
        i = self.activation_width()
        if (self.w2.num_experts, self.w2.in_features, self.w2.out_features) != (e, i, h):
            raise invalid(
                "ExpertWeights.w2",
                f"[{e}, {i}, {h}] to match w13 [{e}, {h}, {width}]",
                f"[{self.w2.num_experts}, {self.w2.in_features}, {self.w2.out_features}]",
            )
        for name, shape in (("w13_bias", (e, width)), ("w2_bias", (e, h))):
            bias = getattr(self, name)
            if bias is None:
                continue
            if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != shape or not torch.is_floating_point(bias):
                got = f"{bias.dtype} {tuple(bias.shape)}" if isinstance(bias, torch.Tensor) else type(bias).__name__
                raise invalid(f"ExpertWeights.{name}", f"a float tensor of shape {shape}", got)

    def activation_width(self) -> int:
        """I: the activation's output width (half of w13's outputs when gated)."""
        width = self.w13.out_features
        return width // 2 if self.activation.gated else width

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
        """I (the input channels of `w2`)."""
        return self.w2.in_features

    @property
    def has_bias(self) -> bool:
        """Whether either projection carries a bias."""
        return self.w13_bias is not None or self.w2_bias is not None


class QuantScheme(abc.ABC):
    """A quantization scheme for the expert weights and activations of one MoE layer."""

    #: The dispatch-relevant facts `hal` resolves the plan from (design.md section 4, step 3).
    traits: ClassVar[SchemeTraits]
    #: Every grouped-matmul kind instances of this scheme may run (the generic runner serves each).
    gemm_kinds: ClassVar[tuple[GemmKind, ...]]
    #: The float dtype carried rows are brought to before they are quantized again for the GEMM.
    staging_dtype: ClassVar[torch.dtype] = torch.float32

    @property
    def name(self) -> str:
        """The scheme's name, as `hal` knows it."""
        return self.traits.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def gemm_kind(self) -> GemmKind:
        """The grouped-matmul kind both projections run with."""
        return self.gemm_kinds[0]

    def output_dtype(self) -> torch.dtype:
        """The dtype the grouped GEMMs produce (the kind's default: bf16 for quantized kinds)."""
        return self.gemm_kind().spec.default_out_dtype

    # -- weights ---------------------------------------------------------------------------------

    def quantize_weights(
        self, vendor: Vendor, w13: torch.Tensor, w2: torch.Tensor, *, activation: Activation = Activation()
    ) -> ExpertWeights:
        """Float weights (`[E, H, 2I]` or, for a plain `activation`, `[E, H, I]`; `[E, I, H]`; on the
        vendor's device) in the kind's weight format."""
        spec = self.gemm_kind().spec
        return self.quantize_both(vendor, w13, w2, spec.weight_layout, spec.weight_dtype, activation=activation)

    @staticmethod
    def quantize_both(
        vendor: Vendor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        layout: ScaleLayout,
        dtype: torch.dtype | None = None,
        *,
        activation: Activation = Activation(),
    ) -> ExpertWeights:
        """Both projections through `vendor.quantize_weight` with one layout and storage dtype."""
        return ExpertWeights(
            vendor.quantize_weight(w13, layout, dtype), vendor.quantize_weight(w2, layout, dtype), activation=activation
        )

    # -- activations -----------------------------------------------------------------------------

    def dispatch_quantizer(self, vendor: Vendor, plan: DispatchPlan, weights: ExpertWeights) -> Quantizer:
        """The function the dispatcher applies to the layer input before communication: the plan's
        dtype and layout, with the checkpoint's input global scale where the dtype takes one (so
        that every rank agrees on it)."""
        dtype, layout = plan.resolved, plan.scale_layout
        global_scale = weights.input_global_scale if dtype.spec.global_scale else None

        def quantize(x: torch.Tensor) -> QuantizedTensor:
            return vendor.quantize(x, dtype, layout=layout, global_scale=global_scale)

        return quantize

    def first_operand(self, vendor: Vendor, x: QuantizedTensor, weights: ExpertWeights) -> GemmOperand:
        """The activation operand of the gate/up GEMM, from the dispatched rows `[M, H]`."""
        return self.gemm_operand(vendor, x, weights.input_global_scale)

    def second_operand(self, vendor: Vendor, h: torch.Tensor, weights: ExpertWeights) -> GemmOperand:
        """The activation operand of the down GEMM, from the activation output `[M, I]`."""
        return self.gemm_operand(vendor, h, weights.intermediate_global_scale)

    def gemm_operand(
        self, vendor: Vendor, x: torch.Tensor | QuantizedTensor, global_scale: torch.Tensor | None = None
    ) -> GemmOperand:
        """`x` in the activation format of the scheme's GEMM kind: as it is where it already is,
        a float cast for float kinds, else quantized (from `staging_dtype` when it was carried
        in another format)."""
        spec = self.gemm_kind().spec
        target = spec.activation
        if target.float_dtype is not None:
            if isinstance(x, torch.Tensor):
                return x if x.dtype == target.float_dtype else x.to(target.float_dtype)
            return self.as_float(vendor, x, target.float_dtype)
        if isinstance(x, QuantizedTensor):
            if spec.accepts(ActivationFormat.of(x)):
                return x
            x = self.as_float(vendor, x, self.staging_dtype)
        if target.int4:
            return vendor.quantize_int4(x)
        return vendor.quantize(
            x,
            target.dtype,
            layout=target.layout,  # type: ignore[arg-type]
            global_scale=global_scale if target.dtype.spec.global_scale else None,
        )  # type: ignore[union-attr]

    @staticmethod
    def as_float(vendor: Vendor, x: QuantizedTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Dispatched rows as floats: a cast payload already in `dtype` as it is, others dequantized."""
        if x.dtype.spec.codec is Codec.CAST and x.data.dtype == dtype:
            return x.data
        return vendor.dequantize(x, dtype)


def check_float_weights(w13: torch.Tensor, w2: torch.Tensor, *, gated: bool = True) -> None:
    """Raise `InvalidInput` unless `w13` `[E, H, 2I]` (`[E, H, I]` when not `gated`) and `w2` `[E, I, H]`
    are float and agree."""
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, torch.Tensor):
            raise invalid(name, "a torch.Tensor", type(w).__name__)
        if w.dim() != 3 or not torch.is_floating_point(w) or w.dtype == torch.float64:
            raise invalid(name, "a 3-D bf16/fp16/fp32 tensor [experts, K, N]", f"{w.dtype} {tuple(w.shape)}")
        with_data(name, w)
    e, h, width = w13.shape
    i = width // 2 if gated else width
    if (gated and width % 2) or tuple(w2.shape) != (e, i, h):
        want = "w13 [E, H, 2I] (gate then up) and w2 [E, I, H]" if gated else "w13 [E, H, I] and w2 [E, I, H]"
        found = f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)}"
        if _linear_layout(w13, w2, gated):
            found += (
                ": the nn.Linear layout ([out_features, in_features] per expert); pass w13.transpose(1, 2) and "
                "w2.transpose(1, 2)"
            )
        raise invalid("w13, w2", want, found)


def _linear_layout(w13: torch.Tensor, w2: torch.Tensor, gated: bool) -> bool:
    """Whether gated `w13`, `w2` are the `nn.Linear` layout of the experts (`[E, 2I, H]` and `[E, H, I]`).

    Not gated, the transposed pair `[E, I, H]`, `[E, H, I]` is itself a valid pair with H and I swapped, so
    it cannot be recognised: such a layer's `hidden_size` is the experts' intermediate size, and its first
    forward refuses the model's hidden states (docs/layer.md says to transpose)."""
    e, n, h = w13.shape
    return gated and n % 2 == 0 and tuple(w2.shape) == (e, h, n // 2)
