"""Every `hal` command keeps the README's exit codes (0 done, 1 refused, 2 bad arguments), `hal
--version` and `python -m hal` work, outputs are checked before long runs, and the bench table fits
100 columns."""

from __future__ import annotations

import subprocess
import sys

import pytest
from rich.console import Console

from bench.cases import CaseResult
from bench.report import table
from hal.cli.app import installed_version


def _hal(*argv: str, module: str = "hal.cli") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=300)


BAD_ARGUMENTS = {
    "unknown option": ("vendors", "--nope"),
    "unknown command": ("frobnicate",),
    "bad scheme": ("explain", "--scheme", "int3"),
    "bad dtype": ("explain", "--dispatch-dtype", "fp9"),
    "bad hidden": ("explain", "--hidden", "-4"),
    "bad activation": ("explain", "--activation", "tanh"),
    "bad device model": ("caps", "--vendor", "cpu", "--device-model", "Z80"),
    "bench tokens": ("bench", "--tokens", "0"),
    "bench output": ("bench", "--vendor", "cpu", "--output", "/nonexistent-dir/x.json"),
    "bench markdown dir": ("bench", "--vendor", "cpu", "--markdown", "/"),
    "bench model": ("bench", "--vendor", "cpu", "--model", "gpt-5"),
    "doctor seed": ("doctor", "--seed", str(10**23)),
    "no command": (),
    "unknown vendor to conformance": ("conformance", "--vendor", "nope"),
    "unknown vendor to doctor": ("doctor", "--vendor", "nope"),
    "petabytes of tokens": ("bench", "--tokens", str(10**12)),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_bad_arguments_exit_2_with_one_line(case):
    done = _hal(*BAD_ARGUMENTS[case])
    assert done.returncode == 2, (done.returncode, done.stdout[-500:], done.stderr[-500:])
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "error:" in done.stderr and "Traceback" not in done.stderr


REFUSED = {
    "unavailable vendor": ("bench", "--vendor", "cuda"),
    "plan that cannot build": ("explain", "--vendor", "ascend-emulated", "--scheme", "w4a4-int4"),
    "rejected dispatch dtype": ("explain", "--vendor", "cpu", "--dispatch-dtype", "nvfp4"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused_requests_exit_1(case):
    done = _hal(*REFUSED[case])
    assert done.returncode == 1, (done.returncode, done.stdout[-500:], done.stderr[-500:])
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("module", ["hal", "hal.cli"])
def test_version_and_module_entry(module):
    done = _hal("--version", module=module)
    assert done.returncode == 0 and done.stdout.strip() == f"hal (moe-hal) {installed_version()}"
    listed = _hal("vendors", "--json", module=module)
    assert listed.returncode == 0 and '"cpu"' in listed.stdout


def test_bench_table_fits_100_columns_with_the_widest_figures():
    """The widest figures an H100 or H200 run gives: 5-digit token counts, 6-digit loop times, 4-digit GB/s."""
    results = [
        CaseResult(
            "deepseek-v3-ep8",
            16384,
            "bf16",
            13347.2,
            13000.1,
            loop_us=123456.7,
            graph_us=13345.1,
            direct_graph_us=13000.0,
            weight_bytes=3.0e10,
            flops=1e13,
            roofline_us=9999.9,
        ),
        CaseResult(
            "qwen3-30b-a3b",
            1,
            "fp8",
            70.5,
            64.1,
            loop_us=1234.5,
            graph_us=50.9,
            direct_graph_us=49.0,
            weight_bytes=1e8,
            flops=1e9,
            roofline_us=25.1,
        ),
    ]
    console = Console(width=100, record=True)
    console.print(table(results, "hal bench: MoE layer, medians"))
    text = console.export_text()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 100
    assert "…" not in text, text  # nothing cut to fit
    assert "deepseek-v3-ep8" in text and "123,457" in text


def test_bench_table_leaves_out_columns_empty_in_every_row():
    results = [CaseResult("tiny", 8, "bf16", 15887.0, 17000.0, loop_us=98589.0)]
    console = Console(width=100, record=True)
    console.print(table(results, "t"))
    header = console.export_text().splitlines()[1]
    assert "graph" not in header and "roof" not in header and "eager" in header


def test_tune_refuses_a_vendor_with_nothing_to_tune_before_announcing_a_run(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hal", "tune", "--vendor", "cpu", "--model", "tiny"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "hal: error: vendor 'cpu' (cpu) has no kernel configurations to tune (its ops do not implement tune); "
        "`hal caps` lists what it declares"
    ]
    assert not list(tmp_path.iterdir())  # no table written
