"""Run the suite against one vendor, in this process, through `pytest.main`, and collect the results.

A `ResultCollector` plugin gathers one `CaseResult` per test (setup, call and teardown
folded together) and reports progress as tests finish; it works with and without
pytest-xdist (`workers`), whose worker processes also isolate a crashing kernel.
pytest's own output goes to a log file, so nothing it prints is lost. A run stopped by
SIGTERM (a time limit) or Ctrl-C ends like an interrupted pytest run, and its `SuiteRun`
names the tests that were still running and for how long.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conformance import SUITE_DIR
from conformance.plugin import DEFAULT_DEPTH, DEPTHS, PROPERTY
from hal import InvalidInput

#: Longest failure text kept per test in the report (the log holds everything).
MAX_DETAILS = 6000


@dataclass
class CaseResult:
    """One suite test: its id, matrix row, outcome and what it said."""

    nodeid: str
    capability: str
    outcome: str = "passed"  #: passed, failed, skipped or error (a failing setup or teardown)
    seconds: float = 0.0
    message: str = ""  #: the skip reason or the failure's one-line summary
    details: str = ""  #: the failure's traceback, truncated

    @property
    def failed(self) -> bool:
        """Whether the test counts as a failure (failed or errored)."""
        return self.outcome in ("failed", "error")

    def as_dict(self) -> dict[str, Any]:
        """Plain-data view for JSON output."""
        return {
            "id": self.nodeid,
            "capability": self.capability,
            "outcome": self.outcome,
            "seconds": round(self.seconds, 4),
            "message": self.message,
            "details": self.details,
        }


@dataclass(frozen=True)
class Progress:
    """How far a run is: tests finished out of those collected, by outcome."""

    vendor: str
    done: int
    total: int
    passed: int
    failed: int
    skipped: int


@dataclass
class SuiteRun:
    """The outcome of running the suite against one vendor."""

    vendor: str
    exit_code: int
    results: list[CaseResult]
    collection_errors: list[str] = field(default_factory=list)
    log: Path | None = None
    seconds: float = 0.0
    depth: str = DEFAULT_DEPTH  #: the `--hal-depth` it ran at
    #: tests started but not finished when the run ended (an interrupted run), longest-running first,
    #: with their seconds so far
    unfinished: list[tuple[str, float]] = field(default_factory=list)

    @property
    def ran(self) -> int:
        """How many tests ran (were collected and selected), whatever their outcome."""
        return len(self.results)

    def counts(self) -> dict[str, int]:
        """Tests per outcome (errors counted apart from failures)."""
        totals = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
        for result in self.results:
            totals[result.outcome] += 1
        return totals

    @property
    def ok(self) -> bool:
        """Whether pytest finished cleanly, something ran, and nothing failed."""
        return (
            self.exit_code == 0
            and self.ran > 0
            and not self.collection_errors
            and not self.unfinished
            and not any(r.failed for r in self.results)
        )


class ResultCollector:
    """A pytest plugin object gathering results and reporting progress (controller side)."""

    def __init__(self, vendor: str, on_progress: Callable[[Progress], None] | None = None) -> None:
        self.vendor = vendor
        self.on_progress = on_progress
        self.total = 0
        self.results: dict[str, CaseResult] = {}
        self.collection_errors: list[str] = []
        self._finished: set[str] = set()
        self._started: dict[str, float] = {}  #: running tests -> when they started (monotonic)
        self._tally = {"passed": 0, "failed": 0, "skipped": 0}  #: finished tests by outcome
        self.interrupted: str | None = None  #: why the run was told to stop (a signal), once it was
        self._session: pytest.Session | None = None

    def interrupt(self, reason: str) -> None:
        """The run was told to stop: no further test starts, and a test that reports after this point
        stays unfinished, even where its own code caught the KeyboardInterrupt (hypothesis, for one,
        can turn an interrupted example into a flaky-test failure and carry on)."""
        self.interrupted = reason
        self._stop()

    def _stop(self) -> None:
        if self._session is not None:
            self._session.shouldstop = f"interrupted by {self.interrupted}"

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """Keep the session, to stop it when interrupted."""
        self._session = session

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Without xdist: the number of tests collected."""
        self.total = len(session.items)
        self._report()

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: object, ids: list[str]) -> None:
        """With xdist: every worker collects the same tests."""
        self.total = max(self.total, len(ids))
        self._report()

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """Keep collection errors (an unimportable suite module fails the run)."""
        if report.failed:
            self.collection_errors.append(f"{report.nodeid or 'collection'}: {report.longreprtext[:MAX_DETAILS]}")

    def pytest_runtest_logstart(self, nodeid: str, location: object) -> None:
        """A test started (with xdist, on some worker)."""
        self._started.setdefault(nodeid, time.monotonic())

    def unfinished(self) -> list[tuple[str, float]]:
        """Tests started and not finished, longest-running first, with their seconds so far."""
        now = time.monotonic()
        running = [(nodeid, now - start) for nodeid, start in self._started.items() if nodeid not in self._finished]
        return sorted(running, key=lambda item: -item[1])

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Fold the setup, call and teardown reports of each test into one result."""
        if self.interrupted is not None:
            self._stop()
            return
        properties = dict(report.user_properties)
        result = self.results.setdefault(
            report.nodeid, CaseResult(report.nodeid, str(properties.get(PROPERTY, "unlabelled")))
        )
        result.seconds += report.duration
        if report.skipped:
            result.outcome, result.message = "skipped", _skip_reason(report)
        elif report.failed:
            result.outcome = "failed" if report.when == "call" else "error"
            result.message = _failure_summary(report)
            result.details = report.longreprtext[:MAX_DETAILS]
        if report.when == "teardown" and report.nodeid not in self._finished:
            self._finished.add(report.nodeid)
            self._tally["failed" if result.failed else result.outcome] += 1
            self._report()

    def _report(self) -> None:
        if self.on_progress is None:
            return
        done = len(self._finished)
        self.on_progress(Progress(self.vendor, done, max(self.total, done), **self._tally))


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _failure_summary(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = getattr(crash, "message", None) or report.longreprtext
    return " ".join(text.split())[:400]


def pytest_arguments(
    vendor: str, *, workers: int = 0, keyword: str | None = None, depth: str = DEFAULT_DEPTH
) -> list[str]:
    """The pytest command line that runs the suite against `vendor`, isolated from the caller's config."""
    if depth not in DEPTHS:
        raise InvalidInput(f"depth: expected one of {', '.join(DEPTHS)}, got {depth!r}")
    args = [
        str(SUITE_DIR),
        "--hal-vendor",
        vendor,
        "--hal-depth",
        depth,
        "--rootdir",
        str(SUITE_DIR),
        "-c",
        os.devnull,
        "-p",
        "no:cacheprovider",
        "-ra",
    ]
    if workers:
        if importlib.util.find_spec("xdist") is None:
            raise InvalidInput(f"-n: expected pytest-xdist to be installed for {workers} workers, got none")
        args += ["-n", str(workers)]
    if keyword:
        args += ["-k", keyword]
    return args


