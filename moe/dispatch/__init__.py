"""Dispatchers: local, expert-parallel all-to-all (normal), low-latency, auto (per call), a vendor's own."""

from moe.dispatch.all_to_all import AllToAllDispatcher
from moe.dispatch.auto import AutoDispatcher
from moe.dispatch.base import DispatchFormat, DispatchOutput, Dispatcher, Pending
from moe.dispatch.local import LocalDispatcher
from moe.dispatch.low_latency import LowLatencyDispatcher
from moe.dispatch.vendor_ep import VendorEpDispatcher

__all__ = [
    "AllToAllDispatcher",
    "AutoDispatcher",
    "DispatchFormat",
    "DispatchOutput",
    "Dispatcher",
    "LocalDispatcher",
    "LowLatencyDispatcher",
    "Pending",
    "VendorEpDispatcher",
]
