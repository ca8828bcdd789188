"""Expert parallelism over torch.distributed (gloo, loopback): `MoELayer` on 2 and 4 ranks.

Each world size runs once per session: the module-scoped fixture spawns one process per
rank (`tests/support/ep_worker.py`, rendezvous through a `file://` store in a temporary folder),
every rank runs all cases of `tests.support.ep_worker.CASES` and writes its results, and the
tests below judge them case by case. Under pytest-xdist the workers of one session share
the run through a file lock, so a world is still spawned only once.

What is checked:

- normal (all-to-all), low-latency and auto layers equal the single-rank layer (within the
  combine's rounding: `single_rank_mismatches`), for each rank's slice of the tokens, for every
  scheme and CPU dispatch dtype, with uneven token counts, a rank without tokens, experts no
  token picks, the grouped sigmoid router, bf16 hidden states and a hidden size with a partial
  128-channel fp8 group; auto takes low-latency mode exactly when every rank's batch fits;
- the low-latency payload: per-expert counts, row contents and order (grouped by local expert,
  source rank then token), and buffer sizes from the plan;
- more tokens than `max_dispatch_tokens_per_rank` raise on every rank and leave the
  world usable; an expert count the world size does not divide raises at construction.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import hal
from tests.support.ep_cases import (
    EQUAL_CASES,
    FORMAT_CASES,
    HIDDEN,
    INDIVISIBLE_CASES,
    NUM_EXPERTS,
    OVERFLOW_CAPACITY,
    OVERFLOW_CASE,
    TOP_K,
    Case,
    capacity_for,
    dead_experts,
    tokens_per_rank,
)
from tests.support.ep_worker import result_path
from tests.support.paths import REPO, SUPPORT

pytestmark = pytest.mark.slow  # subprocesses / multi-process worlds

WORKER = SUPPORT / "ep_worker.py"
REPO = REPO
WORLD_TIMEOUT_S = 240
WORLDS = pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"{w}ranks")


# -- running a world -------------------------------------------------------------------------------


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in (hal.ENV_DISPATCH_DTYPE, hal.ENV_VENDOR, *hal.LEGACY_DISPATCH_VARIABLES):
        env.pop(name, None)  # the cases set their dispatch dtype explicitly; nothing else may steer it
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    return env


def _launch_world(world: int, out: Path) -> None:
    """Run one rank per process until all exit or WORLD_TIMEOUT_S passes; record how they ended."""
    out.mkdir(parents=True)
    rendezvous = out / "rendezvous"  # file stores, fresh for this run
    rendezvous.mkdir()
    env = _worker_env()
    procs: list[subprocess.Popen[bytes]] = []
    timed_out = False
    started = time.monotonic()
    try:
        for rank in range(world):
            with open(out / f"rank{rank}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            str(WORKER),
                            "--rank",
                            str(rank),
                            "--world",
                            str(world),
                            "--rendezvous",
                            str(rendezvous),
                            "--out",
                            str(out),
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=REPO,
                    )
                )
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, started + WORLD_TIMEOUT_S - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for proc in procs:  # only the processes started here
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    summary = {
        "returncodes": [p.returncode for p in procs],
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - started, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary))


class WorldResults:
    """The per-rank results of one world's run, read case by case."""

    def __init__(self, world: int, out: Path) -> None:
        self.world = world
        self.out = out
        self.summary = json.loads((out / "summary.json").read_text())

    def diagnosis(self) -> str:
        lines = [f"world of {self.world} ranks: {self.summary}"]
        for rank in range(self.world):
            log = self.out / f"rank{rank}.log"
            text = log.read_text(errors="replace") if log.exists() else "(no log)"
            lines.append(f"--- rank {rank} log (tail) ---\n{text[-3000:]}")
        return "\n".join(lines)

    def ranks(self, case: Case) -> list[dict[str, Any]]:
        """Every rank's result for `case`; fails the test if a rank has none or raised."""
        results = []
        for rank in range(self.world):
            path = result_path(self.out, case.id, rank)
            if not path.exists():
                pytest.fail(f"rank {rank} wrote no result for case {case.id!r}\n{self.diagnosis()}")
            results.append(torch.load(path, weights_only=True))
        errors = [f"--- rank {rank} ---\n{r['error']}" for rank, r in enumerate(results) if "error" in r]
        if errors:  # all of them: a peer's error may only be the consequence ("connection closed")
            pytest.fail(f"case {case.id!r} raised on a world of {self.world} ranks:\n" + "\n".join(errors))
        return results


