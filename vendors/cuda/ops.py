"""`CudaOps`: the hal ops on CUDA devices, through Triton kernels and torch's grouped GEMMs.

| op | kernel |
|---|---|
| quantize fp8 (per token, per 128 channels), int8 (per token) | Triton, one pass (`kernels/quantize.py`) |
| quantize bf16 | a cast |
| grouped matmul bf16 | `torch._grouped_mm` (sm90+, 16-byte aligned K and N) for many rows per group, else the Triton grouped GEMM |
| grouped matmul fp16, fp32, int8, fp8 row-wise, fp8 128x128-block | the Triton grouped GEMM (`kernels/grouped_gemm.py`) |
| swiglu | Triton, one pass |
| sort by expert | Triton, one launch for up to 1024 pairs (decode); the torch radix sort above |
| weighted combine | Triton, one pass: gather the k rows, weigh in fp32, write once |
| weight quantization | the reference, then int8 and fp8 weights are stored K-major (each expert's `[K, N]` as a transposed `[N, K]`), the operand layout Hopper's 8-bit tensor-core instructions read |
| everything else (dequantize, weights, int4/nvfp4 where not declared) | the torch reference (`vendors.cpu.ops`) |

No op reads a value back on the host: group sizes stay on the device and scheduling is
done inside the kernels, so the MoE layer's forward can be captured in a CUDA graph.
Operands the kernels do not take (a non-contiguous last dimension, an unexpected
layout) take the reference path, which validates them and raises the house errors.
"""

from __future__ import annotations

import torch

from hal.capabilities import GemmKind
from hal.combine import check_combine
from hal.dtypes import DispatchDtype, ScaleLayout
from hal.formats import FLOAT_DTYPES, PackedInt4Tensor, QuantizedTensor, QuantizedWeight
from hal.groups import Groups
from vendors.cpu.ops import TorchReferenceOps

_TRITON_KINDS = {GemmKind.BF16, GemmKind.FP16, GemmKind.FP32, GemmKind.INT8, GemmKind.FP8_ROWWISE,
                 GemmKind.FP8_BLOCK128}
_QUANT_TARGET = {DispatchDtype.FP8: torch.float8_e4m3fn, DispatchDtype.INT8: torch.int8}
#: Rows per group from which torch._grouped_mm beats the Triton kernel for bf16, measured on an H100:
#: at 256 rows per group (qwen3, 4096 tokens) 463 us against 642 us for the gate/up projection; at
#: 128 (mixtral, 512 tokens) 1120 us against 756 us; at 32 (qwen3, 512 tokens) even.
GROUPED_MM_MIN_ROWS_PER_GROUP = 192


