"""The current CUDA device, its current stream and whether that stream captures a graph: torch's own C calls,
bound once (their Python wrappers cost host time on every launch)."""

from __future__ import annotations

from collections.abc import Callable

import torch

#: `current_device()`: the index of the current CUDA device.
current_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
#: `current_stream(device_index)`: the raw handle of that device's current stream (what a launch runs on).
current_stream: Callable[[int], int] = getattr(
    torch._C, "_cuda_getCurrentRawStream", lambda device: torch.cuda.current_stream(device).cuda_stream
)
#: `capturing()`: whether the current stream is capturing a CUDA graph.
capturing: Callable[[], bool] = getattr(
    torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing
)
