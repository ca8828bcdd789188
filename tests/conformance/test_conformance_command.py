"""`hal conformance` and the pytest plugin, end to end in fresh interpreters: the CPU vendor
passes, the out-of-tree template vendor installs with pip and passes through its entry point; the
depth reaches the suite and the reports; a run where no test ran fails; bad arguments of `hal
conformance` and `hal doctor` exit 2 before anything runs; without pytest every command still
registers quietly and `hal conformance` says what to install."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conformance.capability import GRAPH_CAPTURE, all_labels
from conformance.cli import DEPTHS as CLI_DEPTHS
from conformance.plugin import DEPTHS
from tests.support.plugin_dist import environment_with
from tests.support.paths import REPO

pytestmark = pytest.mark.slow  # subprocesses / multi-process worlds

ROOT = REPO
TEMPLATE = ROOT / "examples" / "vendor_template"


def _hal(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hal.cli", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=900
    )


def test_cpu_passes_and_the_reports_parse(tmp_path):
    done = _hal("conformance", "--vendor", "cpu", "--report", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    for label in ("declarations", "dispatch nvfp4", "grouped_matmul int4", "moe layer w8a8-fp8-block", "bad input"):
        assert label in done.stdout
    assert "cpu: 0/" in done.stdout and "tests (passed" in done.stdout  # progress, a line per tenth
    report = json.loads((tmp_path / "conformance.json").read_text())
    assert report["ok"] is True and report["environment"]["moe_hal"]
    assert report["depth"] == "quick" and report["vendors"][0]["depth"] == "quick"
    (cpu,) = report["vendors"]
    assert cpu["vendor"] == "cpu" and cpu["summary"]["failed"] == cpu["summary"]["error"] == 0
    assert cpu["summary"]["passed"] > 250
    assert [row["capability"] for row in cpu["matrix"]] == all_labels()
    rows = {row["capability"]: row for row in cpu["matrix"]}
    assert rows["dispatch nvfp4"]["declared"] == "rejected"
    assert rows["dispatch nvfp4"]["skip_reasons"] == ["vendor cpu declares no nvfp4 dispatch (rejected)"]
    undeclared = {GRAPH_CAPTURE}  # with fused_deep_moe: what the CPU vendor declares absent, so skips
    assert rows[GRAPH_CAPTURE]["declared"] == "not declared"
    assert all(
        row["result"] == "pass"
        for label, row in rows.items()
        if not label.startswith("fused_deep_moe") and label not in undeclared
    )
    markdown = (tmp_path / "conformance.md").read_text()
    assert "## cpu: passed" in markdown and "| dispatch fp8 | native | pass |" in markdown
    assert "· depth quick" in markdown.splitlines()[2]
    sweeps = {t["id"].split("[")[0] for t in cpu["tests"] if t["outcome"] == "passed"}
    assert {"test_shape_sweeps.py::test_layer_sweep", "test_properties.py::test_grouped_matmul_property"} <= sweeps
    assert "passed" in (tmp_path / "pytest-cpu.log").read_text()


def test_the_template_vendor_installs_and_passes_through_its_entry_point(tmp_path):
    site = tmp_path / "site"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(TEMPLATE),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    env = environment_with(site)
    # The package exists only where pip put it: nothing in this repository provides it.
    plain = dict(os.environ)
    plain.pop("PYTHONPATH", None)
    missing = subprocess.run(
        [sys.executable, "-c", "import hal_vendor_template"],
        env=plain,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode != 0
    vendors = json.loads(_hal("vendors", "--json", env=env, cwd=tmp_path).stdout)
    assert any(v["name"] == "template" and v["available"] for v in vendors["vendors"])
    assert vendors["selected"] != "template"  # a lower priority: installing it changes no default

    done = _hal(
        "conformance", "--vendor", "template", "-n", "2", "--report", str(tmp_path / "report"), env=env, cwd=tmp_path
    )
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
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "--pyargs",
                "conformance.suite",
                "-q",
                "-p",
                "no:cacheprovider",
                "-k",
                "declarations or resolution",
                *args,
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )

    done = pytest("--hal-vendor", "cpu", "-rs")
    assert done.returncode == 0 and " passed" in done.stdout and "failed" not in done.stdout, done.stdout
    without = pytest("-rs")
    assert without.returncode == 0 and " passed" not in without.stdout
    assert "run pytest with --hal-vendor NAME" in without.stdout
    unknown = pytest("--hal-vendor", "nope")
    assert unknown.returncode == 4 and "no vendor named 'nope'" in unknown.stderr


def test_an_unknown_vendor_is_a_bad_argument_refused_before_any_run(tmp_path):
    done = _hal("conformance", "--vendor", "nope", "--report", str(tmp_path), "--json")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "no vendor named 'nope'" in done.stderr, done.stderr
    assert json.loads(done.stdout)["error"]["type"] == "UnknownVendor"
    assert not (tmp_path / "conformance.json").exists()


def test_full_depth_adds_the_shapes_of_large_models(tmp_path):
    done = _hal(
        "conformance",
        "--vendor",
        "cpu",
        "--depth",
        "full",
        "-k",
        "sort_by_expert_sweep and 8192",
        "--report",
        str(tmp_path),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "conformance.json").read_text())
    assert report["depth"] == "full" and "· depth full" in (tmp_path / "conformance.md").read_text()
    assert sorted(t["id"] for t in report["vendors"][0]["tests"]) == [
        f"test_shape_sweeps.py::test_sort_by_expert_sweep[8192-tokens-top{k}]" for k in (1, 8)
    ]


def test_no_test_ran_is_a_failure_with_a_message(tmp_path):
    done = _hal("conformance", "--vendor", "cpu", "-k", "nomatch", "--report", str(tmp_path))
    assert done.returncode == 1
    assert "no conformance test ran for cpu (-k 'nomatch' selected none)" in done.stderr
    (cpu,) = json.loads((tmp_path / "conformance.json").read_text())["vendors"]
    assert cpu["ok"] is False and sum(cpu["summary"].values()) == 0
    assert "no test ran" in (tmp_path / "conformance.md").read_text()


#: Arguments of `hal conformance` and `hal doctor` refused before anything runs: exit 2, one line.
BAD_ARGUMENTS = {
    "depth": ("conformance", "--depth", "deep"),
    "empty vendor": ("conformance", "--vendor", " "),
    "workers": ("conformance", "-n", "-1"),
    "report is a file": ("conformance", "--vendor", "cpu", "--report", __file__),
    "report cannot be created": ("conformance", "--vendor", "cpu", "--report", "/proc/no/such/dir"),
    "keyword": ("conformance", "--vendor", "cpu", "-k", "(", "--report", "{tmp}"),
    "doctor seed too large": ("doctor", "--seed", str(10**23)),
    "doctor negative seed": ("doctor", "--seed", "-1"),
    "doctor seed not a number": ("doctor", "--seed", "x"),
    "doctor empty vendor": ("doctor", "--vendor", ""),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_bad_arguments_are_refused_with_exit_2(tmp_path, case):
    args = [a.replace("{tmp}", str(tmp_path)) for a in BAD_ARGUMENTS[case]]
    done = _hal(*args, cwd=tmp_path)
    assert done.returncode == 2, (done.returncode, done.stdout[-800:], done.stderr[-800:])
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not list(tmp_path.rglob("conformance.json"))  # refused before a report was written


#: `hal` as a plain install runs it: pytest is absent (the `[test]` extra is not installed).
WITHOUT_PYTEST = (
    "import sys; sys.modules['pytest'] = None; sys.modules['_pytest'] = None\n"
    "from hal.cli import main\nraise SystemExit(main(sys.argv[1:]))"
)


def test_without_pytest_the_commands_register_quietly_and_conformance_says_what_to_install(tmp_path):
    def hal(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", WITHOUT_PYTEST, *args],
            capture_output=True,
            text=True,
            env=environment_with(ROOT),
            timeout=300,
            cwd=tmp_path,
        )

    for args in (("--help",), ("vendors",), ("conformance", "--help"), ("doctor", "--help")):
        done = hal(*args)
        assert done.returncode == 0 and "warning" not in done.stderr.lower(), (args, done.stderr)
    assert "conformance" in hal("--help").stdout and "--depth" in hal("conformance", "--help").stdout
    done = hal("conformance")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "pytest, which is not installed: pip install 'moe-hal[test]'" in done.stderr
    assert not (tmp_path / "conformance-report").exists()  # nothing was written before refusing


def test_plain_pytest_takes_the_depth(tmp_path):
    def pytest_run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "--pyargs",
                "conformance.suite",
                "-q",
                "-p",
                "no:cacheprovider",
                "--hal-vendor",
                "cpu",
                *args,
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )

    full = pytest_run("--hal-depth", "full", "-k", "sort_by_expert_sweep and 4097", "--co")
    assert full.returncode == 0 and "4097-tokens" in full.stdout, full.stdout
    quick = pytest_run("-k", "sort_by_expert_sweep", "--co")
    assert quick.returncode == 0 and "600-tokens" in quick.stdout and "4097" not in quick.stdout
    assert pytest_run("--hal-depth", "deep").returncode == 4
    assert CLI_DEPTHS == DEPTHS  # restated in the CLI, which does not import pytest


def test_a_run_stopped_by_sigterm_names_the_tests_still_running(tmp_path):
    """What `timeout` does to a long device run: the report still comes out, exits 1, and lists the
    tests that were running (a hang would otherwise leave no name behind)."""
    log = tmp_path / "pytest-cpu.log"
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hal.cli",
            "conformance",
            "--vendor",
            "cpu",
            "--depth",
            "full",
            "-k",
            "test_properties",
            "--report",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        # pytest writes a test's result character after the test; once one is there the next test runs
        while not (log.is_file() and any(c in "." for c in log.read_text().partition("test_properties.py")[2])):
            assert time.monotonic() < deadline and run.poll() is None, "the run ended before a test finished"
            time.sleep(0.2)
        run.send_signal(signal.SIGTERM)
        stdout, stderr = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 1, stdout + stderr
    assert "UNFINISHED test_properties.py::" in stdout and "interrupted with" in stdout, stdout
    (cpu,) = json.loads((tmp_path / "conformance.json").read_text())["vendors"]
    assert (
        cpu["ok"] is False
        and cpu["unfinished"]
        and all(u["id"].startswith("test_properties.py::") for u in cpu["unfinished"])
    )
    finished = {t["id"] for t in cpu["tests"]}
    assert finished and not finished & {u["id"] for u in cpu["unfinished"]}


SWALLOWS_TEST = """
import os, signal, time
def test_catches_the_interrupt():
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    except KeyboardInterrupt:  # as hypothesis may, replaying an example the interrupt cut short
        raise AssertionError("flaky")
