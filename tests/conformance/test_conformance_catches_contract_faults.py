"""The op-contract tests catch what the numeric tests cannot: a vendor that writes into its inputs,
one that returns non-contiguous tensors, one whose grouped matmul is not bit-reproducible. Each
is caught by at least two test functions (the op's and the layer's); the CPU reference vendor
passes them; a vendor that declares `deterministic=False` is not failed for it and the report
says what it declared.

Every vendor is a real plugin distribution, run with `hal conformance` in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hal import GemmKind, KNOWN_SCHEMES
from tests.support.conformance_contract_vendors import write_contract_vendors
from tests.support.plugin_dist import environment_with

pytestmark = pytest.mark.slow  # subprocesses / multi-process worlds

CONTRACTS = "test_op_contracts.py"
OP_INPUTS = f"{CONTRACTS}::test_op_leaves_its_inputs_unchanged"
OP_CONTIGUOUS = f"{CONTRACTS}::test_op_returns_contiguous_tensors"
OP_REPEATS = f"{CONTRACTS}::test_op_repeats_bit_identically"
LAYER_INPUTS = f"{CONTRACTS}::test_layer_keeps_its_inputs_and_returns_a_contiguous_output"
LAYER_REPEATS = f"{CONTRACTS}::test_layer_repeats_bit_identically"
PLACEMENT = "test_expert_placement.py::"
#: the grouped-matmul op cases: the product, and the product with SiLU-GLU applied by the same call
GEMM_FORMS = ("", "-silu-glu")
#: the suite's other tests that compare two layer outputs bit for bit where the vendor declares determinism: a
#: vendor that is not bit-reproducible fails them when its noise happens to flip an output's rounding (a few
#: percent of runs), so they may fail beside the reproducibility tests
ROUND_TRIP = "test_moe_features.py::test_state_dict_round_trip_onto_a_fresh_layer"
KEEPS_WORKING = "test_bad_input.py::test_the_layer_refuses_bad_input_and_keeps_working"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return write_contract_vendors(tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def conformance(site, tmp_path_factory):
    """`hal conformance` on one vendor (only the contract tests, or the whole suite): the JSON
    report's vendor entry, the exit status and the Markdown report."""
    done: dict[tuple[str, bool], dict] = {}

    def run(vendor: str, whole_suite: bool = False) -> dict:
        if (vendor, whole_suite) not in done:
            report = tmp_path_factory.mktemp(f"report-{vendor}")
            env = dict(environment_with(site), OMP_NUM_THREADS="1")  # CI runs these side by side
            command = [sys.executable, "-m", "hal.cli", "conformance", "--vendor", vendor, "--report", str(report)]
            if not whole_suite:
                command += ["-k", "test_op_contracts"]
            finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
            assert (report / "conformance.json").exists(), finished.stdout + finished.stderr
            result = json.loads((report / "conformance.json").read_text())["vendors"][0]
            result["exit"] = finished.returncode
            result["markdown"] = (report / "conformance.md").read_text()
            done[vendor, whole_suite] = result
        return done[vendor, whole_suite]

    return run


def _failed(result: dict) -> set[str]:
    return {t["id"] for t in result["tests"] if t["outcome"] in ("failed", "error")}


def _functions(ids: set[str]) -> set[str]:
    return {i.split("[")[0] for i in ids}


def _row(result: dict, capability: str) -> dict:
    return next(row for row in result["matrix"] if row["capability"] == capability)


def test_an_op_that_writes_into_its_inputs(conformance):
    result = conformance("writes-into-input")
    failed = _failed(result)
    # the grouped matmul scales its float operands in place and back; nvfp4 operands have none that
    # change (uint8 codes, e4m3 scales, a global scale that triples exactly)
    must = {f"{OP_INPUTS}[grouped_matmul-{k}{a}]" for k in GemmKind if k is not GemmKind.NVFP4 for a in GEMM_FORMS}
    must |= {f"{OP_INPUTS}[grouped_matmul-bias]"} | {f"{LAYER_INPUTS}[{s}]" for s in KNOWN_SCHEMES if "w4a16" not in s}
    assert must <= failed, sorted(must - failed)
    may = {f"{OP_INPUTS}[grouped_matmul-nvfp4{a}]" for a in GEMM_FORMS} | {
        f"{LAYER_INPUTS}[{s}]" for s in KNOWN_SCHEMES
    }
    assert failed <= must | may, sorted(failed - must)
    assert _functions(failed) == {OP_INPUTS, LAYER_INPUTS}
    assert result["exit"] == 1 and _row(result, "op contracts")["result"] == "FAIL"


