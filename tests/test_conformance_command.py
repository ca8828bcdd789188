"""`hal conformance` and the pytest plugin, end to end in fresh interpreters: the CPU vendor
passes, the out-of-tree template vendor installs with pip and passes through its entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conformance.capability import all_labels
from tests.plugin_dist import environment_with

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "examples" / "vendor_template"


def _hal(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hal.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=900)


def test_cpu_passes_and_the_reports_parse(tmp_path):
    done = _hal("conformance", "--vendor", "cpu", "--report", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    for label in ("declarations", "dispatch nvfp4", "grouped_matmul int4", "moe layer w8a8-fp8-block", "bad input"):
        assert label in done.stdout
    assert "cpu: 0/" in done.stdout and "tests (passed" in done.stdout  # progress, a line per tenth
    report = json.loads((tmp_path / "conformance.json").read_text())
    assert report["ok"] is True and report["environment"]["moe_hal"]
    (cpu,) = report["vendors"]
    assert cpu["vendor"] == "cpu" and cpu["summary"]["failed"] == cpu["summary"]["error"] == 0
    assert cpu["summary"]["passed"] > 250
    assert [row["capability"] for row in cpu["matrix"]] == all_labels()
    rows = {row["capability"]: row for row in cpu["matrix"]}
    assert rows["dispatch nvfp4"]["declared"] == "rejected"
    assert rows["dispatch nvfp4"]["skip_reasons"] == ["vendor cpu declares no nvfp4 dispatch (rejected)"]
    assert all(row["result"] == "pass" for label, row in rows.items() if not label.startswith("fused_deep_moe"))
    markdown = (tmp_path / "conformance.md").read_text()
    assert "## cpu: passed" in markdown and "| dispatch fp8 | native | pass |" in markdown
    assert "passed" in (tmp_path / "pytest-cpu.log").read_text()


def test_the_template_vendor_installs_and_passes_through_its_entry_point(tmp_path):
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(site), str(TEMPLATE)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr
    env = environment_with(site)
    # The package exists only where pip put it: nothing in this repository provides it.
    plain = dict(os.environ)
    plain.pop("PYTHONPATH", None)
    missing = subprocess.run([sys.executable, "-c", "import hal_vendor_template"], env=plain, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0
    vendors = json.loads(_hal("vendors", "--json", env=env, cwd=tmp_path).stdout)
    assert any(v["name"] == "template" and v["available"] for v in vendors["vendors"])
    assert vendors["selected"] != "template"  # a lower priority: installing it changes no default

    done = _hal("conformance", "--vendor", "template", "-n", "2", "--report", str(tmp_path / "report"),
                env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (template,) = json.loads((tmp_path / "report" / "conformance.json").read_text())["vendors"]
    assert template["ok"] and template["summary"]["failed"] == 0 and template["summary"]["passed"] > 150
    rows = {row["capability"]: row for row in template["matrix"]}
    assert rows["dispatch fp8"]["declared"] == "falls back to int8" and rows["dispatch fp8"]["result"] == "pass"
    assert rows["dispatch nvfp4"]["declared"] == "rejected"
    assert rows["moe layer w8a8-int8"]["result"] == "pass"
    assert rows["grouped_matmul fp8-rowwise"]["result"] == "skipped"


def test_plain_pytest_runs_the_suite_and_skips_without_a_vendor(tmp_path):
    def pytest(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "conformance.suite", "-q",
                               "-p", "no:cacheprovider", "-k", "declarations or resolution", *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=600)

    done = pytest("--hal-vendor", "cpu", "-rs")
    assert done.returncode == 0 and " passed" in done.stdout and "failed" not in done.stdout, done.stdout
    without = pytest("-rs")
    assert without.returncode == 0 and " passed" not in without.stdout
    assert "run pytest with --hal-vendor NAME" in without.stdout
    unknown = pytest("--hal-vendor", "nope")
    assert unknown.returncode == 4 and "no vendor named 'nope'" in unknown.stderr


def test_an_unknown_vendor_is_reported_and_fails(tmp_path):
    done = _hal("conformance", "--vendor", "nope", "--report", str(tmp_path), "--json")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["ok"] is False and "no vendor named 'nope'" in report["vendors"][0]["not_run"]
    assert json.loads((tmp_path / "conformance.json").read_text()) == report
