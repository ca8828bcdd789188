"""The expert-parallel section's results: one record per case (every rank's outcome folded into one),
the matrix of dispatcher and mode against dispatch dtype, a rich table, `ep-conformance.json` and
`ep-conformance.md`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from conformance.environment import environment
from conformance.ep.cases import DTYPE_SCHEMES, MODES, Case

JSON_NAME = "ep-conformance.json"
MARKDOWN_NAME = "ep-conformance.md"
#: Metrics folded over the ranks by their maximum.
METRICS = ("ep_error", "single_error", "agreement", "seconds")


def fold(case: Case, world: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One case's record from every rank's outcome: failed if any rank failed, or if only some refused;
    skipped if every rank refused; failed if the ranks took different modes."""
    record = case.describe(world)
    outcomes = [r["outcome"] for r in ranks]
    failed = [i for i, o in enumerate(outcomes) if o == "failed"]
    skipped = [i for i, o in enumerate(outcomes) if o == "skipped"]
    if failed:
        outcome, message = "failed", "; ".join(f"rank {i}: {ranks[i]['message']}" for i in failed)
    elif skipped and len(skipped) < len(ranks):
        outcome, message = "failed", f"refused on rank(s) {skipped} only: {ranks[skipped[0]]['message']}"
    elif skipped:
        outcome, message = "skipped", ranks[0]["message"]
    else:
        outcome, message = "passed", ranks[0]["message"]
    modes = [r.get("mode_taken") for r in ranks]
    if outcome == "passed" and len(set(modes)) > 1:
        outcome, message = "failed", f"the ranks took different modes: {modes}"
    record.update(
        outcome=outcome,
        message=message,
        mode_taken=modes[0] if len(set(modes)) == 1 else modes,
        resolved=ranks[0].get("resolved"),
        fallback=ranks[0].get("fallback"),
        notes=sorted({n for r in ranks for n in r.get("notes", [])}),
    )
    for metric in METRICS:
        values = [r[metric] for r in ranks if r.get(metric) is not None]
        record[metric] = max(values) if values else None
    record["ranks"] = [{k: v for k, v in r.items() if k not in ("notes", "dropped")} for r in ranks]
    return record


