"""Test vendors for the expert-parallel section of the conformance suite (`tests/conformance/test_conformance_ep.py`),
installed as a real distribution: the spawned ranks find them through the `hal.vendors` entry points
of a temporary dist-info on PYTHONPATH (`tests.support.plugin_dist`).

- `combine-short`: the CPU vendor (ops from `hal.reference`) whose `weighted_combine` is slightly
  wrong: every weighted sum loses 1/32 of itself (the routing weights scaled by 1 - 2^-5).
- `int8-to-fp8`: a correct CPU vendor that does not carry int8 and declares int8 -> fp8 (as CUDA
  does), so that an int8 request resolves to its fallback.
- `raises-on-rank-0`: the CPU vendor whose `sort_by_expert` raises on every seventh call on rank 0
  only (before the dispatch's collectives, which the other rank has then entered).
"""

from __future__ import annotations

from pathlib import Path

from tests.support.plugin_dist import write_distribution

#: The entry-point names of the vendors.
FAULTY = "combine-short"
FALLBACK = "int8-to-fp8"
ONE_SIDED = "raises-on-rank-0"

SOURCE = '''
import dataclasses
import os

from hal import DeclaredFallback, DispatchDtype, ReferenceOps
from vendors.cpu import CpuVendor

SHORT = 1 - 2.0 ** -5


class ShortCombineOps(ReferenceOps):
    """The reference ops, but each token's weighted sum comes out 1/32 short."""

    def weighted_combine(self, rows, index, topk_weights, *, out_dtype):
        return super().weighted_combine(rows, index, topk_weights * SHORT, out_dtype=out_dtype)


class ShortCombineVendor(CpuVendor):
    """The CPU vendor with a weighted combine that is slightly wrong."""

    name = "combine-short"
    description = "test plugin: weighted_combine 1/32 short"

    def _make_ops(self):
        return ShortCombineOps()


class Int8ToFp8Vendor(CpuVendor):
    """The CPU vendor without int8 dispatch, which it declares to fall back to fp8."""

    name = "int8-to-fp8"
    description = "test plugin: int8 dispatch falls back to fp8"

    def _detect_capabilities(self):
        caps = super()._detect_capabilities()
        fp8 = DeclaredFallback(DispatchDtype.FP8, "test plugin: fp8 rows instead")
        return dataclasses.replace(
            caps, dispatch_dtypes=caps.dispatch_dtypes - {DispatchDtype.INT8},
            fallbacks={**caps.fallbacks, DispatchDtype.INT8: fp8})


class RaisingOps(ReferenceOps):
    """The reference ops, but on rank 0 every seventh `sort_by_expert` raises."""

    def __init__(self):
        self.calls = 0

    def sort_by_expert(self, *args, **kwargs):
        self.calls += 1
        if os.environ.get("RANK") == "0" and self.calls % 7 == 3:
            raise RuntimeError("sort_by_expert raises on rank 0")
        return super().sort_by_expert(*args, **kwargs)


class RaisesOnRankZero(CpuVendor):
    """The CPU vendor whose rank 0 fails now and then, alone."""

    name = "raises-on-rank-0"
    description = "test plugin: sort_by_expert raises on rank 0 now and then"

    def _make_ops(self):
        return RaisingOps()
'''


def write_ep_vendors(root: Path) -> Path:
    """A distribution registering the three vendors in `hal.vendors`."""
    entries = {
        FAULTY: "ep_test_vendors:ShortCombineVendor",
        FALLBACK: "ep_test_vendors:Int8ToFp8Vendor",
        ONE_SIDED: "ep_test_vendors:RaisesOnRankZero",
    }
    return write_distribution(root, "hal-ep-test-vendors", {"hal.vendors": entries}, {"ep_test_vendors": SOURCE})
