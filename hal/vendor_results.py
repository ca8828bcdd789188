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


def _home(vendor: Vendor) -> str:
    """The vendor's kind of device: results are checked for the kind only (a vendor may compute on another
    index of its devices)."""
    home = vendor.device
    return home.type


def _fits(home: str, y: object, shape: tuple[int, ...], dtype: torch.dtype | None) -> bool:
    if not (isinstance(y, torch.Tensor) and y.shape == shape and (dtype is None or y.dtype == dtype)):
        return False
    where = y.device
    return where.type == home


def tensor_result(vendor: Vendor, op: str, y: object, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`y` if it is a `dtype` tensor of `shape` on the vendor's device type, else `VendorFault`."""
    if _fits(_home(vendor), y, shape, dtype):
        return y  # type: ignore[return-value]
    raise VendorFault(
        f"vendor {vendor.name!r}: {op} returned {_described(y)}, expected {dtype} {shape} on {vendor.device.type}"
    )


def float_result(vendor: Vendor, op: str, y: object, shape: tuple[int, ...]) -> torch.Tensor:
    """`y` if it is a floating-point tensor of `shape` on the vendor's device type, else `VendorFault`."""
    if _fits(_home(vendor), y, shape, None) and y.dtype.is_floating_point:  # type: ignore[union-attr]
        return y  # type: ignore[return-value]
    raise VendorFault(
        f"vendor {vendor.name!r}: {op} returned {_described(y)}, expected a float tensor {shape} on "
        f"{vendor.device.type}"
    )


def tensors_result(vendor: Vendor, op: str, result: object, specs: Sequence[Spec]) -> tuple[torch.Tensor, ...]:
    """`result` if it is a tuple of tensors, one per `(shape, dtype)` of `specs`, else `VendorFault`."""
    if not (isinstance(result, (tuple, list)) and len(result) == len(specs)):
        got = (
            f"{type(result).__name__} of {len(result)}" if isinstance(result, (tuple, list)) else type(result).__name__
        )
        raise VendorFault(f"vendor {vendor.name!r}: {op} returned {got}, expected a tuple of {len(specs)} tensors")
    home = _home(vendor)
    for i, (y, (shape, dtype)) in enumerate(zip(result, specs)):
        if not _fits(home, y, shape, dtype):
            expected = ", ".join(f"{dtype} {shape}" for shape, dtype in specs)
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
            and _fits(_home(vendor), q.data, q.data.shape, None)
        ):
            return q
        got = f"{q.dtype.value} ({q.layout.value}) data {_described(q.data)}"
    else:
        got = type(q).__name__
    raise VendorFault(
        f"vendor {vendor.name!r}: quantize returned {got}, expected {dtype.value} ({layout.value}) of "
        f"shape {tuple(x.shape)} on {vendor.device.type}"
    )
