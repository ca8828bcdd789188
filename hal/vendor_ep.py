"""The checked entry points of a vendor's own expert-parallel dispatchers (a part of `hal.Vendor`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hal import checks
from hal.dtypes import DispatchDtype, ScaleLayout
from hal.errors import InvalidInput, UnsupportedCapability, invalid, positive_int

if TYPE_CHECKING:
    from hal.capabilities import Capabilities
    from hal.formats import QuantizedTensor
    from hal.ops import VendorOps


#: the combine takes no process group (its handle knows the dispatch's)
_COMBINE = object()


@dataclass(frozen=True)
class EpHandle:
    """What `ep_combine` needs of one `ep_dispatch` (returned by it; pass it back unchanged): the
    dispatcher's name, the tokens and k dispatched, the leading shape of the expert rows the combine
    takes (`[R]`, `[M]` after a row index, or the masked `[L, capacity * ranks]`), the vendor's own handle."""

    name: str
    tokens: int
    top_k: int
    rows: tuple[int, ...]
    inner: object


class ExpertParallelOps:
    """`prepare_ep`, `ep_dispatch`, `ep_combine`: argument checks, then the vendor's ops."""

    name: str
    ops: VendorOps
    device: torch.device

    if TYPE_CHECKING:

        def capabilities(self) -> Capabilities: ...  # hal.Platform's

    def prepare_ep(
        self,
        name: str,
        *,
        process_group: object,
        num_experts: int,
        hidden_size: int,
        dtype: DispatchDtype | str,
        capacity: int | None,
        layout: ScaleLayout | str | None = None,
    ) -> None:
        """Make what expert-parallel dispatcher `name` needs for one layer (communication buffers sized
        from its plan), once, when the layer is built: a plan whose buffers cannot be had (more than
        the device's free memory) is refused here, not at the first forward. `capacity` is the
        low-latency per-rank token capacity (None: normal mode only); `layout` the activation scale layout
        the layer plans for `dtype` (None: the dtype's default)."""
        self._require_ep(name, capacity, process_group=process_group)
        parsed = checks.concrete_dtype(dtype)
        for label, value in (("num_experts", num_experts), ("hidden_size", hidden_size)):
            positive_int(label, value)
        self.ops.prepare_ep(
            name,
            process_group=process_group,
            num_experts=num_experts,
            hidden_size=hidden_size,
            dtype=parsed,
            capacity=capacity,
            layout=_layout(parsed, layout),
        )

    def ep_dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        name: str,
        dtype: DispatchDtype | str,
        num_experts: int,
        process_group: object,
        topk_weights: torch.Tensor | None = None,
        capacity: int | None = None,
        layout: ScaleLayout | str | None = None,
    ) -> tuple[QuantizedTensor, torch.Tensor, object]:
        """Dispatch through the vendor's own expert-parallel dispatcher `name` (declared in
        `capabilities().ep_dispatchers`): `(rows grouped by local expert, counts, handle)`, or
        `(received tokens, counts, handle, row_index)` where the rows are the tokens `row_index` picks
        (the experts' first GEMM reads them through the index instead of a gathered copy).

        `topk_weights` `[T, k]` travel with the tokens where the dispatcher reduces each token's
        expert outputs on the experts' side (the combine then only sums per rank). With `capacity`
        (a dispatcher declared in `ep_low_latency`) the rows come in the masked low-latency layout
        `[local experts, capacity * ranks, H]`; more than `capacity` tokens raise `InvalidInput`."""
        self._require_ep(name, capacity, process_group=process_group)
        parsed = checks.concrete_dtype(dtype)
        checks.float_rows("x", x)
        if x.dim() != 2:
            raise invalid("x", "a 2-D tensor [T, H]", tuple(x.shape))
        for label, tensor in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            checks.on_device(label, tensor, self.device)
        checks.expert_ids(topk_ids, num_experts, host_synchronous=self.capabilities().host_synchronous)
        if topk_ids.shape[0] != x.shape[0]:
            raise invalid("topk_ids", f"one row per token of x ({x.shape[0]})", tuple(topk_ids.shape))
        if topk_weights is not None and (
            not topk_weights.is_floating_point() or tuple(topk_weights.shape) != tuple(topk_ids.shape)
        ):
            raise invalid(
                "topk_weights",
                f"floating-point weights shaped like topk_ids {tuple(topk_ids.shape)}",
                f"{topk_weights.dtype} {tuple(topk_weights.shape)}",
            )
        if capacity is not None and x.shape[0] > capacity:
            raise InvalidInput(
                f"x: expected at most max_dispatch_tokens_per_rank={capacity} tokens for "
                f"low-latency dispatch, got {x.shape[0]}"
            )
        payload, counts, inner, *row_index = self.ops.ep_dispatch(
            x,
            topk_ids,
            name=name,
            dtype=parsed,
            num_experts=num_experts,
            process_group=process_group,
            topk_weights=topk_weights,
            capacity=capacity,
            layout=_layout(parsed, layout),
        )
        rows = tuple(row_index[0].shape) if row_index else tuple(getattr(payload, "data", payload).shape[:-1])
        handle = EpHandle(name, x.shape[0], topk_ids.shape[1], rows, inner)
        return (payload, counts, handle, *row_index)  # type: ignore[return-value]

    def ep_combine(
        self, rows: torch.Tensor, topk_weights: torch.Tensor, handle: object, *, name: str, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """The weighted sum of each token's expert rows after `ep_dispatch` with the same `name`: `[T, H]`.
        `rows` is `[R, H]`, or the masked `[L, capacity * ranks, H]` after a low-latency dispatch (the
        leading shape the dispatch's `handle` records); `topk_weights` `[T, k]` as dispatched."""
        self._require_ep(name)
        checks.out_dtype("out_dtype", out_dtype)
        if not isinstance(handle, EpHandle) or handle.name != name:
            given = (
                f"the handle of dispatcher {handle.name!r}" if isinstance(handle, EpHandle) else type(handle).__name__
            )
            raise invalid("handle", f"the handle an ep_dispatch through {name!r} returned", given)
        flat = rows.reshape(-1, rows.shape[-1]) if isinstance(rows, torch.Tensor) and rows.dim() == 3 else rows
        checks.rows_and_weights(flat, topk_weights)
        if tuple(rows.shape[:-1]) != handle.rows:
            raise invalid("rows", f"the dispatched rows' shape {(*handle.rows, 'H')}", tuple(rows.shape))
        if tuple(topk_weights.shape) != (handle.tokens, handle.top_k):
            raise invalid(
                "topk_weights", f"shape {(handle.tokens, handle.top_k)} (as dispatched)", tuple(topk_weights.shape)
            )
        for label, tensor in (("rows", rows), ("topk_weights", topk_weights)):
            checks.on_device(label, tensor, self.device)
        return self.ops.ep_combine(rows, topk_weights, handle.inner, name=name, out_dtype=out_dtype)

    def _require_ep(self, name: str, capacity: int | None = None, *, process_group: object = _COMBINE) -> None:
        """`name` a declared dispatcher (with a low-latency mode where `capacity` is given); the dispatch
        and prepare calls pass their `process_group` (checked before the declaration: a type error first)."""
        checks.name_string("name", name, "an expert-parallel dispatcher name (str)")
        if process_group is not _COMBINE:
            checks.process_group(process_group, optional=False)
        caps = self.capabilities()
        declared = caps.ep_dispatchers
        if name not in declared:
            absent = caps.ep_dispatchers_absent.get(name)
            raise UnsupportedCapability(
                f"vendor {self.name!r} declares no expert-parallel dispatcher {name!r} "
                f"(declared: {', '.join(sorted(declared)) or 'none'})" + (f": {absent}" if absent else "")
            )
        if capacity is not None:
            positive_int("capacity", capacity)
            if name not in caps.ep_low_latency:
                raise UnsupportedCapability(
                    f"vendor {self.name!r}: expert-parallel dispatcher {name!r} has no low-latency mode "
                    f"(declared for: {', '.join(sorted(caps.ep_low_latency)) or 'none'})"
                )


def _layout(dtype: DispatchDtype, layout: ScaleLayout | str | None) -> ScaleLayout | None:
    """The parsed scale layout (None: the dtype's default), refused when `dtype` does not have it."""
    if layout is None:
        return None
    parsed = ScaleLayout(layout)
    if parsed not in dtype.scale_layouts():
        raise invalid("layout", f"a scale layout of {dtype} ({', '.join(map(str, dtype.scale_layouts()))})", parsed)
    return parsed
