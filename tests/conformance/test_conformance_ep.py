"""The expert-parallel section of the conformance suite: `hal conformance --ep-ranks 2` on gloo.

The CPU vendor passes every case on two ranks, and the JSON matrix lists them all; a vendor whose
`weighted_combine` is slightly wrong fails; a vendor whose int8 dispatch falls back to fp8 passes
with the fallback in every int8 case's plan; a vendor failing on one rank alone fails those cases
at once and the next ones still run (all in `tests/support/ep_vendors.py`, a real plugin distribution the
spawned ranks load). Bad arguments are refused before any rank starts, and the
case table is checked without ranks.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.ep.cases import DTYPE_SCHEMES, MODES, QUICK_SHAPES, TORCH, build_cases, declared_skip
from hal.cli import main as hal_main
from tests.support.ep_vendors import FALLBACK, FAULTY, ONE_SIDED, write_ep_vendors
from tests.support.plugin_dist import environment_with

pytestmark = pytest.mark.slow  # subprocesses / multi-process worlds

#: Every case of the quick depth on a vendor with no dispatcher of its own (the CPU).
QUICK_IDS = {
    f"{TORCH}/{mode}/{dtype}/{shape.name}" for mode in MODES for dtype in DTYPE_SCHEMES for shape in QUICK_SHAPES
}


def _section(vendor: str, report: Path, site: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """`hal conformance --vendor V --ep-ranks 2` in a fresh interpreter: the process and the JSON report."""
    command = [
        sys.executable,
        "-m",
        "hal.cli",
        "conformance",
        "--vendor",
        vendor,
        "--ep-ranks",
        "2",
        "--report",
        str(report),
    ]
    finished = subprocess.run(
        command, env=environment_with(site), capture_output=True, text=True, timeout=300, check=False
    )
    path = report / "ep-conformance.json"
    assert path.exists(), finished.stdout[-4000:] + finished.stderr[-4000:]
    return finished, json.loads(path.read_text())


def test_the_cpu_vendor_passes_on_two_ranks(tmp_path):
    finished, report = _section("cpu", tmp_path / "report", tmp_path)
    output = finished.stdout[-4000:] + finished.stderr[-4000:]
    assert finished.returncode == 0, output
    assert report["ok"] and report["vendor"] == "cpu" and report["world_size"] == 2 and report["backend"] == "gloo"
    assert report["depth"] == "quick"
    cases = {c["id"]: c for c in report["cases"]}
    assert set(cases) == QUICK_IDS and len(report["cases"]) == len(QUICK_IDS)
    assert {c["outcome"] for c in cases.values()} == {"passed"}, output
    assert report["summary"] == {"passed": len(QUICK_IDS), "failed": 0, "skipped": 0, "total": len(QUICK_IDS)}
    for case in cases.values():
        assert case["resolved"] == case["dtype"] and case["fallback"] is None
        assert case["mode_taken"] == case["expected_mode"] or case["mode_taken"] is None and case["notes"], case
        assert case["ep_error"] <= case["ranks"][0]["bounds"]["layer"]
    assert {c["expected_mode"] for c in cases.values() if c["mode"] == "auto-small"} == {"low-latency"}
    assert {c["expected_mode"] for c in cases.values() if c["mode"] == "auto-large"} == {"normal"}
    assert cases[f"{TORCH}/normal/bf16/top8-E16-H256-zero-rank"]["tokens_per_rank"] == [0, 9]
    assert cases[f"{TORCH}/normal/bf16/top2-E16-H128-idle"]["idle_experts"]
    matrix = {(row["dispatcher"], row["mode"]): row["dtypes"] for row in report["matrix"]}
    assert set(matrix) == {(TORCH, mode) for mode in MODES}
    for cells in matrix.values():
        assert cells == {d: {"passed": len(QUICK_SHAPES), "failed": 0, "skipped": 0} for d in DTYPE_SCHEMES}
    markdown = (tmp_path / "report" / "ep-conformance.md").read_text()
    assert "| torch | auto-large |" in markdown and "## Failures" not in markdown
    assert "expert-parallel conformance of vendor 'cpu' on 2 rank(s)" in finished.stdout


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return write_ep_vendors(tmp_path_factory.mktemp("site"))


def test_a_slightly_wrong_weighted_combine_fails(site, tmp_path):
    finished, report = _section(FAULTY, tmp_path / "report", site)
    assert finished.returncode == 1, finished.stdout[-4000:] + finished.stderr[-4000:]
    assert not report["ok"] and report["vendor"] == FAULTY
    assert {c["id"] for c in report["cases"]} == QUICK_IDS  # one failure did not stop or desynchronise the rest
    failed = {c["id"] for c in report["cases"] if c["outcome"] == "failed"}
    # bf16 and int8 dispatch: the combine's 1/32 (twice over in EP: per rank, then across ranks) passes their bound
    assert {i for i in QUICK_IDS if "/bf16/" in i or "/int8/" in i} <= failed
    messages = " ".join(c["message"] for c in report["cases"] if c["outcome"] == "failed")
    assert "against float64" in messages and "the fault is not specific to expert parallelism" in messages
    assert "## Failures" in (tmp_path / "report" / "ep-conformance.md").read_text()
    assert "FAILED torch/" in finished.stdout


def test_a_request_the_vendor_falls_back_from_resolves_to_its_fallback(site, tmp_path):
    finished, report = _section(FALLBACK, tmp_path / "report", site)
    assert finished.returncode == 0, finished.stdout[-4000:] + finished.stderr[-4000:]
    cases = {c["id"]: c for c in report["cases"]}
    assert set(cases) == QUICK_IDS and {c["outcome"] for c in cases.values()} == {"passed"}
    for case in cases.values():
        if case["dtype"] == "int8":
            assert (case["resolved"], case["fallback"]) == ("fp8", "int8 -> fp8"), case
        else:
            assert (case["resolved"], case["fallback"]) == (case["dtype"], None), case


def test_a_case_failing_on_one_rank_neither_stalls_nor_desynchronises_the_rest(site, tmp_path):
    finished, report = _section(ONE_SIDED, tmp_path / "report", site)  # a stall would wait 600 s per case
    assert finished.returncode == 1, finished.stdout[-4000:] + finished.stderr[-4000:]
    assert {c["id"] for c in report["cases"]} == QUICK_IDS
    outcomes = [c["outcome"] for c in report["cases"]]
    assert "failed" in outcomes and "passed" in outcomes[outcomes.index("failed") + 1 :]
    failed = [c for c in report["cases"] if c["outcome"] == "failed"]
    assert all("rank 0: RuntimeError" in c["message"] and "raises on rank 0" in c["message"] for c in failed)
    # where rank 0 failed in the forward, rank 1's collective with it failed too, rather than waiting
    forward = [c for c in failed if c["ranks"][0]["stage"] == "forward"]
    assert forward and all(c["ranks"][1]["outcome"] == "failed" for c in forward)


@pytest.mark.parametrize(
    "arguments",
    [
        ["--ep-ranks", "0"],
        ["--ep-ranks", "2", "--vendor", "cpu", "ascend-emulated"],
        ["--ep-ranks", "2", "--vendor", "cpu", "-k", "layer"],
        ["--ep-ranks", "2", "--vendor", "no-such-vendor"],
    ],
    ids=["no-ranks", "two-vendors", "keyword", "unknown-vendor"],
)
def test_bad_arguments_are_refused_before_any_rank_starts(arguments, tmp_path, capsys):
    command = ["conformance", *arguments, "--report", str(tmp_path)]
    try:
        status = hal_main(command)
    except SystemExit as exc:  # argparse's refusal
        status = exc.code
    assert status == 2
    assert not (tmp_path / "ep-conformance.json").exists()


def test_the_case_table_follows_the_declarations(cpu):
    caps = dataclasses.replace(
        cpu.capabilities(), ep_dispatchers=frozenset({"mine", "fast"}), ep_low_latency=frozenset({"fast"})
    )
    cases = build_cases(caps, "quick")
    assert len({c.id for c in cases}) == len(cases) == 3 * len(QUICK_IDS)
    assert [c.dispatcher for c in cases[:: len(QUICK_IDS)]] == [TORCH, "fast", "mine"]
    assert [c.mode for c in cases[: len(MODES)]] == list(MODES)  # mode innermost
    skipped = {c.id for c in cases if declared_skip(c, caps, "test")}
    assert skipped == {c.id for c in cases if c.dispatcher == "mine" and c.mode != "normal"}
    assert len(build_cases(caps, "full")) > len(cases)
    for world in (1, 2, 3, 4, 8):
        for case in cases:
            tokens, capacity = case.shape.tokens_per_rank(world), case.capacity(world)
            assert len(tokens) == world and case.shape.num_experts(world) % world == 0
            assert case.shape.num_experts(world) - len(case.shape.idle(world)) >= case.shape.top_k
            assert (capacity is None) == (case.mode == "normal")
            if case.mode == "low-latency" or case.mode == "auto-small":
                assert max(tokens) <= capacity and case.expected_mode(world) == "low-latency"
            if case.mode == "auto-large" and max(tokens) > 1:
                assert case.expected_mode(world) == "normal"
