"""`AscendOps`: the hal ops through torch_npu (or any object with its op names), via a binding.

What runs where:

| hal op | torch_npu op |
|---|---|
| quantize int8 (fp8 on A5), per token | `npu_dynamic_quant` (fp16/bf16 input; fp32 input uses the same formula in torch ops, since the op takes no fp32) |
| quantize_int4 | `npu_dynamic_quant(dst_type=torch.quint4x2)`: int4 packed eight per int32 |
| grouped_matmul | `npu_grouped_matmul` in its MoE form: one x `[M, K]`, one weight `[E, K, N]`, `group_type=0`, `split_item=2`, `group_list` int64 as counts (`group_list_type=1`) or offsets (`0`) as hal gives it |
| swiglu | `npu_swiglu` |
| dequantize, quantize_weight | torch ops (the reference formulas; weights are quantized once, offline) |

Quantized GEMMs with a bf16/fp16 output apply the per-token and per-channel scales inside the
op (`per_token_scale`, `scale`); an fp32 output, which the op does not produce for quantized
inputs, takes the op's raw int32 accumulator and applies the scales in fp32.
"""

from __future__ import annotations

import torch

from hal.capabilities import GemmKind
from hal.dtypes import DispatchDtype, ScaleLayout
from hal.errors import UnsupportedCapability
from hal.formats import FLOAT_DTYPES, PackedInt4Tensor, QuantizedTensor, QuantizedWeight
from hal.groups import GroupListKind, Groups
from vendors.ascend.binding import NpuOps
from vendors.cpu import activation
from vendors.cpu.ops import TorchReferenceOps

#: The torch_npu destination dtype of each dispatch dtype npu_dynamic_quant produces.
_DST_TYPE = {DispatchDtype.INT8: torch.int8, DispatchDtype.FP8: torch.float8_e4m3fn}
#: Activation dtypes npu_dynamic_quant accepts.
_NPU_QUANT_INPUTS = (torch.float16, torch.bfloat16)
_FLOAT_KINDS = (GemmKind.BF16, GemmKind.FP16, GemmKind.FP32)
_SCALED_OUTPUTS = (torch.bfloat16, torch.float16)


