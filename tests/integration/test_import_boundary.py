"""The layering of design.md section 1, enforced: hal imports no vendor; moe only hal; no device branches."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from tests.support.paths import REPO

ROOT = REPO

#: package -> top-level modules it must never import
FORBIDDEN = {
    "hal": {"vendors", "moe", "conformance", "torch_npu", "deep_ep", "flashinfer"},
    "moe": {"vendors", "conformance", "torch_npu", "deep_ep", "flashinfer"},
    "conformance": {"vendors"},
    # The benchmark drives whatever vendor hal selects; it may time with CUDA events, never import one.
    "bench": {"vendors", "torch_npu", "deep_ep", "flashinfer"},
}
DEVICE_BRANCH = re.compile(r"is_npu|_is_cuda|is_cuda\(|device\.type\s*==|cuda\.is_available\(")
ENV_WRITE = re.compile(r"os\.environ\[[^]]+\]\s*=|os\.environ\.(update|setdefault|pop)|os\.putenv|os\.unsetenv")


def imported_modules(source: str) -> set[str]:
    """Top-level modules a source file imports, `importlib.import_module("x")` and `__import__` included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.add(node.args[0].value.split(".")[0])
    return found


def python_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported_names(source: str) -> set[str]:
    """Full dotted names of the modules a source file imports (`from a.b import c` gives `a.b`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


#: The modules of hal other layers may import: the API, the public reference ops, the CLI for command plugins.
HAL_PUBLIC = {"hal", "hal.reference", "hal.cli"}
VENDOR_PACKAGES = ("cpu", "cuda", "ascend")


def test_the_scanner_catches_every_import_form():
    source = "import vendors.cpu\nfrom torch_npu import npu\nimport importlib\nimportlib.import_module('deep_ep.x')\n"
    assert {"vendors", "torch_npu", "deep_ep"} <= imported_modules(source)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports(package):
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in python_files(package)
        for name in sorted(imported_modules(path.read_text()) & FORBIDDEN[package])
    ]
    assert offences == []


@pytest.mark.parametrize("package", ["moe", "vendors", "conformance", "bench", "examples"])
def test_only_the_hal_api_is_imported_outside_hal(package):
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in python_files(package)
        for name in sorted(imported_names(path.read_text()))
        if name.split(".")[0] == "hal" and name not in HAL_PUBLIC
    ]
    assert offences == []


@pytest.mark.parametrize("vendor", VENDOR_PACKAGES)
def test_no_vendor_imports_another(vendor):
    others = {f"vendors.{v}" for v in VENDOR_PACKAGES if v != vendor}
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in python_files(f"vendors/{vendor}")
        for name in sorted(imported_names(path.read_text()))
        if name in others or any(name.startswith(o + ".") for o in others)
    ]
    assert offences == []


def test_the_name_scanner_sees_submodules():
    names = imported_names("from hal.dtypes import X\nimport vendors.cpu.vendor\nfrom hal import Vendor\n")
    assert names == {"hal.dtypes", "vendors.cpu.vendor", "hal"}


@pytest.mark.parametrize("package", ["hal", "moe", "conformance"])
def test_no_device_branches(package):
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in python_files(package)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if DEVICE_BRANCH.search(line)
    ]
    assert hits == []


DEVICE_NAMES = {"cpu", "cuda", "npu", "xpu", "mps", "hip", "meta"}


def device_questions(source: str) -> list[str]:
    """Places where code asks which device it is on: device-name literals, `torch.cuda` /
    `torch.npu` / `torch.version.hip` access, `.device.type`, `is_npu`-style names."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value.strip().lower()
            if value in DEVICE_NAMES or value.split(":")[0] in DEVICE_NAMES - {"meta"} and ":" in value:
                found.append(f"line {node.lineno}: device name {node.value!r}")
        elif isinstance(node, ast.Attribute):
            chain = ast.unparse(node)
            if chain in ("torch.cuda", "torch.npu", "torch.version.hip", "torch.version.cuda"):
                found.append(f"line {node.lineno}: {chain}")
            elif node.attr == "type" and ast.unparse(node.value).endswith("device"):
                found.append(f"line {node.lineno}: {chain}")
        elif isinstance(node, ast.Name) and re.fullmatch(r"_?is_(npu|cuda|hip|xpu|gpu)", node.id):
            found.append(f"line {node.lineno}: {node.id}")
    return found


def test_the_device_question_scanner_catches_branches():
    source = (
        "if x.device.type == 'npu':\n    pass\n"
        "if torch.cuda.is_available():\n    pass\n"
        "if _is_npu:\n    pass\n"
        "y = x.to('cuda:0')\n"
    )
    assert len(device_questions(source)) == 5
    assert device_questions("x = vendor.device\ny = torch.empty(3, device=x.device)\n") == []


@pytest.mark.parametrize("package", ["moe", "conformance"])
def test_no_device_questions(package):
    """moe computes the same on every vendor; the suite tests every vendor the same way."""
    hits = [
        f"{path.relative_to(ROOT)} {hit}"
        for path in python_files(package)
        for hit in device_questions(path.read_text())
    ]
    assert hits == []


@pytest.mark.parametrize("package", ["hal", "moe", "conformance", "vendors"])
def test_no_environment_writes(package):
    hits = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in python_files(package)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if ENV_WRITE.search(line)
    ]
    assert hits == []


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is not installed")
def test_import_linter_contracts_hold():
    done = subprocess.run(["lint-imports", "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is not installed")
def test_import_linter_contracts_catch_forbidden_imports(tmp_path):
    """A copy of the tree with a vendor importing another and moe importing a private hal module breaks
    exactly those two contracts."""
    for package in ("hal", "vendors", "moe", "conformance", "bench"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "vendors" / "cuda" / "capabilities.py", "a") as f:
        f.write("\nfrom vendors.cpu import CpuVendor\n")
    with open(tmp_path / "moe" / "routing.py", "a") as f:
        f.write("\nfrom hal.dtypes import DTYPES\n")
    done = subprocess.run(["lint-imports", "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "vendors.cuda is not allowed to import vendors.cpu" in done.stdout
    assert "moe is not allowed to import hal.dtypes" in done.stdout
    assert "Contracts: 4 kept, 2 broken." in done.stdout


#: Most lines a Python module of the project may have (small modules with names that explain themselves).
MAX_MODULE_LINES = 420


def test_no_module_is_long():
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for package in ("hal", "moe", "vendors", "conformance", "bench", "tests", "examples")
        for path in python_files(package)
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert long == []
