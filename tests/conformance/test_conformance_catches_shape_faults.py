"""The shape sweeps and property tests catch the faults that only realistic shapes show:
a grouped matmul wrong beyond 16 groups, a weight quantizer that loses the columns of a partial
128-wide tile, a combine wrong beyond 256 tokens, a combine that drops the weight at top-1, and fp8
block scales stored transposed. Each vendor breaks one public op of the CPU vendor; each must fail at
least two different test functions of `hal conformance` at quick depth, and the correct CPU vendor
must pass every one of the tests that fail (no false alarms).

All six vendors run in one `hal conformance` call in a fresh interpreter, on the sweep tests only
(`-k test_shape_sweeps`: the faults must show there, and the no-false-alarm check compares the same
tests), each vendor's suite split over two workers.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.conformance_vendors import SHAPE_FAULTS, write_faulty_vendors
from tests.support.plugin_dist import environment_with

pytestmark = pytest.mark.slow  # subprocesses / multi-process worlds

SWEEPS = "test_shape_sweeps.py"
#: fault -> test functions (`file::function`) that must fail for it, whatever else fails too. The
#: property tests usually fail too (`test_properties.py`), but which cases hypothesis draws may change
#: with the environment, so only the sweeps, whose cases are fixed, are required.
MUST_FAIL = {
    "sixteen-groups": {f"{SWEEPS}::test_grouped_matmul_sweep", f"{SWEEPS}::test_layer_sweep"},
    "tail-columns-unwritten": {f"{SWEEPS}::test_quantize_weight_sweep", f"{SWEEPS}::test_layer_sweep"},
    "combine-wraps-256": {f"{SWEEPS}::test_weighted_combine_sweep", f"{SWEEPS}::test_layer_sweep"},
    "top1-unweighted": {f"{SWEEPS}::test_weighted_combine_sweep", f"{SWEEPS}::test_layer_sweep"},
    "transposed-block-scales": {f"{SWEEPS}::test_quantize_weight_sweep", f"{SWEEPS}::test_layer_sweep"},
}
#: fault -> the matrix rows its failures may fall in (a fault in one op shows in that op's rows and in
#: the layers built on it, nowhere else).
ROWS = {
    "sixteen-groups": ("grouped_matmul ", "moe layer ", "expert bias", "model features", "op contracts"),
    "tail-columns-unwritten": ("grouped_matmul ", "moe layer ", "model features", "op contracts"),
    "combine-wraps-256": ("sort and combine", "moe layer ", "model features", "dispatch ", "op contracts"),
    "top1-unweighted": ("sort and combine", "moe layer ", "model features", "dispatch ", "op contracts"),
    "transposed-block-scales": ("grouped_matmul fp8-block128", "moe layer w8a8-fp8-block", "op contracts"),
}


@pytest.fixture(scope="module")
def vendors(tmp_path_factory) -> dict[str, dict]:
    """`hal conformance --vendor cpu <the five faulty vendors>`: each vendor's report entry."""
    root = tmp_path_factory.mktemp("shape-faults")
    write_faulty_vendors(root / "site")
    report = root / "report"
    env = dict(environment_with(root / "site"), OMP_NUM_THREADS="1")  # CI runs these side by side
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hal.cli",
            "conformance",
            "--vendor",
            "cpu",
            *SHAPE_FAULTS,
            "-k",
            "test_shape_sweeps",
            "-n",
            "2",
            "--report",
            str(report),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert (report / "conformance.json").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    payload = json.loads((report / "conformance.json").read_text())
    assert payload["depth"] == "quick" and done.returncode == 1
    return {entry["vendor"]: entry for entry in payload["vendors"]}


def _function(test_id: str) -> str:
    """`file::function` of a test id (its parameters dropped)."""
    return test_id.split("[")[0]


def test_the_correct_cpu_vendor_passes(vendors):
    cpu = vendors["cpu"]
    assert cpu["ok"], [t["id"] for t in cpu["tests"] if t["outcome"] in ("failed", "error")]
    ran = {_function(t["id"]) for t in cpu["tests"] if t["outcome"] == "passed"}
    assert set().union(*MUST_FAIL.values()) <= ran  # every test the faults must fail ran and passed here


@pytest.mark.parametrize("fault", SHAPE_FAULTS)
def test_each_shape_fault_fails_two_test_functions_and_no_false_alarm(vendors, fault):
    result = vendors[fault]
    assert result["not_run"] is None and not result["ok"]
    failed = {t["id"]: t for t in result["tests"] if t["outcome"] in ("failed", "error")}
    functions = {_function(test_id) for test_id in failed}
    assert len(functions) >= 2, f"{fault}: only {sorted(functions)} fail"
    assert MUST_FAIL[fault] <= functions, f"{fault}: {sorted(MUST_FAIL[fault] - functions)} did not fail"
    # No false alarm: the correct vendor passes every test that fails here.
    cpu = {t["id"]: t["outcome"] for t in vendors["cpu"]["tests"]}
    assert all(cpu.get(test_id) == "passed" for test_id in failed), sorted(
        test_id for test_id in failed if cpu.get(test_id) != "passed"
    )
    # The fault shows where it is: in its op's rows and the layers built on it.
    stray = {test_id: t["capability"] for test_id, t in failed.items() if not t["capability"].startswith(ROWS[fault])}
    assert not stray, f"{fault}: failures outside its rows: {stray}"
