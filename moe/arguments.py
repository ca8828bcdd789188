"""Checks of the arguments `moe`'s public entries share: the vendor and environment, flags, devices.

Each raises `hal.InvalidInput` naming the caller's argument, so that a wrong value fails where it
is given instead of as a raw torch or Python error somewhere inside.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hal import Vendor, environ_mapping, get_vendor, invalid


def check_environ(environ: object) -> Mapping[str, str] | None:
    """`environ` if it is None or a mapping of str to str, else `InvalidInput` naming `environ`."""
    return environ_mapping(environ)


def choose_vendor(vendor: object, environ: Mapping[str, str] | None) -> Vendor:
    """The vendor a layer computes on: `vendor` itself, the one it names, or (None) `HAL_VENDOR` of
    `environ` (the process environment when None), else the highest-priority available one."""
    environ = check_environ(environ)
    if isinstance(vendor, Vendor):
        return vendor
    if vendor is not None and (not isinstance(vendor, str) or not vendor.strip()):
        raise invalid(
            "vendor",
            "a hal.Vendor, a vendor name or None",
            vendor if isinstance(vendor, str) else type(vendor).__name__,
        )
    return get_vendor(vendor, environ)


def flag(argument: str, value: object, *, optional: bool = False) -> bool | None:
    """`value` if it is a real bool (None too where `optional`), not a truthy string or number."""
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise invalid(argument, "True or False" + (" or None" if optional else ""), value)
    return value


def as_device(argument: str, value: object, *, optional: bool = False) -> torch.device | None:
    """`value` (a `torch.device` or a device name such as 'cuda:0'; None where `optional`) as a `torch.device`,
    or `InvalidInput` naming `argument` for what torch cannot read as a device."""
    if value is None and optional:
        return None
    try:
        return torch.device(value)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as exc:
        expected = "a torch.device, a device name or None" if optional else "a torch.device or a device name"
        raise invalid(argument, expected, value) from exc


def on_device(argument: str, tensor: torch.Tensor, device: torch.device) -> None:
    """Raise `InvalidInput` unless `tensor` is on `device` (an index-less `device` matches any index)."""
    given = tensor.device
    if given == device:  # the common case, decided in one comparison
        return
    if device.index is None:
        given = torch.device(given.type)  # an index-less device matches every index
    if given != device:
        raise invalid(argument, f"a tensor on the layer's device {device}", str(tensor.device))


def with_data(argument: str, tensor: object) -> None:
    """Raise `InvalidInput` for a tensor without data (on the meta device): it cannot be copied in."""
    if isinstance(tensor, torch.Tensor) and tensor.is_meta:
        raise invalid(argument, "a tensor with data to copy (not on the meta device)", "a meta tensor")
