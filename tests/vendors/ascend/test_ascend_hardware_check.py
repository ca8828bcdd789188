"""The hardware checklist (`examples/ascend_hardware_check.py`) runs, and passes, on the emulation,
so that the script an NPU owner runs is known to work; on hardware it tests what the emulation assumes."""

from __future__ import annotations

import importlib.util
from tests.support.paths import REPO

SCRIPT = REPO / "examples" / "ascend_hardware_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("ascend_hardware_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_every_check_passes_or_says_why_it_skips_on_the_emulation(capsys):
    script = _load()
    assert script.main(["--vendor", "ascend-emulated"]) == 0
    lines = capsys.readouterr().out.splitlines()[2:]  # after the vendor and the number of checks
    assert len(lines) == len(script.CHECKS)
    assert all(" PASS" in line or " SKIP " in line for line in lines), lines
    assert sum(" PASS" in line for line in lines) >= 3


def test_a_wrong_op_is_reported_as_a_failure(monkeypatch, capsys):
    from vendors.ascend.emulation.vendor import EmulatedAscendVendor

    class Broken(EmulatedAscendVendor):
        def _make_ops(self):  # type: ignore[no-untyped-def]
            ops = super()._make_ops()
            right = ops.grouped_matmul
            ops.grouped_matmul = lambda *args, **kwargs: right(*args, **kwargs) * 1.1  # every GEMM 10 % off
            return ops

    script = _load()
    monkeypatch.setattr(script.hal, "get_vendor", lambda name=None: Broken())
    assert script.main(["--vendor", "ascend-emulated"]) == 1
    out = capsys.readouterr().out
    assert "w8a8 grouped matmul          FAIL" in out and "fp32 grouped matmul          FAIL" in out
