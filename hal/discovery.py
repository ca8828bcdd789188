"""Vendor discovery through stevedore entry points, and vendor selection.

A vendor package registers a factory (usually its `Vendor` subclass) in the
entry-point group `hal.vendors`; nothing in this repository needs to change. A plugin
that fails to import or to build is recorded with its error and hides no other.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from stevedore import ExtensionManager

from hal.errors import VendorUnavailable
from hal.vendor import Vendor

#: The entry-point group vendors register in.
ENTRY_POINT_GROUP = "hal.vendors"
#: The environment variable naming the vendor to use (below an explicit name).
ENV_VENDOR = "HAL_VENDOR"


@dataclass(frozen=True)
class PluginFailure:
    """A vendor plugin that could not be loaded, and why."""

    name: str
    target: str
    error: str


class SelectionSource(str, enum.Enum):
    """Why a vendor was selected."""

    EXPLICIT = "explicit"
    ENVIRONMENT = "environment"
    PRIORITY = "priority"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Selection:
    """The selected vendor and the rule that selected it."""

    vendor: Vendor
    source: SelectionSource
    detail: str


class VendorRegistry:
    """The vendors found in one discovery pass (an object, never a process global)."""

    def __init__(self, vendors: Iterable[Vendor], failures: Iterable[PluginFailure] = ()) -> None:
        self._vendors: dict[str, Vendor] = {}
        self._failures: list[PluginFailure] = list(failures)
        for vendor in vendors:
            if vendor.name in self._vendors:
                self._failures.append(PluginFailure(
                    vendor.name, type(vendor).__qualname__,
                    f"duplicate vendor name {vendor.name!r}: already provided by "
                    f"{type(self._vendors[vendor.name]).__qualname__}"))
                continue
            self._vendors[vendor.name] = vendor

    @classmethod
    def discover(cls, group: str = ENTRY_POINT_GROUP) -> VendorRegistry:
        """Load every vendor registered in `group`; failures are recorded, not raised."""
        failures: list[PluginFailure] = []

        def on_failure(_manager: object, entry_point: object, error: Exception) -> None:
            failures.append(PluginFailure(
                getattr(entry_point, "name", "?"), getattr(entry_point, "value", "?"),
                f"{type(error).__name__}: {error}"))

        manager = ExtensionManager(
            namespace=group, invoke_on_load=False, on_load_failure_callback=on_failure
        )
        vendors: list[Vendor] = []
        for extension in sorted(manager.extensions, key=lambda e: e.name):
            target = extension.entry_point.value
            try:
                vendor = extension.plugin()
            except Exception as exc:
                failures.append(PluginFailure(extension.name, target, f"{type(exc).__name__}: {exc}"))
                continue
            if not isinstance(vendor, Vendor):
                failures.append(PluginFailure(
                    extension.name, target,
                    f"factory returned {type(vendor).__name__}, expected a hal.Vendor"))
            elif vendor.name != extension.name:
                failures.append(PluginFailure(
                    extension.name, target,
                    f"entry point {extension.name!r} builds a vendor named {vendor.name!r}; "
                    "the two names must match"))
            else:
                vendors.append(vendor)
        return cls(vendors, failures)

    @property
    def failures(self) -> list[PluginFailure]:
        """Plugins that failed to load."""
        return list(self._failures)

    def names(self) -> list[str]:
        """Names of the loaded vendors, highest priority first."""
        return [v.name for v in self.vendors()]

    def vendors(self) -> list[Vendor]:
        """Loaded vendors, highest priority first (ties by name)."""
        return sorted(self._vendors.values(), key=lambda v: (-v.priority, v.name))

    def available(self) -> list[Vendor]:
        """Loaded vendors whose probe succeeds, highest priority first."""
        return [v for v in self.vendors() if v.probe().available]

    def get(self, name: str) -> Vendor:
        """A loaded vendor by name (available or not); `VendorUnavailable` if unknown."""
        key = name.strip().lower()
        if key in self._vendors:
            return self._vendors[key]
        failed = [f for f in self._failures if f.name == key]
        if failed:
            raise VendorUnavailable(
                f"vendor {key!r} failed to load: {failed[0].error}; available: {self._available_names()}")
        raise VendorUnavailable(
            f"no vendor named {key!r} is installed (entry-point group {ENTRY_POINT_GROUP!r}); "
            f"installed: {', '.join(self._vendors) or 'none'}; available: {self._available_names()}")

    def select(self, name: str | None = None, environ: Mapping[str, str] | None = None, *,
               require_available: bool = True) -> Selection:
        """Pick a vendor: explicit `name` > `HAL_VENDOR` > the highest-priority available one.

        Raises `VendorUnavailable` naming the reason and the available vendors. With
        `require_available=False` a vendor named explicitly or by `HAL_VENDOR` is returned
        even when its probe fails (to show its declared tables).
        """
        env = os.environ if environ is None else environ
        if name:
            source, detail, wanted = SelectionSource.EXPLICIT, f"asked for {name!r}", name
        elif env.get(ENV_VENDOR, "").strip():
            wanted = env[ENV_VENDOR]
            source, detail = SelectionSource.ENVIRONMENT, f"{ENV_VENDOR}={wanted!r}"
        else:
            available = self.available()
            if not available:
                reasons = "; ".join(f"{v.name}: {v.probe().reason}" for v in self.vendors())
                raise VendorUnavailable(f"no vendor is available: {reasons or 'none is installed'}")
            top = available[0]
            return Selection(top, SelectionSource.PRIORITY,
                             f"highest priority ({top.priority}) among available: {self._available_names()}")
        vendor = self.get(wanted)
        probe = vendor.probe()
        if require_available and not probe.available:
            raise VendorUnavailable(
                f"vendor {vendor.name!r} ({detail}) is unavailable: {probe.reason}; "
                f"available: {self._available_names()}")
        return Selection(vendor, source, detail)

    def _available_names(self) -> str:
        return ", ".join(v.name for v in self.available()) or "none"


def load_plugins(group: str) -> tuple[list[tuple[str, object]], list[PluginFailure]]:
    """Load every entry point of `group`, sorted by name: `(name, object)` pairs and failures.

    Upper layers use this for their own plugin groups (expert runners, CLI commands) so
    that only `hal` talks to the entry-point machinery.
    """
    failures: list[PluginFailure] = []

    def on_failure(_manager: object, entry_point: object, error: Exception) -> None:
        failures.append(PluginFailure(
            getattr(entry_point, "name", "?"), getattr(entry_point, "value", "?"),
            f"{type(error).__name__}: {error}"))

    manager = ExtensionManager(namespace=group, invoke_on_load=False, on_load_failure_callback=on_failure)
    loaded = [(ext.name, ext.plugin) for ext in sorted(manager.extensions, key=lambda e: e.name)]
    return loaded, failures


def get_vendor(name: str | None = None, environ: Mapping[str, str] | None = None) -> Vendor:
    """Discover the installed vendors and select one (explicit > `HAL_VENDOR` > priority)."""
    return VendorRegistry.discover().select(name, environ).vendor
