"""The dispatcher interface and the dispatch output every expert runner consumes.

A dispatcher moves each (token, expert) pair to the rank owning the expert, quantized
before it travels (the plan's dtype, scales beside), and brings the expert outputs back,
applying the top-k weights. Its output has an explicit `DispatchFormat`:

- `STANDARD`: one rank; rows sorted by expert, per-expert counts.
- `EP_NORMAL`: expert parallel; the rows this rank's experts received, sorted by local
  expert (variable count per expert), per-expert counts.
- `EP_LOW_LATENCY`: expert parallel, fixed capacity; a masked `[local_experts,
  capacity * ranks, H]` payload whose first `counts[e]` rows of expert e are valid.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hal import DispatchPlan, Groups, InvalidInput, QuantizedTensor, Vendor, invalid, positive_int
from hal.reference import sort_by_expert, weighted_combine
from moe.dispatch.tokens import Pending
from moe.routing import Routing
from moe.schemes.base import Quantizer


class DispatchFormat(str, enum.Enum):
    """The layout of a dispatch output."""

    STANDARD = "standard"
    EP_NORMAL = "ep-normal"
    EP_LOW_LATENCY = "ep-low-latency"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class DispatchOutput:
    """What the experts of this rank receive.

    `payload` holds rows in the planned dispatch dtype: `[R, H]` sorted by local expert
    (standard and ep-normal) or `[L, capacity * ranks, H]` (ep-low-latency).
    `expert_counts` (int64 `[L]`) counts the valid rows of each local expert. `handle`
    is the dispatcher's private state for `combine`.

    A dispatcher that has the rows where they already are (one rank) may hand over `source`
    (`[T, H]`) and `row_index` (`[R]`, the source row of each sorted row) instead of the
    gathered rows: runners pass both to `hal.Vendor.grouped_matmul(row_index=)`, whose kernels
    may read the rows through the index, and `payload` gathers them on first use (once).
    """

    format: DispatchFormat
    source: QuantizedTensor  #: the rows, or with `row_index` the rows they are taken from
    expert_counts: torch.Tensor
    handle: Any = None
    row_index: torch.Tensor | None = None
    #: a static bound on the valid rows (e.g. a masked layout's `capacity * ranks * min(k, L)`), which the
    #: experts may size their work by; None: every row may be valid
    max_rows: int | None = None
    #: the rows per group the experts' GEMMs take, where they differ from `expert_counts` (a padded tail
    #: counted into the last group, for a vendor whose grouped matmul wants every row covered)
    gemm_counts: torch.Tensor | None = None

    @property
    def payload(self) -> QuantizedTensor:
        """The rows the experts receive (`source[row_index]` when the rows are taken through an index)."""
        if self.row_index is None:
            return self.source
        gathered = self.__dict__.get("_gathered")
        if gathered is None:
            gathered = self.source.rows(self.row_index)
            object.__setattr__(self, "_gathered", gathered)
        return gathered

    @property
    def num_local_experts(self) -> int:
        """L, the experts on this rank."""
        return self.expert_counts.numel()

    def groups(self) -> Groups:
        """The grouped-matmul split of the payload rows (every slot of the masked layout)."""
        if self.format is DispatchFormat.EP_LOW_LATENCY:
            slots = self.payload.data.shape[1]
            return Groups.from_counts(torch.full_like(self.expert_counts, slots))
        return Groups.from_counts(self.expert_counts if self.gemm_counts is None else self.gemm_counts)


class Dispatcher(abc.ABC):
    """Moves tokens to their experts and back for one layer (one plan, one expert split).

    Experts are split evenly and contiguously across the ranks of `process_group`:
    rank r owns experts `[r * L, (r + 1) * L)`. Without a group there is one rank.
    """

    format: ClassVar[DispatchFormat]
    #: whether a dispatch and combine never wait for the host (no value read back), so that a graph can
    #: capture them (`moe.GraphConfig`); dispatchers that size their work by received counts do not
    capturable: bool = True

    def __init__(
        self, plan: DispatchPlan, num_experts: int, process_group: Any = None, *, vendor: Vendor | None = None
    ) -> None:
        if not isinstance(plan, DispatchPlan):
            raise invalid("plan", "a hal.DispatchPlan (hal.resolve_dispatch_plan)", type(plan).__name__)
        if vendor is not None and not isinstance(vendor, Vendor):
            raise invalid("vendor", "a hal.Vendor or None", type(vendor).__name__)
        self.plan = plan
        self.vendor = vendor  #: whose `weighted_combine` takes the weighted sums (None: plain torch)
        self.process_group = process_group
        self.world_size, self.rank = group_size_and_rank(process_group)
        positive_int("num_experts", num_experts)
        if num_experts % self.world_size:
            raise InvalidInput(
                f"num_experts: expected a multiple of the expert-parallel ranks ({self.world_size}) "
                f"so that every rank holds the same number of experts, got {num_experts}"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.world_size
        self.first_expert = self.rank * self.num_local_experts

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dtype={self.plan.resolved}, experts={self.num_experts}, "
            f"rank={self.rank}/{self.world_size})"
        )

    @abc.abstractmethod
    def dispatch(self, hidden_states: torch.Tensor, routing: Routing, quantize: Quantizer) -> DispatchOutput:
        """Quantize `hidden_states` `[T, H]` with `quantize` and send each routed row to its expert."""

    def sort_pairs(self, topk_ids: torch.Tensor, *, tokens: bool = False) -> tuple[torch.Tensor, ...]:
        """`(order, inverse, counts)` of the pairs sorted by expert, and with `tokens` the token of each
        sorted row (see `hal.Vendor.sort_by_expert`)."""
        if self.vendor is not None:
            return self.vendor.sort_by_expert(topk_ids, self.num_experts, tokens=tokens)
        sorted_pairs = sort_by_expert(topk_ids, self.num_experts)
        if not tokens:
            return sorted_pairs
        return (*sorted_pairs, torch.div(sorted_pairs[0], topk_ids.shape[-1], rounding_mode="floor"))

    def combine_rows(
        self, rows: torch.Tensor, index: torch.Tensor | None, routing: Routing, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """Each token's weighted sum of `rows[index]` (see `hal.Vendor.weighted_combine`)."""
        if self.vendor is not None:
            return self.vendor.weighted_combine(rows, index, routing.topk_weights, out_dtype)
        return weighted_combine(rows, index, routing.topk_weights, out_dtype)

    @abc.abstractmethod
    def combine(self, expert_output: torch.Tensor, dispatched: DispatchOutput, out_dtype: torch.dtype) -> torch.Tensor:
        """Return each token's top-k-weighted sum of its experts' outputs: `[T, H]` in `out_dtype`."""

    def dispatch_async(self, hidden_states: torch.Tensor, routing: Routing, quantize: Quantizer) -> Pending:
        """`dispatch`, started: the returned handle's `wait()` gives the `DispatchOutput`. Between the two
        the caller may issue other work (another micro-batch's experts), which the communication then
        overlaps where the dispatcher communicates asynchronously. The default finishes at once."""
        return Pending.done(self.dispatch(hidden_states, routing, quantize))

    def combine_async(self, expert_output: torch.Tensor, dispatched: DispatchOutput, out_dtype: torch.dtype) -> Pending:
        """`combine`, started: `wait()` gives the `[T, H]` result (see `dispatch_async`)."""
        return Pending.done(self.combine(expert_output, dispatched, out_dtype))

    @property
    def last_mode(self) -> str:
        """The mode the latest call took: "local", "normal" or "low-latency"."""
        return {
            DispatchFormat.STANDARD: "local",
            DispatchFormat.EP_NORMAL: "normal",
            DispatchFormat.EP_LOW_LATENCY: "low-latency",
        }[self.format]

    @property
    def formats(self) -> tuple[DispatchFormat, ...]:
        """Every format this dispatcher's outputs may have (one, except for a dispatcher that changes
        mode per call)."""
        return (self.format,)


