"""`hal conformance` and `hal doctor`, registered in the `hal.commands` entry-point group.

`hal conformance` runs the suite for vendors, shows progress and the matrix and writes the
reports; `hal doctor` runs each declared op of one vendor once (`conformance.doctor`).
Registering imports nothing heavy: pytest is needed only when the suite runs, so a plain
install (without the `[test]` extra) still has `hal doctor`, and `hal conformance` says what
to install. Arguments are checked before anything runs (exit status 2); a run where a
vendor failed, could not run, or ran no test at all exits with 1.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.progress import Progress as Bar
from rich.table import Table

from hal import HalError, InvalidInput, UnknownVendor, VendorUnavailable
from hal.cli import positive_int_argument

if TYPE_CHECKING:
    from conformance.report import VendorReport
    from conformance.runner import Progress
    from hal import VendorRegistry


#: The values of `--depth` (restated from `conformance.plugin`, which imports pytest).
DEPTHS = ("quick", "full")
#: The largest seed a torch generator takes (`hal doctor --seed`).
MAX_SEED = 2**64 - 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `conformance` command to the `hal` command line."""
    text = "run the shared conformance suite against vendors and write a capability report"
    parser = subparsers.add_parser("conformance", help=text, description=text)
    parser.add_argument(
        "--vendor",
        action="extend",
        nargs="+",
        dest="vendors",
        metavar="NAME",
        type=_vendor_name,
        help="vendors to test (--vendor a b, or repeated; default: every available vendor)",
    )
    parser.add_argument(
        "--report",
        type=Path,
        default=Path("conformance-report"),
        metavar="DIR",
        help="directory for conformance.json, conformance.md and pytest logs (default: ./conformance-report)",
    )
    parser.add_argument(
        "-n",
        "--workers",
        type=_workers,
        default=0,
        metavar="N",
        help="pytest-xdist worker processes per vendor ('auto' for one per CPU; default 0: in this process)",
    )
    parser.add_argument("-k", dest="keyword", metavar="EXPR", help="only tests matching this pytest -k expression")
    parser.add_argument(
        "--depth",
        choices=DEPTHS,
        default="quick",
        help="shape sweeps and property tests: quick (CI on a CPU; default) or full (the shapes "
        "of large models: thousands of tokens, 256 experts; for accelerators)",
    )
    parser.add_argument(
        "--ep-ranks",
        type=positive_int_argument,
        default=0,
        metavar="N",
        help="run the expert-parallel section instead, on N local ranks (one device each where the "
        "vendor has devices); writes ep-conformance.json and .md",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of tables")
    parser.set_defaults(handler=conformance)


def _vendor_name(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError(f"expected a vendor name, got {value!r}")
    return value.strip().lower()


def _seed(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {value!r}") from None
    if not 0 <= number <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a seed from 0 to 2**64 - 1, got {value!r}")
    return number


def _workers(value: str) -> int:
    if value == "auto":
        return os.cpu_count() or 1
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of workers or 'auto', got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number of workers, got {value!r}")
    return number


def conformance(args: argparse.Namespace, console: Console) -> int:
    """Run the suite for each vendor; exit status 1 when anything failed, could not run, or no test ran."""
    if args.ep_ranks:
        from conformance.ep.launch import run_section

        _writable_directory(args.report)
        return run_section(args, console)
    if importlib.util.find_spec("pytest") is None:
        raise HalError(
            "hal conformance runs the suite with pytest, which is not installed: pip install 'moe-hal[test]'"
        )
    try:
        from conformance.report import as_json, print_matrix, write_reports
    except ImportError as exc:  # pytest present but broken, or another test dependency missing
        raise HalError(f"hal conformance could not load the suite ({exc}): pip install 'moe-hal[test]'") from None

    from hal import VendorRegistry

    _writable_directory(args.report)
    registry = VendorRegistry.discover()
    names = list(args.vendors) if args.vendors else [v.name for v in registry.available()]
    for name in names:
        _refuse_unknown(registry, name)
    if not names:
        raise HalError("no vendor is available to test; `hal vendors` says why")
    with contextlib.ExitStack() as stack:
        stream = _terminal_stream()
        if stream is not None:
            stack.callback(stream.close)
        screen = (
            Console(
                file=stream, highlight=False, width=console.width, force_terminal=console.is_terminal, quiet=args.json
            )
            if stream is not None
            else console
        )
        reports = [_run_one(registry, name, args, screen) for name in dict.fromkeys(names)]
    payload = as_json(reports)
    json_path, md_path = write_reports(reports, args.report, payload)
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        for report in reports:
            print_matrix(report, console)
        console.print(f"report: {escape(str(json_path))} and {escape(str(md_path))}")
    empty = [r.vendor for r in reports if r.run is not None and not r.run.ran]
    if empty:
        selected = f" (-k {args.keyword!r} selected none)" if args.keyword else ""
        sys.stderr.write(f"hal: error: no conformance test ran for {', '.join(empty)}{selected}\n")
    return 0 if all(r.ok for r in reports) else 1


def _refuse_unknown(registry: VendorRegistry, name: str) -> None:
    """An unknown name is a bad argument (exit 2), refused before any run; a vendor that is installed but
    unavailable, or whose plugin fails to load, is run as far as it can be and reported (exit 1)."""
    try:
        registry.select(name, require_available=False)
    except UnknownVendor:
        raise
    except VendorUnavailable:
        pass


def _writable_directory(path: Path) -> None:
    """Create `path` and check that files can be written in it, before anything runs."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise InvalidInput(
            f"--report: expected a directory that can be created and written, got {str(path)!r} ({exc.strerror or exc})"
        ) from None


def _run_one(registry: VendorRegistry, name: str, args: argparse.Namespace, screen: Console) -> VendorReport:
    from conformance.report import VendorReport
    from conformance.runner import run_suite

    try:
        vendor = registry.select(name).vendor
    except HalError as exc:
        return VendorReport(name, not_run=str(exc))
    caps = vendor.capabilities()
    report = VendorReport(vendor.name, vendor.description, caps.device_name, caps)
    log = args.report / f"pytest-{vendor.name}.log"
    screen.print(
        f"conformance suite on vendor {escape(vendor.name)} ({escape(caps.device_name)}); "
        f"pytest output in {escape(str(log))}"
    )
    with _progress_display(screen) as show:
        report.run = run_suite(
            vendor.name, workers=args.workers, keyword=args.keyword, log=log, on_progress=show, depth=args.depth
        )
    if report.run.exit_code == USAGE_ERROR:
        _refuse_usage(args, log)
    return report


#: pytest's exit status for a command line it refuses (`pytest.ExitCode.USAGE_ERROR`).
USAGE_ERROR = 4


def _refuse_usage(args: argparse.Namespace, log: Path) -> None:
    """pytest refused the command line (in practice, a `-k` expression): say so as a bad argument."""
    try:
        lines = log.read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    said = next(
        (line.removeprefix("ERROR: ").strip() for line in lines if line.startswith("ERROR:")),
        f"pytest exit status {USAGE_ERROR}, see {log}",
    )
    if args.keyword:
        raise InvalidInput(f"-k: expected a pytest -k expression, got {args.keyword!r} ({said})")
    raise HalError(f"pytest refused the suite's command line: {said}")


#: Longest wait between two progress lines in a log (no terminal), while tests keep finishing.
PROGRESS_EVERY_S = 5.0


class _progress_display:
    """A progress bar on a terminal; otherwise (CI logs) a line per tenth of the suite, and at least one every
    `every_s` seconds of work."""

    def __init__(self, screen: Console, every_s: float = PROGRESS_EVERY_S, clock=time.monotonic) -> None:  # type: ignore[no-untyped-def]
        self.screen = screen
        self.bar: Bar | None = None
        self.task: TaskID | None = None
        self.printed = -1
        self.every_s, self.clock = every_s, clock
        self.last = clock()

    def __enter__(self) -> _progress_display:
        if self.screen.is_terminal:
            self.bar = Bar(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[counts]}"),
                TimeElapsedColumn(),
                console=self.screen,
            )
            self.bar.start()
        return self

    def __call__(self, progress: Progress) -> None:
        counts = f"passed {progress.passed}, failed {progress.failed}, skipped {progress.skipped}"
        if self.bar is not None:
            if self.task is None:
                self.task = self.bar.add_task(progress.vendor, total=progress.total, counts=counts)
            self.bar.update(self.task, completed=progress.done, total=progress.total, counts=counts)
            return
        tenth = progress.done * 10 // progress.total if progress.total else 0
        now = self.clock()
        if progress.total and (tenth > self.printed or now - self.last >= self.every_s):
            self.printed, self.last = max(tenth, self.printed), now
            self.screen.print(f"{progress.vendor}: {progress.done}/{progress.total} tests ({counts})")

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _terminal_stream() -> IO[str] | None:
    """A duplicate of stdout that pytest's output capture cannot redirect (None if stdout has no fd)."""
    try:
        return os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1, encoding="utf-8", closefd=True)
    except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
        return None


def register_doctor(subparsers: argparse._SubParsersAction) -> None:
    """Add the `doctor` command to the `hal` command line."""
    text = "run the selected vendor's ops once against float64 references"
    parser = subparsers.add_parser("doctor", help=text, description=text)
    parser.add_argument(
        "--vendor", type=_vendor_name, help="vendor name (default: HAL_VENDOR, then the highest-priority available)"
    )
    parser.add_argument("--seed", type=_seed, default=0, help="random seed, 0 to 2**64 - 1 (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(handler=doctor)


def doctor(args: argparse.Namespace, console: Console) -> int:
    """`hal doctor`: select a vendor and run each of its declared ops once against float64."""
    from conformance.doctor import run_doctor
    from hal import VendorRegistry

    selection = VendorRegistry.discover().select(args.vendor)
    vendor = selection.vendor
    results = run_doctor(vendor, seed=args.seed)
    failed = [r for r in results if not r.passed]
    if args.json:
        print(
            json.dumps(
                {
                    "vendor": vendor.name,
                    "device": vendor.capabilities().device_name,
                    "selection": {"source": selection.source.value, "detail": selection.detail},
                    "checks": [r.as_dict() for r in results],
                    "failed": len(failed),
                },
                indent=2,
            )
        )
        return 1 if failed else 0
    console.print(
        f"vendor: {vendor.name} on {escape(vendor.capabilities().device_name)} "
        f"(selected by {selection.source}: {escape(selection.detail)})"
    )
    table = Table(title="ops against float64 references (the conformance suite's bounds)", title_justify="left")
    for column in ("check", "result", "max error", "bound", "ms"):
        table.add_column(column, overflow="fold")
    for r in results:
        table.add_row(
            r.name,
            "[green]pass[/]" if r.passed else "[red]FAIL[/]",
            "-" if r.max_error is None else f"{r.max_error:.3g}",
            "-" if r.bound is None else f"{r.bound:.3g}",
            f"{r.seconds * 1000:.1f}",
        )
    console.print(table)
    for r in failed:
        if r.detail:
            console.print(f"[red]{escape(r.name)}:[/] {escape(r.detail)}")
    console.print(f"{len(results) - len(failed)} of {len(results)} checks passed")
    return 1 if failed else 0
