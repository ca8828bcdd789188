"""The torchrun world of the EP benchmark (`bench.ep`): per-rank medians behind barriers, the slowest
rank's figure, and agreement on which case failed, so that every rank issues the same collectives."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import hal
from bench.timing import DeviceTimer

#: Untimed calls before the samples.
WARMUP = 3


class World:
    """This rank in the torchrun world: timing behind barriers, agreement on errors, the max over ranks."""

    def __init__(self, device: torch.device, repeats: int, warmup: int = WARMUP) -> None:
        self.device, self.repeats, self.warmup = device, repeats, warmup
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.timer = DeviceTimer(device)

    def synchronize(self) -> None:
        """Wait for this rank's device."""
        if self.timer.events:
            self.timer.synchronize()
        elif torch.accelerator.is_available() and self.device.type != "cpu":
            torch.accelerator.synchronize()

    def median_us(self, fn: Callable[[], object]) -> float:
        """This rank's median µs of `fn()` after the warm-up; every sample starts behind a barrier."""
        for _ in range(self.warmup):
            fn()
        samples, events = [], []
        for _ in range(self.repeats):
            self.synchronize()
            dist.barrier()
            if self.timer.events:  # device time between two events, as `bench.timing.DeviceTimer`
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                events.append((start, end))
            else:
                t0 = time.perf_counter()
                fn()
                self.synchronize()
                samples.append((time.perf_counter() - t0) * 1e6)
        self.synchronize()
        samples += [s.elapsed_time(e) * 1000.0 for s, e in events]
        return statistics.median(samples)

    def graph_median_us(self, fn: Callable[[], object]) -> float | None:
        """This rank's median µs of replaying `fn()` captured in a CUDA graph (what an engine does for decode),
        or None where the device has no graphs (or `fn` cannot be captured: every rank must then say so)."""
        if not self.timer.events:
            return None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self.median_us(graph.replay)

    def slowest(self, values: Sequence[float]) -> list[float]:
        """Each value's maximum over the ranks (one all_reduce)."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def agree(self, error: str | None) -> str | None:
        """None if no rank failed, else the first failing rank's message, naming the rank unless all failed
        (every rank gets the same answer)."""
        errors: list[str | None] = [None] * self.size
        dist.all_gather_object(errors, error)
        failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
        if not failed:
            return None
        rank, message = failed[0]
        return message if len(failed) == self.size else f"rank {rank}: {message}"

    def attempt(self, fn: Callable[[], Any]) -> tuple[Any, str | None]:
        """`fn()`, or the `hal.HalError` any rank raised (`type: message`), agreed across ranks."""
        try:
            result, error = fn(), None
        except hal.HalError as exc:
            result, error = None, f"{type(exc).__name__}: {exc}"
        error = self.agree(error)
        return (None if error else result), error
