"""Rebalancing over NCCL on two GPUs: redundant experts and a `rebalance()` keep the expert-parallel layer within
its tolerance of the single-GPU layer, and every migrated buffer holds exactly its new expert's tensors
(`tests/support/eplb_cuda_worker.py` under torchrun; skipped without two CUDA devices)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.paths import REPO, SUPPORT, release_device_memory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

#: bf16 partial sums per rank (see docs/expert-parallel.md): 2^-6 of the max for bf16, 2^-5 for fp8
TOLERANCE = {"unquantized": 2.0**-6, "w8a8-fp8-block": 2.0**-5}


def test_rebalancing_over_nccl_keeps_the_layer_and_moves_the_buffers_exactly(tmp_path: Path) -> None:
    out = tmp_path / "rows"
    release_device_memory()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(SUPPORT / "eplb_cuda_worker.py"),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for rank in (0, 1) for line in Path(f"{out}.{rank}").read_text().splitlines()]
    assert len(rows) == 8
    for row in rows:
        tol = TOLERANCE[row["scheme"]]
        assert row["exact"] and row["moved"], row
        assert row["before"] <= tol and row["after"] <= tol, row
