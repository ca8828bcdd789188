"""Vendor discovery through real entry points, and the selection order."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hal import ENV_VENDOR, InvalidInput, SelectionSource, VendorRegistry, VendorUnavailable
from tests.support.plugin_dist import environment_with, write_test_plugins
from vendors.cpu import CpuVendor


DISCOVER = """
import json, sys
from hal import VendorRegistry, VendorUnavailable
registry = VendorRegistry.discover()
out = {"names": registry.names(), "failures": {f.name: f.error for f in registry.failures}}
for label, name, env in (("priority", None, {}), ("env", None, {"HAL_VENDOR": "CPU"}),
                         ("broken", "broken", {})):
    try:
        selection = registry.select(name, environ=env)
        out[label] = [selection.vendor.name, selection.source.value]
    except VendorUnavailable as exc:
        out[label] = str(exc)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def discovered_with_plugins(tmp_path_factory):
    """Discovery in a fresh interpreter that has the test distribution on its path, as if installed."""
    root = write_test_plugins(tmp_path_factory.mktemp("plugins"))
    done = subprocess.run(
        [sys.executable, "-c", DISCOVER],
        env=environment_with(root),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout)


def test_shipped_vendors_are_found_through_their_entry_points():
    registry = VendorRegistry.discover()
    assert {"cpu", "cuda", "ascend"} <= set(registry.names())
    assert registry.get("cpu").probe().available


def test_a_third_party_vendor_is_found_and_broken_plugins_are_reported(discovered_with_plugins):
    found = discovered_with_plugins
    assert found["names"][0] == "fake" and "cpu" in found["names"]
    assert "ImportError: libfake.so" in found["failures"]["broken"]
    assert "must match" in found["failures"]["misnamed"]
    assert "expected a hal.Vendor" in found["failures"]["notvendor"]
    assert found["priority"] == ["fake", "priority"]


def test_asking_for_a_plugin_that_failed_to_load_says_why(discovered_with_plugins):
    assert "'broken' failed to load: ImportError: libfake.so" in discovered_with_plugins["broken"]


def test_environment_beats_priority(discovered_with_plugins):
    assert discovered_with_plugins["env"] == ["cpu", "environment"]


def test_explicit_name_beats_environment():
    selection = VendorRegistry.discover().select("cpu", environ={ENV_VENDOR: "ascend"})
    assert (selection.vendor.name, selection.source) == ("cpu", SelectionSource.EXPLICIT)


def test_unavailable_vendor_names_the_reason_and_the_available_ones():
    with pytest.raises(VendorUnavailable, match=r"'ascend'.*torch_npu.*available: .*cpu"):
        VendorRegistry.discover().select(environ={ENV_VENDOR: "ascend"})


def test_unknown_vendor_lists_the_installed_ones():
    with pytest.raises(VendorUnavailable, match="no vendor named 'tpu'.*installed: .*cpu"):
        VendorRegistry.discover().select("tpu", environ={})


def test_duplicate_names_are_reported_not_silently_replaced():
    registry = VendorRegistry([CpuVendor(), CpuVendor()])
    assert registry.names() == ["cpu"]
    assert "duplicate vendor name 'cpu'" in registry.failures[0].error


def test_no_available_vendor_explains_each_one():
    from vendors.ascend import AscendVendor

    with pytest.raises(VendorUnavailable, match="no vendor is available: ascend: torch_npu"):
        VendorRegistry([AscendVendor()]).select(environ={})


def test_unavailable_vendor_can_be_selected_for_its_declared_tables():
    selection = VendorRegistry.discover().select(environ={ENV_VENDOR: "ascend"}, require_available=False)
    assert (selection.vendor.name, selection.source) == ("ascend", SelectionSource.ENVIRONMENT)
    assert not selection.vendor.probe().available


def test_an_empty_vendor_name_is_refused_not_read_as_the_default():
    with pytest.raises(InvalidInput, match=r"^vendor: expected a vendor name \(a non-empty str\) or None"):
        VendorRegistry([CpuVendor()]).select("  ", environ={})
