"""EMULATED MC2 expert-parallel ops of torch_npu: `npu_moe_distribute_dispatch` / `_combine` on gloo.

Sources: the op schemas of the torch-npu 2.13.0 wheel (`npu_native_functions_by_codegen.yaml`:
argument names, keyword-only parameters and defaults), its meta functions
(`_meta_registrations.py`: output shapes: `expand_x [A, H]` with `A = BS * ep_world_size *
min(local experts, K)`, `dynamic_scales [A]`, `expand_idx [BS * K]` int32, `expert_token_nums
[local experts]` int64, `ep_recv_counts [ep_world_size * local experts]` int32, int8 output when
`quant_mode != 0`), and Ascend's op page (limits: 0 < K <= 8; BS <= 256 on A2, <= 512 on A3; H
a multiple of 32 up to 7168 on A2, exactly 7168 on A3; dynamic per-token int8 with
`quant_mode=2`; combine weights each token's rows by `expert_scales`).

How the rows are laid out inside `expand_x` and what `expand_idx` / `ep_recv_counts` hold
exactly is not documented in those files: the emulation groups the received rows by local
expert, then by source rank and (token, slot) order, gives each (token, slot) pair's row
position on its expert's rank in `expand_idx`, and cumulative receive counts per (local
expert, source rank). The vendor only hands these back to combine, so it depends on none of
it; docs/ascend.md lists the layout as unverified. Rows of `expand_x` past the received
total are padding (NaN for float rows, 0 with a NaN scale for int8). The communication is
emulated with torch.distributed collectives over the group registered under `group_ep`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from vendors.ascend.emulation.common import err

_INT8_MAX = 127.0


class Mc2Ops:
    """The MC2 dispatch / combine pair; groups are registered by name (`register_group`), as HCCL
    communicators have names on hardware."""

    generation: str

    def register_group(self, group: Any) -> str:
        """A name for a torch.distributed group, as `group_ep` (HCCL's communicator name on hardware)."""
        groups = self.__dict__.setdefault("_mc2_groups", {})
        for name, known in groups.items():
            if known is group:
                return name
        name = f"emulated-hccl-{len(groups)}"
        groups[name] = group
        return name

    def _group(self, op: str, name: str, world: int, rank: int) -> Any:
        group = self.__dict__.get("_mc2_groups", {}).get(name)
        if group is None:
            raise err(op, f"group_ep {name!r} is not a communicator of this process")
        if dist.get_world_size(group) != world or dist.get_rank(group) != rank:
            raise err(
                op,
                f"ep_world_size/ep_rank_id {world}/{rank} do not match the communicator "
                f"({dist.get_world_size(group)}/{dist.get_rank(group)})",
            )
        return group

    def _check_shapes(self, op: str, h: int, bs: int, k: int) -> None:
        if not 0 < k <= 8:
            raise err(op, f"K (expert_ids.size(1)) must be in (0, 8], got {k}")
        if self.generation == "A3":
            if h != 7168:
                raise err(op, f"H must be 7168 on Atlas A3, got {h}")
            if not 0 < bs <= 512:
                raise err(op, f"BS must be in (0, 512] on Atlas A3, got {bs}")
        else:
            if not 0 < h <= 7168 or h % 32:
                raise err(op, f"H must be a multiple of 32 in (0, 7168] on Atlas {self.generation}, got {h}")
            if not 0 < bs <= 256:
                raise err(op, f"BS must be in (0, 256] on Atlas {self.generation}, got {bs}")

    def npu_moe_distribute_dispatch(
        self,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        group_ep: str,
        ep_world_size: int,
        ep_rank_id: int,
        moe_expert_num: int,
        *,
        scales: torch.Tensor | None = None,
        x_active_mask: torch.Tensor | None = None,
        expert_scales: torch.Tensor | None = None,
        group_tp: str = "",
        tp_world_size: int = 0,
        tp_rank_id: int = 0,
        expert_shard_type: int = 0,
        shared_expert_num: int = 1,
        shared_expert_rank_num: int = 0,
        quant_mode: int = 0,
        global_bs: int = 0,
        expert_token_nums_type: int = 1,
    ) -> tuple[torch.Tensor, ...]:
        """Send each (token, slot) pair's row to the rank of its expert; rows grouped by local expert."""
        op = "npu_moe_distribute_dispatch"
        if x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2:
            raise err(op, f"x must be a 2-D bf16/fp16 tensor, got {x.dtype} of shape {tuple(x.shape)}")
        if expert_ids.dtype != torch.int32 or tuple(expert_ids.shape[:1]) != (x.shape[0],) or expert_ids.dim() != 2:
            raise err(op, f"expert_ids must be int32 [BS, K], got {expert_ids.dtype} {tuple(expert_ids.shape)}")
        unsupported = {"scales": scales, "x_active_mask": x_active_mask, "expert_scales": expert_scales}
        if (
            any(v is not None for v in unsupported.values())
            or group_tp
            or tp_world_size
            or shared_expert_rank_num
            or expert_shard_type
            or global_bs
        ):
            raise err(
                op,
                "the emulation computes the plain EP form only (no smooth scales, active mask, TP "
                "domain, shared-expert ranks or global_bs)",
            )
        if quant_mode not in (0, 2):
            raise err(op, f"quant_mode must be 0 (none) or 2 (dynamic per token) here, got {quant_mode}")
        if expert_token_nums_type not in (0, 1):
            raise err(op, f"expert_token_nums_type must be 0 (cumsum) or 1 (counts), got {expert_token_nums_type}")
        bs, k, h = x.shape[0], expert_ids.shape[1], x.shape[1]
        self._check_shapes(op, h, bs, k)
        if moe_expert_num % ep_world_size:
            raise err(op, f"moe_expert_num ({moe_expert_num}) must be a multiple of ep_world_size ({ep_world_size})")
        if bs and (int(expert_ids.min()) < 0 or int(expert_ids.max()) >= moe_expert_num):
            raise err(op, f"expert_ids must be in [0, {moe_expert_num})")
        group = self._group(op, group_ep, ep_world_size, ep_rank_id)
        local = moe_expert_num // ep_world_size
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(ep_world_size)]
        dist.all_gather(sizes, torch.tensor([bs]), group=group)
        if any(int(s) != bs for s in sizes):
            raise err(op, "global_bs=0 needs the same BS on every rank, got " + str([int(s) for s in sizes]))
        rows = x.to(torch.float32)
        row_scale = torch.ones(bs)
        if quant_mode == 2:
            row_scale = rows.abs().amax(dim=-1) / _INT8_MAX
            rows = torch.where(row_scale[:, None] > 0, torch.round(rows / row_scale.clamp_min(1e-30)[:, None]), 0.0)
        all_rows = [torch.empty_like(rows) for _ in range(ep_world_size)]
        all_scales = [torch.empty_like(row_scale) for _ in range(ep_world_size)]
        all_ids = [torch.empty_like(expert_ids) for _ in range(ep_world_size)]
        dist.all_gather(all_rows, rows, group=group)
        dist.all_gather(all_scales, row_scale, group=group)
        dist.all_gather(all_ids, expert_ids, group=group)
        capacity = bs * ep_world_size * min(local, k)
        out_dtype = torch.int8 if quant_mode else x.dtype
        expand_x = torch.full((capacity, h), float("nan")) if not quant_mode else torch.zeros(capacity, h)
        dyn = torch.full((capacity,), float("nan"))
        first = ep_rank_id * local
        counts = torch.zeros(local, dtype=torch.int64)
        recv = torch.zeros(local, ep_world_size, dtype=torch.int64)
        positions = [torch.full((bs * k,), -1, dtype=torch.int32) for _ in range(ep_world_size)]
        row = 0
        for e in range(first, first + local):
            for src in range(ep_world_size):
                pairs = (all_ids[src].reshape(-1) == e).nonzero().flatten()
                for pair in pairs.tolist():
                    expand_x[row] = all_rows[src][pair // k]
                    dyn[row] = all_scales[src][pair // k]
                    positions[src][pair] = row
                    row += 1
                recv[e - first, src] = pairs.numel()
            counts[e - first] = recv[e - first].sum()
        # every rank learns where its own pairs landed: each source's positions, from each rank
        sent = torch.stack(positions)
        mine = torch.empty_like(sent)
        dist.all_to_all_single(mine, sent, group=group)
        owner = (expert_ids.reshape(-1).cpu() // local).to(torch.int64)
        expand_idx = mine.gather(0, owner[None]).reshape(-1).to(torch.int32)
        token_nums = counts if expert_token_nums_type == 1 else counts.cumsum(0)
        ep_recv_counts = recv.reshape(-1).cumsum(0).to(torch.int32)
        return (
            expand_x.to(out_dtype).to(x.device),
            dyn.to(x.device),
            expand_idx.to(x.device),
            token_nums.to(x.device),
            ep_recv_counts.to(x.device),
            torch.zeros(0, dtype=torch.int32),
            torch.zeros(0, dtype=torch.float32),
        )

    def npu_moe_distribute_combine(
        self,
        expand_x: torch.Tensor,
        expert_ids: torch.Tensor,
        expand_idx: torch.Tensor,
        ep_send_counts: torch.Tensor,
        expert_scales: torch.Tensor,
        group_ep: str,
        ep_world_size: int,
        ep_rank_id: int,
        moe_expert_num: int,
        *,
        tp_send_counts: torch.Tensor | None = None,
        x_active_mask: torch.Tensor | None = None,
        activation_scale: torch.Tensor | None = None,
        weight_scale: torch.Tensor | None = None,
        group_list: torch.Tensor | None = None,
        expand_scales: torch.Tensor | None = None,
        shared_expert_x: torch.Tensor | None = None,
        group_tp: str = "",
        tp_world_size: int = 0,
        tp_rank_id: int = 0,
        expert_shard_type: int = 0,
        shared_expert_num: int = 1,
        shared_expert_rank_num: int = 0,
        global_bs: int = 0,
        out_dtype: int = 0,
        comm_quant_mode: int = 0,
        group_list_type: int = 0,
    ) -> torch.Tensor:
        """Bring each pair's expert output row home and sum a token's rows weighted by `expert_scales`."""
        op = "npu_moe_distribute_combine"
        if expand_x.dtype not in (torch.bfloat16, torch.float16) or expand_x.dim() != 2:
            raise err(op, f"expand_x must be a 2-D bf16/fp16 tensor, got {expand_x.dtype} {tuple(expand_x.shape)}")
        bs, k = expert_ids.shape
        if expert_scales.dtype != torch.float32 or tuple(expert_scales.shape) != (bs, k):
            raise err(
                op,
                f"expert_scales must be float32 [BS, K] = {[bs, k]}, got {expert_scales.dtype} "
                f"{tuple(expert_scales.shape)}",
            )
        if expand_idx.dtype != torch.int32 or tuple(expand_idx.shape) != (bs * k,):
            raise err(
                op, f"expand_idx must be int32 [BS * K] = [{bs * k}], got {expand_idx.dtype} {tuple(expand_idx.shape)}"
            )
        if (
            any(
                v is not None
                for v in (
                    tp_send_counts,
                    x_active_mask,
                    activation_scale,
                    weight_scale,
                    group_list,
                    expand_scales,
                    shared_expert_x,
                )
            )
            or group_tp
            or comm_quant_mode
        ):
            raise err(op, "the emulation computes the plain EP form only")
        group = self._group(op, group_ep, ep_world_size, ep_rank_id)
        self._check_shapes(op, expand_x.shape[1], bs, k)
        gathered = [torch.empty_like(expand_x, device="cpu") for _ in range(ep_world_size)]
        dist.all_gather(gathered, expand_x.cpu(), group=group)
        local = moe_expert_num // ep_world_size
        owner = (expert_ids.reshape(-1) // local).to(torch.int64).cpu()
        rows = torch.stack(gathered)[owner, expand_idx.to(torch.int64).cpu()].to(torch.float32)
        out = (rows.reshape(bs, k, -1) * expert_scales.cpu()[..., None]).sum(dim=1)
        return out.to(expand_x.dtype).to(expand_x.device)
