"""The capability matrix of conformance runs, as a rich table, `conformance.json` and `conformance.md`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from conformance.capability import all_labels, declared_status
from conformance.environment import environment
from conformance.runner import SuiteRun
from hal import Capabilities

JSON_NAME = "conformance.json"
MARKDOWN_NAME = "conformance.md"
#: Skip reasons shown per matrix row (all of them are in the JSON's per-test list).
REASONS_SHOWN = 3


@dataclass
class MatrixRow:
    """One capability: what the vendor declares and what its tests did."""

    capability: str
    declared: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)

    @property
    def result(self) -> str:
        """`FAIL` if anything failed, `pass` if something passed, `skipped` if all were skipped."""
        if self.failed:
            return "FAIL"
        if self.passed:
            return "pass"
        return "skipped" if self.skipped else "no tests"

    def as_dict(self) -> dict[str, Any]:
        """Plain-data view for JSON output."""
        return {
            "capability": self.capability,
            "declared": self.declared,
            "result": self.result,
            "passed": self.passed,
            "failed": self.failed,
            "skipped": self.skipped,
            "skip_reasons": self.reasons,
        }


@dataclass
class VendorReport:
    """A vendor's run (or why it did not run) and its matrix."""

    vendor: str
    description: str = ""
    device: str = ""
    capabilities: Capabilities | None = None
    run: SuiteRun | None = None
    not_run: str = ""  #: why the suite did not run (an unavailable vendor)

    @property
    def ok(self) -> bool:
        """Whether the suite ran and nothing failed."""
        return self.run is not None and self.run.ok

    def matrix(self) -> list[MatrixRow]:
        """One row per capability label, in report order (labels no test carried come last)."""
        caps = self.capabilities
        rows = {label: MatrixRow(label, declared_status(caps, label) if caps else "-") for label in all_labels()}
        for result in self.run.results if self.run else []:
            row = rows.setdefault(result.capability, MatrixRow(result.capability, "-"))
            if result.failed:
                row.failed += 1
            elif result.outcome == "skipped":
                row.skipped += 1
                if result.message not in row.reasons:
                    row.reasons.append(result.message)
            else:
                row.passed += 1
        return list(rows.values())

    def as_dict(self) -> dict[str, Any]:
        """Plain-data view for JSON output."""
        run = self.run
        return {
            "vendor": self.vendor,
            "description": self.description,
            "device": self.device,
            "ok": self.ok,
            "not_run": self.not_run or None,
            "depth": run.depth if run else None,
            "capabilities": self.capabilities.as_dict() if self.capabilities else None,
            "exit_code": run.exit_code if run else None,
            "seconds": round(run.seconds, 2) if run else None,
            "summary": run.counts() if run else None,
            "collection_errors": run.collection_errors if run else [],
            "log": run.log.name if run and run.log else None,
            "matrix": [row.as_dict() for row in self.matrix()] if run else [],
            "tests": [r.as_dict() for r in run.results] if run else [],
            "unfinished": [{"id": nodeid, "seconds": round(seconds, 1)} for nodeid, seconds in run.unfinished]
            if run
            else [],
        }


def run_depth(reports: list[VendorReport]) -> str | None:
    """The `--hal-depth` the suite ran at (one per `hal conformance` call; None if nothing ran)."""
    return next((r.run.depth for r in reports if r.run is not None), None)


def as_json(reports: list[VendorReport]) -> dict[str, Any]:
    """The whole report: environment, depth, overall verdict, one entry per vendor."""
    return {
        "environment": environment(),
        "depth": run_depth(reports),
        "ok": bool(reports) and all(r.ok for r in reports),
        "vendors": [r.as_dict() for r in reports],
    }


def _summary(report: VendorReport) -> str:
    if report.run is None:
        return f"not run: {report.not_run}"
    c = report.run.counts()
    text = (
        f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped "
        f"in {report.run.seconds:.1f} s"
    )
    if report.run.collection_errors:
        text += f"; {len(report.run.collection_errors)} collection error(s)"
    if report.run.exit_code not in (0, 1):
        text += f"; pytest exit code {report.run.exit_code}"
    if report.run.unfinished:
        text += f"; interrupted with {len(report.run.unfinished)} test(s) unfinished"
    if not report.run.ran and not report.run.collection_errors:
        text += "; no test ran"
    return text


