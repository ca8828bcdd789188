"""The `hal` command line, run in-process and once through the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from hal.cli import main
from hal import DispatchDtype, VendorRegistry
from vendors.cpu import CpuVendor
from tests.support.plugin_dist import environment_with, write_distribution
from tests.support.paths import REPO

ROOT = REPO


@pytest.fixture(autouse=True)
def no_env_overrides(monkeypatch):
    for variable in (
        "HAL_VENDOR",
        "HAL_DISPATCH_DTYPE",
        "SGLANG_DEEPEP_BF16_DISPATCH",
        "DEEP_NORMAL_MODE_USE_INT8_QUANT",
    ):
        monkeypatch.delenv(variable, raising=False)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        status = main(list(argv))
    except SystemExit as exc:  # argparse errors
        status = int(exc.code)
    out, err = capsys.readouterr()
    return status, out, err


def run_json(capsys, *argv: str) -> dict:
    status, out, err = run(capsys, *argv, "--json")
    assert status == 0, err
    return json.loads(out)


def expected_default() -> str:
    """cpu on a machine without accelerators, cuda on a GPU host."""
    return VendorRegistry.discover().select(environ={}).vendor.name


def test_vendors_lists_every_vendor_with_its_state(capsys):
    status, out, _ = run(capsys, "vendors")
    assert status == 0
    assert f"{expected_default()} (selected)" in out and "available" in out
    assert "torch_npu is not installed" in out
    data = run_json(capsys, "vendors")
    by_name = {v["name"]: v for v in data["vendors"]}
    assert by_name["cpu"]["available"] and data["selected"] == expected_default()
    assert not by_name["ascend"]["available"] and "torch_npu" in by_name["ascend"]["detail"]
    assert "cuda" in by_name and by_name["cuda"]["detail"]


def test_caps_of_the_cpu_vendor(capsys):
    status, out, _ = run(capsys, "caps", "--vendor", "cpu")
    declared = ", ".join(sorted(d.value for d in CpuVendor().capabilities().dispatch_dtypes))
    assert status == 0 and declared in out and "probed" in out
    status, out, _ = run(capsys, "caps")
    assert status == 0 and f"capabilities of vendor '{expected_default()}'" in out
    data = run_json(capsys, "caps", "--vendor", "cpu")
    assert data["source"] == "probed" and data["capabilities"]["supports_fp8_dispatch"] is True
    assert data["consistency_problems"] == []


def test_caps_of_absent_hardware_uses_a_declared_table_and_says_so(capsys):
    status, out, _ = run(capsys, "caps", "--vendor", "ascend")
    words = " ".join(out.split())  # the console wraps long lines
    assert status == 0 and "declared table for device model A3" in words and "fp8 -> int8" in words
    data = run_json(capsys, "caps", "--vendor", "cuda", "--device-model", "a100")
    assert data["source"] == "declared" and data["device_model"] == "a100"
    assert data["capabilities"]["dispatch_dtypes"] == ["bf16", "fp16", "fp32"]


def test_explain_ascend_fp8_shows_the_fallback_and_why(capsys):
    status, out, _ = run(capsys, "explain", "--vendor", "ascend", "--dispatch-dtype", "fp8")
    assert status == 0
    assert "fallback:  fp8 -> int8" in out and "no fp8 matmul" in out
    assert "resolved:  int8 (per-token), 4100 bytes per token" in out


def test_explain_ascend_nvfp4_fails_with_one_clear_line(capsys):
    status, out, err = run(capsys, "explain", "--vendor", "ascend", "--dispatch-dtype", "nvfp4")
    assert status == 1
    assert err.count("\n") == 1 and "cannot dispatch nvfp4" in err and "bf16, fp16, fp32, int8" in err
    assert "Traceback" not in err


def test_explain_cuda_int8_shows_int8_to_fp8(capsys):
    data = run_json(capsys, "explain", "--vendor", "cuda", "--dispatch-dtype", "int8", "--hidden", "7168")
    plan = data["plan"]
    assert (plan["requested"], plan["resolved"]) == ("int8", "fp8")
    assert plan["fallback"]["from"] == "int8" and plan["bytes_per_token"] == 7168 + 56 * 4
    if VendorRegistry.discover().get("cuda").probe().available:
        assert data["table"] == "probed"
    else:
        assert data["table"] == "declared" and "H100" in data["note"]


def test_explain_reads_the_environment_variable(capsys, monkeypatch):
    monkeypatch.setenv("HAL_DISPATCH_DTYPE", "int8")
    plan = run_json(capsys, "explain", "--vendor", "cpu", "--scheme", "w8a8-fp8-block")["plan"]
    assert (plan["source"], plan["resolved"]) == ("environment", "int8")


def test_explain_with_a_scheme(capsys):
    status, out, _ = run(capsys, "explain", "--scheme", "W8A8-INT8", "--hidden", "2048")
    assert status == 0 and "scheme 'w8a8-int8' declares int8" in out and "2052 bytes per token" in out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["explain", "--dispatch-dtype", "fp9"], f"expected one of {', '.join(DispatchDtype.names())}"),
        (["explain", "--hidden", "-3"], "expected a positive integer"),
        (["explain", "--scheme", "w2a2"], "expected one of unquantized"),
        (["caps", "--vendor", "cuda", "--device-model", "V100"], "expected one of H100"),
        (["caps", "--vendor", "tpu"], "no vendor named 'tpu'"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_non_zero_with_one_line(capsys, argv, fragment):
    status, _, err = run(capsys, *argv)
    assert status in (1, 2) and err.count("\n") == 1 and fragment in err, err
    assert "Traceback" not in err


def test_bad_dispatch_dtype_exits_2(capsys):
    assert run(capsys, "explain", "--dispatch-dtype", "fp9")[0] == 2


def test_error_under_json_is_json_too(capsys):
    status, out, _ = run(capsys, "explain", "--vendor", "ascend", "--dispatch-dtype", "nvfp4", "--json")
    assert status == 1 and json.loads(out)["error"]["type"] == "UnsupportedDispatchDtype"


def test_doctor_passes_on_the_cpu_vendor(capsys):
    status, out, _ = run(capsys, "doctor")
    assert status == 0 and "checks passed" in out
    data = run_json(capsys, "doctor")
    assert data["failed"] == 0 and len(data["checks"]) >= 10


def test_doctor_on_an_unavailable_vendor_explains(capsys):
    status, _, err = run(capsys, "doctor", "--vendor", "ascend")
    assert status == 1 and "torch_npu" in err


def test_no_command_prints_help_and_exits_2(capsys):
    status, out, _ = run(capsys)
    assert status == 2 and "vendors" in out


@pytest.mark.skipif(shutil.which("hal") is None, reason="the package is not installed (pip install -e .)")
def test_console_script_and_command_plugins(tmp_path):
    """The installed `hal` script loads a command registered by another distribution."""
    root = write_distribution(
        tmp_path,
        "hal-test-command",
        {"hal.commands": {"hello": "hello_cmd:register", "bad": "nope_cmd:x"}},
        {
            "hello_cmd": """
            def register(subparsers):
                parser = subparsers.add_parser("hello", help="say hello")
                parser.set_defaults(handler=lambda args, console: print("hello from a plugin") or 0)
        """
        },
    )
    env = environment_with(root)
    done = subprocess.run(["hal", "hello"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "hello from a plugin" in done.stdout
    assert "command plugin 'bad' failed to load" in done.stderr
    listed = subprocess.run(["hal", "vendors", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and json.loads(listed.stdout)["selected"] == expected_default()


def test_doctor_works_without_pytest_and_conformance_says_what_to_install():
    """The README's main job (`pip install -e . && hal doctor`) has no test extra: pytest is absent."""
    code = (
        "import sys; sys.modules['pytest'] = None; sys.modules['_pytest'] = None\n"
        "from hal.cli import main\nraise SystemExit(main(sys.argv[1:]))"
    )
    env = environment_with(ROOT)
    doctor = subprocess.run(
        [sys.executable, "-c", code, "doctor", "--vendor", "cpu"], capture_output=True, text=True, env=env, timeout=300
    )
    assert doctor.returncode == 0 and "checks passed" in doctor.stdout and "warning" not in doctor.stderr
    suite = subprocess.run(
        [sys.executable, "-c", code, "conformance", "--vendor", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert suite.returncode == 1 and "pip install 'moe-hal[test]'" in suite.stderr


def test_explain_names_the_expert_parallel_dispatchers_and_refuses_an_absent_one(capsys):
    status, out, _ = run(capsys, "explain", "--vendor", "ascend", "--ep-dispatcher", "mc2")
    assert status == 0, out
    assert "expert parallel: mc2 (normal)" in " ".join(out.split())
    status, out, _ = run(capsys, "explain", "--vendor", "cpu", "--ep-dispatcher", "deepep", "--json")
    assert status == 1
    report = json.loads(out)
    assert not report["buildable"] and "'deepep' is not declared" in report["problems"][0]
    assert report["ep_dispatchers"]["declared"] == []
