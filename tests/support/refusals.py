"""The check that a call is refused with a message naming the argument."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from hal import InvalidInput


def refused(call: Callable[[], object], argument: str) -> str:
    """The message of the `InvalidInput` the call raises; it must begin with the argument's name."""
    with pytest.raises(InvalidInput) as raised:
        call()
    message = str(raised.value)
    assert re.match(rf"{re.escape(argument)}:", message), message
    return message
