"""`AscendOps`: the hal ops through torch_npu (or any object with its op names), via a binding.

What runs where (hal op: torch_npu op):

- quantize int8 (fp8 on A5), per token: `npu_dynamic_quant` (fp16/bf16 input; fp32 input uses the
  same formula in torch ops, since the op takes no fp32)
- quantize_int4: `npu_dynamic_quant(dst_type=torch.quint4x2)`: int4 packed eight per int32
- grouped_matmul: `npu_grouped_matmul` in its MoE form: one x `[M, K]`, one weight `[E, K, N]`,
  `group_type=0`, `split_item=2`, `group_list` int64 as counts (`group_list_type=1`) or offsets
  (`0`) as hal gives it
- swiglu: `npu_swiglu`
- dequantize, quantize_weight: torch ops (the reference formulas; weights are quantized once,
  offline)

Quantized GEMMs with a bf16/fp16 output apply the per-token and per-channel scales inside the
op (`per_token_scale`, `scale`); an fp32 output, which the op does not produce for quantized
inputs, takes the op's raw int32 accumulator and applies the scales in fp32.
"""

from __future__ import annotations

import torch

from hal import (
    Codec,
    DispatchDtype,
    GemmKind,
    GroupListKind,
    Groups,
    PackedInt4Tensor,
    QuantizedTensor,
    QuantizedWeight,
    ReferenceOps,
    ScaleLayout,
    invalid,
)
from vendors.ascend.binding import NpuBinding
from vendors.ascend.fused import DeepEpFusedMoe, check_fused_operands
from vendors.ascend.mc2 import check_mc2, mc2_combine, mc2_dispatch

#: Activation dtypes npu_dynamic_quant accepts.
_NPU_QUANT_INPUTS = (torch.float16, torch.bfloat16)
_SCALED_OUTPUTS = (torch.bfloat16, torch.float16)


