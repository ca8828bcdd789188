"""`TemplateOps`: the ops the template computes itself; everything else is `hal.ReferenceOps`.

These methods are what a real vendor replaces with calls into its kernels. hal has
checked the arguments before they arrive (types, shapes, devices, the declared kinds and
limits) and resolved the dtype, layout, grouped-matmul kind and output dtype, so an op
only computes, in the formats `hal.formats` documents. Where a kernel does not take an
operand, hand it to `super()` (the reference).
"""

from __future__ import annotations

import torch

import hal


class TemplateOps(hal.ReferenceOps):
    """int8 quantization, the grouped matmul and swiglu in the template's own torch code."""

    notes = {
        "quantize": "int8 per token in the template's own code; bf16 through the reference cast",
        "grouped_matmul": "one matmul per group, in the template's own code",
        "swiglu": "the template's own code",
    }

    def quantize(
        self, x: torch.Tensor, *, dtype: hal.DispatchDtype, layout: hal.ScaleLayout, global_scale: torch.Tensor | None
    ) -> hal.QuantizedTensor:
        """int8 per token: `scale = rowmax|x| / 127`, values rounded half to even (a zero row stays 0)."""
        if dtype is not hal.DispatchDtype.INT8:
            return super().quantize(x, dtype=dtype, layout=layout, global_scale=global_scale)
        xf = x.to(torch.float32)
        scale = xf.abs().amax(dim=-1) / hal.INT8_MAX
        divisor = torch.where(scale == 0, torch.ones_like(scale), scale).unsqueeze(-1)
        data = torch.round(xf / divisor).clamp(-hal.INT8_MAX, hal.INT8_MAX).to(torch.int8)
        return hal.QuantizedTensor(data, dtype, layout, scale)

    def grouped_matmul(
        self,
        x: torch.Tensor | hal.QuantizedTensor | hal.PackedInt4Tensor,
        weight: hal.QuantizedWeight,
        groups: hal.Groups,
        *,
        kind: hal.GemmKind,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """One matmul per group: fp32 for float kinds; int8 exactly (in float64), then both scales."""
        data = x if isinstance(x, torch.Tensor) else x.data
        # The template reads the group sizes on the host; a device kernel takes the group tensor as it is.
        counts = groups.counts().tolist()
        if any(c < 0 for c in counts) or sum(counts) != data.shape[0]:
            raise hal.invalid(
                f"groups ({groups.kind})",
                f"non-negative rows covering the {data.shape[0]} rows of x",
                groups.tensor.tolist(),
            )
        out = torch.empty((data.shape[0], weight.out_features), dtype=out_dtype, device=data.device)
        start = 0
        for g, count in enumerate(counts):
            rows = slice(start, start + count)
            if kind.spec.is_float:
                out[rows] = (data[rows].to(torch.float32) @ weight.data[g].to(torch.float32)).to(out_dtype)
            else:
                exact = data[rows].to(torch.float64) @ weight.data[g].to(torch.float64)
                out[rows] = (exact * x.scale[rows, None] * weight.scale[g][None, :]).to(out_dtype)
            start += count
        return out

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(first half) * second half` of the last dimension, in fp32, returned in x's dtype."""
        gate, up = x.to(torch.float32).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up).to(x.dtype)