def _world_results(factory: pytest.TempPathFactory, world: int) -> WorldResults:
    # Under xdist every worker has its own basetemp inside the session's; share the run there.
    base = factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "moe-expert-parallel"
    root.mkdir(exist_ok=True)
    out = root / f"world{world}"
    with open(root / f"world{world}.lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if not (out / "summary.json").exists():
            if out.exists():
                shutil.rmtree(out)  # left by a pytest worker interrupted mid-run
            _launch_world(world, out)
    return WorldResults(world, out)


@pytest.fixture(scope="module")
def world_2(tmp_path_factory: pytest.TempPathFactory) -> WorldResults:
    return _world_results(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def world_4(tmp_path_factory: pytest.TempPathFactory) -> WorldResults:
    return _world_results(tmp_path_factory, 4)


def run(request: pytest.FixtureRequest, world: int, case: Case) -> list[dict[str, Any]]:
    results: WorldResults = request.getfixturevalue(f"world_{world}")
    return results.ranks(case)


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.numel() == 0:
        return "empty"
    d = (a.float() - b.float()).abs()
    return f"max |diff| {d.max().item():.3g}, {(d > 0).sum().item()} of {d.numel()} elements differ"


# -- the layer equals the single-rank layer --------------------------------------------------------

#: Schemes whose grouped GEMMs the CPU reference computes exactly (integer products in fp64),
#: so a row's result never depends on how many rows the GEMM has.
#: Expert parallel vs the single-rank layer: max |diff| / max |reference|. Each rank returns one partial
#: sum per token in the experts' output dtype, and the home rank adds them in rank order: an extra
#: rounding of the partials (bf16: 2^-9) and another summation order than one rank's top-k sum.
EP_RELATIVE_TOLERANCE = 2**-7


def single_rank_mismatches(case: Case, res: dict[str, Any], rank: int) -> list[str]:
    """How this rank's expert-parallel output differs from the single-rank layer's beyond the combine's
    rounding (none: within `EP_RELATIVE_TOLERANCE` of the largest reference value, same shape)."""
    out, ref = res["out"], res["ref"]
    if out.shape != ref.shape:
        return [f"rank {rank}: {_diff(out, ref)}"]
    if not out.numel():
        return []
    worst = (out.float() - ref.float()).abs().max().item()
    if not worst <= EP_RELATIVE_TOLERANCE * ref.float().abs().max().item():  # NaN fails too
        return [f"rank {rank} vs the single-rank layer: {_diff(out, ref)}"]
    return []


@WORLDS
@pytest.mark.parametrize("case", EQUAL_CASES, ids=lambda c: c.id)
def test_expert_parallel_layer_equals_single_rank(request: pytest.FixtureRequest, world: int, case: Case) -> None:
    ranks = run(request, world, case)
    counts = tokens_per_rank(case.tokens, world)
    dtype = torch.bfloat16 if case.x_dtype == "bf16" else torch.float32
    dispatcher = "LowLatencyDispatcher" if case.low_latency else "AllToAllDispatcher"
    mode = "low-latency" if case.low_latency else "normal"
    if case.auto_capacity is not None:  # the mode every rank must agree on: low-latency iff all batches fit
        dispatcher, mode = "AutoDispatcher", "low-latency" if max(counts) <= case.auto_capacity else "normal"
    local = NUM_EXPERTS // world
    mismatches = []
    for rank, res in enumerate(ranks):
        out, ref = res["out"], res["ref"]
        assert res["dispatcher"] == dispatcher, f"rank {rank}"
        assert res["mode"] == mode, f"rank {rank}: took {res['mode']}, expected {mode}"
        assert res["single_dispatcher"] == "LocalDispatcher"
        assert res["local_experts"] == [rank * local, (rank + 1) * local], f"rank {rank}"
        assert out.dtype == dtype and ref.dtype == dtype, f"rank {rank}: {out.dtype}, {ref.dtype}"
        assert tuple(out.shape) == (counts[rank], case.hidden), f"rank {rank}: {tuple(out.shape)}"
        assert tuple(ref.shape) == (counts[rank], case.hidden)
        if counts[rank]:
            assert ref.abs().sum() > 0, f"rank {rank}: a trivial reference proves nothing"
        mismatches += single_rank_mismatches(case, res, rank)
    assert not mismatches, f"{case.id} on {world} ranks differs from the single-rank layer: {mismatches}"


# -- the low-latency masked layout -----------------------------------------------------------------


@WORLDS
@pytest.mark.parametrize("case", FORMAT_CASES, ids=lambda c: c.id)
def test_low_latency_payload_layout(request: pytest.FixtureRequest, world: int, case: Case) -> None:
    ranks = run(request, world, case)
    cap, local = capacity_for(case), NUM_EXPERTS // world
    sent = tokens_per_rank(case.tokens, world)
    ids, rows = ranks[0]["gathered_ids"], ranks[0]["gathered_rows"]
    assert tuple(ids.shape) == (world, cap, TOP_K) and tuple(rows.shape) == (world, cap, case.hidden)
    for res in ranks[1:]:  # every rank gathered the same routing
        assert torch.equal(res["gathered_ids"], ids) and torch.equal(res["gathered_rows"], rows)
    for s in range(world):
        assert (ids[s, : sent[s]] >= 0).all() and (ids[s, sent[s] :] == -1).all()

    # The true (token, expert) pairs of each expert, in source-rank then token order.
    def routed_to(expert: int) -> list[torch.Tensor]:
        return [rows[s, t] for s in range(world) for t in range(sent[s]) if (ids[s, t] == expert).any()]

    assert sum(len(routed_to(e)) for e in range(NUM_EXPERTS)) == TOP_K * sum(sent)
    assert all(not routed_to(e) for e in dead_experts(world))

    for rank, res in enumerate(ranks):
        where = f"rank {rank}"
        # Static collectives, but the experts get their rows grouped by local expert, valid rows only
        # (on the CPU, where the count is read for free; elsewhere a padded tail the GEMMs skip).
        assert res["format"] == "ep-normal", where
        assert res["payload_dtype"] == res["plan_dtype"] == case.dtype, where
        assert res["payload_layout"] == res["plan_layout"], where
        assert res["local_experts"] == [rank * local, (rank + 1) * local], where
        counts = res["expert_counts"]
        assert counts.dtype == torch.int64 and tuple(counts.shape) == (local,), where
        assert res["payload_shape"] == [int(counts.sum()), case.hidden], where
        deq = res["payload_dequantized"]
        start = 0
        for e in range(local):
            expected = routed_to(rank * local + e)
            n = len(expected)
            where = f"rank {rank}, local expert {e} (global {rank * local + e})"
            assert counts[e].item() == n, f"{where}: count {counts[e].item()}, routed {n}"
            if n:
                got, want = deq[start : start + n], torch.stack(expected)
                assert torch.equal(got, want), f"{where}: valid rows differ ({_diff(got, want)})"
            start += n


def _bytes_per_token(dtype: str, layout: str, hidden: int) -> int:
    if dtype == "bf16":
        return 2 * hidden
    if dtype == "fp8" and layout == hal.ScaleLayout.GROUP_128.value:
        return hidden + 4 * math.ceil(hidden / 128)
    return hidden + 4  # int8, or fp8 with one fp32 scale per token


@WORLDS
@pytest.mark.parametrize("case", FORMAT_CASES, ids=lambda c: c.id)
def test_low_latency_buffer_bytes_follow_the_plan(request: pytest.FixtureRequest, world: int, case: Case) -> None:
    for rank, res in enumerate(run(request, world, case)):
        tokens = world * res["capacity"]
        per_token = _bytes_per_token(case.dtype, res["plan_layout"], case.hidden)
        assert res["bytes_per_token"] == per_token, f"rank {rank}"
        assert res["buffer_bytes"] == res["plan_buffer_bytes"] == tokens * per_token, f"rank {rank}"
        if case.scheme == "w8a8-fp8-block":  # fp8 with 128-channel group scales: not 2 bytes per element
            assert res["buffer_bytes"] == tokens * (case.hidden + 4 * math.ceil(case.hidden / 128))
            assert res["buffer_bytes"] != tokens * case.hidden * 2


# -- errors ----------------------------------------------------------------------------------------


@WORLDS
def test_low_latency_overflow_raises_on_every_rank_and_world_stays_usable(
    request: pytest.FixtureRequest, world: int
) -> None:
    for rank, res in enumerate(run(request, world, OVERFLOW_CASE)):
        assert res["raised"], f"rank {rank}: {res['tokens_sent']} tokens over capacity {OVERFLOW_CAPACITY} passed"
        assert res["is_invalid_input"], f"rank {rank}: raised {res['error_type']}: {res['message']}"
        assert "max_dispatch_tokens_per_rank" in res["message"], res["message"]
        assert str(res["tokens_sent"]) in res["message"], res["message"]
        # The valid call after the failed one: every rank still in step.
        assert tuple(res["out"].shape) == (OVERFLOW_CAPACITY, HIDDEN)
        assert not single_rank_mismatches(OVERFLOW_CASE, res, rank)


@WORLDS
@pytest.mark.parametrize("case", INDIVISIBLE_CASES, ids=lambda c: c.id)
def test_experts_not_divisible_by_world_size_raise_at_construction(
    request: pytest.FixtureRequest, world: int, case: Case
) -> None:
    for rank, res in enumerate(run(request, world, case)):
        assert res["num_experts"] % world
        for how in ("constructor", "from_float"):
            got = res[how]
            assert got["raised"], f"rank {rank}, {how}: built {got.get('dispatcher')}"
            assert got["is_invalid_input"], f"rank {rank}, {how}: raised {got['error_type']}: {got['message']}"
            assert "num_experts" in got["message"] and f"({world})" in got["message"], got["message"]
