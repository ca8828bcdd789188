"""No broken vendor plugin hides the others.

Each misbehaving plugin is a real distribution written to a temporary directory and found
through its entry points by a fresh interpreter, the way a pip-installed one would be: a
plugin whose import calls `sys.exit(3)`, probes that answer None, call `sys.exit` or never
return, bool and str priorities, an empty name, capability detection that raises, a
distribution registering a name another one already has. In-process tests cover argument
types and the probe's time limit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

import moe
from hal import (
    DEFAULT_PROBE_TIMEOUT,
    InvalidInput,
    ProbeResult,
    SelectionSource,
    UnknownVendor,
    VendorRegistry,
    VendorUnavailable,
    get_vendor,
)
from hal.cli.app import main
from tests.support.plugin_dist import environment_with, write_distribution, write_misbehaving_plugins
from vendors.cpu import CpuVendor

pytestmark = pytest.mark.slow  # subprocesses / multi-process worlds


def run_python(root, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """Run `python *args` with the distributions under `root` installed; the result and its wall time."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, *args], env=environment_with(root), capture_output=True, text=True, timeout=timeout
    )
    return done, time.monotonic() - start


def last_json(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


ZOO = """
import json, time
from hal import VendorRegistry
start = time.monotonic()
registry = VendorRegistry.discover(probe_timeout=0.5)
selection = registry.select(environ={})
print(json.dumps({
    "selected": selection.vendor.name, "detail": selection.detail,
    "statuses": {v.name: [registry.status(v).available, registry.status(v).reason] for v in registry.vendors()},
    "failures": {f.name: f.error for f in registry.failures}, "seconds": time.monotonic() - start}))
"""


def test_every_misbehaving_plugin_is_reported_and_cpu_is_still_selected(tmp_path):
    done, wall = run_python(write_misbehaving_plugins(tmp_path), "-c", ZOO)
    found = last_json(done)  # the process also exited, though a probe thread never returns
    statuses, failures = found["statuses"], found["failures"]
    assert failures["exits-on-import"] == "SystemExit: 3"
    assert "priority: expected an int, got True" in failures["bool-priority"]
    assert "priority: expected an int, got 'high'" in failures["str-priority"]
    assert "name: expected a non-empty str, got ''" in failures["nameless"]
    assert statuses["none-probe"] == [False, "probe returned None, expected a hal.ProbeResult"]
    assert statuses["exiting-probe"] == [False, "probe failed: SystemExit: 4"]
    assert statuses["hanging-probe"] == [False, "probe did not finish within 0.5 s"]
    assert statuses["broken-caps"] == [
        False,
        "vendor 'broken-caps': capability detection failed: RuntimeError: cannot read the device registers",
    ]
    assert statuses["cpu"][0] is True
    assert found["selected"] == "cpu"  # broken-caps (700) probes fine but is passed over, with the reason
    assert "skipped: broken-caps (vendor 'broken-caps': capability detection failed" in found["detail"]
    assert found["seconds"] < 20, found  # the hanging probe cost its 0.5 s, not more


def test_hal_vendors_lists_cpu_within_seconds_despite_sys_exit_and_a_hanging_probe(tmp_path):
    root = write_misbehaving_plugins(tmp_path, "exits-on-import", "hanging-probe")
    done, wall = run_python(root, "-m", "hal.cli", "vendors", timeout=60)
    assert done.returncode == 0, done.stderr
    assert "cpu (selected)" in done.stdout
    assert f"probe did not finish within {DEFAULT_PROBE_TIMEOUT:g} s" in done.stdout
    assert "plugin 'exits-on-import' (exiting_plugin:Anything) failed to load: SystemExit: 3" in done.stdout
    # torch's import and the shipped probes take a few seconds on a loaded machine; the hung probe adds its limit
    assert wall < DEFAULT_PROBE_TIMEOUT + 20, wall


LAYER = """
import json, torch, moe
torch.manual_seed(0)
w13, w2 = torch.randn(4, 64, 64) / 8, torch.randn(4, 32, 64) / 6
x, logits = torch.randn(5, 64), torch.randn(5, 4)
chosen = moe.MoELayer.from_float(w13, w2, 2)
named = moe.MoELayer.from_float(w13, w2, 2, vendor="cpu")
print(json.dumps({"vendor": chosen.vendor.name, "equal": torch.equal(chosen(x, logits), named(x, logits))}))
"""


def test_a_layer_without_a_vendor_name_skips_a_vendor_whose_capabilities_fail(tmp_path):
    done, _ = run_python(write_misbehaving_plugins(tmp_path, "broken-caps", "exits-on-import"), "-c", LAYER)
    assert last_json(done) == {"vendor": "cpu", "equal": True}


SPY = """
import pathlib
pathlib.Path(__file__).with_name("imported").write_text("yes")
from vendors.cpu import CpuVendor

class Spy(CpuVendor):
    name, priority = "spy", 1000
"""

LAZY = """
import json, pathlib, sys
import hal, spy_marker
marker = pathlib.Path(spy_marker.__file__).parent.parent / "spy_vendor" / "imported"
chosen = [hal.get_vendor(environ={"HAL_VENDOR": "cpu"}).name, hal.get_vendor("cpu").name,
          hal.VendorRegistry.discover().select(" CPU ").vendor.name]
imported = {"spy": marker.exists(), "cuda": "vendors.cuda" in sys.modules, "ascend": "vendors.ascend" in sys.modules}
names = hal.VendorRegistry.discover().names()
print(json.dumps({"chosen": chosen, "imported_when_named": imported, "listed": names,
                  "spy_after_listing": marker.exists()}))
"""


def test_naming_a_vendor_imports_only_that_plugin(tmp_path):
    write_distribution(
        tmp_path, "spy-plugin", {"hal.vendors": {"spy": "spy_vendor:Spy"}}, {"spy_vendor": SPY, "spy_marker": ""}
    )
    write_misbehaving_plugins(tmp_path, "exits-on-import")
    found = last_json(run_python(tmp_path, "-c", LAZY)[0])
    assert found["chosen"] == ["cpu", "cpu", "cpu"]
    assert found["imported_when_named"] == {"spy": False, "cuda": False, "ascend": False}
    assert found["listed"][0] == "spy" and found["spy_after_listing"]  # listing imports every plugin


EVIL_CPU = """
from vendors.cpu import CpuVendor

class EvilCpu(CpuVendor):
    name, priority = "cpu", 5000
"""

DUPLICATE = """
import json
import hal
registry = hal.VendorRegistry.discover()
try:
    hal.get_vendor("cpu")
    error = None
except hal.HalError as exc:
    error = [type(exc).__name__, str(exc)]
print(json.dumps({"error": error, "names": registry.names(), "other": hal.get_vendor("ascend-emulated").name,
                  "failure": [f.error for f in registry.failures if f.name == "cpu"]}))
"""


def test_a_name_registered_by_two_distributions_is_an_error_naming_both(tmp_path):
    write_distribution(tmp_path, "evil-cpu", {"hal.vendors": {"cpu": "evil_cpu:EvilCpu"}}, {"evil_cpu": EVIL_CPU})
    found = last_json(run_python(tmp_path, "-c", DUPLICATE)[0])
    kind, message = found["error"]
    assert kind == "VendorUnavailable"
    for both in (message, found["failure"][0]):
        assert "moe-hal (vendors.cpu:CpuVendor)" in both and "evil-cpu (evil_cpu:EvilCpu)" in both, both
    assert "cpu" not in found["names"] and found["other"] == "ascend-emulated"
    listed, _ = run_python(tmp_path, "-m", "hal.cli", "vendors", "--json")
    data = json.loads(listed.stdout)
    assert listed.returncode == 0 and data["selected"] == "ascend-emulated"
    assert [f["name"] for f in data["failures"]] == ["cpu"] and "evil-cpu" in data["failures"][0]["error"]


BROKEN_SECTIONS = """
import sys

def exits(vendor):
    sys.exit(1)

NOT_CALLABLE = 3
"""


def test_a_broken_hal_caps_section_is_one_row_saying_why(tmp_path):
    write_distribution(
        tmp_path,
        "broken-sections",
        {
            "hal.caps_sections": {
                "exits": "broken_sections:exits",
                "not-callable": "broken_sections:NOT_CALLABLE",
                "missing": "broken_sections:nothing_here",
            }
        },
        {"broken_sections": BROKEN_SECTIONS},
    )
    done, _ = run_python(tmp_path, "-m", "hal.cli", "caps", "--vendor", "cpu", "--json")
    assert done.returncode == 0, done.stderr
    sections = json.loads(done.stdout)["sections"]
    assert sections["exits"] == [["exits", "section failed: SystemExit: 1"]]
    assert sections["not-callable"] == [
        ["not-callable", "section failed: TypeError: expected a callable hook(vendor), got 3"]
    ]
    assert sections["missing"][0][1].startswith("section failed to load: AttributeError")
    assert dict(sections["expert_runners"])["runner replacements"] == "none"  # moe's own section still there


# -- in process: probes, capabilities, argument types --------------------------------------------


class Hanging(CpuVendor):
    name, priority = "hanging", 10

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release

    def _probe_once(self) -> ProbeResult:
        self.release.wait()
        return ProbeResult.ok()


class Exiting(CpuVendor):
    name, priority = "exiting", 10

    def _probe_once(self) -> ProbeResult:
        raise SystemExit(2)


class FailingCaps(CpuVendor):
    name, priority = "failing-caps", 10
    calls = 0

    def _detect_capabilities(self):
        type(self).calls += 1
        raise KeyError("model register")


def test_a_hanging_probe_is_unavailable_after_the_registry_timeout():
    release = threading.Event()
    try:
        registry = VendorRegistry([Hanging(release), CpuVendor()], probe_timeout=0.2)
        start = time.monotonic()
        selection = registry.select(environ={})
        assert time.monotonic() - start < 5
        assert selection.vendor.name == "cpu" and selection.source is SelectionSource.PRIORITY
        with pytest.raises(VendorUnavailable, match="'hanging'.*probe did not finish within 0.2 s"):
            registry.select("hanging", environ={})
    finally:
        release.set()  # let the abandoned probe thread end


def test_sys_exit_in_a_probe_and_failing_capabilities_make_a_vendor_unavailable():
    failing = FailingCaps()
    registry = VendorRegistry([Exiting(), failing, CpuVendor()])
    assert registry.status(registry.get("exiting")).reason == "probe failed: SystemExit: 2"
    assert [v.name for v in registry.available()] == ["cpu"]
    for _ in range(2):  # detection runs once; its failure is kept
        with pytest.raises(VendorUnavailable, match="capability detection failed: KeyError"):
            failing.capabilities()
    assert FailingCaps.calls == 1
    with pytest.raises(VendorUnavailable, match="'failing-caps' .* is unavailable: .*KeyError"):
        registry.select("failing-caps", environ={})
    assert registry.select("failing-caps", environ={}, require_available=False).vendor is failing


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda: get_vendor(3), "vendor"),
        (lambda: get_vendor(["cpu"]), "vendor"),
        (lambda: get_vendor(None, environ=[("HAL_VENDOR", "cpu")]), "environ"),
        (lambda: get_vendor(None, environ={"HAL_VENDOR": 3}), "environ"),
        (lambda: get_vendor("cpu", environ={1: "x"}), "environ"),
        (lambda: VendorRegistry.discover(probe_timeout=0), "probe_timeout"),
        (lambda: VendorRegistry.discover(probe_timeout=True), "probe_timeout"),
        (lambda: VendorRegistry([object()]), "vendors"),
        (lambda: moe.MoELayer(64, 32, 4, 2, vendor=3), "vendor"),
    ],
)
def test_bad_argument_types_are_invalid_input_naming_the_argument(call, argument):
    with pytest.raises(InvalidInput, match=rf"^{argument}: expected"):
        call()


def test_an_unknown_vendor_is_an_argument_error_that_is_also_vendor_unavailable(capsys):
    with pytest.raises(UnknownVendor, match="vendor: no vendor named 'tpu'.*installed: .*cpu") as raised:
        get_vendor("tpu")
    assert isinstance(raised.value, VendorUnavailable) and isinstance(raised.value, InvalidInput)
    with pytest.raises(UnknownVendor, match="HAL_VENDOR: no vendor named 'tpu'"):
        get_vendor(environ={"HAL_VENDOR": "tpu"})
    assert main(["caps", "--vendor", "tpu"]) == 2
    assert "no vendor named 'tpu'" in capsys.readouterr().err