def test_ops_that_return_non_contiguous_tensors(conformance):
    result = conformance("non-contiguous-outputs")
    failed = _failed(result)
    must = {f"{OP_CONTIGUOUS}[grouped_matmul-{k}{a}]" for k in GemmKind for a in GEMM_FORMS}
    must |= {f"{OP_CONTIGUOUS}[grouped_matmul-bias]", f"{OP_CONTIGUOUS}[weighted_combine]"}
    must |= {f"{LAYER_INPUTS}[{s}]" for s in KNOWN_SCHEMES}  # the layer's output is the combine's
    assert failed == must, sorted(failed ^ must)
    assert "cannot be viewed flat" in " ".join(t["message"] for t in result["tests"] if t["id"] in failed)
    assert result["exit"] == 1


def test_a_grouped_matmul_that_is_not_bit_reproducible(conformance):
    """Only the reproducibility tests fail: every numeric test of the whole suite passes."""
    result = conformance("non-deterministic-gemm", whole_suite=True)
    failed = _failed(result)
    must = {f"{OP_REPEATS}[grouped_matmul-{k}{a}]" for k in GemmKind for a in GEMM_FORMS}
    must |= {f"{OP_REPEATS}[grouped_matmul-bias]"}
    must |= {f"{LAYER_REPEATS}[{s}]" for s in KNOWN_SCHEMES}
    assert must <= failed, sorted(must - failed)
    # moving experts between slots is checked bit for bit too, where the vendor declares deterministic ops
    placement = {t for t in failed if t.startswith(PLACEMENT)}
    concurrency = {t for t in failed if t.startswith("test_concurrency.py")}  # threads see other results too
    # a refused load must leave the output as it was: bit for bit where the vendor declares deterministic ops
    loading = {t for t in failed if t.startswith("test_loading.py")}
    assert failed <= must | {ROUND_TRIP, KEEPS_WORKING} | placement | concurrency | loading, sorted(failed - must)
    assert len(_functions(failed)) >= 2 and result["exit"] == 1


def test_a_vendor_declaring_deterministic_false_is_not_failed_for_it(conformance):
    result = conformance("declared-non-deterministic", whole_suite=True)
    assert result["exit"] == 0 and result["ok"], sorted(_failed(result))
    assert result["capabilities"]["deterministic"] is False
    repeats = [t for t in result["tests"] if t["id"].startswith((OP_REPEATS, LAYER_REPEATS))]
    assert repeats and all(t["outcome"] == "skipped" and "deterministic=False" in t["message"] for t in repeats)
    row = _row(result, "op contracts")
    assert row["declared"] == "required (deterministic=False)" and row["result"] == "pass"
    assert "| op contracts | required (deterministic=False) | pass |" in result["markdown"]


def test_the_cpu_reference_vendor_keeps_every_contract(conformance):
    result = conformance("cpu")
    assert result["exit"] == 0 and result["ok"], sorted(_failed(result))
    outcomes = {t["outcome"] for t in result["tests"]}
    assert outcomes == {"passed"}  # the CPU declares every op, so no contract test is skipped
    assert _functions({t["id"] for t in result["tests"]}) == {
        OP_INPUTS,
        OP_CONTIGUOUS,
        OP_REPEATS,
        LAYER_INPUTS,
        LAYER_REPEATS,
    }
    assert result["capabilities"]["deterministic"] is True
    assert _row(result, "op contracts")["declared"] == "required (deterministic)"
