"""What a hal op's argument checks concluded for one signature of arguments, kept per vendor.

Most of an op's checks read only metadata: types, shapes, dtypes, devices, the weight's format, the
enums given. For a given signature of those they reach the same verdict every call, so the checked
entry points (`hal.Vendor.grouped_matmul`, `hal.Vendor.quantize`) run them on the first call of a
signature and keep what they derived (the GEMM kind, the output dtype, ...). Checks that read values
(indices, group counts, where reading them is free) still run on every call.

A signature holds plain `torch.Tensor`s and hal's own formats only; anything else (tensor subclasses,
other types) is never kept, so its checks run in full. A weight enters by its format and its tensors'
shapes, dtypes and devices, read on every call (a weight recast or moved in place meets the checks
again); no tensor is held.
"""

from __future__ import annotations

from typing import Any

import torch

from hal.activations import Activation, ActivationKind
from hal.dtypes import DispatchDtype, ScaleLayout
from hal.formats import QuantizedTensor, QuantizedWeight
from hal.groups import Groups

_TENSOR = torch.Tensor
_ENUM_ARGS = (str, Activation, ActivationKind, DispatchDtype, ScaleLayout)


def _meta(t: object) -> tuple[Any, ...] | None | bool:
    """A plain tensor's shape, dtype and device; None for None; False for anything else."""
    if t is None:
        return None
    if type(t) is _TENSOR:
        return (t.shape, t.dtype, t.device)  # type: ignore[attr-defined]
    return False


def gemm_signature(
    x: object, weight: object, groups: object, out_dtype: object, bias: object, activation: object, row_index: object
) -> tuple[Any, ...] | None:
    """The metadata a grouped matmul's checks depend on, or None where the call has an argument that is
    never kept (then it is checked in full). Runs on every call: attribute reads, few function calls."""
    kind = type(x)
    if kind is _TENSOR:
        xs: tuple[Any, ...] = (x.shape, x.dtype, x.device)  # type: ignore[attr-defined]
    elif kind is QuantizedTensor:
        data = x.data  # type: ignore[attr-defined]
        if type(data) is not _TENSOR:
            return None
        # the scales' shapes, dtypes and devices follow from these (checked when the QuantizedTensor was made)
        xs = (data.shape, data.dtype, data.device, x.dtype, x.layout, x.scale is None, x.global_scale is None)  # type: ignore[attr-defined]
    else:
        return None
    if type(weight) is not QuantizedWeight or type(groups) is not Groups:
        return None
    w, g = weight.data, groups.tensor  # type: ignore[attr-defined]
    if type(w) is not _TENSOR or type(g) is not _TENSOR:
        return None
    if not (out_dtype is None or type(out_dtype) is torch.dtype):
        return None
    if not (activation is None or isinstance(activation, _ENUM_ARGS)):
        return None
    optional = (_meta(weight.scale), _meta(weight.global_scale), _meta(row_index), _meta(bias))  # type: ignore[attr-defined]
    if False in optional:
        return None
    return (
        kind,
        xs,
        weight.layout,
        w.shape,
        w.dtype,
        w.device,
        optional,
        groups.kind,
        g.shape,
        g.dtype,
        g.device,
        out_dtype,
        activation,
    )  # type: ignore[attr-defined]


def quantize_signature(x: object, dtype: object, layout: object, global_scale: object) -> tuple[Any, ...] | None:
    """The metadata a quantization's checks depend on (no global scale given), or None (checked in full)."""
    if type(x) is not _TENSOR or global_scale is not None:
        return None
    if not isinstance(dtype, _ENUM_ARGS) or not (layout is None or isinstance(layout, _ENUM_ARGS)):
        return None
    return (x.dim(), x.shape[-1] if x.dim() else None, x.dtype, x.device, dtype, layout)  # type: ignore[attr-defined]


class Verdicts:
    """Kept verdicts by signature (at most `capacity`; all dropped when full), each valid for the one
    `Capabilities` object it was reached under (a vendor resolves its capabilities once)."""

    def __init__(self, capacity: int = 1024) -> None:
        self._kept: dict[tuple[Any, ...], tuple[object, Any]] = {}
        self._capacity = capacity

    def get(self, signature: tuple[Any, ...], capabilities: object) -> Any:
        """The verdict kept for `signature` under these very `capabilities`, or None."""
        found = self._kept.get(signature)
        return found[1] if found is not None and found[0] is capabilities else None

    def put(self, signature: tuple[Any, ...], capabilities: object, verdict: Any) -> None:
        """Keep `verdict` for `signature` under `capabilities` (one dict store: safe from any thread)."""
        if len(self._kept) >= self._capacity:
            self._kept.clear()
        self._kept[signature] = (capabilities, verdict)

    def __len__(self) -> int:
        return len(self._kept)


def verdicts_of(owner: object) -> Verdicts:
    """The `Verdicts` kept on `owner` (a vendor), made at first use; a throwaway one where `owner` has no
    instance dictionary (nothing is kept then)."""
    state = getattr(owner, "__dict__", None)
    if state is None:
        return Verdicts(capacity=0)
    found = state.get("_hal_verdicts")
    return found if found is not None else state.setdefault("_hal_verdicts", Verdicts())
