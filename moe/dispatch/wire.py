"""Token records: one quantized row as bytes on the wire (payload, then its scales).

Expert-parallel dispatchers send each token as one record of exactly
`plan.bytes_per_token` bytes, so buffers are sized from the plan and one collective
carries payload and scales together on any backend (bytes travel everywhere, fp8 and
bf16 do not). What a record holds comes from the plan's row of `hal.DTYPES`. A per-tensor
global scale (nvfp4) is not part of a record: the scheme's checkpoint value is the same
on every rank.

A routed row carries a record and its token's routing: the record, padding, then k int32 expert ids
and k fp32 weights in the row's last 8k bytes; rows are `ROW_ALIGN` bytes apart. One collective then
moves a token's record and routing, and the receiver reads every part through a view of the rows it
got (no copy where the byte offsets allow one).
"""

from __future__ import annotations

import torch

from hal import DispatchPlan, InvalidInput, QuantizedTensor

#: Bytes a routed row's width is a multiple of: rows (and their payload) start 16-byte aligned, as
#: vectorised reads of the payload rows want.
ROW_ALIGN = 16


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor `[..., C]` viewed as uint8 `[..., C * itemsize]` (copied only if not contiguous)."""
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8)


def from_bytes(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `as_bytes`: uint8 `[..., C * itemsize]` viewed as `dtype` `[..., C]`."""
    return raw.contiguous().view(dtype)


def pack(q: QuantizedTensor, plan: DispatchPlan) -> torch.Tensor:
    """Records of rows `[..., H]`: uint8 `[..., plan.bytes_per_token]`."""
    if q.dtype is not plan.resolved or q.layout is not plan.scale_layout:
        raise InvalidInput(
            f"dispatch payload: expected {plan.resolved} ({plan.scale_layout}) as planned, got {q.dtype} ({q.layout})"
        )
    parts = [as_bytes(q.data)]
    if q.scale is not None:  # per-token scales get a channel dimension of one
        parts.append(as_bytes(q.scale.unsqueeze(-1) if q.layout.group_size is None else q.scale))
    record = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    if record.shape[-1] != plan.bytes_per_token:
        raise InvalidInput(
            f"dispatch payload: expected {plan.bytes_per_token} bytes per token as planned, got {record.shape[-1]}"
        )
    return record


def unpack(records: torch.Tensor, plan: DispatchPlan, global_scale: torch.Tensor | None = None) -> QuantizedTensor:
    """Rows back from records `[..., plan.bytes_per_token]` (the inverse of `pack`)."""
    h, spec, layout = plan.hidden_size, plan.resolved.spec, plan.scale_layout
    payload_bytes = spec.payload_bytes(h)
    data = from_bytes(records[..., :payload_bytes], spec.storage)
    lead = tuple(records.shape[:-1])
    scale = None
    shape = spec.scale_shape(lead, h, layout)
    if shape is not None:
        scale = from_bytes(records[..., payload_bytes:], spec.scale_dtype).reshape(shape)  # type: ignore[arg-type]
    return QuantizedTensor(data, plan.resolved, layout, scale, global_scale)


def routed_row_bytes(plan: DispatchPlan, top_k: int) -> int:
    """Bytes of one routed row: its record and the routing of `top_k` experts, padded to `ROW_ALIGN`."""
    return _align(plan.bytes_per_token + 8 * top_k, ROW_ALIGN)


def routing_offset(plan: DispatchPlan, top_k: int) -> int:
    """The byte where a routed row's routing starts (a multiple of 4: the last 8k bytes of the row)."""
    return routed_row_bytes(plan, top_k) - 8 * top_k


def pack_routed(
    q: QuantizedTensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, plan: DispatchPlan
) -> torch.Tensor:
    """Routed rows of rows `q` `[T, H]` with their expert ids and weights `[T, k]`: uint8
    `[T, routed_row_bytes(plan, k)]`, written by one concatenation (zero bytes between record and routing)."""
    _check_planned(q, plan)
    parts = [as_bytes(q.data)]
    if q.scale is not None:
        parts.append(as_bytes(q.scale.unsqueeze(-1) if q.layout.group_size is None else q.scale))
    record = sum(part.shape[-1] for part in parts)
    if record != plan.bytes_per_token:
        raise InvalidInput(
            f"dispatch payload: expected {plan.bytes_per_token} bytes per token as planned, got {record}"
        )
    gap = routing_offset(plan, topk_ids.shape[-1]) - record
    if gap:
        parts.append(q.data.new_zeros((q.data.shape[0], gap), dtype=torch.uint8))
    parts += [as_bytes(topk_ids.to(torch.int32)), as_bytes(topk_weights.to(torch.float32))]
    return torch.cat(parts, dim=-1)


