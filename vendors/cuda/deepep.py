"""The CUDA vendor's expert-parallel dispatcher "deepep": DeepEP v1.2.1 (github deepseek-ai/DeepEP, the
NVSHMEM-based V1 `deep_ep.Buffer`), in its normal and low-latency modes.

- Normal mode (no capacity): `get_dispatch_layout` + `dispatch` send each token once to every rank holding
  one of its experts, with its top-k ids (local ids there, -1 for other ranks' experts) and weights: bf16
  rows, or fp8 rows quantized here by the vendor's own kernel (e4m3, fp32 scale per 128 channels) with
  their scales beside, which the experts consume as they are. The receiving rank sorts the (token, slot)
  pairs by local expert (`hal.reference.sort_received` through the vendor's sort) and, after the
  experts, reduces each received token's rows with its weights (`hal.reference.reduce_received` through
  the vendor's combine); DeepEP's `combine` then sums each token's partials from the ranks it went to.
  DeepEP reads the received counts on the host: one synchronisation per call.
- Low-latency mode (a per-rank capacity): `low_latency_dispatch` / `low_latency_combine` over NVSHMEM,
  without a host synchronisation: the masked `[local experts, capacity * ranks, H]` layout and its
  counts. For fp8 DeepEP's kernel casts the bf16 rows (e4m3, fp32 scale amax / 448 per 128 channels);
  its column-major scales are made row-major here. Rows past an expert's count are left unwritten
  (undefined); the combine reads only the valid ones and applies the routing weights.

Buffers: one `deep_ep.Buffer` per (process group, mode), held by the ops object, sized from the layers'
plans at `prepare_ep` (the largest any prepared layer needs; a larger need replaces the buffer), refused
when it exceeds the device's free memory (the least over the group's ranks). Making, replacing and
releasing a buffer are collective: every rank of the group does it at the same point. `deep_ep` is
imported only by the probe and when a buffer is made.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch

from hal import (
    DispatchDtype,
    InvalidInput,
    QuantizedTensor,
    ScaleLayout,
    UnsupportedCapability,
    UnsupportedDispatchDtype,
)
from hal.reference import ReceivedTokens, reduce_received, sort_received
from vendors.cuda.deepep_limits import (
    FP8_GROUP,
    LOW_LATENCY,
    LOW_LATENCY_MAX_TOP_K,
    NORMAL,
    NORMAL_MAX_TOP_K,
    BufferSize,
    check_request,
    low_latency_size,
    memory_refusal,
    normal_size,
)

from vendors.cuda.deepep_probe import DEEPEP, DeepEpProbe, probe_deep_ep


@dataclass(frozen=True)
class NormalHandle:
    """What the normal-mode combine needs: the buffer, DeepEP's handle and where the received tokens went."""

    buffer: Any
    deep: Any
    received: ReceivedTokens


@dataclass(frozen=True)
class LowLatencyHandle:
    """What the low-latency combine needs: the buffer, DeepEP's handle and the dispatched ids."""

    buffer: Any
    deep: Any
    topk_ids: torch.Tensor


@dataclass
class _Held:
    """One made buffer and what it was made for."""

    group: Any
    buffer: Any
    size: BufferSize
    specs: set[tuple[Any, ...]] = field(default_factory=set)  #: the (experts, hidden, capacity, dtype) prepared
    shape: tuple[int, int, int] | None = None  #: low-latency: (capacity, hidden, experts) of the last call


