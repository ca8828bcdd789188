"""The EP benchmark's outputs (`bench.ep`): one row per case, a table per dispatch dtype for people,
JSON for tools (docs/bench-ep.md explains the columns)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table


@dataclass
class Row:
    """The measurements of one case: the slowest rank's median times (µs), bytes per rank."""

    dispatcher: str
    mode: str
    dtype: str
    tokens: int
    capacity: int | None = None
    status: str = "ok"
    reason: str | None = None
    plan_dtype: str | None = None
    bytes_per_token: int | None = None
    dispatch_bytes: int | None = None
    combine_bytes: int | None = None
    dispatch_us: float | None = None
    a2a_dispatch_us: float | None = None
    combine_us: float | None = None
    a2a_combine_us: float | None = None
    layer_us: float | None = None
    local_layer_us: float | None = None
    #: the layer captured in a CUDA graph and replayed (low-latency mode, where the device has graphs), and the
    #: single-rank layer of this rank's experts the same way
    layer_graph_us: float | None = None
    local_layer_graph_us: float | None = None
    #: dispatch and combine alone, replayed from CUDA graphs (low-latency mode)
    dispatch_graph_us: float | None = None
    combine_graph_us: float | None = None
    local_reason: str | None = None  #: why the single-rank layer could not run (a `hal.HalError`)
    derived: dict[str, float | None] = field(default_factory=dict)

    def skip(self, reason: str) -> Row:
        """This row, marked skipped for `reason`."""
        self.status, self.reason = "skipped", reason
        return self.finish()

    def finish(self) -> Row:
        """Fill `derived`: % of the all-to-all baseline (baseline time / our time), GB/s, layer / local."""
        self.derived = {
            "dispatch_pct_of_a2a": _pct(self.a2a_dispatch_us, self.dispatch_us),
            "dispatch_GBps": _rate(self.dispatch_bytes, self.dispatch_us),
            "a2a_dispatch_GBps": _rate(self.dispatch_bytes, self.a2a_dispatch_us),
            "combine_pct_of_a2a": _pct(self.a2a_combine_us, self.combine_us),
            "combine_GBps": _rate(self.combine_bytes, self.combine_us),
            "a2a_combine_GBps": _rate(self.combine_bytes, self.a2a_combine_us),
            "layer_over_local": None
            if not self.layer_us or not self.local_layer_us
            else self.layer_us / self.local_layer_us,
            "graph_layer_over_local": None
            if not self.layer_graph_us or not self.local_layer_graph_us
            else self.layer_graph_us / self.local_layer_graph_us,
        }
        return self

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        data = asdict(self)
        derived = data.pop("derived")
        return {**data, **derived}


def _pct(baseline: float | None, ours: float | None) -> float | None:
    return None if baseline is None or not ours else 100.0 * baseline / ours


def _rate(nbytes: int | None, micros: float | None) -> float | None:
    return None if nbytes is None or not micros else nbytes / (micros * 1e-6) / 1e9


def us(value: float | None) -> str:
    """A time in µs for the table."""
    return "-" if value is None else (f"{value:.1f}" if value < 1000 else f"{value:,.0f}")


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


#: The table's columns (docs/bench-ep.md explains them).
COLUMNS = (
    "dispatcher/mode",
    "tok/rank",
    "disp µs",
    "a2a µs",
    "% a2a",
    "GB/s",
    "comb µs",
    "a2a µs",
    "% a2a",
    "layer µs",
    "local µs",
    "x local",
)
LEGEND = (
    "µs: the slowest rank's median; disp / comb: the dispatcher's dispatch / combine; a2a: "
    "all_to_all_single of the same bytes (dispatch: tokens x top-k x plan bytes per token; combine: tokens x "
    "top-k x H x 2); % a2a: a2a time / ours (100% = as fast as the plain collective); GB/s: dispatch bytes / "
    "dispatch time; local: one rank's layer holding only its own experts, no process group, on the same "
    "tokens; x local: layer / local, the price of expert parallelism"
)


def print_tables(console: Console, rows: list[Row], meta: dict[str, Any]) -> None:
    """One table per dtype, then the skipped rows' reasons and the legend."""
    console.print(
        f"[bold]EP benchmark[/bold]: {meta['vendor']} on {meta['world_size']} x {meta['device']} "
        f"({meta['backend']}), H={meta['hidden']} I={meta['intermediate']} E={meta['experts']} "
        f"top-{meta['top_k']}, {meta['local_experts']} experts per rank"
    )
    for dtype in dict.fromkeys(r.dtype for r in rows):
        table = Table(
            title=f"dispatch dtype {dtype} (scheme {meta['schemes'][dtype]})",
            box=box.SIMPLE_HEAD,
            padding=(0, 1),
            pad_edge=False,
        )
        for i, name in enumerate(COLUMNS):
            table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True, min_width=len(name))
        for r in (r for r in rows if r.dtype == dtype):
            d = r.derived
            label = f"{r.dispatcher}/{r.mode}"
            if r.status != "ok":
                table.add_row(label, str(r.tokens), "skipped", *["-"] * (len(COLUMNS) - 3))
                continue
            table.add_row(
                label,
                str(r.tokens),
                us(r.dispatch_us),
                us(r.a2a_dispatch_us),
                _num(d["dispatch_pct_of_a2a"], ".0f") + "%",
                _num(d["dispatch_GBps"], ".3g"),
                us(r.combine_us),
                us(r.a2a_combine_us),
                _num(d["combine_pct_of_a2a"], ".0f") + "%",
                us(r.layer_us),
                us(r.local_layer_us),
                _num(d["layer_over_local"], ".2f"),
            )
        console.print(table)
    graphed = [r for r in rows if r.layer_graph_us is not None]
    if graphed:
        table = Table(
            title="low-latency mode replayed from CUDA graphs", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False
        )
        for i, name in enumerate(
            ("dtype", "dispatcher", "tok/rank", "disp µs", "comb µs", "layer µs", "local µs", "x local")
        ):
            table.add_column(name, justify="left" if i < 2 else "right", no_wrap=True)
        for r in graphed:
            table.add_row(
                r.dtype,
                r.dispatcher,
                str(r.tokens),
                us(r.dispatch_graph_us),
                us(r.combine_graph_us),
                us(r.layer_graph_us),
                us(r.local_layer_graph_us),
                _num(r.derived["graph_layer_over_local"], ".2f"),
            )
        console.print(table)
    for r in rows:
        if r.status != "ok":
            console.print(f"skipped: {r.dtype} {r.dispatcher}/{r.mode} {r.tokens} tokens: {r.reason}", markup=False)
    console.print(LEGEND, style="dim")
