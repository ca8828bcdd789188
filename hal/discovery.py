"""Vendor discovery through entry points, and vendor selection.

A vendor package registers a factory (usually its `Vendor` subclass) in the entry-point
group `hal.vendors`; nothing in this repository needs to change. Each plugin is isolated:
one that fails to import or to build (even by calling `sys.exit`), declares a bad name or
priority, shares its name with another distribution's, or whose probe raises, answers
nonsense or hangs, or whose capability detection fails, is recorded with the reason and
hides no other. Plugins are imported only when needed: selecting a vendor by name (or
`HAL_VENDOR`) imports that one only; listing and priority selection import them all.
"""

from __future__ import annotations

import enum
import importlib.metadata
import math
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hal.entry_points import PluginFailure, entry_points, guarded, load, load_plugins
from hal import checks
from hal.capabilities import Capabilities
from hal.errors import HalError, UnknownVendor, VendorUnavailable, invalid
from hal.platform import ProbeResult
from hal.vendor import Vendor

__all__ = [
    "DEFAULT_PROBE_TIMEOUT",
    "ENTRY_POINT_GROUP",
    "ENV_VENDOR",
    "PluginFailure",
    "Selection",
    "SelectionSource",
    "VendorRegistry",
    "get_vendor",
    "load_plugins",
]

