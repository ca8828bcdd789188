"""W8A8-INT8 `fused_deep_moe` through the Ascend DeepEP port's `Buffer`.

Two modes, as the port has them:

- **low latency** (the layer sets a capacity per rank, and dispatches int8): the port's one
  fused op, `Buffer.fused_deep_moe` (dispatch, both grouped GEMMs with swiglu, combine);
- **normal**: `Buffer.dispatch` carries the tokens (int8 or bf16, as the layer's plan says),
  this rank's experts run on torch_npu's MoE ops (`npu_moe_init_routing_v2` sorts the
  received (token, expert) pairs and quantizes bf16 rows to int8, two `npu_grouped_matmul`
  with `npu_swiglu` and `npu_dynamic_quant` between, `npu_moe_finalize_routing` sums each
  token's experts with their weights), and `Buffer.combine` returns the rows.

The port's normal-mode dispatch reads whether to quantize to int8 from the environment
variable `DEEP_NORMAL_MODE_USE_INT8_QUANT`. It is set from the calling layer's own plan for
the duration of that one call only (see `vendors.ascend.environment`), so two layers with
different settings in one process each get what they asked for.

Weights are passed in hal's layout (w13 `[E, H, 2I]` gate first, per-channel fp32 scales).
The port documents a "permuted" first weight for its fused kernel; that layout is not
reproduced here and needs checking on Ascend hardware.
"""

from __future__ import annotations

from typing import Any

import torch

from hal import DispatchDtype, HalError, InvalidInput, QuantizedWeight, invalid
from vendors.ascend.binding import NpuOps
from vendors.ascend.environment import scoped_environment

#: The environment variable the Ascend DeepEP port reads in its normal-mode dispatch.
INT8_DISPATCH_VARIABLE = "DEEP_NORMAL_MODE_USE_INT8_QUANT"


class FusedMoeError(HalError):
    """The DeepEP library returned something other than what the call asked for."""