def view_records(rows: torch.Tensor, plan: DispatchPlan, global_scale: torch.Tensor | None = None) -> QuantizedTensor:
    """The quantized rows of routed rows `[N, >= bytes_per_token]`, as views of them (a part whose byte
    offset or row stride does not fit its dtype is copied)."""
    h, spec, layout = plan.hidden_size, plan.resolved.spec, plan.scale_layout
    payload_bytes = spec.payload_bytes(h)
    data = _view(rows[:, :payload_bytes], spec.storage)
    scale = None
    shape = spec.scale_shape((rows.shape[0],), h, layout)
    if shape is not None:
        scales = _view(rows[:, payload_bytes : plan.bytes_per_token], spec.scale_dtype)  # type: ignore[arg-type]
        scale = scales.reshape(shape)
    return QuantizedTensor(data, plan.resolved, layout, scale, global_scale)


def view_routing(rows: torch.Tensor, plan: DispatchPlan, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids int32 `[N, k]`, weights fp32 `[N, k]`) of routed rows `[N, routed_row_bytes]`, as views."""
    start = routing_offset(plan, top_k)
    middle = start + 4 * top_k
    return (_view(rows[:, start:middle], torch.int32), _view(rows[:, middle : middle + 4 * top_k], torch.float32))


def _view(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 `[N, C * itemsize]` viewed as `dtype` `[N, C]`: a view where the offset and strides allow it,
    else a copy (one row is a contiguous tensor whatever its offset, so `contiguous()` may not move it)."""
    try:
        return raw.view(dtype)
    except RuntimeError:
        return raw.clone(memory_format=torch.contiguous_format).view(dtype)


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _check_planned(q: QuantizedTensor, plan: DispatchPlan) -> None:
    if q.dtype is not plan.resolved or q.layout is not plan.scale_layout:
        raise InvalidInput(
            f"dispatch payload: expected {plan.resolved} ({plan.scale_layout}) as planned, got {q.dtype} ({q.layout})"
        )


def pack_into(out: torch.Tensor, q: QuantizedTensor, plan: DispatchPlan) -> None:
    """Write the records of rows `q` `[T, H]` into the first T rows of `out` (uint8 `[N, >= bytes_per_token]`,
    N >= T), payload then scales, without an intermediate copy."""
    rows = q.data.shape[0]
    _check_planned(q, plan)
    payload = as_bytes(q.data)
    out[:rows, : payload.shape[-1]].copy_(payload)
    if q.scale is not None:
        scale = as_bytes(q.scale.unsqueeze(-1) if q.layout.group_size is None else q.scale)
        out[:rows, payload.shape[-1] : payload.shape[-1] + scale.shape[-1]].copy_(scale)


def take_records(
    records: torch.Tensor, index: torch.Tensor, plan: DispatchPlan, global_scale: torch.Tensor | None = None
) -> QuantizedTensor:
    """The rows `index` (1-D) of records `[N, >= plan.bytes_per_token]` as quantized rows: one gather per part
    (payload, scales) straight from the records, no copy of the records themselves."""
    h, spec, layout = plan.hidden_size, plan.resolved.spec, plan.scale_layout
    payload_bytes = spec.payload_bytes(h)
    data = records[:, :payload_bytes].index_select(0, index).view(spec.storage)
    scale = None
    shape = spec.scale_shape((index.numel(),), h, layout)
    if shape is not None:
        picked = records[:, payload_bytes : plan.bytes_per_token].index_select(0, index)
        scale = picked.view(spec.scale_dtype).reshape(shape)  # type: ignore[arg-type]
    return QuantizedTensor(data, plan.resolved, layout, scale, global_scale)
