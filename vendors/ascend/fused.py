"""W8A8-INT8 `fused_deep_moe` through the Ascend DeepEP port (sgl-kernel-npu `python/deep_ep/`).

The port's contract (its source at f425bdf and `../shared/reference/torch_npu.md`), not CUDA DeepEP's:

- `Buffer(group)` calls `group.rank()`: a process group is required. The layer's
  `process_group` is passed; None (one rank) takes the world group when torch.distributed is
  initialised with one rank, else a private one-rank gloo group (whether the port's C++
  runtime accepts a group without an HCCL communicator is unverified: on hardware pass an
  HCCL group); None on a world of several ranks is refused (InvalidInput).
- **low latency** (the layer sets a capacity, dispatches int8, the chip is A3/A5 and the
  shapes meet the kernel's documented limits, `fused_kernel_problems`): the port's one op
  `Buffer.fused_deep_moe` on weights prepared once per set of stored weights
  (`FusedWeights`: w13 and its scale tile-permuted along N, FRACTAL_NZ via `npu_format_cast`,
  w2 as `[E, H, I]`). Otherwise the port's **normal mode**, which has no such limits:
  `Buffer.dispatch` returns one row per (token, local expert) pair grouped by expert with the
  counts per expert (its `recv_topk_idx` / `recv_topk_weights` are unfilled and never read);
  the vendor's own grouped matmul (`group_list_type=1` on those counts), swiglu, int8
  quantize and grouped matmul run on those rows; `Buffer.combine` applies the routing
  weights itself, so the expert outputs are passed unweighted.
- int8 on the wire: `dispatch(..., quant_mode="int8" | "bf16")` where the port's dispatch
  takes `quant_mode`; a port without it is sent bf16 rows and they are quantized after the
  dispatch (same values, twice the bytes). The process environment is never written, so
  no other layer's resolution can observe a setting made for this one.
- Expert ids must lie in [0, experts): -1 ("not dispatched" in the port) and out-of-range
  ids raise InvalidInput (hal has no "no expert" id; the unfused path refuses them too).
"""

from __future__ import annotations

import inspect
import threading
import weakref
from typing import Any

import torch

from hal import DispatchDtype, GemmKind, Groups, HalError, InvalidInput, QuantizedTensor, QuantizedWeight, ScaleLayout
from hal import invalid
from vendors.ascend.capabilities import FUSED_GENERATIONS, generation_of

#: The deprecated variable the port's normal dispatch reads when no `quant_mode` is given.
INT8_DISPATCH_VARIABLE = "DEEP_NORMAL_MODE_USE_INT8_QUANT"
ACL_FORMAT_FRACTAL_NZ = 29
TILE_N = 64  #: gate/up column tiles of the port's permuted first weight


class FusedMoeError(HalError):
    """The DeepEP library returned something other than what the call asked for."""


def fused_kernel_problems(
    generation: str | None, tokens: int, hidden: int, width: int, top_k: int, experts: int, capacity: int
) -> list[str]:
    """Why the port's one-kernel `fused_deep_moe` cannot take this call (empty: it can).

    Limits of FUSED_DEEP_MOE.md (FuseMode 1): tokens per rank 1..256 and at most the capacity,
    hidden 512..7168, gmm1 width `width` = 2I 1024..6144 (A5: a multiple of 1024), top-k 1..12,
    experts 1..512; the tile permutation needs 2I a multiple of 128.
    """
    if generation not in FUSED_GENERATIONS:
        return [f"the fused kernel is built for A3 and A5, not {generation}"]
    found = [
        f"{name} {value} outside {low}..{high}"
        for name, value, low, high in (
            ("tokens", tokens, 1, min(256, capacity)),
            ("hidden", hidden, 512, 7168),
            ("2I", width, 1024, 6144),
            ("top-k", top_k, 1, 12),
            ("experts", experts, 1, 512),
        )
        if not low <= value <= high
    ]
    if width % (2 * TILE_N) or (generation == "A5" and width % 1024):
        found.append(f"2I {width} not a multiple of {1024 if generation == 'A5' else 2 * TILE_N}")
    return found


