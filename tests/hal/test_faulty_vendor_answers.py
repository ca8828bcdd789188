"""A vendor plugin whose platform answers are wrong (no device, ops that fail to build or are not ops,
a device memory that is not a size) is reported as the vendor's fault with `VendorUnavailable`,
naming the vendor and the answer, never a raw error from deep inside a layer."""

from __future__ import annotations

import pytest
import torch

import hal
import moe
from hal import DispatchConfig, VendorUnavailable
from vendors.cpu import CpuVendor

E, H, I, K = 4, 32, 16, 2


class NoDevices(CpuVendor):
    name = "no-devices"

    def devices(self):
        return []


class DevicesNotDevices(CpuVendor):
    name = "devices-are-strings"

    def devices(self):
        return "cpu"


class OpsNone(CpuVendor):
    name = "ops-none"

    def _make_ops(self):
        return None


class OpsRaise(CpuVendor):
    name = "ops-raise"

    def _make_ops(self):
        raise ImportError("the kernels are not built")


class OpsRaiseHalError(CpuVendor):
    name = "ops-hal-error"

    def _make_ops(self):
        raise hal.UnsupportedCapability("no kernels for this device generation")


class MemoryText(CpuVendor):
    name = "memory-text"

    def device_memory_bytes(self):
        return "80 GB"


class MemoryNegative(CpuVendor):
    name = "memory-negative"

    def device_memory_bytes(self):
        return -1


def _layer(vendor: hal.Vendor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    layer = moe.MoELayer.from_float(
        torch.randn(E, H, 2 * I, generator=gen) / 6, torch.randn(E, I, H, generator=gen) / 4, K, vendor=vendor
    )
    return layer(torch.randn(3, H, generator=gen), torch.randn(3, E, generator=gen))


@pytest.mark.parametrize(
    ("vendor", "said"),
    [
        (NoDevices, "devices() returned 0 item(s), expected a non-empty list of torch.device"),
        (DevicesNotDevices, "devices() returned str, expected a non-empty list of torch.device"),
        (OpsNone, "_make_ops() returned NoneType, expected a hal.VendorOps"),
        (OpsRaise, "building its ops failed: ImportError: the kernels are not built"),
    ],
)
def test_a_wrong_platform_answer_is_the_vendors_fault_with_its_name(vendor, said):
    with pytest.raises(VendorUnavailable) as raised:
        _layer(vendor())
    assert str(raised.value) == f"vendor {vendor.name!r}: {said}"


def test_a_hal_error_raised_while_building_ops_reaches_the_caller_as_it_was():
    with pytest.raises(hal.UnsupportedCapability, match="no kernels for this device generation"):
        _layer(OpsRaiseHalError())


@pytest.mark.parametrize("vendor", [MemoryText, MemoryNegative])
def test_a_device_memory_that_is_not_a_size_is_the_vendors_fault(vendor):
    config = DispatchConfig(max_dispatch_tokens_per_rank=64, ep_mode="low-latency")
    with pytest.raises(VendorUnavailable, match=rf"vendor '{vendor.name}': device_memory_bytes\(\) returned "):
        moe.MoELayer(H, I, E, K, vendor=vendor(), dispatch=config)
    assert _layer(vendor()).shape == (3, H)  # nothing else reads the memory
