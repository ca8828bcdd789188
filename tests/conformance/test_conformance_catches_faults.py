"""The conformance suite is proven to catch faults: each deliberately broken vendor fails exactly
the tests its fault affects, and everything else still passes. A correct fused vendor passes.

Every vendor is a real plugin distribution, run with `hal conformance` in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hal import GemmKind, KNOWN_SCHEMES
from tests.support.conformance_vendors import write_faulty_vendors
from tests.support.plugin_dist import environment_with

pytestmark = pytest.mark.slow  # subprocesses / multi-process worlds


def _run(tmp_path, vendor: str) -> dict:
    write_faulty_vendors(tmp_path / "site")
    report = tmp_path / "report"
    env = dict(environment_with(tmp_path / "site"), OMP_NUM_THREADS="1")  # CI runs these side by side
    done = subprocess.run(
        [sys.executable, "-m", "hal.cli", "conformance", "--vendor", vendor, "--report", str(report)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert (report / "conformance.json").exists(), done.stdout + done.stderr
    result = json.loads((report / "conformance.json").read_text())["vendors"][0]
    result["exit"] = done.returncode
    return result


def _outcomes(result: dict) -> tuple[set[str], set[str]]:
    failed = {t["id"] for t in result["tests"] if t["outcome"] in ("failed", "error")}
    return failed, {t["id"] for t in result["tests"]}


GEMM = "test_grouped_matmul.py::test_grouped_matmul_matches_float64"
GEMM_ACTIVATED = "test_grouped_matmul.py::test_grouped_matmul_with_activation_matches_float64"
LAYER = "test_moe_layer.py::test_layer_matches_the_float64_moe"
MODEL_DTYPE = "test_model_dtype.py::test_a_model_computes_in_its_own_dtype"
#: The shape sweeps and property tests (`tests/conformance/test_conformance_catches_shape_faults.py` proves them
#: on faults of their own); here they may fail alongside the tests each fault is known to fail.
GEMM_SWEEPS = ("test_shape_sweeps.py::test_grouped_matmul_sweep", "test_properties.py::test_grouped_matmul_property")
LAYER_SWEEP = "test_shape_sweeps.py::test_layer_sweep"
#: The op-contract tests call grouped_matmul with a bias, which `drops-last-group` does not take.
OP_CONTRACTS = "test_op_contracts.py::"
PLACEMENT = "test_expert_placement.py::"  # replicas change the last group: a dropped one shows there too
#: grouped-matmul cases whose last group has rows (see the suite's CASES)
LAST_GROUP_USED = [
    "counts",
    "offsets",
    "one-group",
    "int32-group-list",
    "offsets-int32",
    "strided-activations",
    "strided-weights",
    "out-fp32",
    "out-bf16",
    "row-index",
    "row-index-int32",
    "row-index-strided",
]
#: the first projection read through a row index, with its activation (rows in every group)
GEMM_THROUGH_INDEX = "test_grouped_matmul.py::test_grouped_matmul_through_row_index_with_activation_matches_float64"
#: the same with each expert's bias before the activation (rows in the last group)
GEMM_BIASED = "test_grouped_matmul.py::test_grouped_matmul_with_bias_through_row_index_matches_float64"


def test_a_grouped_matmul_that_ignores_the_last_group(tmp_path):
    result = _run(tmp_path, "drops-last-group")
    failed, ran = _outcomes(result)
    must = {f"{GEMM}[{kind}-{case}]" for kind in GemmKind for case in LAST_GROUP_USED}
    must |= {
        t for t in ran if t.startswith((GEMM_ACTIVATED, GEMM_THROUGH_INDEX, GEMM_BIASED))
    }  # rows in every last group
    # the bias cases whose last group has rows, and every model-features layer (300 tokens, 16 experts)
    must |= {
        f"test_activations_and_bias.py::test_grouped_matmul_bias_matches_float64[{c}]"
        for c in ("40-groups", "one-row", "uneven")
    }
    must |= {t for t in ran if t.startswith("test_moe_features.py::test_layer_features_match")}
    # Every layer with 29 tokens sends some to the last expert. nvfp4 dispatch is refused on the
    # CPU table (which is what those cases check), so they never reach a GEMM; int4's tolerance
    # is wide enough that a lost expert may stay inside it (the GEMM tests catch it).
    refused = ("[nvfp4-auto-", "[nvfp4-nvfp4-", "[unquantized-nvfp4-")
    layers = {
        t
        for t in ran
        if t.startswith(LAYER) and "29-tokens" in t and not any(r in t for r in refused) and "w4a" not in t
    }
    layers |= {t for t in ran if t.startswith(MODEL_DTYPE) and "37-tokens" in t}
    may = {t for t in ran if t.startswith((LAYER, MODEL_DTYPE)) and ("1-tokens" in t or "w4a" in t)}
    may.add("test_moe_features.py::test_state_dict_round_trip_onto_a_fresh_layer")  # rows left unwritten differ
    may |= {t for t in ran if t.startswith((*GEMM_SWEEPS, LAYER_SWEEP, OP_CONTRACTS, PLACEMENT))}
    may |= {t for t in ran if t.startswith("test_loading.py")}  # loaded layers are computed and compared too
    assert must | layers <= failed
    assert failed <= must | layers | may, sorted(failed - must - layers - may)
    assert any(t.startswith(GEMM_SWEEPS[0]) for t in failed)
    assert {
        "test_grouped_matmul.py",
        "test_moe_layer.py",
        "test_model_dtype.py",
        "test_activations_and_bias.py",
        "test_moe_features.py",
        "test_shape_sweeps.py",
    } <= {t.split("::")[0] for t in failed}
    assert result["exit"] == 1
    rows = {row["capability"]: row for row in result["matrix"]}
    assert all(rows[f"grouped_matmul {kind}"]["result"] == "FAIL" for kind in GemmKind)
    # ... and they reach the Markdown report
    markdown = (tmp_path / "report" / "conformance.md").read_text()
    assert "## drops-last-group: FAILED" in markdown
    assert "| grouped_matmul bf16 | declared | FAIL |" in markdown
    assert "### Failures" in markdown and "[bf16-counts]" in markdown
    assert rows["dispatch fp8"]["result"] == rows["swiglu"]["result"] == "pass"  # "bad input" computes loaded layers


def test_an_fp8_quantizer_that_truncates(tmp_path):
    result = _run(tmp_path, "truncating-fp8")
    failed, ran = _outcomes(result)
    layouts = ["per-token-group-128", "per-token"]
    must = {
        f"test_quantize.py::test_round_trip_error_is_within_one_rounding[fp8-{lay}-{t}]"
        for lay in layouts
        for t in ("bfloat16", "float16", "float32")
    }
    must |= {
        f"test_quantize.py::test_formats_scales_and_device[fp8-{lay}-{s}]"
        for lay in layouts
        for s in ("2d", "3d", "one-token")
    }
    must |= {f"test_quantize.py::test_all_zero_rows_stay_zero[fp8-{lay}-zero-rows]" for lay in layouts}
    must |= {
        f"test_dispatch.py::test_round_trip_through_scaling_experts[fp8-{lay}-{d}-{n}]"
        for lay in layouts
        for d in ("local", "low-latency")
        for n in ("37-tokens", "one-token")
    }
    must |= {
        f"test_shape_sweeps.py::test_quantize_sweep[fp8-{lay}-{n}-tokens]"
        for lay in layouts
        for n in (1, 7, 255, 257, 600)
    }
    # Layers that carry fp8 or quantize to fp8 after dispatch may exceed their tolerance too.
    may = {t for t in ran if t.startswith((LAYER, LAYER_SWEEP)) and ("-fp8-" in t or "w8a8-fp8-block" in t)}
    may |= {f"test_properties.py::test_quantize_round_trip_property[fp8-{lay}]" for lay in layouts}
    assert must <= failed, sorted(must - failed)
    assert failed <= must | may, sorted(failed - must - may)
    assert result["exit"] == 1
    rows = {row["capability"]: row for row in result["matrix"]}
    assert rows["dispatch fp8"]["result"] == "FAIL"
    assert all(rows[f"grouped_matmul {kind}"]["result"] == "pass" for kind in GemmKind)


def test_a_vendor_class_that_skips_hals_checks_is_refused_at_load(tmp_path):
    """`RawErrors` redefines `Vendor.swiglu` without its argument checks: its plugin fails to load, naming the
    method, and the suite does not run on it."""
    result = _run(tmp_path, "raw-errors")
    assert result["exit"] == 1 and not result["tests"]
    assert "redefines hal.Vendor's op method(s) swiglu" in result["not_run"], result["not_run"]


def test_an_inconsistent_declaration_makes_the_vendor_unavailable(tmp_path):
    result = _run(tmp_path, "inconsistent")
    assert result["exit"] == 1 and not result["tests"]
    assert "capability table contradicts itself" in result["not_run"], result["not_run"]
    assert "fallback int8 -> nvfp4 targets an unsupported dtype" in result["not_run"]


def test_a_correct_fused_op_passes_and_is_tested(tmp_path):
    result = _run(tmp_path, "fused-int8")
    assert result["exit"] == 0 and result["ok"], [t for t in result["tests"] if t["outcome"] == "failed"]
    rows = {row["capability"]: row for row in result["matrix"]}
    assert rows["fused_deep_moe w8a8-int8"] == {
        "capability": "fused_deep_moe w8a8-int8",
        "declared": "declared",
        "result": "pass",
        "passed": 1,
        "failed": 0,
        "skipped": 0,
        "skip_reasons": [],
    }
    assert rows["moe layer w8a8-int8"]["declared"] == "supported (fused)"
    assert {s for s in KNOWN_SCHEMES if rows[f"fused_deep_moe {s}"]["result"] == "skipped"} == set(KNOWN_SCHEMES) - {
        "w8a8-int8"
    }


def test_a_fused_op_that_ignores_the_routing_weights(tmp_path):
    result = _run(tmp_path, "fused-ignores-weights")
    failed, ran = _outcomes(result)
    must = {"test_moe_layer.py::test_fused_deep_moe_equals_the_unfused_path[w8a8-int8]"}
    must |= {t for t in ran if t.startswith(f"{LAYER}[w8a8-int8-") and "29-tokens" in t}
    may = {t for t in ran if t.startswith(f"{LAYER}[w8a8-int8-") and "1-tokens" in t}
    may |= {t for t in ran if t.startswith(f"{LAYER_SWEEP}[w8a8-int8-")}  # the fused path at top-1 and top-8
    assert must <= failed and failed <= must | may, sorted(failed ^ must)
