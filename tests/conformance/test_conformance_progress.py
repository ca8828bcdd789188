"""`hal conformance` in a log (no terminal) prints progress at least every few seconds of work, not only
per tenth of the suite."""

from __future__ import annotations

import io

from rich.console import Console

from conformance.cli import PROGRESS_EVERY_S, _progress_display
from conformance.runner import Progress


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _lines(seconds_per_test: float, total: int = 900) -> list[str]:
    out, clock = io.StringIO(), _Clock()
    show = _progress_display(Console(file=out, width=200, force_terminal=False), clock=clock)
    with show:
        for done in range(1, total + 1):
            clock.now += seconds_per_test
            show(Progress("cpu", done, total, done, 0, 0))
    return out.getvalue().splitlines()


def test_a_slow_suite_reports_every_few_seconds():
    lines = _lines(seconds_per_test=0.5)  # 450 s of work: a tenth is 45 s
    assert len(lines) >= 450 / PROGRESS_EVERY_S - 1
    assert lines[-1] == "cpu: 900/900 tests (passed 900, failed 0, skipped 0)"


def test_a_fast_suite_reports_once_per_tenth():
    lines = _lines(seconds_per_test=0.001)
    assert len(lines) == 11 and lines[0].startswith("cpu: 1/900") and lines[1].startswith("cpu: 90/900")