class AscendOps(ReferenceOps):
    """The Ascend vendor's op implementations, on the torch_npu ops of one binding."""

    notes = {
        "quantize": "npu_dynamic_quant (per token, fp16/bf16 input); a cast for bf16; the reference otherwise",
        "quantize_int4": "npu_dynamic_quant(dst_type=torch.quint4x2) for fp16/bf16 input",
        "grouped_matmul": "npu_grouped_matmul (group_type=0, split_item=2)",
        "swiglu": "npu_swiglu",
        "prepare_fused": "the port's weights (FRACTAL_NZ, w13 tile permutation, w2 [E, H, I]) made at load",
        "prepare_ep": "refuses the hidden sizes the MC2 ops reject on this SoC (their op page's limits)",
        "ep_dispatch": "npu_moe_distribute_dispatch (MC2; int8 with quant_mode=2)",
        "ep_combine": "npu_moe_distribute_combine (MC2, weighted by the routing weights)",
        "fused_deep_moe": "the Ascend DeepEP port (Buffer.fused_deep_moe / dispatch + torch_npu MoE ops + combine)",
    }

    def prepare_fused(
        self, w13: QuantizedWeight, w2: QuantizedWeight, *, scheme: str, process_group: object | None
    ) -> None:
        """The port's NZ, tile-permuted form of the weights, made at load (`vendors.ascend.fused`)."""
        if self._fused is None:
            self._fused = DeepEpFusedMoe(self)
        self._fused.prepare(w13, w2, process_group)

    def prepare_ep(
        self,
        name: str,
        *,
        process_group: object,
        num_experts: int,
        hidden_size: int,
        dtype: DispatchDtype,
        capacity: int | None,
        layout: ScaleLayout | None = None,
    ) -> None:
        """Refuse, when the layer is built, a hidden size the MC2 ops reject on this SoC."""
        check_mc2(self.binding, hidden=hidden_size)

    def ep_dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        name: str,
        dtype: DispatchDtype,
        num_experts: int,
        process_group: object,
        topk_weights: torch.Tensor | None,
        capacity: int | None,
        layout: ScaleLayout | None,
    ) -> tuple[QuantizedTensor, torch.Tensor, object]:
        """The MC2 dispatch (`vendors.ascend.mc2`; normal mode only, per-token int8 scales): the routing
        weights are applied by the combine, at home."""
        return mc2_dispatch(
            self.binding, x, topk_ids, dtype=dtype, num_experts=num_experts, process_group=process_group
        )

    def ep_combine(
        self, rows: torch.Tensor, topk_weights: torch.Tensor, handle: object, *, name: str, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """The MC2 combine (`vendors.ascend.mc2`)."""
        return mc2_combine(self.binding, rows, topk_weights, handle, out_dtype=out_dtype)  # type: ignore[arg-type]

    def __init__(self, binding: NpuBinding) -> None:
        self.binding = binding
        self.npu = binding.ops
        self._fused: DeepEpFusedMoe | None = None

    # -- quantization -----------------------------------------------------------------------------

    def quantize(
        self, x: torch.Tensor, *, dtype: DispatchDtype, layout: ScaleLayout, global_scale: torch.Tensor | None
    ) -> QuantizedTensor:
        """Symmetric per-token dtypes (int8, fp8 where declared) through `npu_dynamic_quant`; casts and
        fp32 input through the reference (the op takes fp16/bf16 only)."""
        spec = dtype.spec
        native = (
            spec.codec is Codec.SYMMETRIC
            and layout is ScaleLayout.PER_TOKEN
            and global_scale is None
            and x.dtype in _NPU_QUANT_INPUTS
        )
        if not native:
            return super().quantize(x, dtype=dtype, layout=layout, global_scale=global_scale)
        data, scale = self._dynamic_quant(x, spec.storage)
        return QuantizedTensor(data, dtype, ScaleLayout.PER_TOKEN, scale)

    def quantize_int4(self, x: torch.Tensor) -> PackedInt4Tensor:
        """Per-token int4 through `npu_dynamic_quant(dst_type=torch.quint4x2)`, eight per int32."""
        if x.dtype not in _NPU_QUANT_INPUTS:
            return super().quantize_int4(x)  # fp32 input
        data, scale = self._dynamic_quant(x, torch.quint4x2)
        return PackedInt4Tensor(data, scale)

    def _dynamic_quant(self, x: torch.Tensor, dst_type: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """npu_dynamic_quant on `[..., H]`; the op wants at least 2 dimensions."""
        rows = x.reshape(-1, x.shape[-1]) if x.dim() < 2 else x
        data, scale = self.npu.npu_dynamic_quant(rows, dst_type=dst_type)
        lead = tuple(x.shape[:-1])
        return data.reshape(*lead, data.shape[-1]), scale.reshape(lead)

    # -- grouped matmul ---------------------------------------------------------------------------

    def grouped_matmul(
        self,
        x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
        weight: QuantizedWeight,
        groups: Groups,
        *,
        kind: GemmKind,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """`y[rows of g] = x[rows of g] @ weight[g]` through `npu_grouped_matmul`, scales applied."""
        data = x if isinstance(x, torch.Tensor) else x.data
        m, n = data.shape[0], weight.out_features
        if m == 0:
            return torch.zeros((0, n), dtype=out_dtype, device=data.device)
        group_list, group_list_type = _group_list(groups, data.device)
        call = {"group_list": group_list, "group_list_type": group_list_type, "split_item": 2, "group_type": 0}
        npu = self.npu
        if kind.spec.is_float:  # the weight as stored; another output dtype: fp32, one expert at a time
            if out_dtype == data.dtype == weight.data.dtype:
                return npu.npu_grouped_matmul([data], [weight.data], **call)[0]
            return _per_expert_fp32(data, weight, groups, None, out_dtype)
        scale, token_scale = weight.scale, x.scale  # type: ignore[union-attr]
        if not kind.spec.exact_integer:  # fp8 row-wise: fp32 scale, bf16/fp16 output (A5)
            if out_dtype in _SCALED_OUTPUTS:
                return npu.npu_grouped_matmul(
                    [data], [weight.data], scale=[scale], per_token_scale=[token_scale], output_dtype=out_dtype, **call
                )[0]
            return _per_expert_fp32(data, weight, groups, token_scale, out_dtype)
        if out_dtype == torch.float16:
            # int8: the op pairs bf16 scale -> bf16 out and fp32 scale -> fp16 out. A bf16 scale costs 2^-9
            # relative per channel (outside hal's bound), so only an fp16 output takes the op's own dequant.
            return npu.npu_grouped_matmul(
                [data],
                [weight.data],
                scale=[scale.to(torch.float32)],
                per_token_scale=[token_scale],
                output_dtype=torch.float16,
                **call,
            )[0]
        # bf16 and fp32 outputs: the int32 accumulator scaled in fp32 and rounded once (through fp16 a bf16
        # output would round twice and overflow above 65504).
        acc = npu.npu_grouped_matmul([data], [weight.data], output_dtype=torch.int32, **call)[0]
        rows_scale = scale.index_select(0, _row_groups(groups, m).to(scale.device))
        return (acc.to(torch.float32) * token_scale.unsqueeze(1) * rows_scale).to(out_dtype)

    # -- activation and the fused op --------------------------------------------------------------

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(a) * b` through `npu_swiglu` (a, the gate, is the first half)."""
        if x.numel() == 0:
            return torch.empty_like(x[..., : x.shape[-1] // 2])
        return self.npu.npu_swiglu(x, dim=-1)

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
        """W8A8-INT8 through the Ascend DeepEP port (see `vendors.ascend.fused`)."""
        check_fused_operands(hidden_states, topk_ids, topk_weights, w13, w2)
        device = self.binding.device
        for name, tensor in (
            ("hidden_states", hidden_states),
            ("topk_ids", topk_ids),
            ("topk_weights", topk_weights),
            ("w13.data", w13.data),
            ("w2.data", w2.data),
        ):
            given = tensor.device
            if given.type != device.type or (device.index is not None and given.index != device.index):
                raise invalid(name, f"a tensor on device {device}", str(given))
        if self._fused is None:
            self._fused = DeepEpFusedMoe(self)
        return self._fused(
            hidden_states,
            topk_ids,
            topk_weights,
            w13,
            w2,
            process_group=process_group,
            dispatch_dtype=dispatch_dtype,
            max_tokens_per_rank=max_tokens_per_rank,
        )


def _group_list(groups: Groups, device: torch.device) -> tuple[torch.Tensor, int]:
    """hal's group list as npu_grouped_matmul takes it: int64 on the device, and its type.

    The op refuses a counts list of length 1, so one group is always passed as its offset.
    """
    values = groups.tensor.to(device=device, dtype=torch.int64)
    if groups.kind is GroupListKind.OFFSETS or groups.num_groups == 1:
        return (values if groups.kind is GroupListKind.OFFSETS else values.cumsum(0)), 0
    return values, 1


def _per_expert_fp32(
    data: torch.Tensor,
    weight: QuantizedWeight,
    groups: Groups,
    token_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`x @ w` in fp32 for an output wider than npu_grouped_matmul returns for these operands,
    casting one expert's `[K, N]` weight at a time (never the whole `[E, K, N]`); syncs for the counts."""
    a = data.to(torch.float32) if token_scale is None else data.to(torch.float32) * token_scale.unsqueeze(1)
    out = torch.zeros((a.shape[0], weight.out_features), dtype=torch.float32, device=a.device)
    start = 0
    for g, count in enumerate(groups.counts().tolist()):
        w = weight.data[g].to(torch.float32)
        if token_scale is not None:
            w = w * weight.scale[g].to(torch.float32)
        out[start : start + count] = a[start : start + count] @ w
        start += count
    return out.to(out_dtype)


def _row_groups(groups: Groups, rows: int) -> torch.Tensor:
    """The group of every row, `[M]` int64 (for scales applied outside the op), without a host sync.
    Rows past the counts' sum (a dispatcher's padding: the op leaves them unspecified, and nothing reads
    them back) take the last group."""
    counts = groups.counts()
    ends = torch.cumsum(counts, 0)
    row = torch.arange(rows, device=counts.device, dtype=ends.dtype)
    return torch.searchsorted(ends, row, right=True).clamp_(max=counts.numel() - 1)