def run_suite(
    vendor: str,
    *,
    workers: int = 0,
    keyword: str | None = None,
    log: Path | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    depth: str = DEFAULT_DEPTH,
) -> SuiteRun:
    """Run the conformance suite against `vendor` in this process at `depth`; pytest's output goes to `log`."""
    collector = ResultCollector(vendor, on_progress)
    args = pytest_arguments(vendor, workers=workers, keyword=keyword, depth=depth)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_sigterm_interrupts(collector.interrupt))
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            stream = stack.enter_context(log.open("w", encoding="utf-8"))
            stack.enter_context(contextlib.redirect_stdout(stream))
            stack.enter_context(contextlib.redirect_stderr(stream))
        exit_code = int(pytest.main(args, plugins=[collector]))
    unfinished = collector.unfinished()
    stopped = {nodeid for nodeid, _ in unfinished}  # their setup may have reported: they have no outcome
    results = sorted((r for r in collector.results.values() if r.nodeid not in stopped), key=lambda r: r.nodeid)
    return SuiteRun(
        vendor, exit_code, results, collector.collection_errors, log, time.perf_counter() - start, depth, unfinished
    )


@contextlib.contextmanager
def _sigterm_interrupts(on_signal: Callable[[str], None]) -> Any:
    """While the suite runs, SIGTERM (what `timeout` sends) interrupts it as Ctrl-C does, so pytest stops,
    the workers are shut down and the report still names what ran; `on_signal` hears of it first, so the
    run stops even if a test swallows the KeyboardInterrupt. Only the main thread can do this."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        on_signal(f"signal {signum}")
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
