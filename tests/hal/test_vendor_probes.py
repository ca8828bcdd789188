"""Probes of the shipped vendors: truthful reasons off their hardware, no crash on a broken runtime."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hal import DispatchDtype, InvalidInput, UnsupportedCapability, VendorUnavailable
from vendors.ascend import AscendVendor
from tests.support.paths import REPO
from vendors.cuda import CudaVendor


def test_cpu_is_always_available(cpu):
    assert cpu.probe().available
    assert cpu.devices() == [torch.device("cpu")]
    assert cpu.capabilities() is cpu.capabilities()  # resolved once


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_is_unavailable_with_a_reason_off_gpu():
    vendor = CudaVendor()
    result = vendor.probe()
    assert not result.available and "CUDA" in result.reason
    with pytest.raises(VendorUnavailable, match="'cuda' is unavailable"):
        vendor.capabilities()


@pytest.mark.parametrize(
    "option", ["dependent_launch", "deep_gemm", "split_fp4_decode"], ids=["dependent-launch", "deep-gemm", "fp4-split"]
)
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_cuda_vendor_refuses_options_that_are_not_booleans(option, value):
    """The CUDA vendor's switches take True or False only, refused at construction (before any device is
    touched) with the option's name."""
    with pytest.raises(InvalidInput, match=option):
        CudaVendor(**{option: value})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_cuda_probe_reads_the_compute_capability():
    vendor = CudaVendor()
    assert vendor.probe().available
    major, minor = torch.cuda.get_device_capability()
    assert vendor.capabilities().supports_fp8_dispatch == (major * 10 + minor >= 89)


def _fake_torch_npu(tmp_path, monkeypatch, body: str) -> None:
    """Put a stand-in `torch_npu` package (the API surface the probe reads) first on sys.path."""
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    importlib.invalidate_caches()


@pytest.fixture
def restore_torch_npu():
    yield
    sys.modules.pop("torch_npu", None)


def test_ascend_without_torch_npu_says_it_is_not_installed():
    result = AscendVendor().probe()
    assert not result.available and "torch_npu is not installed" in result.reason


def test_ascend_without_cann_reports_the_import_error(tmp_path, monkeypatch, restore_torch_npu):
    _fake_torch_npu(
        tmp_path,
        monkeypatch,
        'raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")',
    )
    result = AscendVendor().probe()
    assert not result.available
    assert "libhccl.so" in result.reason and "CANN" in result.reason


def test_ascend_without_a_device_says_so(tmp_path, monkeypatch, restore_torch_npu):
    _fake_torch_npu(
        tmp_path,
        monkeypatch,
        """
        class npu:
            is_available = staticmethod(lambda: False)
            device_count = staticmethod(lambda: 0)
    """,
    )
    result = AscendVendor().probe()
    assert not result.available and "sees no NPU" in result.reason


#: Run in a fresh interpreter: a stand-in torch_npu renames torch's privateuse1 backend to "npu", as the
#: real one does, and that rename lasts for the process (torch.compile in the same process then fails).
SOC_PROBE = """
import json, sys
from hal import DispatchDtype
from vendors.ascend import AscendVendor
import torch
vendor = AscendVendor()
caps = vendor.capabilities()
print(json.dumps({"available": vendor.probe().available, "reason": vendor.probe().reason,
                  "device_name": caps.device_name, "notes": list(caps.notes),
                  "fp8_fallback": str(caps.fallback_for(DispatchDtype.FP8)),
                  "device": str(vendor.device), "fused": sorted(caps.fused_deep_moe)}))
"""


@pytest.mark.parametrize("soc, generation", [("Ascend910_9392", "A3"), ("Ascend910B3", "A2"), ("Ascend910X", "A2")])
def test_ascend_capabilities_follow_the_soc(tmp_path, soc, generation):
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent(f"""
        import torch
        torch.utils.rename_privateuse1_backend("npu")  # as torch_npu does on import

        class npu:
            is_available = staticmethod(lambda: True)
            device_count = staticmethod(lambda: 8)
            current_device = staticmethod(lambda: 0)
            get_device_name = staticmethod(lambda index: {soc!r})
    """)
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("HAL_VENDOR", None)
    done = subprocess.run([sys.executable, "-c", SOC_PROBE], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["available"] and soc in found["reason"]
    assert found["device_name"].startswith(soc) and f"SoC generation {generation}" in found["notes"]
    assert found["fp8_fallback"] == str(DispatchDtype.INT8)
    assert found["device"] == "npu:0"
    if soc == "Ascend910X":
        assert any("unrecognised SoC" in note for note in found["notes"])
    # The fused op is not declared, and the notes say why: no Ascend DeepEP port importable here
    # (A3), or a generation the port's fused kernel is not built for (A2).
    why = "deep_ep" if generation == "A3" else "built for A3 and A5"
    assert found["fused"] == [] and any(why in note for note in found["notes"])


def test_importing_vendor_packages_needs_no_runtime():
    for module in ("vendors.ascend", "vendors.cuda", "vendors.cpu"):
        importlib.import_module(module)
    assert "torch_npu" not in sys.modules


def test_fused_deep_moe_is_refused_where_not_declared(cpu):
    weight = cpu.quantize_weight(torch.zeros(2, 8, 8), "per-channel")
    with pytest.raises(UnsupportedCapability, match="'cpu' does not declare fused_deep_moe.*'w8a8-int8'"):
        cpu.fused_deep_moe(
            torch.zeros(1, 8),
            torch.zeros(1, 1, dtype=torch.int64),
            torch.ones(1, 1),
            weight,
            weight,
            scheme="w8a8-int8",
        )
