"""A vendor whose own `probe()` / `capabilities()` overrides misbehave is unavailable with the reason, and
default selection still finds the others (in-process; the plugin-distribution versions are in the slow tier)."""

from __future__ import annotations

import pytest

from hal import SelectionSource, VendorRegistry, VendorUnavailable
from vendors.cpu import CpuVendor


class _Loud(CpuVendor):
    priority = 100  # outranks cpu, so default selection must pass over it


class ProbeRaises(_Loud):
    name = "probe-raises"

    def probe(self, timeout=None):
        raise RuntimeError("driver exploded")


class NoSuperInit(_Loud):
    name = "no-super-init"

    def __init__(self) -> None:  # forgets CpuVendor.__init__: its probe state is missing
        pass


class CapsRaise(_Loud):
    name = "caps-raise"

    def capabilities(self):
        raise RuntimeError("no device table")


class CapsDict(_Loud):
    name = "caps-dict"

    def capabilities(self):
        return {"grouped_matmul": True}


class ProbeNone(_Loud):
    name = "probe-none"

    def probe(self, timeout=None):
        return None


REASONS = {
    "probe-raises": "its probe() raised RuntimeError: driver exploded",
    "no-super-init": "its probe() raised AttributeError",
    "caps-raise": "its capabilities() raised RuntimeError: no device table",
    "caps-dict": "its capabilities() returned dict, expected hal.Capabilities",
    "probe-none": "its probe() returned NoneType, expected hal.ProbeResult",
}


def test_misbehaving_overrides_make_only_their_vendor_unavailable():
    broken = [ProbeRaises(), NoSuperInit(), CapsRaise(), CapsDict(), ProbeNone()]
    registry = VendorRegistry([*broken, CpuVendor()])
    for vendor in broken:
        status = registry.status(vendor)
        assert not status.available and REASONS[vendor.name] in status.reason, (vendor.name, status.reason)
    assert [v.name for v in registry.available()] == ["cpu"]
    selection = registry.select(environ={})
    assert selection.vendor.name == "cpu" and selection.source is SelectionSource.PRIORITY
    for name in ("caps-raise", "caps-dict"):
        assert name in selection.detail  # passed over, and the detail says why
    with pytest.raises(VendorUnavailable, match=r"'probe-raises' .* is unavailable: its probe\(\) raised"):
        registry.select("probe-raises", environ={})


class CapsHang(_Loud):
    name = "caps-hang"

    def __init__(self, release) -> None:
        super().__init__()
        self.release = release

    def capabilities(self):
        self.release.wait()
        return super().capabilities()


def test_capability_detection_that_hangs_makes_only_its_vendor_unavailable():
    import threading
    import time

    release = threading.Event()
    hung = CapsHang(release)
    try:
        registry = VendorRegistry([hung, CpuVendor()], detection_timeout=0.3)
        start = time.monotonic()
        assert registry.select(environ={}).vendor.name == "cpu"
        status = registry.status(hung)
        assert time.monotonic() - start < 5  # one wait of 0.3 s, then the answer is remembered
        assert not status.available
        assert status.reason == "its capability detection did not finish within 0.3 s"
        with pytest.raises(VendorUnavailable, match="'caps-hang' .* did not finish within 0.3 s"):
            registry.select("caps-hang", environ={})
    finally:
        release.set()


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), True, "60"])
def test_a_detection_timeout_that_is_not_a_positive_number_of_seconds_is_refused(bad):
    from hal import InvalidInput

    with pytest.raises(InvalidInput, match="detection_timeout"):
        VendorRegistry([CpuVendor()], detection_timeout=bad)


class _Unavailable(CpuVendor):
    def _probe_once(self):
        from hal import ProbeResult

        return ProbeResult.unavailable("no such device here")


@pytest.mark.parametrize(
    ("models", "reason"),
    [
        (lambda: 1 / 0, "its declared_models\\(\\) raised ZeroDivisionError"),
        (lambda: {}, "got an empty mapping"),
        (lambda: ["A100"], "got list"),
        (lambda: {"X1": "fast"}, "got dict"),
    ],
)
def test_a_broken_declared_table_is_a_clear_error_naming_the_vendor(models, reason):
    class Broken(_Unavailable):
        name = "broken-tables"

        def declared_models(self):
            return models()

    for read in (lambda v: v.declared_capabilities(), lambda v: v.default_model):  # what hal caps / explain read
        with pytest.raises(VendorUnavailable, match=rf"'broken-tables': .*{reason}"):
            read(Broken())


def test_ops_returning_the_wrong_structure_are_the_vendors_fault_by_name():
    import torch

    import moe
    from hal import VendorFault
    from hal.reference import ReferenceOps

    class ThreeOfFour(ReferenceOps):
        def sort_by_expert_tokens(self, topk_ids, num_experts):
            return super().sort_by_expert_tokens(topk_ids, num_experts=num_experts)[:3]

        def softmax_topk(self, logits, top_k, renormalize=True):
            return None

    class Faulty(CpuVendor):
        name = "faulty-structure"

        def _make_ops(self):
            return ThreeOfFour()

    vendor = Faulty()
    ids = torch.randint(0, 8, (5, 2))
    with pytest.raises(VendorFault, match=r"'faulty-structure': sort_by_expert returned tuple of 3, expected .* 4"):
        vendor.sort_by_expert(ids, 8, tokens=True)
    with pytest.raises(VendorFault, match=r"softmax_topk returned NoneType, expected a tuple of 2 tensors"):
        vendor.softmax_topk(torch.randn(5, 8), 2)
    assert len(vendor.sort_by_expert(ids, 8)) == 3  # the reference's own answer passes
    layer = moe.MoELayer.from_float(torch.randn(8, 32, 64) / 8, torch.randn(8, 32, 32) / 8, 2, vendor=vendor)
    with pytest.raises(VendorFault):
        layer(torch.randn(5, 32).bfloat16(), torch.randn(5, 8))