def check_fused_operands(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         w13: QuantizedWeight, w2: QuantizedWeight) -> None:
    """Validate the fused op's operands (types, shapes, dtypes) with the house messages."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16,
                                                                           torch.float32):
        raise invalid("hidden_states", "a bf16, fp16 or fp32 tensor [T, H]",
                      tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__)
    t, h = x.shape
    for name, value in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[0] != t:
            raise invalid(name, f"a tensor [{t}, top_k]",
                          tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__)
    if topk_ids.shape != topk_weights.shape:
        raise invalid("topk_weights", f"the shape of topk_ids {tuple(topk_ids.shape)}", tuple(topk_weights.shape))
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise invalid("topk_ids", "int32 or int64 expert ids", topk_ids.dtype)
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, QuantizedWeight) or w.data.dtype != torch.int8:
            raise invalid(name, "int8 per-channel QuantizedWeight (scheme w8a8-int8)",
                          getattr(getattr(w, "data", None), "dtype", type(w).__name__))
    e, wh, two_i = w13.data.shape
    if wh != h or two_i % 2 or tuple(w2.data.shape) != (e, two_i // 2, h):
        raise invalid("w13, w2", f"w13 [E, {h}, 2I] and w2 [E, I, {h}]",
                      f"{tuple(w13.data.shape)} and {tuple(w2.data.shape)}")


class DeepEpFusedMoe:
    """The fused W8A8-INT8 MoE of one vendor instance: a DeepEP buffer per process group."""

    def __init__(self, npu: NpuOps, deep_ep: Any) -> None:
        self._npu = npu
        self._deep_ep = deep_ep
        self._buffers: dict[int, tuple[object, Any]] = {}

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w13: QuantizedWeight, w2: QuantizedWeight, *, process_group: object | None,
                 dispatch_dtype: DispatchDtype, max_tokens_per_rank: int | None) -> torch.Tensor:
        """The layer's output `[T, H]` in bf16."""
        world = _world_size(process_group)
        num_experts = w13.num_experts * world
        ids = topk_ids.to(torch.int64)
        weights = topk_weights.to(torch.float32)
        xb = x.to(torch.bfloat16)
        buffer = self._buffer(process_group)
        int8 = dispatch_dtype is DispatchDtype.INT8
        if max_tokens_per_rank is not None and int8:
            if x.shape[0] > max_tokens_per_rank:
                raise InvalidInput(
                    f"hidden_states: expected at most max_dispatch_tokens_per_rank={max_tokens_per_rank} "
                    f"tokens for the low-latency fused op, got {x.shape[0]}")
            out, _ = buffer.fused_deep_moe(xb, ids, weights, w13.data, w13.scale, w2.data, w2.scale,
                                           max_tokens_per_rank, num_experts, quant_mode=1)
            return out
        return self._normal(buffer, xb, ids, weights, w13, w2, num_experts, int8)

    def _normal(self, buffer: Any, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                w13: QuantizedWeight, w2: QuantizedWeight, num_experts: int, int8: bool) -> torch.Tensor:
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, num_experts)
        with scoped_environment(INT8_DISPATCH_VARIABLE, "1" if int8 else "0"):
            recv_x, recv_ids, recv_weights, recv_counts, handle, _ = buffer.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=ids, topk_weights=weights)
        if isinstance(recv_x, tuple) != int8:
            raise FusedMoeError(
                f"deep_ep Buffer.dispatch returned {'int8' if isinstance(recv_x, tuple) else 'unquantized'} rows "
                f"although {INT8_DISPATCH_VARIABLE}={'1' if int8 else '0'} was set for the call")
        y = self._local_experts(recv_x, recv_ids, recv_weights, sum(recv_counts), w13, w2)
        combined, _, _ = buffer.combine(y, handle)
        return combined

    def _local_experts(self, recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], recv_ids: torch.Tensor,
                       recv_weights: torch.Tensor, valid: int, w13: QuantizedWeight,
                       w2: QuantizedWeight) -> torch.Tensor:
        """Each received token's weighted sum over this rank's experts: `[R, H]` bf16."""
        npu = self._npu
        rows, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        r, k = recv_ids.shape
        local = w13.num_experts
        if r == 0:
            return torch.zeros((0, w2.data.shape[-1]), dtype=torch.bfloat16, device=rows.device)
        # Ids of other ranks' experts (-1) go to a bucket just past the active range.
        ids = torch.where(recv_ids < 0, torch.full_like(recv_ids, local), recv_ids).to(torch.int32)
        expanded, row_idx, counts, expanded_scale = npu.npu_moe_init_routing_v2(
            rows, ids, scale=scale, expert_num=local + 1, active_expert_range=[0, local],
            expert_tokens_num_type=1, expert_tokens_num_flag=True,
            quant_mode=-1 if scale is not None else 1, row_idx_type=0)
        gemm = {"group_list": counts if local > 1 else counts.cumsum(0), "group_list_type": 1 if local > 1 else 0,
                "split_item": 2, "group_type": 0, "output_dtype": torch.bfloat16}
        h = npu.npu_grouped_matmul([expanded[:valid]], [w13.data], scale=[w13.scale],
                                   per_token_scale=[expanded_scale[:valid]], **gemm)[0]
        hq, hs = npu.npu_dynamic_quant(npu.npu_swiglu(h, dim=-1))
        y = npu.npu_grouped_matmul([hq], [w2.data], scale=[w2.scale], per_token_scale=[hs], **gemm)[0]
        padded = torch.zeros((r * k, y.shape[-1]), dtype=y.dtype, device=y.device)
        padded[:valid] = y
        # finalize_routing reads pair (i, k) at i + k*R (k-major); init_routing numbered it i*K + k.
        to_dst = row_idx.view(r, k).t().reshape(-1)
        active = to_dst >= 0
        pair_weights = torch.where(active.view(k, r).t(), recv_weights, torch.zeros_like(recv_weights))
        return npu.npu_moe_finalize_routing(padded, None, None, None, pair_weights.to(y.dtype),
                                            torch.where(active, to_dst, torch.zeros_like(to_dst)), None,
                                            drop_pad_mode=0, k=k)

    def _buffer(self, group: object | None) -> Any:
        """The DeepEP buffer of `group`, created on first use (None: this process alone)."""
        key = id(group)
        found = self._buffers.get(key)
        if found is None or found[0] is not group:
            found = (group, self._deep_ep.Buffer(group))
            self._buffers[key] = found
        return found[1]


def _world_size(group: object | None) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)
