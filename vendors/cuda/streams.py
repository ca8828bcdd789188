"""A second CUDA stream per device, for work that runs beside the caller's stream (shared experts)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class SideStreams:
    """One side stream per device, made on first use; `run` forks work onto it and returns the join.

    The fork and the join are stream waits, so they are captured in a CUDA graph like any
    other work; nothing synchronises with the host.
    """

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            found = self._streams.get(device.index)
            if found is None:
                found = self._streams[device.index] = torch.cuda.Stream(device=device)
            return found

    def run(self, work: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Start `work` on the side stream after what the current stream has issued; the returned
        function makes the current stream wait for it and gives its result."""
        main = torch.cuda.current_stream()
        side = self._stream(main.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            result = work()

        def join() -> torch.Tensor:
            main.wait_stream(side)
            result.record_stream(main)  # made on the side stream, used on the main one from here
            return result

        return join
