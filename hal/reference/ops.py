"""`ReferenceOps`: every hal op in plain, device-agnostic torch.

The CPU vendor computes with it as it is; other vendors subclass it and override the ops
their runtime accelerates (calling `super()` for operands their kernels do not take).
It has no vendor identity: it never asks which vendor or device it serves. Arguments come
checked by `hal.Vendor`, so it calls the reference computations directly (not the checked
public functions of `hal.reference`); the value checks only the host can afford (finite
inputs, group lists covering every row) are made here.
"""

from __future__ import annotations

import torch

from hal.dtypes import DispatchDtype, ScaleLayout
from hal.errors import UnsupportedCapability
from hal.formats import PackedInt4Tensor, QuantizedTensor, QuantizedWeight
from hal.gemm_kinds import GemmKind
from hal.groups import Groups
from hal.ops import VendorOps
from hal.activations import Activation, ActivationKind
from hal.reference.activation import apply_activation, silu_glu
from hal.reference.bias import add_group_bias
from hal.reference.grouped_matmul import compute
from hal.reference.int4 import encode_int4
from hal.reference.permute import combine_rows, sort_pairs
from hal.reference.quantize import dequantize, encode
from hal.reference.routing import topk_of_softmax
from hal.reference.weights import encode_weight


class ReferenceOps(VendorOps):
    """The reference implementation of every op (`hal caps` lists an op it serves as 'hal.reference')."""

    reference_implementation = True
    notes = {"fused_deep_moe": "none: the reference has no fused op (the layer runs the unfused path)"}

    def quantize(
        self, x: torch.Tensor, *, dtype: DispatchDtype, layout: ScaleLayout, global_scale: torch.Tensor | None
    ) -> QuantizedTensor:
        """See `hal.reference.quantize.quantize`."""
        return encode(x, dtype, layout, global_scale)

    def dequantize(self, q: QuantizedTensor, *, out_dtype: torch.dtype) -> torch.Tensor:
        """See `hal.reference.quantize.dequantize`."""
        return dequantize(q, out_dtype)

    def quantize_weight(
        self, weight: torch.Tensor, *, layout: ScaleLayout, dtype: torch.dtype | None
    ) -> QuantizedWeight:
        """See `hal.reference.weights.quantize_weight`."""
        return encode_weight(weight, layout, dtype)

    def quantize_int4(self, x: torch.Tensor) -> PackedInt4Tensor:
        """See `hal.reference.int4.quantize_int4`."""
        return encode_int4(x)

    def grouped_matmul(
        self,
        x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
        weight: QuantizedWeight,
        groups: Groups,
        *,
        kind: GemmKind,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """See `hal.reference.grouped_matmul`."""
        return compute(x, weight, groups, kind.spec, out_dtype)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """See `hal.reference.activation.swiglu`."""
        return silu_glu(x)

    def activate(self, x: torch.Tensor, *, activation: Activation) -> torch.Tensor:
        """SiLU-GLU through `swiglu` (which a subclass may accelerate); the other kinds as
        `hal.reference.activation.apply_activation`."""
        if activation.kind is ActivationKind.SILU_GLU:
            return self.swiglu(x)
        return apply_activation(x, activation)

    def add_expert_bias(self, y: torch.Tensor, bias: torch.Tensor, *, groups: Groups) -> torch.Tensor:
        """See `hal.reference.bias`."""
        return add_group_bias(y, bias, groups)

    def softmax_topk(self, logits: torch.Tensor, *, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """See `hal.reference.routing`."""
        return topk_of_softmax(logits, top_k, renormalize)

    def sort_by_expert(
        self, topk_ids: torch.Tensor, *, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See `hal.reference.permute.sort_by_expert`."""
        return sort_pairs(topk_ids, num_experts)

    def weighted_combine(
        self, rows: torch.Tensor, index: torch.Tensor | None, topk_weights: torch.Tensor, *, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """See `hal.reference.permute.weighted_combine`."""
        return combine_rows(rows, index, topk_weights, out_dtype)

    def fused_deep_moe(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: QuantizedWeight,
        w2: QuantizedWeight,
        *,
        scheme: str,
        process_group: object | None,
        dispatch_dtype: DispatchDtype,
        max_tokens_per_rank: int | None,
    ) -> torch.Tensor:
        """The reference has no fused op: a vendor that declares one implements it."""
        raise UnsupportedCapability(f"the reference ops have no fused_deep_moe (scheme {scheme!r})")
