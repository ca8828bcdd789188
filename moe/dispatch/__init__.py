"""Dispatchers: local, expert-parallel all-to-all, and expert-parallel low-latency."""

from moe.dispatch.all_to_all import AllToAllDispatcher
from moe.dispatch.base import DispatchFormat, DispatchOutput, Dispatcher
from moe.dispatch.local import LocalDispatcher
from moe.dispatch.low_latency import LowLatencyDispatcher
from moe.dispatch.vendor_ep import VendorEpDispatcher

__all__ = [
    "AllToAllDispatcher", "DispatchFormat", "DispatchOutput", "Dispatcher",
    "LocalDispatcher", "LowLatencyDispatcher", "VendorEpDispatcher",
]
