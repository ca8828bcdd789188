"""Expert parallelism on two GPUs (NCCL, and DeepEP where it imports): every declared dispatcher and mode
against the single-rank layer at realistic shapes, auto's per-call mode, a low-latency CUDA graph.
Runs `tests/support/ep_cuda_worker.py` under torchrun; skipped without two CUDA devices."""

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

WORKER = SUPPORT / "ep_cuda_worker.py"


def test_every_gpu_dispatcher_matches_the_single_rank_layer(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    release_device_memory()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    failed = [r for r in rows if not r.get("ok_all_ranks", r.get("ok", True))]
    assert not failed, json.dumps(failed, indent=1)[:4000]
    ran = [r for r in rows if "skipped" not in r]
    assert any(r["case"] == "torch auto (fits)" and r["mode"] == "low-latency" for r in ran)
    assert any(r["case"] == "torch auto (over)" and r["mode"] == "normal" for r in ran)
    assert any(r["case"] == "graph low-latency" for r in ran)
