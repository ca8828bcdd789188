"""`hal tune`: search a vendor's kernel configurations for named model shapes and write its table.

The problems are the two grouped matmuls of each model shape's MoE layer (gate/up: K=H,
N=2I, with the experts' SiLU-GLU as the layer applies it in the same call; down: K=I, N=H)
for each precision's grouped-matmul kind, at each token count. The
vendor times them (`Vendor.tune`) and returns its own table; this command writes it. Each
(problem, token count) is tuned by its own call, and the table so far is written after every
one: a run that is stopped keeps every case it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

from bench.cli import token_count, writable_file
from bench.tuning_merge import check_device, has_entries, join_runs, merge_tables, read_table
from bench.shapes import DEFAULT_PRECISIONS, PRECISIONS, SHAPES, TOKENS, ModelShape, parse_shapes
from hal import ActivationKind, InvalidInput

if TYPE_CHECKING:
    from rich.console import Console

    from hal import GemmKind, GemmProblem

_DEFAULT_MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3-ep8")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `tune` command to the `hal` command line."""
    text = "search a vendor's kernel configurations for model shapes and write its tuning table"
    parser = subparsers.add_parser("tune", help=text, description=text)
    parser.add_argument("--vendor", help="vendor to tune (default: the selected one)")
    parser.add_argument(
        "--model",
        action="extend",
        nargs="+",
        dest="models",
        metavar="NAME",
        help=f"model shapes ({', '.join(SHAPES)}; default: {' '.join(_DEFAULT_MODELS)})",
    )
    parser.add_argument(
        "--tokens",
        action="extend",
        nargs="+",
        type=token_count,
        metavar="N",
        help=f"token counts (default {' '.join(map(str, TOKENS))})",
    )
    parser.add_argument(
        "--precision",
        action="extend",
        nargs="+",
        choices=sorted(PRECISIONS),
        dest="precisions",
        help="bf16, fp8 (w8a8-fp8-block) and/or fp8-rowwise (w8a8-fp8); default bf16 and fp8 where declared",
    )
    parser.add_argument(
        "--output", type=Path, metavar="FILE", help="where to write the table (default: hal-tuning-<device>.json here)"
    )
    parser.add_argument(
        "--merge",
        type=Path,
        metavar="FILE",
        help="merge into this earlier table of the same device: its entries are kept unless tuned "
        "again now (default --output: FILE itself)",
    )
    parser.add_argument("--json", action="store_true", help="also print the table")
    parser.set_defaults(handler=tune)


def problems_for(shapes: list[ModelShape], kinds: list[GemmKind], tokens: tuple[int, ...]) -> list[GemmProblem]:
    """Both grouped matmuls of each shape, for each kind (duplicates once); the gate/up one with SiLU-GLU."""
    from hal import GemmProblem

    out: dict[tuple, GemmProblem] = {}
    for shape in shapes:
        for kind in kinds:
            for k, n, activation in (
                (shape.hidden, 2 * shape.intermediate, ActivationKind.SILU_GLU),
                (shape.intermediate, shape.hidden, None),
            ):
                out.setdefault(
                    (kind, shape.experts, k, n, shape.top_k, activation),
                    GemmProblem(kind, shape.experts, k, n, shape.top_k, tokens, activation),
                )
    return list(out.values())


def tune(args: argparse.Namespace, console: Console) -> int:
    """Tune, write the table, print where it went."""
    from rich.console import Console

    from hal import VendorRegistry, parse_scheme

    output = args.output or args.merge
    writable_file("--output", output)
    earlier = read_table(args.merge) if args.merge is not None else None
    vendor = VendorRegistry.discover().select(args.vendor).vendor
    caps = vendor.capabilities()
    if earlier is not None:
        check_device(earlier, caps.device_name, args.merge)
    try:
        shapes = parse_shapes(args.models, _DEFAULT_MODELS)
    except ValueError as exc:
        raise InvalidInput(f"--model: {exc}") from None
    kinds = []
    for precision in args.precisions or DEFAULT_PRECISIONS:
        kind = parse_scheme(PRECISIONS[precision]).compute_kind
        if kind is not None and caps.supports_gemm(kind):
            kinds.append(kind)
        elif args.precisions:
            raise InvalidInput(
                f"--precision {precision}: vendor {vendor.name!r} does not declare the {kind} grouped matmul"
            )
    vendor.check_tunable()  # after the arguments are checked, before anything is announced or written
    problems = problems_for(shapes, kinds, tuple(args.tokens or TOKENS))
    output = output or Path(f"hal-tuning-{re.sub(r'[^a-z0-9]+', '-', caps.device_name.lower()).strip('-')}.json")
    cases = [replace(problem, tokens=(tokens,)) for problem in problems for tokens in problem.tokens]
    progress = Console(stderr=True)
    progress.print(
        f"tuning {len(problems)} grouped-matmul problems x {len(problems[0].tokens)} token counts on "
        f"{caps.device_name} (vendor {vendor.name}), one case at a time; {output} is rewritten after "
        "each, so an interrupted run keeps what it measured"
    )
    table: dict | None = None
    for done, case in enumerate(cases, 1):
        part = vendor.tune([case], progress=lambda line, done=done: progress.print(f"[{done}/{len(cases)}] {line}"))
        if table is None and not has_entries(part):  # a table of the vendor's own shape: one call for everything
            progress.print("the vendor's table has no problem entries to join case by case: tuning in one call")
            written = _write(vendor.tune(problems, progress=progress.print), earlier, output, progress)
            break
        table = part if table is None else join_runs(table, part)
        written = _write(table, earlier, output, progress)
    merged = (
        ""
        if earlier is None
        else (f", merged into the {sum(len(v) for v in earlier['entries'].values())} entries of {args.merge}")
    )
    if args.json:
        print(json.dumps(written, indent=1))
    console.print(
        f"wrote {output} ({sum(len(v) for v in written.get('entries', {}).values())} entries{merged}); "
        f"vendor {vendor.name!r} reads it as its tuning table (see `hal caps --vendor {vendor.name}`)"
    )
    return 0


def _write(table: dict[str, Any], earlier: dict[str, Any] | None, output: Path, progress: Console) -> dict[str, Any]:
    """Write the table tuned so far (merged into `earlier` when given) to `output` in one replace, so the file is
    never half written; return what was written. A table that cannot be merged goes beside `output`, unmerged."""
    if earlier is not None:
        try:
            table = merge_tables(earlier, table)
        except InvalidInput:  # the fresh table is not lost: it goes beside the one it could not join
            aside = output.with_name(output.stem + ".unmerged.json")
            aside.write_text(json.dumps(table, indent=1) + "\n")
            progress.print(f"the new table was written to {aside}, unmerged")
            raise
    partial = output.with_name(output.name + ".partial")
    partial.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(partial, output)
    return table
