"""Scratch for kernels that split K: each share's fp32 product and a count of finished shares per tile.

The split kernels leave every count at zero when they finish (the share that finishes last resets it),
so the counts need zeroing only once, when their memory is new. `SplitScratch` keeps one pair of
buffers per (device, stream) and hands them to every eager call on that stream: calls on one stream run
one after the other, so they never share the buffers at the same time, and an eager split call then
allocates nothing. Under CUDA-graph capture it hands out fresh zeroed buffers instead (`FreshScratch`),
which the graph owns: a replay may run on any stream, beside eager calls on the capturing one.
"""

from __future__ import annotations

import threading

import torch

from vendors.cuda.kernels.current import capturing, current_device, current_stream


class FreshScratch:
    """Newly allocated buffers per call: the shares uninitialised, the counts zeroed (one fill for both)."""

    def buffers(self, device: torch.device, shares: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(fp32 [>= shares], int32 [>= tiles] of zeros)` on `device`."""
        memory = torch.zeros(shares + tiles, dtype=torch.float32, device=device)
        return memory[:shares], memory[shares:].view(torch.int32)


class SplitScratch(FreshScratch):
    """One pair of buffers per (device, stream), grown when a call needs more, reused by eager calls."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def buffers(self, device: torch.device, shares: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept buffers of the current stream (at least `shares` fp32 values and `tiles` zeroed counts);
        fresh ones while the stream captures a CUDA graph."""
        if device.type != "cuda" or capturing():
            return super().buffers(device, shares, tiles)
        index = device.index if device.index is not None else current_device()
        key = (index, current_stream(index))
        found = self._kept.get(key)
        if found is None or found[0].numel() < shares or found[1].numel() < tiles:
            with self._lock:
                old_shares, old_tiles = (0, 0) if found is None else (found[0].numel(), found[1].numel())
                part = torch.empty(max(shares, old_shares), dtype=torch.float32, device=device)
                done = torch.zeros(max(tiles, old_tiles), dtype=torch.int32, device=device)
                found = self._kept[key] = (part, done)
        return found

    def clear(self) -> None:
        """Drop every kept buffer (their memory returns to torch's allocator)."""
        with self._lock:
            self._kept.clear()
