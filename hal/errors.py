"""The error hierarchy of moe-hal.

Every public entry point validates its input and raises one of these; messages
name the argument, what was expected and what was given.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

#: The range of a positive fp32 setting: the smallest normal fp32 value and the largest finite one
#: (a setting outside it becomes inf or is flushed towards zero in an fp32 kernel).
FP32_TINY = 2.0**-126
FP32_MAX = (2 - 2.0**-23) * 2.0**127


class HalError(Exception):
    """Base class of every error moe-hal raises on purpose."""


class VendorUnavailable(HalError):
    """A vendor was asked for but cannot run here (missing hardware, library or plugin)."""


class UnsupportedCapability(HalError):
    """An operation needs a capability the vendor does not declare."""


class UnsupportedDispatchDtype(HalError):
    """The resolved dispatch dtype is neither supported nor has a declared fallback."""


class InvalidInput(HalError, ValueError):
    """An argument has the wrong type, shape, dtype or value."""


class VendorFault(HalError):
    """A vendor's op broke its own contract (returned something other than the op's result type): the
    vendor's bug, not the caller's."""


class UnknownVendor(VendorUnavailable, InvalidInput):
    """A vendor name that no installed plugin provides: an argument error (`InvalidInput`) that existing
    `except VendorUnavailable` code still catches."""


def invalid(argument: str, expected: str, given: object) -> InvalidInput:
    """Build an `InvalidInput` in the house style: argument, expectation, value given."""
    return InvalidInput(f"{argument}: expected {expected}, got {given!r}")


def positive_int(argument: str, value: object, expected: str = "a positive int") -> int:
    """Return `value` if it is a positive int (bools excluded), else raise `InvalidInput`."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise invalid(argument, expected, value)
    return value


def positive_fp32(argument: str, value: object, expected: str = "a finite positive number") -> float:
    """`value` as a float if it is a real number (not a bool) in `[FP32_TINY, FP32_MAX]`, the positive
    values an fp32 kernel computes with (no overflow to inf, no flush to zero), else `InvalidInput`
    naming the limit."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not FP32_TINY <= value <= FP32_MAX:
        raise invalid(argument, f"{expected} in the fp32 range [{FP32_TINY:.6g}, {FP32_MAX:.6g}]", value)
    return float(value)


def names(items: Iterable[object]) -> str:
    """Render a collection of names as a short, sorted, comma-separated list."""
    rendered = sorted(str(getattr(i, "value", i)) for i in items)
    return ", ".join(rendered) if rendered else "none"
