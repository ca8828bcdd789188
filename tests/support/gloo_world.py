"""A small gloo world for layer tests: spawn one process per rank, each runs named cases and
writes `{case name: result or traceback}` to `<out>/rank<R>.json`.

Workers call `worker_main(cases, run)`; tests call `spawn_world(worker, world, folder)` and get
the ranks' results back. Rendezvous is a `file://` store in the folder.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def worker_main(cases: Callable[[int], Sequence[Any]], run: Callable[[Any, int, int], float]) -> int:
    """Join the world from the command line (`--rank --world --init --out`), run `run(case, rank, world)`
    for every case of `cases(world)`, write the results (a raising case records its traceback)."""
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    for name in ("--rank", "--world"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--init", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group(
        "gloo", init_method=args.init, rank=args.rank, world_size=args.world, timeout=timedelta(seconds=60)
    )
    results: dict[str, object] = {}
    for case in cases(args.world):
        try:
            results[case.name] = run(case, args.rank, args.world)
        except Exception:  # recorded for the test to show
            results[case.name] = traceback.format_exc()
    (args.out / f"rank{args.rank}.json").write_text(json.dumps(results))
    gc.collect()  # free the cases' layers (reference cycles) before the group: gloo at times aborts at exit otherwise
    dist.destroy_process_group()
    return 0


def spawn_world(worker: Path, world: int, out: Path, timeout_s: int = 300) -> list[dict[str, Any]]:
    """Run `worker` on `world` ranks; every rank's results, in rank order (asserts they all exited 0)."""
    init = f"file://{out / 'rendezvous'}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), "--rank", str(r), "--world", str(world), "--init", init, "--out", str(out)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