def test_never_starts():
    pass
"""

SWALLOWS_RUN = """
import json, sys, pytest
from conformance.runner import ResultCollector, _sigterm_interrupts
collector = ResultCollector("cpu")
with _sigterm_interrupts(collector.interrupt):
    code = int(pytest.main([sys.argv[1], "-q", "-p", "no:cacheprovider", "-c", "/dev/null"], plugins=[collector]))
print(json.dumps({"code": code, "results": sorted(collector.results),
                  "unfinished": [n for n, _ in collector.unfinished()]}))
"""


def test_a_test_that_catches_the_interrupt_still_stops_the_run(tmp_path):
    """SIGTERM during a test whose code turns the KeyboardInterrupt into a failure: the run stops there,
    and that test is reported unfinished, not failed."""
    (tmp_path / "test_swallows.py").write_text(SWALLOWS_TEST)
    done = subprocess.run(
        [sys.executable, "-c", SWALLOWS_RUN, str(tmp_path / "test_swallows.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["code"] == 2, out  # pytest's "interrupted"
    assert [n.rpartition("::")[2] for n in out["unfinished"]] == ["test_catches_the_interrupt"], out
    assert not any("never_starts" in r for r in out["results"]), out


THREADS_TEST = """
import os, torch
def test_threads():
    cpus = len(os.sched_getaffinity(0))
    assert torch.get_num_threads() == max(1, cpus // 2), (torch.get_num_threads(), cpus)
"""


def test_xdist_workers_of_a_suite_run_share_the_cpus(tmp_path):
    """Each of N workers gets its share of the CPU threads (the float64 references of 15 workers of 16
    threads each stalled the full-depth run on an H100 host); plain pytest sessions are left alone."""
    (tmp_path / "test_threads.py").write_text(THREADS_TEST)
    env = {**os.environ, "OMP_NUM_THREADS": str(4 * len(os.sched_getaffinity(0)))}

    def pytest_run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_threads.py", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    shared = pytest_run("--hal-vendor", "cpu", "-n", "2")
    assert shared.returncode == 0, shared.stdout + shared.stderr
    untouched = pytest_run("-n", "2")  # not a suite run: the threads stay as configured
    assert untouched.returncode == 1 and "assert" in untouched.stdout, untouched.stdout