@dataclass
class Section:
    """The whole run: who ran it, where, and every case's record."""

    vendor: str
    description: str
    device: str
    world: int
    backend: str
    depth: str
    capabilities: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    cases: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    stopped: str = ""  #: why the run ended before its last case (empty: it did not)

    def counts(self) -> dict[str, int]:
        """Cases by outcome."""
        counted = {o: sum(c["outcome"] == o for c in self.cases) for o in ("passed", "failed", "skipped")}
        return {**counted, "total": len(self.cases)}

    @property
    def ok(self) -> bool:
        """Every case ran, nothing failed, and something ran."""
        counts = self.counts()
        return not self.stopped and counts["failed"] == 0 and counts["total"] > 0

    def matrix(self) -> list[dict[str, Any]]:
        """One row per (dispatcher, mode): passed / failed / skipped cases per dispatch dtype."""
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for c in self.cases:
            row = rows.setdefault(
                (c["dispatcher"], c["mode"]), {"dispatcher": c["dispatcher"], "mode": c["mode"], "dtypes": {}}
            )
            cell = row["dtypes"].setdefault(c["dtype"], {"passed": 0, "failed": 0, "skipped": 0})
            cell[c["outcome"]] += 1
        return sorted(
            rows.values(), key=lambda r: (r["dispatcher"] != "torch", r["dispatcher"], MODES.index(r["mode"]))
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain data for `ep-conformance.json`."""
        return {
            "section": "expert-parallel",
            "environment": environment(),
            "vendor": self.vendor,
            "description": self.description,
            "device": self.device,
            "world_size": self.world,
            "backend": self.backend,
            "depth": self.depth,
            "ok": self.ok,
            "summary": self.counts(),
            "seconds": round(self.seconds, 2),
            "stopped": self.stopped or None,
            "notes": self.notes,
            "matrix": self.matrix(),
            "capabilities": self.capabilities,
            "cases": self.cases,
        }


def _cell(cell: dict[str, int] | None) -> str:
    if not cell:
        return "-"
    ran = cell["passed"] + cell["failed"]
    if cell["failed"]:
        return f"FAIL {cell['failed']} of {ran}" + (f", {cell['skipped']} skipped" if cell["skipped"] else "")
    if ran:
        return f"pass {ran}" + (f", {cell['skipped']} skipped" if cell["skipped"] else "")
    return f"skipped {cell['skipped']}"


def _summary(section: Section) -> str:
    c = section.counts()
    return (
        f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped of {c['total']} cases "
        f"in {section.seconds:.1f} s" + ("; stopped early" if section.stopped else "")
    )


def _title(section: Section) -> str:
    return (
        f"expert-parallel conformance of vendor {section.vendor!r} on {section.world} rank(s) "
        f"({section.device}, {section.backend}, depth {section.depth})"
    )


_STYLE = {"FAIL": "bold red", "pass": "green", "skipped": "yellow", "-": "dim"}


def print_section(section: Section, console: Console) -> None:
    """The matrix as a table, then the failures and the distinct skip reasons."""
    table = Table(title=_title(section), title_justify="left")
    for column in ("dispatcher", "mode", *DTYPE_SCHEMES):
        table.add_column(
            column if column in ("dispatcher", "mode") else f"{column} ({DTYPE_SCHEMES[column]})", overflow="fold"
        )
    for row in section.matrix():
        cells = [_cell(row["dtypes"].get(d)) for d in DTYPE_SCHEMES]
        table.add_row(row["dispatcher"], row["mode"], *(f"[{_STYLE[c.split()[0]]}]{c}[/]" for c in cells))
    console.print(table)
    for note in section.notes:
        console.print(f"note: {escape(note)}")
    if section.stopped:
        console.print(f"[red]{escape(section.stopped)}[/]")
    for c in section.cases:
        if c["outcome"] == "failed":
            console.print(f"[red]FAILED[/] {escape(c['id'])}: {escape(c['message'])}")
    for reason, count in _skip_reasons(section).items():
        console.print(f"[yellow]skipped[/] {count} case(s): {escape(reason)}")
    for note in sorted({n for c in section.cases for n in c["notes"]}):
        console.print(f"note: {escape(note)}")
    console.print(f"[{'green' if section.ok else 'red'}]{escape(section.vendor)}: {_summary(section)}[/]")


def _skip_reasons(section: Section) -> dict[str, int]:
    reasons: dict[str, int] = {}
    for c in section.cases:
        if c["outcome"] == "skipped":
            reasons[c["message"]] = reasons.get(c["message"], 0) + 1
    return reasons


def _md(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def as_markdown(section: Section, env: dict[str, str]) -> str:
    """The matrix, the failures, the skip reasons and every case, as Markdown."""
    lines = [
        f"# {_title(section)}",
        "",
        f"{env['date']} · moe-hal {env['moe_hal']} · torch {env['torch']} · Python {env['python']}",
        "",
        f"{'passed' if section.ok else 'FAILED'}: {_summary(section)}.",
        "",
        "| dispatcher | mode | " + " | ".join(f"{d} ({s})" for d, s in DTYPE_SCHEMES.items()) + " |",
        "|---|---|" + "---|" * len(DTYPE_SCHEMES),
    ]
    for row in section.matrix():
        lines.append(
            f"| {row['dispatcher']} | {row['mode']} | "
            + " | ".join(_cell(row["dtypes"].get(d)) for d in DTYPE_SCHEMES)
            + " |"
        )
    lines += [""] + [f"Note: {_md(n)}\n" for n in section.notes]
    if section.stopped:
        lines += [f"**{_md(section.stopped)}**", ""]
    failures = [c for c in section.cases if c["outcome"] == "failed"]
    if failures:
        lines += ["## Failures", ""] + [f"- `{c['id']}`: {_md(c['message'])}" for c in failures] + [""]
    reasons = _skip_reasons(section)
    if reasons:
        lines += ["## Skipped", ""] + [f"- {count} case(s): {_md(r)}" for r, count in reasons.items()] + [""]
    header = "| case | result | resolved | mode taken | EP error | single-rank error | EP vs single | tokens per rank |"
    lines += ["## Cases", "", header, "|---|---|---|---|---:|---:|---:|---|"]
    for c in section.cases:
        lines.append(
            f"| `{c['id']}` | {c['outcome']} | {c['resolved'] or '-'} | {_md(c['mode_taken'] or '-')} | "
            f"{_number(c['ep_error'])} | {_number(c['single_error'])} | {_number(c['agreement'])} | "
            f"{c['tokens_per_rank']} |"
        )
    return "\n".join(lines) + "\n"


def write_reports(section: Section, directory: Path) -> tuple[Path, Path]:
    """Write `ep-conformance.json` and `ep-conformance.md` into `directory`; return both paths."""
    directory.mkdir(parents=True, exist_ok=True)
    payload = section.as_dict()
    json_path, md_path = directory / JSON_NAME, directory / MARKDOWN_NAME
    json_path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    md_path.write_text(as_markdown(section, payload["environment"]), encoding="utf-8")
    return json_path, md_path
