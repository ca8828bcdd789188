"""`hal bench`: time the MoE layer on a vendor for named model shapes (registered via `hal.commands`).

The arguments only: the run (`bench.run`) imports torch when the command runs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from bench.shapes import CPU_TOKENS, MAX_TOKENS, PRECISIONS, SHAPES, TOKENS
from hal import InvalidInput
from hal.cli import lazy, positive_int_argument

if TYPE_CHECKING:
    from moe.routing_traces import RoutingTrace


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` command to the `hal` command line."""
    text = "time the MoE layer on a vendor against the device's measured roofline"
    parser = subparsers.add_parser("bench", help=text, description=text)
    parser.add_argument("--vendor", help="vendor to run (default: the selected one)")
    parser.add_argument(
        "--model",
        action="extend",
        nargs="+",
        dest="models",
        metavar="NAME",
        help=f"model shapes ({', '.join(SHAPES)}; default: the three named models on a GPU, tiny elsewhere)",
    )
    parser.add_argument(
        "--tokens",
        action="extend",
        nargs="+",
        type=token_count,
        metavar="N",
        help=f"token counts (default {' '.join(map(str, TOKENS))} on a GPU, "
        f"{' '.join(map(str, CPU_TOKENS))} elsewhere)",
    )
    parser.add_argument(
        "--precision",
        action="extend",
        nargs="+",
        choices=sorted(PRECISIONS),
        dest="precisions",
        help="bf16 (unquantized), fp8 (w8a8-fp8-block) and/or fp8-rowwise (w8a8-fp8); default bf16 and fp8 "
        "where declared",
    )
    parser.add_argument(
        "--routing",
        type=_routing,
        metavar="PATTERN",
        help="router logits following a pattern (uniform, zipf:S, hot:N:F; moe.routing_traces) instead of "
        "standard normal ones",
    )
    parser.add_argument("--output", type=Path, metavar="FILE", help="also write the JSON report to FILE")
    parser.add_argument("--markdown", type=Path, metavar="FILE", help="also write the table as Markdown to FILE")
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    parser.add_argument(
        "--ep",
        nargs=argparse.REMAINDER,
        metavar="OPTION",
        help="the expert-parallel benchmark, run under torchrun (torchrun --nproc-per-node 2 "
        "$(which hal) bench --ep ...); every option after --ep is its own: see "
        "hal bench --ep --help and docs/bench-ep.md",
    )
    parser.set_defaults(handler=lazy("bench.run:bench"))


def token_count(value: str) -> int:
    """argparse type for a token count: a positive integer of at most `MAX_TOKENS` (refused before anything
    is allocated: the layer's buffers grow with it)."""
    number = positive_int_argument(value)
    if number > MAX_TOKENS:
        raise argparse.ArgumentTypeError(
            f"expected at most {MAX_TOKENS} tokens per case (its activations and expert buffers are "
            f"allocated in full), got {number}"
        )
    return number


def _routing(text: str) -> RoutingTrace:
    from moe.routing_traces import RoutingTrace

    try:
        return RoutingTrace.parse(text)
    except InvalidInput as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def writable_file(option: str, path: Path | None) -> None:
    """Raise `InvalidInput` naming `option` unless `path` (when given) can be written: an existing
    directory holds it and it is not itself a directory."""
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InvalidInput(f"{option}: expected a file path, got the directory {str(path)!r}")
    if not parent.is_dir():
        raise InvalidInput(
            f"{option}: expected a file in an existing directory, got {str(path)!r} ({str(parent)!r} does not exist)"
        )
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InvalidInput(f"{option}: {str(path)!r} is not writable")
