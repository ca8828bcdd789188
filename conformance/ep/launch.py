"""`hal conformance --ep-ranks N`: start N local ranks of `python -m conformance.ep` and wait for them.

The ranks meet through a `file://` rendezvous in a fresh temporary folder; each gets `RANK`,
`LOCAL_RANK` and `WORLD_SIZE` in its environment (as torchrun sets them), so it takes device
LOCAL_RANK where the vendor has devices, and a share of the host's CPU threads unless
`OMP_NUM_THREADS` is set. Rank 0 prints to this terminal and writes the report; the others' output
goes to `<report>/ep-rank<R>.log`. Once a rank has ended (at the end, or early: a crash, a signal)
the others get `GRACE_S` seconds, then are stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from hal import InvalidInput, VendorRegistry

#: Seconds the other ranks get to finish after one died.
GRACE_S = 30.0
#: How often the ranks are polled.
POLL_S = 0.2


def rank_command(vendor: str | None, depth: str, report: Path, init: str, *, json_output: bool) -> list[str]:
    """The command line of one rank."""
    command = [sys.executable, "-m", "conformance.ep", "--depth", depth, "--report", str(report), "--init-method", init]
    if vendor:
        command += ["--vendor", vendor]
    return command + (["--json"] if json_output else [])


def rank_environment(rank: int, ranks: int) -> dict[str, str]:
    """This process's environment plus the launcher variables of `rank` (the process's own is not changed)."""
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    return env


def run_section(args: argparse.Namespace, console: Console) -> int:
    """Run the expert-parallel section of one vendor on `args.ep_ranks` local ranks; 0 if no case failed."""
    vendors = list(dict.fromkeys(args.vendors or []))
    if len(vendors) > 1:
        raise InvalidInput(f"--ep-ranks: expected one --vendor (the ranks run one vendor), got {', '.join(vendors)}")
    if args.keyword:
        raise InvalidInput(
            "-k: selects tests of the single-process suite; --ep-ranks runs the expert-parallel "
            "section (python -m conformance.ep --case GLOB selects its cases)"
        )
    vendor = vendors[0] if vendors else None
    VendorRegistry.discover().select(vendor)  # an unknown or unavailable vendor is refused before any rank starts
    with tempfile.TemporaryDirectory(prefix="hal-ep-") as folder:
        init = (Path(folder) / "rendezvous").as_uri()
        codes = _run_ranks(args.ep_ranks, vendor, args, init)
    failed = {r: c for r, c in enumerate(codes) if c not in (0, 1)}
    for rank, code in failed.items():
        where = "above" if rank == 0 else escape(str(args.report / f"ep-rank{rank}.log"))
        console.print(f"[red]rank {rank} ended with exit status {code}[/] (its output: {where})")
    if failed or any(codes):
        return 2 if set(codes) == {2} else 1
    return 0


def _run_ranks(ranks: int, vendor: str | None, args: argparse.Namespace, init: str) -> list[int]:
    with contextlib.ExitStack() as stack:
        procs = []
        for rank in range(ranks):
            command = rank_command(vendor, args.depth, args.report, init, json_output=args.json and rank == 0)
            path = args.report / f"ep-rank{rank}.log"
            log = None if rank == 0 else stack.enter_context(open(path, "w", encoding="utf-8"))
            procs.append(
                subprocess.Popen(
                    command,
                    env=rank_environment(rank, ranks),
                    stdout=log,
                    stderr=None if log is None else subprocess.STDOUT,
                )
            )
        try:
            return _wait(procs)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def _wait(procs: list[subprocess.Popen]) -> list[int]:
    """Every rank's exit status; once one has ended, the rest get `GRACE_S` seconds (they end together when
    all is well: the last thing they do is agree on the last case)."""
    deadline: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes]  # type: ignore[arg-type]
        if deadline is None and any(c is not None for c in codes):
            deadline = time.monotonic() + GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            return [int(p.wait()) for p in procs]
        time.sleep(POLL_S)
