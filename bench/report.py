"""The benchmark's outputs: a table for people, JSON for tools."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from bench.cases import CaseResult


def _us(value: float | None) -> str:
    return "-" if value is None else (f"{value:.1f}" if value < 1000 else f"{value:,.0f}")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2g}" if value < 10 else (f"{value:.1f}" if value < 100 else f"{value:.0f}")


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


#: Columns of the table (and of the Markdown version in docs/performance.md).
COLUMNS = (
    "model",
    "tokens",
    "prec",
    "graph µs",
    "eager µs",
    "roof µs",
    "roof% g",
    "roof% e",
    "GB/s",
    "TFLOP/s",
    "ovh g",
    "ovh e",
    "loop µs",
    "vs loop",
    "wall e µs",
    "wall r µs",
    "wall e/g",
    "wall r/g",
)
LEGEND = (
    "times in µs; graph / eager: the layer under CUDA-graph replay / called eagerly; roof: max(touched "
    "weight bytes / copy bandwidth, flops / matmul peak); %rf g / e: roofline / measured time; GB/s and TF/s: "
    "achieved (best time); ovh g / e: layer time / the same kernels called directly (1.00x = no overhead); "
    "loop: a per-expert PyTorch loop (eager); x loop: loop time / the layer's best time; wall e / r: wall time per "
    "call of 50 back-to-back calls, the eager layer (launch plans where the vendor has them) / the layer replaying its captures (moe.GraphConfig); "
    "e/g, r/g: those over the graph time"
)


def rows(results: list[CaseResult]) -> list[list[str]]:
    """The table's cells, one list per case."""
    out = []
    for r in results:
        d = r.derived()
        out.append(
            [
                r.model,
                str(r.tokens),
                r.precision,
                _us(r.graph_us),
                _us(r.eager_us),
                _us(r.roofline_us),
                _pct(d["roofline_fraction_graph"]),
                _pct(d["roofline_fraction_eager"]),
                _rate(d["weight_GBps"]),
                _rate(d["TFLOPs"]),
                _x(d["overhead_graph"]),
                _x(d["overhead_eager"]),
                _us(r.loop_us),
                _x(d["speedup_vs_loop"]),
                _us(r.eager_wall_us),
                _us(r.replayed_wall_us),
                _x(d["eager_wall_vs_graph"]),
                _x(d["replayed_wall_vs_graph"]),
            ]
        )
    return out


def markdown(results: list[CaseResult]) -> str:
    """The table as Markdown."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows(results)]
    return "\n".join(lines)


#: The terminal table's shorter headers (the Markdown table keeps `COLUMNS`).
SHORT = {
    "graph µs": "graph",
    "eager µs": "eager",
    "roof µs": "roof",
    "roof% g": "%rf g",
    "roof% e": "%rf e",
    "TFLOP/s": "TF/s",
    "loop µs": "loop",
    "vs loop": "x loop",
    "wall e µs": "wall e",
    "wall r µs": "wall r",
}


def table(results: list[CaseResult], title: str) -> Table:
    """One row per case: times (µs), achieved rates, roofline fractions and ratios. Columns empty in
    every row (no graphs or roofline off a GPU) are left out, so that the table fits 100 columns."""
    cells = rows(results)
    keep = [i for i, _ in enumerate(COLUMNS) if not cells or any(row[i] != "-" for row in cells)]
    out = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False, show_edge=False, title_justify="left")
    for i in keep:
        column = COLUMNS[i]
        out.add_column(
            SHORT.get(column, column), justify="left" if column in ("model", "prec") else "right", no_wrap=True
        )
    for row in cells:
        out.add_row(*(row[i] for i in keep))
    return out


def print_report(console: Console, payload: dict[str, Any], results: list[CaseResult]) -> None:
    """The header (device, ceilings or why there are none) and the table."""
    console.print(
        f"device: {payload['device']} (vendor {payload['vendor']}), torch {payload['torch']}, {payload['date']}"
    )
    ceilings = payload.get("ceilings")
    if ceilings:
        console.print("ceilings: " + ", ".join(f"{k} {v:.0f}" for k, v in ceilings.items()))
    else:
        console.print(f"[yellow]{payload['note']}[/yellow]")
    console.print(table(results, "hal bench: MoE layer, medians"))
    console.print(LEGEND)
    noisy = [r for r in results if r.noisy]
    if noisy:
        console.print(
            "[yellow]noisy timings[/yellow] (eager medians of successive rounds still differed after the repeats "
            "allowed; the host is shared or throttled, compare with care): "
            + ", ".join(f"{r.model} {r.precision} {r.tokens} tokens ±{100 * r.eager_spread:.0f}%" for r in noisy)
        )
