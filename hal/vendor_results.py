"""What a vendor's op returned, checked against what the op promises before anything reads it.

Metadata only (type, shape, dtype, device kind): no values are read and nothing waits for the device. A
result that breaks the op's contract raises `VendorFault` naming the vendor and the op, instead of
surfacing in the next op under that op's argument names, or not at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hal.errors import VendorFault
from hal.formats import QuantizedTensor

if TYPE_CHECKING:
    from hal.dtypes import DispatchDtype, ScaleLayout
    from hal.vendor import Vendor

Spec = tuple[tuple[int, ...], "torch.dtype | None"]


def _described(y: object) -> str:
    return f"{y.dtype} {tuple(y.shape)} on {y.device}" if isinstance(y, torch.Tensor) else type(y).__name__


def _same_kind(tensor: torch.Tensor, vendor: Vendor) -> bool:
    """Whether `tensor` is on the vendor's kind of device (the kind only: a vendor may compute on another index)."""
    where, home = tensor.device, vendor.device
    return where.type == home.type


def _fits(vendor: Vendor, y: object, shape: tuple[int, ...], dtype: torch.dtype | None) -> bool:
    return (
        isinstance(y, torch.Tensor)
        and y.shape == shape
        and (dtype is None or y.dtype == dtype)
        and _same_kind(y, vendor)
    )


def tensor_result(vendor: Vendor, op: str, y: object, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`y` if it is a `dtype` tensor of `shape` on the vendor's device type, else `VendorFault`."""
    if _fits(vendor, y, shape, dtype):
        return y  # type: ignore[return-value]
    raise VendorFault(
        f"vendor {vendor.name!r}: {op} returned {_described(y)}, expected {dtype} {shape} on {vendor.device.type}"
    )


def float_result(vendor: Vendor, op: str, y: object, shape: tuple[int, ...]) -> torch.Tensor:
    """`y` if it is a floating-point tensor of `shape` on the vendor's device type, else `VendorFault`."""
    if _fits(vendor, y, shape, None) and y.dtype.is_floating_point:  # type: ignore[union-attr]
        return y  # type: ignore[return-value]
    raise VendorFault(
        f"vendor {vendor.name!r}: {op} returned {_described(y)}, expected a float tensor {shape} on "
        f"{vendor.device.type}"
    )


def tensors_result(vendor: Vendor, op: str, result: object, specs: Sequence[Spec]) -> tuple[torch.Tensor, ...]:
    """`result` if it is a tuple of tensors, one per `(shape, dtype)` of `specs`, else `VendorFault`."""
    expected = ", ".join(f"{dtype} {shape}" for shape, dtype in specs)
    if not (isinstance(result, (tuple, list)) and len(result) == len(specs)):
        got = (
            f"{type(result).__name__} of {len(result)}" if isinstance(result, (tuple, list)) else type(result).__name__
        )
        raise VendorFault(f"vendor {vendor.name!r}: {op} returned {got}, expected a tuple of {len(specs)} tensors")
    for i, (y, (shape, dtype)) in enumerate(zip(result, specs)):
        if not _fits(vendor, y, shape, dtype):
            raise VendorFault(
                f"vendor {vendor.name!r}: {op} returned {_described(y)} as output {i}, expected ({expected}) on "
                f"{vendor.device.type}"
            )
    return tuple(result)


def quantized_result(
    vendor: Vendor, x: torch.Tensor, q: object, dtype: DispatchDtype, layout: ScaleLayout
) -> QuantizedTensor:
    """`q` if it is a `QuantizedTensor` of `dtype` and `layout` holding `x`'s shape, else `VendorFault`."""
    if isinstance(q, QuantizedTensor):
        values = q.data.shape[-1] * q.dtype.spec.values_per_element
        if (
            q.dtype is dtype
            and q.layout is layout
            and q.data.shape[:-1] == x.shape[:-1]
            and values == x.shape[-1]
            and _same_kind(q.data, vendor)
        ):
            return q
        got = f"{q.dtype.value} ({q.layout.value}) data {_described(q.data)}"
    else:
        got = type(q).__name__
    raise VendorFault(
        f"vendor {vendor.name!r}: quantize returned {got}, expected {dtype.value} ({layout.value}) of "
        f"shape {tuple(x.shape)} on {vendor.device.type}"
    )
