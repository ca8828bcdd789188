"""Shared fixtures: the real vendor classes, used with their declared tables where hardware is absent."""

from __future__ import annotations

import pytest

from vendors.ascend import AscendVendor
from vendors.cpu import CpuVendor
from vendors.cuda import CudaVendor


@pytest.fixture
def cpu() -> CpuVendor:
    """A fresh CPU reference vendor."""
    return CpuVendor()


@pytest.fixture
def cuda() -> CudaVendor:
    """The real CUDA vendor class (its declared tables need no GPU)."""
    return CudaVendor()


@pytest.fixture
def ascend() -> AscendVendor:
    """The real Ascend vendor class (its declared tables need no NPU)."""
    return AscendVendor()
