"""Expert parallelism through torch_npu's MC2 ops (`npu_moe_distribute_dispatch` / `_combine`).

The dispatch quantizes (int8: `quant_mode=2`, dynamic per token) and sends every (token,
slot) pair's row to the rank of its expert in one op; the received rows come grouped by
local expert with per-expert counts (`expert_token_nums_type=1`), in a buffer of fixed
capacity whose rows past the counts' sum are padding. The combine brings the expert outputs
home and sums each token's rows weighted by the routing weights (`expert_scales`). The
handle carries what the combine needs back: the ids, `expand_idx` and the receive counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hal import DispatchDtype, InvalidInput, QuantizedTensor, ScaleLayout, UnsupportedCapability
from vendors.ascend.binding import NpuBinding
from vendors.ascend.capabilities import generation_of

#: dispatch dtype -> the op's quant_mode (0: rows as they are, 2: dynamic per-token int8)
_QUANT_MODES = {DispatchDtype.BF16: 0, DispatchDtype.FP16: 0, DispatchDtype.INT8: 2}


@dataclass(frozen=True)
class Mc2Handle:
    """What `combine` hands back to `npu_moe_distribute_combine`."""

    expert_ids: torch.Tensor
    expand_idx: torch.Tensor
    recv_counts: torch.Tensor
    group_name: str
    world: int
    rank: int
    num_experts: int


def mc2_problems(
    generation: str | None, *, hidden: int, tokens: int | None = None, top_k: int | None = None
) -> list[str]:
    """Why the MC2 ops refuse a layer of hidden size `hidden` (and, when given, a batch of `tokens`
    with `top_k` experts each); empty when they take it.

    Limits of Ascend's op page for `npu_moe_distribute_dispatch`: 0 < K <= 8; on Atlas A3 H is
    exactly 7168 and BS at most 512; elsewhere H is a multiple of 32 up to 7168 and BS at most 256.
    """
    found = []
    if generation == "A3":
        if hidden != 7168:
            found.append(f"hidden size {hidden}: the MC2 dispatch takes exactly 7168 on Atlas A3")
        most = 512
    else:
        if not 0 < hidden <= 7168 or hidden % 32:
            found.append(
                f"hidden size {hidden}: the MC2 dispatch takes a multiple of 32 up to 7168 on Atlas {generation}"
            )
        most = 256
    if tokens is not None and not 0 < tokens <= most:
        found.append(f"{tokens} tokens per rank: the MC2 dispatch takes 1..{most} on Atlas {generation}")
    if top_k is not None and not 0 < top_k <= 8:
        found.append(f"top-k {top_k}: the MC2 dispatch takes 1..8")
    return found


def check_mc2(binding: NpuBinding, *, hidden: int, tokens: int | None = None, top_k: int | None = None) -> None:
    """Refuse (`InvalidInput`, every reason) what the MC2 ops would reject on this binding's SoC."""
    found = mc2_problems(generation_of(binding.soc_name), hidden=hidden, tokens=tokens, top_k=top_k)
    if found:
        raise InvalidInput("the MC2 expert-parallel dispatcher cannot take this: " + "; ".join(found))


def mc2_dispatch(
    binding: NpuBinding,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    dtype: DispatchDtype,
    num_experts: int,
    process_group: Any,
) -> tuple[QuantizedTensor, torch.Tensor, Mc2Handle]:
    """The rows for this rank's experts in `dtype` (bf16, fp16 or int8), their counts, and the handle."""
    import torch.distributed as dist

    if dtype not in _QUANT_MODES:
        raise UnsupportedCapability(f"the MC2 dispatcher carries bf16, fp16 and int8, not {dtype}")
    if binding.comm_name is None:
        raise UnsupportedCapability("the MC2 dispatcher needs the runtime's HCCL communicator names")
    check_mc2(binding, hidden=x.shape[-1], tokens=x.shape[0], top_k=topk_ids.shape[-1])
    name, world, rank = (
        binding.comm_name(process_group),
        dist.get_world_size(process_group),
        dist.get_rank(process_group),
    )
    rows = x.to(torch.float16 if dtype is DispatchDtype.FP16 else torch.bfloat16)
    ids = topk_ids.to(torch.int32)
    expand_x, scales, expand_idx, counts, recv_counts, *_ = binding.ops.npu_moe_distribute_dispatch(
        rows, ids, name, world, rank, num_experts, quant_mode=_QUANT_MODES[dtype], global_bs=0, expert_token_nums_type=1
    )
    if dtype is DispatchDtype.INT8:
        payload = QuantizedTensor(expand_x, dtype, ScaleLayout.PER_TOKEN, scales.to(torch.float32))
    else:
        payload = QuantizedTensor(expand_x, dtype, ScaleLayout.NONE)
    handle = Mc2Handle(ids, expand_idx, recv_counts, name, world, rank, num_experts)
    return payload, counts.to(torch.int64), handle


def mc2_combine(
    binding: NpuBinding, rows: torch.Tensor, topk_weights: torch.Tensor, handle: Mc2Handle, *, out_dtype: torch.dtype
) -> torch.Tensor:
    """Each token's routing-weighted sum of its expert output rows, `[T, H]` in `out_dtype`."""
    expert_rows = rows if rows.dtype in (torch.bfloat16, torch.float16) else rows.to(torch.bfloat16)
    out = binding.ops.npu_moe_distribute_combine(
        expert_rows,
        handle.expert_ids,
        handle.expand_idx,
        handle.recv_counts,
        topk_weights.to(torch.float32),
        handle.group_name,
        handle.world,
        handle.rank,
        handle.num_experts,
        global_bs=0,
    )
    return out.to(out_dtype)
