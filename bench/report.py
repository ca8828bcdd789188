"""The benchmark's outputs: a table for people, JSON for tools."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from bench.cases import CaseResult


def _us(value: float | None) -> str:
    return "-" if value is None else (f"{value:.1f}" if value < 1000 else f"{value:,.0f}")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


#: Columns of the table (and of the Markdown version in docs/performance.md).
COLUMNS = ("model", "tokens", "prec", "graph µs", "eager µs", "roof µs", "roof% g", "roof% e", "GB/s", "TFLOP/s",
           "ovh g", "ovh e", "loop µs", "vs loop")
LEGEND = ("graph / eager: the layer under CUDA-graph replay / called eagerly; roof µs: max(touched weight bytes / "
          "copy bandwidth, flops / matmul peak); roof% g / e: roofline / measured time; GB/s and TFLOP/s: achieved "
          "(best time); ovh g / e: layer time / the same kernels called directly (1.00x = no overhead); "
          "loop µs: a per-expert PyTorch loop (eager); vs loop: loop time / the layer's best time")


def rows(results: list[CaseResult]) -> list[list[str]]:
    """The table's cells, one list per case."""
    out = []
    for r in results:
        d = r.derived()
        out.append([r.model, str(r.tokens), r.precision, _us(r.graph_us), _us(r.eager_us), _us(r.roofline_us),
                    _pct(d["roofline_fraction_graph"]), _pct(d["roofline_fraction_eager"]),
                    f"{d['weight_GBps']:.0f}", f"{d['TFLOPs']:.1f}", _x(d["overhead_graph"]),
                    _x(d["overhead_eager"]), _us(r.loop_us), _x(d["speedup_vs_loop"])])
    return out


def markdown(results: list[CaseResult]) -> str:
    """The table as Markdown."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows(results)]
    return "\n".join(lines)


def table(results: list[CaseResult], title: str) -> Table:
    """One row per case: times, achieved rates, roofline fractions and ratios."""
    out = Table(title=title)
    for column in COLUMNS:
        out.add_column(column, justify="left" if column in ("model", "prec") else "right")
    for cells in rows(results):
        out.add_row(*cells)
    return out


def print_report(console: Console, payload: dict[str, Any], results: list[CaseResult]) -> None:
    """The header (device, ceilings or why there are none) and the table."""
    console.print(f"device: {payload['device']} (vendor {payload['vendor']}), torch {payload['torch']}, "
                  f"{payload['date']}")
    ceilings = payload.get("ceilings")
    if ceilings:
        console.print("ceilings: " + ", ".join(f"{k} {v:.0f}" for k, v in ceilings.items()))
    else:
        console.print(f"[yellow]{payload['note']}[/yellow]")
    console.print(table(results, "hal bench: MoE layer, medians"))
    console.print(LEGEND)
