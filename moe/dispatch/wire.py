"""Token records: one quantized row as bytes on the wire (payload, then its scales).

Expert-parallel dispatchers send each token as one record of exactly
`plan.bytes_per_token` bytes, so buffers are sized from the plan and one collective
carries payload and scales together on any backend (bytes travel everywhere, fp8 and
bf16 do not). What a record holds comes from the plan's row of `hal.DTYPES`. A per-tensor
global scale (nvfp4) is not part of a record: the scheme's checkpoint value is the same
on every rank.
"""

from __future__ import annotations

import torch

from hal import DispatchPlan, InvalidInput, QuantizedTensor


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
            f"dispatch payload: expected {plan.resolved} ({plan.scale_layout}) as planned, "
            f"got {q.dtype} ({q.layout})"
        )
    parts = [as_bytes(q.data)]
    if q.scale is not None:  # per-token scales get a channel dimension of one
        parts.append(as_bytes(q.scale.unsqueeze(-1) if q.layout.group_size is None else q.scale))
    record = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    if record.shape[-1] != plan.bytes_per_token:
        raise InvalidInput(
            f"dispatch payload: expected {plan.bytes_per_token} bytes per token as planned, "
            f"got {record.shape[-1]}"
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


def pack_into(out: torch.Tensor, q: QuantizedTensor, plan: DispatchPlan) -> None:
    """Write the records of rows `q` `[T, H]` into the first T rows of `out` (uint8 `[N, >= bytes_per_token]`,
    N >= T), payload then scales, without an intermediate copy."""
    rows = q.data.shape[0]
    if q.dtype is not plan.resolved or q.layout is not plan.scale_layout:
        raise InvalidInput(f"dispatch payload: expected {plan.resolved} ({plan.scale_layout}) as planned, "
                           f"got {q.dtype} ({q.layout})")
    payload = as_bytes(q.data)
    out[:rows, :payload.shape[-1]].copy_(payload)
    if q.scale is not None:
        scale = as_bytes(q.scale.unsqueeze(-1) if q.layout.group_size is None else q.scale)
        out[:rows, payload.shape[-1]:payload.shape[-1] + scale.shape[-1]].copy_(scale)


def take_records(records: torch.Tensor, index: torch.Tensor, plan: DispatchPlan,
                 global_scale: torch.Tensor | None = None) -> QuantizedTensor:
    """The rows `index` (1-D) of records `[N, >= plan.bytes_per_token]` as quantized rows: one gather per part
    (payload, scales) straight from the records, no copy of the records themselves."""
    h, spec, layout = plan.hidden_size, plan.resolved.spec, plan.scale_layout
    payload_bytes = spec.payload_bytes(h)
    data = records[:, :payload_bytes].index_select(0, index).view(spec.storage)
    scale = None
    shape = spec.scale_shape((index.numel(),), h, layout)
    if shape is not None:
        picked = records[:, payload_bytes:plan.bytes_per_token].index_select(0, index)
        scale = picked.view(spec.scale_dtype).reshape(shape)  # type: ignore[arg-type]
    return QuantizedTensor(data, plan.resolved, layout, scale, global_scale)