class AscendOps(TorchReferenceOps):
    """The op methods of the Ascend vendor; the host class provides `npu_ops()`."""

    def npu_ops(self) -> NpuOps:
        """The bound torch_npu ops (the host vendor overrides this)."""
        raise NotImplementedError

    # -- quantization -----------------------------------------------------------------------------

    def quantize(
        self,
        x: torch.Tensor,
        dtype: DispatchDtype,
        *,
        layout: ScaleLayout | None = None,
        global_scale: torch.Tensor | None = None,
    ) -> QuantizedTensor:
        """bf16: a cast; int8 (fp8 where declared): per-token `npu_dynamic_quant`."""
        parsed = DispatchDtype.parse(dtype)
        caps = self.capabilities()
        if parsed is not DispatchDtype.AUTO and parsed not in caps.dispatch_dtypes:
            fallback = caps.fallback_for(parsed)
            raise UnsupportedCapability(
                f"vendor {self.name!r} ({caps.device_name}) does not quantize to {parsed} "
                f"({'it falls back to ' + str(fallback) if fallback else 'rejected'}: "
                f"{caps.fallback_reasons.get(parsed, 'not declared')})"
            )
        native = (
            parsed in _DST_TYPE and isinstance(x, torch.Tensor) and x.dtype in _NPU_QUANT_INPUTS
            and x.dim() >= 1 and x.shape[-1] > 0 and global_scale is None
            and (layout is None or ScaleLayout(layout) is ScaleLayout.PER_TOKEN)
        )
        if not native:  # bf16 casts, fp32 input, and every invalid argument (same checks, same errors)
            if parsed is DispatchDtype.FP8 and layout is None:
                layout = caps.fp8_scale_layout
            return super().quantize(x, parsed, layout=layout, global_scale=global_scale)
        self._check_device("x", x)
        data, scale = self._dynamic_quant(x, _DST_TYPE[parsed])
        return QuantizedTensor(data, parsed, ScaleLayout.PER_TOKEN, scale)

    def quantize_int4(self, x: torch.Tensor) -> PackedInt4Tensor:
        """Per-token int4 through `npu_dynamic_quant(dst_type=torch.quint4x2)`, eight per int32."""
        caps = self.capabilities()
        if GemmKind.INT4 not in caps.grouped_matmul:
            raise UnsupportedCapability(
                f"vendor {self.name!r} ({caps.device_name}) does not declare the int4 grouped matmul, "
                "so it does not quantize activations to int4"
            )
        if not (isinstance(x, torch.Tensor) and x.dtype in _NPU_QUANT_INPUTS and x.dim() >= 1
                and x.shape[-1] > 0 and x.shape[-1] % 8 == 0):
            return super().quantize_int4(x)  # fp32 input and invalid arguments
        self._check_device("x", x)
        data, scale = self._dynamic_quant(x, torch.quint4x2)
        return PackedInt4Tensor(data, scale)

    def _dynamic_quant(self, x: torch.Tensor, dst_type: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """npu_dynamic_quant on `[..., H]`; the op wants at least 2 dimensions."""
        rows = x.reshape(-1, x.shape[-1]) if x.dim() < 2 else x
        data, scale = self.npu_ops().npu_dynamic_quant(rows, dst_type=dst_type)
        lead = tuple(x.shape[:-1])
        return data.reshape(*lead, data.shape[-1]), scale.reshape(lead)

    # -- grouped matmul ---------------------------------------------------------------------------

    def grouped_matmul(
        self,
        x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
        weight: QuantizedWeight,
        groups: Groups,
        *,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """`y[rows of g] = x[rows of g] @ weight[g]` through `npu_grouped_matmul`, scales applied."""
        kind, m, n, data, out_dtype = self.checked_gemm(x, weight, groups, out_dtype)
        if m == 0:
            return torch.zeros((0, n), dtype=out_dtype, device=data.device)
        group_list, group_list_type = _group_list(groups, data.device)
        call = {"group_list": group_list, "group_list_type": group_list_type, "split_item": 2, "group_type": 0}
        npu = self.npu_ops()
        if kind in _FLOAT_KINDS:
            w = weight.data
            if out_dtype != data.dtype:  # the op returns x's dtype: compute wider, round once
                data, w = data.to(torch.float32), w.to(torch.float32)
            return npu.npu_grouped_matmul([data], [w], **call)[0].to(out_dtype)
        scale, token_scale = weight.scale, x.scale  # type: ignore[union-attr]
        if out_dtype in _SCALED_OUTPUTS:
            return npu.npu_grouped_matmul([data], [weight.data], scale=[scale], per_token_scale=[token_scale],
                                          output_dtype=out_dtype, **call)[0]
        if kind is GemmKind.FP8_ROWWISE:  # no integer accumulator: exact fp32 operands, scales inside
            a = data.to(torch.float32) * token_scale.unsqueeze(1)
            b = weight.data.to(torch.float32) * scale.unsqueeze(1)
            return npu.npu_grouped_matmul([a], [b], **call)[0]
        acc = npu.npu_grouped_matmul([data], [weight.data], output_dtype=torch.int32, **call)[0]
        rows_scale = scale.index_select(0, _row_groups(groups, m).to(scale.device))
        return acc.to(torch.float32) * token_scale.unsqueeze(1) * rows_scale

    # -- activation -------------------------------------------------------------------------------

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(a) * b` through `npu_swiglu` (a, the gate, is the first half)."""
        if not (isinstance(x, torch.Tensor) and x.dtype in FLOAT_DTYPES and x.dim() >= 1
                and x.shape[-1] % 2 == 0):
            return activation.swiglu(x)  # raises the house InvalidInput
        self._check_device("x", x)
        if x.numel() == 0:
            return torch.empty_like(x[..., : x.shape[-1] // 2])
        return self.npu_ops().npu_swiglu(x, dim=-1)


def _group_list(groups: Groups, device: torch.device) -> tuple[torch.Tensor, int]:
    """hal's group list as npu_grouped_matmul takes it: int64 on the device, and its type.

    The op refuses a counts list of length 1, so one group is always passed as its offset.
    """
    values = groups.tensor.to(device=device, dtype=torch.int64)
    if groups.kind is GroupListKind.OFFSETS or groups.num_groups == 1:
        return (values if groups.kind is GroupListKind.OFFSETS else values.cumsum(0)), 0
    return values, 1


def _row_groups(groups: Groups, rows: int) -> torch.Tensor:
    """The group of every row, `[M]` int64 (for scales applied outside the op)."""
    counts = groups.counts()
    ids = torch.arange(counts.numel(), device=counts.device)
    return torch.repeat_interleave(ids, counts, output_size=rows)
