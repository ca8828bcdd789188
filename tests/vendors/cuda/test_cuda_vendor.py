"""The CUDA vendor on a real GPU (skipped cleanly without one): selection, capabilities, ops."""

from __future__ import annotations

import pytest
import torch

from hal import DispatchDtype, SelectionSource, VendorRegistry
from conformance.doctor import run_doctor
from vendors.cuda import CudaVendor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_outranks_cpu_when_a_gpu_is_present():
    selection = VendorRegistry.discover().select(environ={})
    assert (selection.vendor.name, selection.source) == ("cuda", SelectionSource.PRIORITY)


def test_capabilities_match_the_device():
    vendor = CudaVendor()
    caps = vendor.capabilities()
    major, minor = torch.cuda.get_device_capability()
    assert caps.device_name == torch.cuda.get_device_name()
    assert (DispatchDtype.FP8 in caps.dispatch_dtypes) == (major * 10 + minor >= 89)
    assert (DispatchDtype.NVFP4 in caps.dispatch_dtypes) == (major >= 10)
    assert caps.consistency_problems() == []
    assert vendor.device == torch.device("cuda", torch.cuda.current_device())


def test_every_declared_op_matches_float64_on_the_gpu():
    failed = [r for r in run_doctor(CudaVendor()) if not r.passed]
    assert failed == []


def test_ops_keep_tensors_on_the_gpu():
    vendor = CudaVendor()
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    q = vendor.quantize(x, DispatchDtype.FP8)
    assert q.data.is_cuda and q.scale.is_cuda
    assert vendor.swiglu(x).is_cuda


def test_the_kernels_are_chosen_once_by_the_probe():
    vendor = CudaVendor()
    ops = vendor.ops
    assert type(ops).__name__ == "CudaOps" and vendor.ops is ops
    native = {s.op for s in vendor.op_sources() if s.native}
    assert {"quantize", "grouped_matmul", "swiglu", "sort_by_expert", "weighted_combine"} <= native
    assert ops.torch_grouped_mm == (torch.cuda.get_device_capability()[0] >= 9)
