"""`hal load`: summarise recorded expert-load statistics (`moe.dump_expert_load` files) per layer, and
compare the balanced placement with the greedy baseline on them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from typing import TYPE_CHECKING

from hal import InvalidInput
from hal.cli import positive_int_argument

if TYPE_CHECKING:
    from rich.console import Console


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `load` command to the `hal` command line."""
    text = "summarise recorded per-expert load (moe.dump_expert_load files): imbalance per layer"
    parser = subparsers.add_parser("load", help=text, description=text)
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE", help="JSON written by moe.dump_expert_load")
    parser.add_argument(
        "--ranks",
        type=positive_int_argument,
        help="also place each layer's experts over this many expert-parallel ranks: busiest rank / mean, "
        "for the greedy baseline and the balanced placement",
    )
    parser.add_argument(
        "--redundant", type=int, default=0, metavar="R", help="redundant expert slots for --ranks (default 0)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.set_defaults(handler=load)


def load(args: argparse.Namespace, console: Console) -> int:
    """Read every file, print one row per (file, layer)."""
    from moe.expert_load import summarize

    if args.redundant < 0:
        raise InvalidInput(f"--redundant: expected an int >= 0, got {args.redundant}")
    if args.redundant and not args.ranks:
        raise InvalidInput("--redundant: expected --ranks as well (redundant slots are placed over the ranks)")
    rows = []
    for path in args.files:
        try:
            document = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidInput(f"{path}: expected a JSON file written by moe.dump_expert_load ({exc})") from None
        for row in summarize(document):
            row["file"] = str(path)
            if args.ranks:
                window = document["layers"][row["layer"]]["expert_window"]
                row.update(_placements(window, args.ranks, args.redundant))
            rows.append(row)
    if args.json:
        print(json.dumps({"layers": rows}, indent=1))
        return 0
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, title="expert load per layer (window)", title_justify="left")
    columns = ["file", "layer", "forwards", "pairs", "imbalance", "hottest", "rank_imbalance"]
    if args.ranks:
        columns += ["greedy", "balanced"]
    for column in columns:
        table.add_column(column.replace("_", " "), justify="left" if column in ("file", "layer") else "right")
    for row in rows:
        table.add_row(*(_cell(row.get(c)) for c in columns))
    console.print(table)
    console.print(
        "imbalance: max / mean of the per-expert counts; rank imbalance: of the per-rank loads under the recorded "
        "placement; greedy / balanced: busiest rank / mean for --ranks with --redundant slots"
    )
    return 0


def _placements(window: list[int], ranks: int, redundant: int) -> dict[str, float | None]:
    experts = len(window)
    slots = experts + redundant
    from moe import balanced_placement, greedy_placement

    if slots % ranks:
        raise InvalidInput(f"--ranks {ranks}: expected experts + --redundant ({slots}) divisible by the ranks")
    total = sum(window)
    if not total:
        return {"greedy": None, "balanced": None}
    mean = total / ranks
    out = {}
    for name, place in (("greedy", greedy_placement), ("balanced", balanced_placement)):
        out[name] = max(place(window, slots, ranks).rank_loads(window, ranks)) / mean
    return out


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)