def as_markdown(reports: list[VendorReport], env: dict[str, str] | None = None) -> str:
    """The report as Markdown: a matrix per vendor, then each failure with its message."""
    env = env or environment()
    depth = run_depth(reports)
    lines = [
        "# moe-hal conformance report",
        "",
        f"{env['date']} · moe-hal {env['moe_hal']} · torch {env['torch']} · pytest {env['pytest']} · "
        f"Python {env['python']}" + (f" · depth {depth}" if depth else ""),
        "",
    ]
    for report in reports:
        verdict = "passed" if report.ok else ("not run" if report.run is None else "FAILED")
        lines += [f"## {report.vendor}: {verdict}", ""]
        if report.device:
            lines += [f"Device: {report.device}. {report.description}".strip(), ""]
        lines += [_summary(report) + ".", ""]
        if report.run is None:
            continue
        lines += [
            "| capability | declared | result | passed | failed | skipped | skip reason |",
            "|---|---|---|---:|---:|---:|---|",
        ]
        for row in report.matrix():
            reasons = "; ".join(row.reasons[:REASONS_SHOWN]) + (" …" if len(row.reasons) > REASONS_SHOWN else "")
            lines.append(
                f"| {row.capability} | {row.declared} | {row.result} | {row.passed} | {row.failed} | "
                f"{row.skipped} | {_md(reasons)} |"
            )
        failures = [r for r in report.run.results if r.failed]
        if failures or report.run.collection_errors:
            lines += ["", "### Failures", ""]
            lines += [f"- `{r.nodeid}` ({r.capability}): {_md(r.message)}" for r in failures]
            lines += [f"- collection: {_md(e.splitlines()[0] if e else '')}" for e in report.run.collection_errors]
        lines.append("")
    return "\n".join(lines)


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_reports(
    reports: list[VendorReport], directory: Path, payload: dict[str, Any] | None = None
) -> tuple[Path, Path]:
    """Write `conformance.json` (`payload`, default `as_json(reports)`) and `conformance.md`
    into `directory`; return both paths."""
    directory.mkdir(parents=True, exist_ok=True)
    payload = payload if payload is not None else as_json(reports)
    json_path, md_path = directory / JSON_NAME, directory / MARKDOWN_NAME
    json_path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    md_path.write_text(as_markdown(reports, payload["environment"]), encoding="utf-8")
    return json_path, md_path


_STYLE = {"pass": "green", "FAIL": "bold red", "skipped": "yellow", "no tests": "dim"}


#: Unfinished tests listed on the terminal (the JSON report has them all).
_UNFINISHED_SHOWN = 10


def print_matrix(report: VendorReport, console: Console) -> None:
    """The vendor's matrix as a table, then its failures."""
    if report.run is None:
        console.print(f"[yellow]{escape(report.vendor)}: not run:[/] {escape(report.not_run)}")
        return
    table = Table(
        title=f"conformance of vendor {report.vendor!r} on {report.device} (depth {report.run.depth})",
        title_justify="left",
    )
    for column in ("capability", "declared", "result", "passed", "failed", "skipped", "skip reason"):
        table.add_column(
            column, overflow="fold", justify="right" if column in ("passed", "failed", "skipped") else "left"
        )
    for row in report.matrix():
        reasons = "; ".join(row.reasons[:1]) + (f" (+{len(row.reasons) - 1} more)" if len(row.reasons) > 1 else "")
        table.add_row(
            row.capability,
            row.declared,
            f"[{_STYLE[row.result]}]{row.result}[/]",
            str(row.passed),
            str(row.failed),
            str(row.skipped),
            escape(reasons),
        )
    console.print(table)
    for result in (r for r in report.run.results if r.failed):
        console.print(f"[red]{result.outcome.upper()}[/] {escape(result.nodeid)}: {escape(result.message)}")
    for error in report.run.collection_errors:
        console.print(f"[red]collection error[/] {escape(error.splitlines()[0] if error else '')}")
    for nodeid, seconds in report.run.unfinished[:_UNFINISHED_SHOWN]:
        console.print(f"[red]UNFINISHED[/] {escape(nodeid)} (running for {seconds:.0f} s)")
    if len(report.run.unfinished) > _UNFINISHED_SHOWN:
        console.print(
            f"[red]... and {len(report.run.unfinished) - _UNFINISHED_SHOWN} more unfinished (see the JSON report)[/]"
        )
    style = "green" if report.ok else "red"
    console.print(f"[{style}]{escape(report.vendor)}: {escape(_summary(report))}[/]")