#: The entry-point group vendors register in.
ENTRY_POINT_GROUP = "hal.vendors"
#: The environment variable naming the vendor to use (below an explicit name).
ENV_VENDOR = "HAL_VENDOR"
#: Seconds a vendor's probe may take before it counts as unavailable (a hung probe must not hang selection).
DEFAULT_PROBE_TIMEOUT = 5.0
#: Seconds a vendor's capability detection may take (it may import kernel libraries, so longer than a probe).
DEFAULT_DETECTION_TIMEOUT = 60.0


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
    """The vendors of one discovery pass (an object, never a process global).

    Built from vendor instances, or by `discover()` from entry points that are imported on
    first use. `probe_timeout` (seconds, or None for no limit) bounds every probe it runs, and
    `detection_timeout` every vendor's first `capabilities()` call made by `status`.
    """

    def __init__(
        self,
        vendors: Iterable[Vendor] = (),
        failures: Iterable[PluginFailure] = (),
        *,
        probe_timeout: float | None = DEFAULT_PROBE_TIMEOUT,
        detection_timeout: float | None = DEFAULT_DETECTION_TIMEOUT,
    ) -> None:
        self._probe_timeout = _checked_timeout("probe_timeout", probe_timeout)
        self._detection_timeout = _checked_timeout("detection_timeout", detection_timeout)
        self._vendors: dict[str, Vendor] = {}
        self._failures: list[PluginFailure] = list(failures)
        self._unloaded: dict[str, importlib.metadata.EntryPoint] = {}
        self._group = ENTRY_POINT_GROUP
        self._lock = threading.RLock()
        self._stalled: dict[str, ProbeResult] = {}
        for vendor in vendors:
            if not isinstance(vendor, Vendor):
                raise invalid("vendors", "hal.Vendor instances", vendor)
            self._add(vendor, type(vendor).__qualname__)

    @classmethod
    def discover(
        cls,
        group: str = ENTRY_POINT_GROUP,
        *,
        probe_timeout: float | None = DEFAULT_PROBE_TIMEOUT,
        detection_timeout: float | None = DEFAULT_DETECTION_TIMEOUT,
    ) -> VendorRegistry:
        """The vendors registered in `group`, imported when first needed; failures are recorded, not raised."""
        if not isinstance(group, str) or not group:
            raise invalid("group", "an entry-point group name (a non-empty str)", group)
        registry = cls(probe_timeout=probe_timeout, detection_timeout=detection_timeout)
        registry._group = group
        registry._unloaded, duplicates = entry_points(group)
        registry._failures.extend(duplicates)
        return registry

    # -- loading ---------------------------------------------------------------------------------

    def _add(self, vendor: Vendor, target: str, entry_name: str | None = None) -> None:
        problem = _declaration_problem(vendor, entry_name)
        if problem is not None:
            self._failures.append(PluginFailure(entry_name or type(vendor).__qualname__, target, problem))
        elif vendor.name.lower() in self._vendors:
            self._failures.append(
                PluginFailure(
                    vendor.name,
                    target,
                    f"duplicate vendor name {vendor.name!r}: already provided by "
                    f"{type(self._vendors[vendor.name.lower()]).__qualname__}",
                )
            )
        else:
            self._vendors[vendor.name.lower()] = vendor

    def _load(self, key: str) -> None:
        """Import and build the entry point `key` if it is still unloaded."""
        with self._lock:
            entry_point = self._unloaded.pop(key, None)
            if entry_point is None:
                return
            factory, failure = load(entry_point)
            if failure is not None:
                self._failures.append(failure)
                return
            vendor, error = guarded(factory) if callable(factory) else (None, f"{factory!r} is not callable")
            if error is not None:
                self._failures.append(PluginFailure(entry_point.name, entry_point.value, error))
            elif not isinstance(vendor, Vendor):
                self._failures.append(
                    PluginFailure(
                        entry_point.name,
                        entry_point.value,
                        f"factory returned {type(vendor).__name__}, expected a hal.Vendor",
                    )
                )
            else:
                self._add(vendor, entry_point.value, entry_point.name)

    def _load_all(self) -> None:
        for key in sorted(self._unloaded):
            self._load(key)

    # -- what was found --------------------------------------------------------------------------

    @property
    def failures(self) -> list[PluginFailure]:
        """Plugins that failed to load (every plugin is loaded first)."""
        self._load_all()
        return list(self._failures)

    def names(self) -> list[str]:
        """Names of the loaded vendors, highest priority first."""
        return [v.name for v in self.vendors()]

    def vendors(self) -> list[Vendor]:
        """Loaded vendors, highest priority first (ties by name); every plugin is loaded first."""
        self._load_all()
        return sorted(self._vendors.values(), key=lambda v: (-v.priority, v.name))

    def status(self, vendor: Vendor) -> ProbeResult:
        """Whether `vendor` can be used here: its probe (bounded by the registry's `probe_timeout`) and then
        its capability detection, whose failure makes it unavailable with the reason."""
        probe = self._probed(vendor)
        if not probe.available:
            return probe
        if vendor.name in self._stalled:
            return self._stalled[vendor.name]
        answer: list[object] = []
        if self._detection_timeout is None:
            _detect(vendor, answer)
        else:  # a daemon thread, as for the probe: detection that never returns is abandoned, not waited on
            thread = threading.Thread(target=_detect, args=(vendor, answer), name="hal-capabilities", daemon=True)
            thread.start()
            thread.join(self._detection_timeout)
        if not answer:
            stalled = ProbeResult.unavailable(
                f"its capability detection did not finish within {self._detection_timeout:g} s"
            )
            self._stalled[vendor.name] = stalled
            return stalled
        caps = answer[0]
        if isinstance(caps, HalError):
            return ProbeResult.unavailable(str(caps))
        if isinstance(caps, Exception):
            return ProbeResult.unavailable(f"its capabilities() raised {type(caps).__name__}: {caps}")
        if not isinstance(caps, Capabilities):
            return ProbeResult.unavailable(
                f"its capabilities() returned {type(caps).__name__}, expected hal.Capabilities"
            )
        return probe

    def _probed(self, vendor: Vendor) -> ProbeResult:
        """`vendor.probe`, bounded by the registry's timeout; a probe that raises or returns something
        else than a `ProbeResult` makes the vendor unavailable with the reason."""
        try:
            probe = vendor.probe(timeout=self._probe_timeout)
        except Exception as exc:  # noqa: BLE001 - a plugin's own probe override
            return ProbeResult.unavailable(f"its probe() raised {type(exc).__name__}: {exc}")
        if not isinstance(probe, ProbeResult):
            return ProbeResult.unavailable(f"its probe() returned {type(probe).__name__}, expected hal.ProbeResult")
        return probe

    def available(self) -> list[Vendor]:
        """Loaded vendors that can be used here (see `status`), highest priority first."""
        return [v for v in self.vendors() if self.status(v).available]

    def get(self, name: str) -> Vendor:
        """A vendor by name (available or not), importing only its plugin.

        Raises `VendorUnavailable` if its plugin failed, `UnknownVendor` (also an `InvalidInput`)
        if no plugin provides it.
        """
        return self._get(name, "name")

    def _get(self, name: object, argument: str) -> Vendor:
        if not isinstance(name, str) or not name.strip():
            raise invalid(argument, "a vendor name (a non-empty str)", name)
        key = name.strip().lower()
        self._load(key)
        if key in self._vendors:
            return self._vendors[key]
        failed = [f for f in self._failures if f.name.strip().lower() == key]
        if failed:
            raise VendorUnavailable(
                f"vendor {key!r} failed to load: {failed[0].error}; available: {self._available_names()}"
            )
        installed = sorted({*self._vendors, *self._unloaded, *(f.name for f in self._failures)})
        raise UnknownVendor(
            f"{argument}: no vendor named {key!r} is installed (entry-point group {self._group!r}); "
            f"installed: {', '.join(installed) or 'none'}"
        )

    # -- selection -------------------------------------------------------------------------------

    def select(
        self, name: str | None = None, environ: Mapping[str, str] | None = None, *, require_available: bool = True
    ) -> Selection:
        """Pick a vendor: explicit `name` > `HAL_VENDOR` > the highest-priority available one.

        Only a named vendor's plugin is imported. Raises `VendorUnavailable` naming the reason
        and the available vendors (`UnknownVendor` for a name nobody provides). With
        `require_available=False` a vendor named explicitly or by `HAL_VENDOR` is returned even
        when it cannot be used here (to show its declared tables).
        """
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise invalid("vendor", "a vendor name (a non-empty str) or None", name)
        env = os.environ if environ is None else checks.environ_mapping(environ)
        if name is not None and name.strip():
            source, detail, wanted, argument = SelectionSource.EXPLICIT, f"asked for {name!r}", name, "vendor"
        elif env.get(ENV_VENDOR, "").strip():
            wanted = env[ENV_VENDOR]
            source, detail, argument = SelectionSource.ENVIRONMENT, f"{ENV_VENDOR}={wanted!r}", ENV_VENDOR
        else:
            return self._by_priority()
        vendor = self._get(wanted, argument)
        status = self.status(vendor)
        if require_available and not status.available:
            raise VendorUnavailable(
                f"vendor {vendor.name!r} ({detail}) is unavailable: {status.reason}; "
                f"available: {self._available_names()}"
            )
        return Selection(vendor, source, detail)

    def _by_priority(self) -> Selection:
        statuses = {v.name: self.status(v) for v in self.vendors()}
        available = [v for v in self.vendors() if statuses[v.name].available]
        if not available:
            reasons = "; ".join(f"{name}: {status.reason}" for name, status in statuses.items())
            raise VendorUnavailable(f"no vendor is available: {reasons or 'none is installed'}")
        top = available[0]
        # A vendor that probes fine but cannot build its capabilities is passed over, and the detail says so.
        skipped = [
            f"{v.name} ({statuses[v.name].reason})"
            for v in self.vendors()
            if v.priority > top.priority and self._probed(v).available and not statuses[v.name].available
        ]
        detail = f"highest priority ({top.priority}) among available: {', '.join(v.name for v in available)}"
        return Selection(
            top, SelectionSource.PRIORITY, detail + (f"; skipped: {'; '.join(skipped)}" if skipped else "")
        )

    def _available_names(self) -> str:
        return ", ".join(v.name for v in self.available()) or "none"


