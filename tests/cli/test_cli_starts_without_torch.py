"""`hal --version`, `--help`, the help of every command and argument errors answer without importing torch
(through the console script and `python -m hal`); the help's name lists match the tables they restate."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hal
from hal.cli.names import DISPATCH_DTYPE_NAMES, SCHEME_NAMES

NO_TENSOR_NEEDED = {
    "version": ("--version",),
    "help": ("--help",),
    "no command": (),
    "unknown option": ("--bogus",),
    "unknown command": ("frobnicate",),
    "command help": ("bench", "--help"),
    "conformance help": ("conformance", "--help"),
    "unknown option of a command": ("explain", "--nope"),
    "bad integer": ("explain", "--hidden", "many"),
    "petabytes of tokens": ("bench", "--tokens", str(10**12)),
    "tune tokens": ("tune", "--tokens", str(10**12)),
}


def _imported(argv: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `argv` with import timing on; the completed process and the top-level modules it imported."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    modules = {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    }
    return done, modules


def _console_script() -> str:
    found = Path(sys.executable).with_name("hal")
    return str(found) if found.exists() else shutil.which("hal") or pytest.skip("no `hal` console script installed")


@pytest.mark.parametrize(
    ("entry", "case"),
    [("console script", case) for case in NO_TENSOR_NEEDED]
    + [("python -m hal", case) for case in ("version", "help", "unknown option")],
)
def test_answers_without_importing_torch(case, entry):
    prefix = [_console_script()] if entry == "console script" else [sys.executable, "-m", "hal"]
    done, modules = _imported([*prefix, *NO_TENSOR_NEEDED[case]])
    assert "hal" in modules, done.stderr[-2000:]  # the timing is on: the check can see imports
    assert "torch" not in modules, (case, done.returncode)
    assert "moe" not in modules and "Traceback" not in done.stderr


def test_a_command_that_computes_still_imports_torch():
    done, modules = _imported([sys.executable, "-m", "hal", "explain", "--vendor", "cpu"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch" in modules


def test_help_lists_the_tables_names():
    assert SCHEME_NAMES == tuple(hal.KNOWN_SCHEMES)
    assert DISPATCH_DTYPE_NAMES == tuple(hal.DispatchDtype.names())
