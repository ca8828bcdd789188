"""Setting an environment variable around one library call, for libraries steered only that way.

The Ascend DeepEP port reads `DEEP_NORMAL_MODE_USE_INT8_QUANT` when its normal-mode dispatch
runs, so one process-wide variable would decide int8 for every layer. moe-hal sets it only
for the duration of the call that reads it, from the calling layer's own plan, and restores
the previous value afterwards. The lock serialises those calls inside this process; it cannot
protect code outside moe-hal that reads or writes the same variable at the same moment.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: Serialises every scoped setting made by this module (not a per-model setting: a mutex).
_LOCK = threading.Lock()


@contextmanager
def scoped_environment(name: str, value: str) -> Iterator[None]:
    """Hold `os.environ[name] = value` for the body only, then restore the previous state."""
    with _LOCK:
        previous = os.environ.get(name)
        os.environ[name] = value
        try:
            yield
        finally:
            if previous is None:
                del os.environ[name]
            else:
                os.environ[name] = previous