def check_fused_operands(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: QuantizedWeight,
    w2: QuantizedWeight,
    num_experts: int | None = None,
) -> None:
    """Validate the fused op's operands (types, shapes, dtypes, expert ids) with the house messages."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise invalid(
            "hidden_states",
            "a bf16, fp16 or fp32 tensor [T, H]",
            tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__,
        )
    t, h = x.shape
    for name, value in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[0] != t:
            raise invalid(
                name,
                f"a tensor [{t}, top_k]",
                tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__,
            )
    if topk_ids.shape != topk_weights.shape:
        raise invalid("topk_weights", f"the shape of topk_ids {tuple(topk_ids.shape)}", tuple(topk_weights.shape))
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise invalid("topk_ids", "int32 or int64 expert ids", topk_ids.dtype)
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, QuantizedWeight) or w.data.dtype != torch.int8:
            raise invalid(
                name,
                "int8 per-channel QuantizedWeight (scheme w8a8-int8)",
                getattr(getattr(w, "data", None), "dtype", type(w).__name__),
            )
    e, wh, two_i = w13.data.shape
    if wh != h or two_i % 2 or tuple(w2.data.shape) != (e, two_i // 2, h):
        raise invalid(
            "w13, w2", f"w13 [E, {h}, 2I] and w2 [E, I, {h}]", f"{tuple(w13.data.shape)} and {tuple(w2.data.shape)}"
        )
    if num_experts is not None and topk_ids.numel():
        low, high = int(topk_ids.min()), int(topk_ids.max())  # one host read (normal mode reads counts anyway)
        if low < 0 or high >= num_experts:
            raise invalid(
                "topk_ids",
                f"expert ids in [0, {num_experts}) (the port would skip -1 silently)",
                f"ids in [{low}, {high}]",
            )


class FusedWeights:
    """The fused kernel's weights of one stored (w13, w2), made once and kept while they live.

    Keyed by the stored tensors (weak references) and their version counters, so a reload in
    place or a new set of weights prepares again; a forward on the same weights does not.
    """

    def __init__(self, npu: Any) -> None:
        self._npu = npu
        self._lock = threading.Lock()
        self._entry: tuple[Any, ...] | None = None

    def get(self, w13: QuantizedWeight, w2: QuantizedWeight) -> tuple[torch.Tensor, ...]:
        with self._lock:
            key = (
                w13.data._version,
                w2.data._version,
                w13.scale._version,  # type: ignore[union-attr]
                w2.scale._version,  # type: ignore[union-attr]
            )
            entry = self._entry
            if entry is None or entry[0]() is not w13.data or entry[1]() is not w2.data or entry[2] != key:
                entry = (weakref.ref(w13.data), weakref.ref(w2.data), key, self._prepare(w13, w2))
                self._entry = entry
            return entry[3]

    def _prepare(self, w13: QuantizedWeight, w2: QuantizedWeight) -> tuple[torch.Tensor, ...]:
        cast = self._npu.npu_format_cast
        return (
            cast(permute_tiles(w13.data).contiguous(), ACL_FORMAT_FRACTAL_NZ),
            permute_tiles(w13.scale.to(torch.float32)).contiguous(),  # type: ignore[union-attr]
            cast(w2.data.transpose(1, 2).contiguous(), ACL_FORMAT_FRACTAL_NZ),
            w2.scale.to(torch.float32).contiguous(),
        )  # type: ignore[union-attr]


def permute_tiles(w: torch.Tensor) -> torch.Tensor:
    """`[..., 2I]` gate-first columns into the port's order: 64 gate columns, 64 up columns, ..."""
    *lead, n = w.shape
    return w.reshape(*lead, 2, n // (2 * TILE_N), TILE_N).transpose(-3, -2).reshape(*lead, n)


class DeepEpFusedMoe:
    """The fused W8A8-INT8 MoE of one vendor instance: a DeepEP buffer per process group."""

    def __init__(self, ops: Any) -> None:
        self._ops, self._npu = ops, ops.npu
        self._deep_ep = ops.binding.deep_ep
        self._generation = generation_of(ops.binding.soc_name)
        self._buffers: dict[int, tuple[object, Any]] = {}
        self._weights: dict[int, FusedWeights] = {}
        self._own_group: Any = None

    def __call__(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: QuantizedWeight,
        w2: QuantizedWeight,
        *,
        process_group: object | None,
        dispatch_dtype: DispatchDtype,
        max_tokens_per_rank: int | None,
    ) -> torch.Tensor:
        """The layer's output `[T, H]` in bf16."""
        group = self._group(process_group)
        num_experts = w13.num_experts * group.size()
        check_fused_operands(x, topk_ids, topk_weights, w13, w2, num_experts)
        ids, weights, xb = topk_ids.to(torch.int64), topk_weights.to(torch.float32), x.to(torch.bfloat16)
        buffer = self._buffer(group)
        int8 = dispatch_dtype is DispatchDtype.INT8
        if (
            max_tokens_per_rank is not None
            and int8
            and not fused_kernel_problems(
                self._generation,
                x.shape[0],
                x.shape[1],
                w13.out_features,
                ids.shape[1],
                num_experts,
                max_tokens_per_rank,
            )
        ):
            prepared = self._weights.setdefault(id(buffer), FusedWeights(self._npu)).get(w13, w2)
            out, _ = buffer.fused_deep_moe(xb, ids, weights, *prepared, max_tokens_per_rank, num_experts, quant_mode=1)
            return out
        return self._normal(buffer, xb, ids, weights, w13, w2, num_experts, int8)

    def prepare(self, w13: QuantizedWeight, w2: QuantizedWeight, process_group: object | None) -> None:
        """Make the one-kernel op's weights for the group's buffer now (at load), where the port has
        the fused kernel; a forward then finds them made."""
        if fused_kernel_problems(self._generation, 1, w13.in_features, w13.out_features, 1, w13.num_experts, 1):
            return  # every call of these shapes runs the port's normal mode, on the hal-format weights
        buffer = self._buffer(self._group(process_group))
        self._weights.setdefault(id(buffer), FusedWeights(self._npu)).get(w13, w2)

    def _normal(
        self,
        buffer: Any,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        w13: QuantizedWeight,
        w2: QuantizedWeight,
        num_experts: int,
        int8: bool,
    ) -> torch.Tensor:
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, num_experts)
        args = {
            "num_tokens_per_rank": per_rank,
            "is_token_in_rank": in_rank,
            "num_tokens_per_expert": per_expert,
            "topk_idx": ids,
            "topk_weights": weights,
        }
        if _takes_quant_mode(buffer):
            args["quant_mode"] = "int8" if int8 else "bf16"
        recv_x, _unfilled_idx, _unfilled_weights, counts, handle, _ = buffer.dispatch(x, **args)
        if isinstance(recv_x, tuple) and not int8 and "quant_mode" in args:
            raise FusedMoeError("deep_ep Buffer.dispatch returned int8 rows for quant_mode='bf16'")
        y = self._local_experts(recv_x, counts, w13, w2)
        combined, _, _ = buffer.combine(y, handle)  # the port applies the routing weights
        return combined

    def _local_experts(self, recv_x: Any, counts: list[int], w13: QuantizedWeight, w2: QuantizedWeight) -> torch.Tensor:
        """`[R, H]` bf16: each received (token, expert) row through its expert, unweighted."""
        ops = self._ops
        int8 = (DispatchDtype.INT8, ScaleLayout.PER_TOKEN)
        if isinstance(recv_x, tuple):
            rows = QuantizedTensor(recv_x[0], *int8, recv_x[1])
        else:
            rows = ops.quantize(recv_x, dtype=int8[0], layout=int8[1], global_scale=None)
        if len(counts) != w13.num_experts or sum(counts) != rows.data.shape[0]:
            raise FusedMoeError(
                f"deep_ep Buffer.dispatch returned {rows.data.shape[0]} rows and counts {counts} "
                f"for {w13.num_experts} local experts"
            )
        groups = Groups.from_counts(torch.tensor(counts, dtype=torch.int64, device=rows.data.device))
        gemm = {"kind": GemmKind.INT8, "out_dtype": torch.bfloat16}
        h = ops.swiglu(ops.grouped_matmul(rows, w13, groups, **gemm))
        hq = ops.quantize(h, dtype=int8[0], layout=int8[1], global_scale=None)
        return ops.grouped_matmul(hq, w2, groups, **gemm)

    def _group(self, group: Any) -> Any:
        """The process group handed to the port (which calls `group.rank()`; None fails there)."""
        if group is not None:
            return group
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size() != 1:
                raise InvalidInput(
                    f"process_group: expected the expert-parallel process group for the Ascend "
                    f"DeepEP port on a world of {dist.get_world_size()} ranks, got None"
                )
            return dist.group.WORLD
        if self._own_group is None:  # one process, no torch.distributed: a private one-rank group
            self._own_group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
        return self._own_group

    def _buffer(self, group: Any) -> Any:
        key = id(group)
        found = self._buffers.get(key)
        if found is None or found[0] is not group:
            found = (group, self._deep_ep.Buffer(group))
            self._buffers[key] = found
        return found[1]


def _takes_quant_mode(buffer: Any) -> bool:
    try:
        return "quant_mode" in inspect.signature(buffer.dispatch).parameters
    except (TypeError, ValueError):
        return False
