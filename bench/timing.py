"""Timing on the vendor's device: CUDA events where the device has them, else the wall clock."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


class DeviceTimer:
    """Median time of a callable on one device, after warm-up, over many repeats.

    On a CUDA device each repeat is bracketed by CUDA events (device time, no host
    sleeps in the number); elsewhere by `time.perf_counter`.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events = device.type == "cuda"

    def synchronize(self) -> None:
        """Wait for the device to finish queued work."""
        if self.events:
            torch.cuda.synchronize(self.device)

    def median_us(self, fn: Callable[[int], object], *, warmup: int, repeats: int) -> float:
        """Median microseconds of `fn(i)` (i counts calls, for rotating inputs)."""
        for i in range(warmup):
            fn(i)
        self.synchronize()
        times: list[float] = []
        if self.events:
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            for i in range(repeats):
                starts[i].record()
                fn(i)
                ends[i].record()
            torch.cuda.synchronize(self.device)
            times = [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends)]
        else:
            for i in range(repeats):
                t0 = time.perf_counter()
                fn(i)
                times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)


#: Relative spread of the round medians (max / min - 1) above which a measurement is called noisy.
NOISY_SPREAD = 0.10


def stable_median_us(
    timer: DeviceTimer, fn: Callable[[int], object], *, warmup: int, repeats: int, rounds: int = 3, max_rounds: int = 6
) -> tuple[float, float]:
    """Median microseconds of `fn` over rounds of `repeats` calls, and the spread of the last `rounds` round
    medians (max / min - 1). Rounds are added until that spread is within `NOISY_SPREAD` or `max_rounds` ran;
    a spread still above it marks the figure as noisy (a shared or throttled host)."""
    medians = [timer.median_us(fn, warmup=warmup, repeats=repeats)]
    while len(medians) < max_rounds:
        medians.append(timer.median_us(fn, warmup=0, repeats=repeats))
        last = medians[-rounds:]
        if len(last) == rounds and max(last) / max(min(last), 1e-9) - 1 <= NOISY_SPREAD:
            break
    last = medians[-rounds:]
    return statistics.median(last), max(last) / max(min(last), 1e-9) - 1


def wall_us(timer: DeviceTimer, fn: Callable[[int], object], *, calls: int = 50, rounds: int = 5) -> float:
    """Wall time per call of `calls` back-to-back calls and one synchronisation (what an eager engine sees:
    host time where the host is slower than the device), the median of `rounds` after one warm-up round."""
    per_call = []
    for r in range(rounds + 1):
        timer.synchronize()
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        timer.synchronize()
        if r:
            per_call.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(per_call)


def repeats_for(estimate_us: float, budget_us: float = 200_000.0, low: int = 10, high: int = 200) -> int:
    """Repeats that fit `budget_us` for a call of about `estimate_us`, between `low` and `high`."""
    return max(low, min(high, int(budget_us / max(estimate_us, 1.0))))