class CudaOps(TorchReferenceOps):
    """The op methods of the CUDA vendor; the host class provides `capabilities()` and `device`."""

    #: Whether Triton imports (set by the host vendor's probe); without it: the reference path.
    kernels_available: bool = False
    #: Whether torch._grouped_mm may be used (sm90+); set by the host vendor's probe.
    use_torch_grouped_mm: bool = False

    def quantize(
        self,
        x: torch.Tensor,
        dtype: DispatchDtype,
        *,
        layout: ScaleLayout | None = None,
        global_scale: torch.Tensor | None = None,
    ) -> QuantizedTensor:
        """bf16: a cast; fp8 / int8: the one-pass Triton kernel; anything else: the reference."""
        parsed = DispatchDtype.parse(dtype) if isinstance(dtype, (str, DispatchDtype)) else dtype
        if not (self.kernels_available and _is_float_on(x, self.device) and x.dim() >= 1 and x.shape[-1] > 0 and global_scale is None):
            return super().quantize(x, dtype, layout=layout, global_scale=global_scale)
        if parsed is DispatchDtype.BF16 and layout in (None, ScaleLayout.NONE, "none"):
            return QuantizedTensor(x.to(torch.bfloat16), DispatchDtype.BF16, ScaleLayout.NONE)
        target = _QUANT_TARGET.get(parsed)
        chosen = parsed.default_scale_layout if layout is None and target is not None else layout
        chosen = ScaleLayout(chosen) if isinstance(chosen, str) else chosen
        group = {ScaleLayout.PER_TOKEN: None, ScaleLayout.GROUP_128: 128}
        if target is None or chosen not in group or (target == torch.int8 and chosen is not ScaleLayout.PER_TOKEN):
            return super().quantize(x, dtype, layout=layout, global_scale=global_scale)
        from vendors.cuda.kernels.quantize import quantize_rows

        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        data, scale = quantize_rows(rows, target, group[chosen])
        lead = tuple(x.shape[:-1])
        return QuantizedTensor(data.view(*lead, x.shape[-1]), parsed, chosen, scale.view(*lead, *scale.shape[1:]))

    def grouped_matmul(
        self,
        x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
        weight: QuantizedWeight,
        groups: Groups,
        *,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """`y[rows of g] = x[rows of g] @ weight[g]` on the device, without a host synchronisation."""
        kind, m, _, data, resolved = self.checked_gemm(x, weight, groups, out_dtype)
        if kind not in _TRITON_KINDS or not self.kernels_available:
            return super().grouped_matmul(x, weight, groups, out_dtype=out_dtype)
        out_dtype = resolved
        if data.stride(-1) != 1:
            data = data.contiguous()
        counts = groups.counts().to(self.device)
        if (kind is GemmKind.BF16 and self.use_torch_grouped_mm and out_dtype == torch.bfloat16
                and m >= GROUPED_MM_MIN_ROWS_PER_GROUP * groups.num_groups and _aligned(weight.data)):
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            return torch._grouped_mm(data, weight.data, offs=offsets, out_dtype=torch.bfloat16)
        from vendors.cuda.kernels import grouped_gemm as kernel

        if kind in (GemmKind.INT8, GemmKind.FP8_ROWWISE):
            return kernel.grouped_gemm(data, weight.data, counts, out_dtype, x_scale=x.scale,  # type: ignore[union-attr]
                                       w_scale=weight.scale, scale_mode=kernel.SCALE_ROWWISE)
        if kind is GemmKind.FP8_BLOCK128:
            return kernel.grouped_gemm(data, weight.data, counts, out_dtype, x_scale=x.scale,  # type: ignore[union-attr]
                                       w_scale=weight.scale, scale_mode=kernel.SCALE_BLOCK128)
        return kernel.grouped_gemm(data, weight.data, counts, out_dtype)

    def quantize_weight(
        self, weight: torch.Tensor, layout: ScaleLayout, dtype: torch.dtype | None = None
    ) -> QuantizedWeight:
        """The reference quantization; 8-bit weights are then stored K-major (same values, same shape)."""
        q = super().quantize_weight(weight, layout, dtype)
        if q.data.dtype not in (torch.int8, torch.float8_e4m3fn):
            return q
        k_major = q.data.transpose(1, 2).contiguous().transpose(1, 2)
        return QuantizedWeight(k_major, q.layout, q.scale, q.global_scale)

    def sort_by_expert(self, topk_ids: torch.Tensor,
                       num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pairs sorted by expert: one Triton launch for small batches, else the torch version."""
        if (self.kernels_available and isinstance(topk_ids, torch.Tensor) and topk_ids.device.type == "cuda"
                and not topk_ids.dtype.is_floating_point):
            from vendors.cuda.kernels import sorting

            if 0 < topk_ids.numel() <= sorting.MAX_PAIRS and num_experts <= sorting.MAX_EXPERTS:
                return sorting.sort_pairs(topk_ids, num_experts)
        return super().sort_by_expert(topk_ids, num_experts)

    def weighted_combine(self, rows: torch.Tensor, index: torch.Tensor | None, topk_weights: torch.Tensor,
                         out_dtype: torch.dtype) -> torch.Tensor:
        """Each token's weighted sum of its k rows, in one Triton pass."""
        check_combine(rows, index, topk_weights)
        if not (self.kernels_available and _is_float_on(rows, self.device) and rows.stride(-1) == 1
                and out_dtype in FLOAT_DTYPES):
            return super().weighted_combine(rows, index, topk_weights, out_dtype)
        from vendors.cuda.kernels.combine import weighted_combine

        return weighted_combine(rows, index, topk_weights, out_dtype)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(a) * b` in one Triton pass (a, the gate, is the first half)."""
        if not (self.kernels_available and _is_float_on(x, self.device) and x.dim() >= 1
                and x.shape[-1] % 2 == 0 and x.numel()):
            return super().swiglu(x)
        from vendors.cuda.kernels.activation import swiglu

        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return swiglu(rows).view(*x.shape[:-1], x.shape[-1] // 2)


def _is_float_on(x: object, device: torch.device) -> bool:
    return (isinstance(x, torch.Tensor) and x.dtype in FLOAT_DTYPES and x.device.type == device.type
            and (device.index is None or x.device.index == device.index))


def _aligned(w: torch.Tensor) -> bool:
    """torch._grouped_mm needs 16-byte aligned strides: K and N multiples of 8 bf16 values."""
    return w.shape[1] % 8 == 0 and w.shape[2] % 8 == 0 and w.is_contiguous()