def _detect(vendor: Vendor, answer: list[object]) -> None:
    """Append `vendor.capabilities()` to `answer`, or the exception it raised."""
    try:
        answer.append(vendor.capabilities())
    except Exception as exc:  # noqa: BLE001 - one plugin's fault must not stop discovery of the others
        answer.append(exc)


def _declaration_problem(vendor: Vendor, entry_name: str | None) -> str | None:
    """Why a built vendor's declaration is unusable (name, priority, description), or None."""
    name, error = guarded(lambda: vendor.name)
    if error is not None or not isinstance(name, str) or not name.strip():
        return f"name: expected a non-empty str, got {error or repr(name)}"
    if entry_name is not None and name != entry_name:
        return f"entry point {entry_name!r} builds a vendor named {name!r}; the two names must match"
    priority, error = guarded(lambda: vendor.priority)
    if error is not None or isinstance(priority, bool) or not isinstance(priority, int):
        return f"vendor {name!r}: priority: expected an int, got {error or repr(priority)}"
    description, error = guarded(lambda: vendor.description)
    if error is not None or not isinstance(description, str):
        return f"vendor {name!r}: description: expected a str, got {error or repr(description)}"
    return None


def _checked_timeout(name: str, timeout: object) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise invalid(name, "a positive, finite number of seconds or None", timeout)
    return float(timeout)


def get_vendor(
    name: str | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    probe_timeout: float | None = DEFAULT_PROBE_TIMEOUT,
) -> Vendor:
    """Discover the installed vendors and select one (explicit > `HAL_VENDOR` > priority).

    A named vendor (or `HAL_VENDOR`'s) imports only its own plugin.
    """
    return VendorRegistry.discover(probe_timeout=probe_timeout).select(name, environ).vendor
