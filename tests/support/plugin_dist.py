"""Build small installed-looking distributions on disk, so discovery runs through real entry points."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path


def write_distribution(root: Path, name: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str]) -> Path:
    """Write `modules` and a `<name>-0.1.dist-info` with `entry_points` under `root`; return root.

    Putting `root` on `sys.path` (or PYTHONPATH) makes `importlib.metadata`, and so
    stevedore, see the distribution exactly as if pip had installed it.
    """
    for module, source in modules.items():
        path = root / Path(*module.split("."))
        path.mkdir(parents=True, exist_ok=True)
        (path / "__init__.py").write_text(textwrap.dedent(source))
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = []
    for group, entries in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{key} = {value}" for key, value in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return root


def environment_with(root: Path) -> dict[str, str]:
    """The current environment with `root` put first on PYTHONPATH (keeping what was there)."""
    paths = [str(root), os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    for name in ("HAL_VENDOR", "MOE_RUNNER_REPLACEMENTS"):
        env.pop(name, None)
    return env


FAKE_VENDOR = """
    from vendors.cpu import CpuVendor


    class FakeVendor(CpuVendor):
        '''A third-party vendor computing with the reference ops, at the highest priority.'''

        name = "fake"
        priority = 1000
        description = "test plugin"


    class MisnamedVendor(CpuVendor):
        name = "not-the-entry-point-name"


    def not_a_vendor():
        return object()
"""

BROKEN = """
    raise ImportError("libfake.so: cannot open shared object file")
"""


def write_test_plugins(root: Path) -> Path:
    """A distribution with one good vendor and three broken entry points."""
    return write_distribution(
        root,
        "hal-test-plugins",
        {
            "hal.vendors": {
                "fake": "fake_vendor_pkg:FakeVendor",
                "broken": "broken_vendor_pkg:Anything",
                "misnamed": "fake_vendor_pkg:MisnamedVendor",
                "notvendor": "fake_vendor_pkg:not_a_vendor",
            }
        },
        {"fake_vendor_pkg": FAKE_VENDOR, "broken_vendor_pkg": BROKEN},
    )


EXITS_ON_IMPORT = """
    import sys

    sys.exit(3)
"""

MISBEHAVING_VENDORS = """
    import threading

    from vendors.cpu import CpuVendor


    class NoneProbe(CpuVendor):
        '''A probe that answers None instead of a ProbeResult.'''

        name, priority = "none-probe", 800

        def _probe_once(self):
            return None


    class ExitingProbe(CpuVendor):
        name, priority = "exiting-probe", 800

        def _probe_once(self):
            raise SystemExit(4)


    class HangingProbe(CpuVendor):
        '''A probe that never returns.'''

        name, priority = "hanging-probe", 900

        def _probe_once(self):
            threading.Event().wait()


    class BoolPriority(CpuVendor):
        name, priority = "bool-priority", True


    class StrPriority(CpuVendor):
        name, priority = "str-priority", "high"


    class Nameless(CpuVendor):
        name = ""


    class BrokenCapabilities(CpuVendor):
        '''Available, but its capability detection raises.'''

        name, priority = "broken-caps", 700

        def _detect_capabilities(self):
            raise RuntimeError("cannot read the device registers")
"""

MISBEHAVING = {
    "none-probe": "NoneProbe",
    "exiting-probe": "ExitingProbe",
    "hanging-probe": "HangingProbe",
    "bool-priority": "BoolPriority",
    "str-priority": "StrPriority",
    "nameless": "Nameless",
    "broken-caps": "BrokenCapabilities",
}


def write_misbehaving_plugins(root: Path, *names: str) -> Path:
    """A distribution registering the vendors of `MISBEHAVING` named in `names` (default: all of them and
    `exits-on-import`, a plugin whose import calls `sys.exit(3)`)."""
    chosen = names or (*MISBEHAVING, "exits-on-import")
    entries = {
        n: "exiting_plugin:Anything" if n == "exits-on-import" else f"misbehaving_vendors:{MISBEHAVING[n]}"
        for n in chosen
    }
    return write_distribution(
        root,
        "hal-misbehaving-plugins",
        {"hal.vendors": entries},
        {"misbehaving_vendors": MISBEHAVING_VENDORS, "exiting_plugin": EXITS_ON_IMPORT},
    )
