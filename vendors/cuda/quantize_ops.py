"""The CUDA vendor's activation quantize and dequantize ops: symmetric one-byte dtypes (fp8, int8) per token or per
128 channels run one-pass Triton kernels (`kernels/quantize.py`); cast dtypes are casts; the rest (int4, nvfp4,
other group sizes, a global scale) go on to the reference."""

from __future__ import annotations

import torch

from hal import FP8_GROUP_SIZE, Codec, DispatchDtype, DtypeSpec, QuantizedTensor, ScaleLayout
from vendors.cuda.kernels import quantize


def _one_pass(spec: DtypeSpec, group: int | None) -> bool:
    """Whether the Triton kernels take this format: symmetric, one byte, per token or per 128 channels."""
    return spec.codec is Codec.SYMMETRIC and spec.storage.itemsize == 1 and group in (None, FP8_GROUP_SIZE)


class QuantizeOps:
    """Activation quantize / dequantize of the CUDA vendor's ops (a mixin: other formats go on to the next
    class)."""

    pdl: bool
    notes = {
        "quantize": "Triton one-pass kernel for fp8 / int8 (per token, per 128 channels; tiles of rows); "
        "a cast for bf16",
        "dequantize": "Triton one-pass kernel for fp8 / int8 (per token, per 128 channels); a cast for bf16",
    }

    def quantize(
        self, x: torch.Tensor, *, dtype: DispatchDtype, layout: ScaleLayout, global_scale: torch.Tensor | None
    ) -> QuantizedTensor:
        """A cast, the one-pass Triton kernel for symmetric one-byte dtypes, the reference otherwise."""
        spec = dtype.spec
        if spec.codec is Codec.CAST:
            return QuantizedTensor(x.to(spec.storage), dtype, layout)
        group = layout.group_size
        if not _one_pass(spec, group) or global_scale is not None:
            return super().quantize(x, dtype=dtype, layout=layout, global_scale=global_scale)  # type: ignore[misc]
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        data, scale = quantize.quantize_rows(
            rows,
            spec.storage,
            group,
            qmax=float(spec.qmax),  # type: ignore[arg-type]
            rounds=spec.rounds,
            pdl=self.pdl,
        )
        lead = tuple(x.shape[:-1])
        return QuantizedTensor(data.view(*lead, x.shape[-1]), dtype, layout, scale.view(*lead, *scale.shape[1:]))

    def dequantize(self, q: QuantizedTensor, *, out_dtype: torch.dtype) -> torch.Tensor:
        """`data * scale` in fp32, rounded once to `out_dtype` (as the reference): a cast for cast dtypes, the
        one-pass Triton kernel for symmetric one-byte dtypes, the reference otherwise."""
        spec = q.dtype.spec
        if spec.codec is Codec.CAST:
            return q.data.to(out_dtype)
        group = q.layout.group_size
        if not _one_pass(spec, group) or q.data.dim() == 0 or out_dtype == torch.float64:
            return super().dequantize(q, out_dtype=out_dtype)  # type: ignore[misc]
        h = q.data.shape[-1]
        if q.data.numel() == 0:
            return torch.empty(q.data.shape, dtype=out_dtype, device=q.data.device)
        rows = q.data.reshape(-1, h)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        scale = q.scale.to(torch.float32)  # type: ignore[union-attr]
        out = quantize.dequantize_rows(rows, scale, group, out_dtype, pdl=self.pdl)
        return out.view(q.data.shape)
