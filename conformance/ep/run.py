"""One rank of the expert-parallel section: `python -m conformance.ep`.

Under a launcher (`torchrun --nproc-per-node N -m conformance.ep --vendor NAME`) the rank and world
come from `RANK` / `WORLD_SIZE` / `LOCAL_RANK` and the rendezvous from `env://`; `hal conformance
--ep-ranks N` starts the ranks itself with a `file://` rendezvous. Every rank picks the vendor by
name, makes its accelerator (LOCAL_RANK) current where the host has one, joins the vendor's
collective backend and runs every case in the same order; rank 0 prints the matrix and writes
`ep-conformance.json` and `ep-conformance.md`. Exit status: 0 when no case failed (skips are
fine), 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

import hal
from conformance.ep.cases import Case, build_cases, declared_skip
from conformance.ep.check import RankContext, run_case, scheme_skip
from conformance.ep.report import Section, fold, print_section, write_reports
from conformance.ep.world import Placement, World, choose_backend, select_device

DEPTHS = ("quick", "full")
#: Default seconds a collective of a case may wait for its peers.
DEFAULT_TIMEOUT_S = 600


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The rank's command line."""
    parser = argparse.ArgumentParser(prog="python -m conformance.ep", description=__doc__.splitlines()[0])
    parser.add_argument("--vendor", help="vendor name (default: HAL_VENDOR, then the highest-priority available)")
    parser.add_argument(
        "--depth",
        choices=DEPTHS,
        default="quick",
        help="quick (small shapes, CI on a CPU; default) or full (adds 64-256 experts, H 1000-2048)",
    )
    parser.add_argument(
        "--report",
        type=Path,
        default=Path("conformance-report"),
        metavar="DIR",
        help="where rank 0 writes ep-conformance.json and ep-conformance.md (default: ./conformance-report)",
    )
    parser.add_argument(
        "--init-method", default="env://", help="torch.distributed rendezvous (default env://, as torchrun sets it up)"
    )
    parser.add_argument("--rank", type=int, help="this process's rank (default: RANK)")
    parser.add_argument("--world-size", type=int, help="number of ranks (default: WORLD_SIZE)")
    parser.add_argument("--backend", help="collective backend (default: the vendor's declared one)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"how long a collective waits for its peers (default {DEFAULT_TIMEOUT_S})",
    )
    parser.add_argument(
        "--case",
        action="append",
        dest="patterns",
        metavar="GLOB",
        help="only cases whose id matches (fnmatch; repeatable), e.g. 'torch/auto-*'",
    )
    parser.add_argument("--json", action="store_true", help="rank 0 prints the JSON report instead of tables")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the section on this rank; the exit status every rank agrees on."""
    args = parse_args(argv)
    environ = dict(os.environ)
    try:
        placement = Placement.from_environment(args.rank, args.world_size, environ)
    except ValueError as exc:
        sys.stderr.write(f"python -m conformance.ep: error: {exc}\n")
        return 2
    where = select_device(placement)
    try:
        vendor = hal.VendorRegistry.discover().select(args.vendor).vendor
    except hal.HalError as exc:
        sys.stderr.write(f"rank {placement.rank}: error: {exc}\n")
        return 2 if isinstance(exc, hal.InvalidInput) else 1
    caps = vendor.capabilities()
    backend, backend_note = choose_backend(caps.collective_backend, args.backend)
    world = World(placement, backend, args.init_method, args.timeout)
    console = Console(highlight=False, width=120, quiet=placement.rank != 0 or args.json)
    console.print(
        f"expert-parallel section on vendor {escape(vendor.name)} ({escape(caps.device_name)}), "
        f"{placement.world} rank(s) on {backend} ({where} on rank 0), depth {args.depth}"
    )
    cases = [
        c
        for c in build_cases(caps, args.depth)
        if not args.patterns or any(fnmatch.fnmatchcase(c.id, p) for p in args.patterns)
    ]
    section = Section(
        vendor.name,
        vendor.description,
        caps.device_name,
        placement.world,
        backend,
        args.depth,
        caps.as_dict(),
        notes=[backend_note] if backend_note else [],
    )
    started = time.perf_counter()
    try:
        run_cases(cases, vendor, world, section, console)
    except Exception as exc:  # noqa: BLE001 - a peer gone (a crash, a timeout): report what ran
        section.stopped = f"the run stopped after {len(section.cases)} case(s): {type(exc).__name__}: {exc}"
    finally:
        section.seconds = time.perf_counter() - started
        world.close()
    if placement.rank == 0:
        json_path, md_path = write_reports(section, args.report)
        if args.json:
            print(json.dumps(section.as_dict(), indent=2))
        else:
            print_section(section, console)
            console.print(f"report: {escape(str(json_path))} and {escape(str(md_path))}")
    return 0 if section.ok else 1


def run_cases(cases: list[Case], vendor: hal.Vendor, world: World, section: Section, console: Console) -> None:
    """Every case on this rank, each agreed on by all ranks before the next; rank 0 shows progress."""
    place = world.placement
    ctx = RankContext(vendor, place.rank, place.world)
    caps = vendor.capabilities()
    shown = -1
    for number, case in enumerate(cases, 1):
        reason = declared_skip(case, caps, vendor.name) or scheme_skip(case, vendor)
        if reason is not None:
            outcome = {"outcome": "skipped", "message": reason, "declared": True, "notes": []}
        else:
            outcome = run_case(case, ctx, world.data)
        section.cases.append(fold(case, place.world, world.agree(outcome)))
        if section.cases[-1]["outcome"] == "failed":
            console.print(f"[red]FAILED[/] {escape(case.id)}: {escape(section.cases[-1]['message'])}")
        tenth = number * 10 // len(cases)
        if tenth > shown:
            shown = tenth
            c = section.counts()
            console.print(
                f"{number}/{len(cases)} cases (passed {c['passed']}, failed {c['failed']}, skipped {c['skipped']})"
            )