class DeepEp:
    """The DeepEP buffers of one ops object and the dispatch / combine on them. `ops` gives the vendor's
    `quantize`, `sort_by_expert` and `weighted_combine`."""

    def __init__(self, ops: Any) -> None:
        self._ops = ops
        self._buffers: dict[tuple[int, str], _Held] = {}
        self._probe: DeepEpProbe | None = None

    # -- buffers ---------------------------------------------------------------------------------------

    def prepare(
        self,
        process_group: Any,
        *,
        num_experts: int,
        hidden_size: int,
        dtype: DispatchDtype,
        capacity: int | None,
        normal_too: bool = True,
        layout: ScaleLayout | None = None,
    ) -> None:
        """Check the request against what DeepEP takes and make (or grow) the group's buffer for it. With a
        `capacity` the normal-mode buffer is made as well where that mode can serve the layer (a layer in
        "auto" mode switches per call) and `normal_too`; otherwise it is made at a first normal call."""
        _check_low_latency_layout(dtype, capacity, layout)
        world = _world(process_group)
        probe = self._deep_ep_probe()
        request = {
            "dtype": dtype,
            "hidden_size": hidden_size,
            "num_experts": num_experts,
            "world": world,
            "fp8_built": probe.fp8,
            "nvshmem_built": probe.low_latency,
        }
        check_request(**request, capacity=capacity)
        module = importlib.import_module("deep_ep")
        if capacity is None:
            held = self._ensure(module, process_group, world, NORMAL, normal_size(module, hidden_size, world))
        else:
            size = low_latency_size(module, capacity, hidden_size, world, num_experts)
            held = self._ensure(module, process_group, world, LOW_LATENCY, size)
        held.specs.add((num_experts, hidden_size, capacity, dtype))
        if capacity is not None and normal_too:
            try:
                check_request(**request, capacity=None)
            except (InvalidInput, UnsupportedCapability, UnsupportedDispatchDtype):
                return  # low-latency only: a normal call refuses then, with the reason
            self.prepare(process_group, num_experts=num_experts, hidden_size=hidden_size, dtype=dtype, capacity=None)

    def release(self) -> None:
        """Destroy every buffer (collective: every rank of each group calls it), e.g. before
        `torch.distributed.destroy_process_group()`."""
        held, self._buffers = list(self._buffers.values()), {}
        for entry in held:
            entry.buffer.destroy()

    def _deep_ep_probe(self) -> DeepEpProbe:
        if self._probe is None:
            self._probe = probe_deep_ep()
        if self._probe.reason is not None:
            raise UnsupportedCapability(f"deepep: {self._probe.reason}")
        return self._probe

    def _ensure(self, module: Any, group: Any, world: int, mode: str, size: BufferSize) -> _Held:
        key = (id(group), mode)
        held = self._buffers.get(key)
        if held is not None and held.group is not group:  # a new group object reusing a freed one's id
            held = None
        if held is not None and held.size.covers(size):
            return held
        wanted = size if held is None else held.size.union(size)
        freed = 0 if held is None else held.size.total_bytes
        device = torch.device("cuda", torch.cuda.current_device())
        problem = memory_refusal(mode, wanted, _least_free_bytes(group, device), freed, world)
        if problem is not None:
            raise InvalidInput(problem)
        if held is not None:
            del self._buffers[key]
            held.buffer.destroy()
        buffer = module.Buffer(
            group,
            wanted.nvl_bytes,
            wanted.rdma_bytes,
            low_latency_mode=mode == LOW_LATENCY,
            num_qps_per_rank=wanted.qps,
            explicitly_destroy=True,
        )
        made = _Held(group, buffer, wanted, set() if held is None else set(held.specs))
        self._buffers[key] = made
        return made

    def _held(self, group: Any, mode: str, spec: tuple[Any, ...], prepare: dict[str, Any]) -> _Held:
        """The buffer a call runs on, prepared now if its layer was not (collective, like `prepare_ep`)."""
        held = self._buffers.get((id(group), mode))
        if held is None or held.group is not group or spec not in held.specs:
            self.prepare(group, **prepare, normal_too=False)
            held = self._buffers[(id(group), mode)]
        return held

    # -- dispatch / combine ----------------------------------------------------------------------------

    def dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        dtype: DispatchDtype,
        num_experts: int,
        process_group: Any,
        topk_weights: torch.Tensor | None,
        capacity: int | None,
        layout: ScaleLayout | None = None,
    ) -> tuple[Any, ...]:
        """`(rows, int64 counts per local expert, handle)`: normal mode without `capacity`, else low-latency."""
        mode = NORMAL if capacity is None else LOW_LATENCY
        top_k = topk_ids.shape[1]
        limit = NORMAL_MAX_TOP_K if capacity is None else LOW_LATENCY_MAX_TOP_K
        if top_k > limit:
            raise UnsupportedCapability(
                f"deepep {mode} mode: top-k up to {limit} (DeepEP v1.2.1's kernels), got {top_k}"
            )
        spec = (num_experts, x.shape[1], capacity, dtype)
        prepare = {"num_experts": num_experts, "hidden_size": x.shape[1], "dtype": dtype, "capacity": capacity}
        _check_low_latency_layout(dtype, capacity, layout)
        held = self._held(process_group, mode, spec, prepare)
        ids = topk_ids.to(torch.int64).contiguous()
        if capacity is None:
            if topk_weights is None:
                raise InvalidInput(
                    "topk_weights: expected the routing weights [T, k] for deepep's normal mode "
                    "(they travel with the tokens; the experts' side applies them), got None"
                )
            return self._dispatch_normal(
                held.buffer, x, ids, topk_weights, dtype, num_experts, layout or ScaleLayout.GROUP_128
            )
        return self._dispatch_low_latency(held, x, ids, dtype, num_experts, capacity)

    def _dispatch_normal(
        self,
        buffer: Any,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        dtype: DispatchDtype,
        num_experts: int,
        layout: ScaleLayout,
    ) -> tuple[Any, ...]:
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, num_experts)
        if dtype is DispatchDtype.FP8:  # the plan's scale layout; DeepEP carries any number of scales per token
            sent = self._ops.quantize(x, dtype=DispatchDtype.FP8, layout=layout, global_scale=None)
            # [T, scales per token] also for T = 0 (a rank that routes nothing this call)
            scale = (sent.scale.flatten(1) if sent.scale.dim() > 1 else sent.scale.unsqueeze(1)).contiguous()
            rows: Any = (sent.data.contiguous(), scale)
        else:
            rows = x.to(torch.bfloat16).contiguous()
        recv, recv_ids, recv_weights, counts, handle, _ = buffer.dispatch(
            rows,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=ids,
            topk_weights=weights.to(torch.float32).contiguous(),
        )
        if isinstance(recv, tuple):
            scale = recv[1] if layout is ScaleLayout.GROUP_128 else recv[1].reshape(-1)
            tokens = QuantizedTensor(recv[0], DispatchDtype.FP8, layout, scale)
        else:
            tokens = QuantizedTensor(recv, DispatchDtype.BF16, ScaleLayout.NONE)
        received = sort_received(
            recv_ids, recv_weights, len(counts), rows=int(sum(counts)), sort=self._sort if recv_ids.shape[0] else None
        )
        # the received tokens and the row of each pair: the first GEMM reads them through the index (no gather)
        return (
            tokens,
            received.expert_counts.to(torch.int64),
            NormalHandle(buffer, handle, received),
            received.row_index,
        )

    def _dispatch_low_latency(
        self, held: _Held, x: torch.Tensor, ids: torch.Tensor, dtype: DispatchDtype, num_experts: int, capacity: int
    ) -> tuple[QuantizedTensor, torch.Tensor, LowLatencyHandle]:
        buffer, shape = held.buffer, (capacity, x.shape[1], num_experts)
        if held.shape is not None and held.shape != shape:  # DeepEP's signal area is laid out per shape
            buffer.clean_low_latency_buffer(*shape)
        held.shape = shape
        fp8 = dtype is DispatchDtype.FP8
        recv, counts, handle, _, _ = buffer.low_latency_dispatch(
            x.to(torch.bfloat16).contiguous(),
            ids,
            capacity,
            num_experts,
            use_fp8=fp8,
            round_scale=False,
            use_ue8m0=False,
            async_finish=False,
            return_recv_hook=False,
        )
        if fp8:  # DeepEP's scales are [L, slots, H / 128] with column-major last two dimensions
            payload = QuantizedTensor(recv[0], DispatchDtype.FP8, ScaleLayout.GROUP_128, recv[1].contiguous())
        else:
            payload = QuantizedTensor(recv, DispatchDtype.BF16, ScaleLayout.NONE)
        return payload, counts.to(torch.int64), LowLatencyHandle(buffer, handle, ids)

    def combine(
        self, rows: torch.Tensor, topk_weights: torch.Tensor, handle: object, *, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """Each token's routing-weighted sum of its experts' rows, back on its own rank: `[T, H]` in `out_dtype`."""
        if isinstance(handle, LowLatencyHandle):
            slots = tuple(handle.deep[0].shape)  # DeepEP's source info: [L, capacity * ranks]
            expert_rows = rows.to(torch.bfloat16).reshape(*slots, rows.shape[-1]).contiguous()
            combined, _, _ = handle.buffer.low_latency_combine(
                expert_rows,
                handle.topk_ids,
                topk_weights.to(torch.float32).contiguous(),
                handle.deep,
                async_finish=False,
                return_recv_hook=False,
            )
            return combined.to(out_dtype)
        if not isinstance(handle, NormalHandle):
            raise InvalidInput(f"handle: expected the handle of a deepep dispatch, got {type(handle).__name__}")
        needed = handle.received.row_index.numel()
        if rows.dim() != 2 or rows.shape[0] < needed:
            raise InvalidInput(
                f"rows: expected the experts' output for the {needed} dispatched rows [{needed}, H], "
                f"got {tuple(rows.shape)}"
            )
        partial = reduce_received(rows, handle.received, torch.bfloat16, combine=self._combine)
        combined, _, _ = handle.buffer.combine(partial.contiguous(), handle.deep)
        return combined.to(out_dtype)

    def _sort(self, ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
        return self._ops.sort_by_expert(ids, num_experts=num_experts)

    def _combine(
        self, rows: torch.Tensor, index: torch.Tensor | None, weights: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        return self._ops.weighted_combine(rows, index, weights, out_dtype=out_dtype)


def _check_low_latency_layout(dtype: DispatchDtype, capacity: int | None, layout: ScaleLayout | None) -> None:
    """DeepEP's low-latency dispatch casts to fp8 itself, with one scale per 128 channels."""
    if capacity is not None and dtype is DispatchDtype.FP8 and layout not in (None, ScaleLayout.GROUP_128):
        raise UnsupportedCapability(
            f"deepep low-latency mode casts fp8 itself, with one scale per 128 channels; this layer plans fp8 "
            f"with {layout} scales (its scheme's): use normal mode, or the torch.distributed low-latency path"
        )


def _world(process_group: Any) -> int:
    """The group's size; deepep needs a group (DeepEP makes its buffers over it)."""
    if process_group is None:
        raise InvalidInput("process_group: expected the expert-parallel process group deepep dispatches over, got None")
    import torch.distributed as dist

    return int(dist.get_world_size(process_group))


def _least_free_bytes(group: Any, device: torch.device) -> int:
    """The least free device memory over the group's ranks, so that every rank refuses or none does."""
    import torch.distributed as dist

    free = torch.tensor([torch.cuda.mem_get_info(device)[0]], dtype=torch.int64, device=device)
    dist.all_reduce(free, op=dist.ReduceOp.MIN, group=group)
    return int(free.item())


__all__ = ["DEEPEP", "DeepEp", "DeepEpProbe", "FP8_GROUP", "LowLatencyHandle", "NormalHandle", "probe_deep_ep"]
