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
from hal.cli.names import DISPATCH_DTYPE_NAMES, DISPATCH_DTYPE_SPELLINGS, SCHEME_NAMES, SCHEME_SPELLINGS, known_scheme

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
    "misspelt scheme": ("explain", "--scheme", "w8a8-fp9"),
    "misspelt dispatch dtype": ("explain", "--dispatch-dtype", "fp7"),
    "misspelt scheme of a layer": ("layer", "--scheme", "int3"),
    "misspelt dispatch dtype of a layer": ("layer", "--dispatch-dtype", "e5m2"),
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


def _accepted(parse, value: str) -> bool:
    try:
        parse(value)
    except hal.InvalidInput:
        return False
    return True


CANDIDATES = sorted(
    {*SCHEME_SPELLINGS, *DISPATCH_DTYPE_SPELLINGS, *(n.replace("-", "_") for n in SCHEME_SPELLINGS)}
    | {"e5m2", "fp4", "int3", "w8a8", "float64", "fp8-e5m2", "mxfp6", "bfloat", ""}
)


@pytest.mark.parametrize("value", CANDIDATES + [c.upper() for c in CANDIDATES if c])
def test_the_torch_free_name_checks_agree_with_the_parsers(value):
    assert known_scheme(value) == _accepted(hal.parse_scheme, value)
    assert (value.strip().lower().replace("-", "_") in DISPATCH_DTYPE_SPELLINGS) == _accepted(
        hal.DispatchDtype.parse, value
    )


def test_every_spelling_the_parsers_accept_is_known_without_torch():
    from hal.dtypes import _ALIASES
    from hal.schemes import _SCHEME_ALIASES

    assert set(_ALIASES) == DISPATCH_DTYPE_SPELLINGS
    assert {*hal.KNOWN_SCHEMES, *_SCHEME_ALIASES} <= SCHEME_SPELLINGS
    assert {s for s in SCHEME_SPELLINGS if s not in hal.KNOWN_SCHEMES and s not in _SCHEME_ALIASES} == {
        a.replace("_", "-")
        for a in _ALIASES
        if _accepted(hal.parse_scheme, a) and a not in _SCHEME_ALIASES and a not in hal.KNOWN_SCHEMES
    }