def padded_counts(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """`counts` with the rows past their total (of `rows`) added to the last group, on the device."""
    padded = counts.clone()
    padded[-1:] += rows - counts.sum()
    return padded


def group_size_and_rank(process_group: Any, argument: str = "process_group") -> tuple[int, int]:
    """(world size, rank) of a process group (`argument` names it in errors); (1, 0) without one."""
    if process_group is None:
        return 1, 0
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise InvalidInput(
            f"{argument}: expected a group of an initialized torch.distributed process group, "
            "got one while torch.distributed is not initialized"
        )
    try:
        size, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    except (RuntimeError, ValueError, TypeError, AttributeError) as exc:
        raise invalid(
            argument,
            "a torch.distributed process group this process belongs to or None",
            f"{type(process_group).__name__} ({type(exc).__name__}: {exc})",
        ) from exc
    if size < 1 or not 0 <= rank < size:  # torch answers -1 for a group this process is not in
        raise invalid(
            argument,
            "a torch.distributed process group this process belongs to or None",
            f"a group of which this process (global rank {dist.get_rank()}) is not a member",
        )
    return size, rank


def tensor_group_size_and_rank(tp_group: Any, process_group: Any) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel group, refused where it shares a rank other than this one with
    the expert-parallel `process_group` (the same group passed as both: every rank would hold a slice of
    I of different experts, and the all-reduce would add outputs of different tokens)."""
    size, rank = group_size_and_rank(tp_group, "tp_group")
    ep_size = group_size_and_rank(process_group)[0]
    if size > 1 and ep_size > 1:
        import torch.distributed as dist

        shared = sorted(set(dist.get_process_group_ranks(tp_group)) & set(dist.get_process_group_ranks(process_group)))
        if len(shared) > 1:
            raise invalid(
                "tp_group",
                "a tensor-parallel group that shares only this rank with the expert-parallel process_group "
                "(ep x tp ranks)",
                f"a group sharing global ranks {shared[:8]} with it",
            )
    return size, rank


__all__ = [
    "DispatchFormat",
    "DispatchOutput",
    "Dispatcher",
    "Pending",
    "group_size_and_rank",
    "sort_by_expert",
    "tensor_group_size_and_rank",
]
