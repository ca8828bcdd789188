"""`Platform`: the questions about a vendor that are not computations.

Whether it can run here (`probe`), which device it drives, what it can do there
(`capabilities`, resolved once), what it declares for named device models, and which op
implementations it computes with (`ops`, chosen once). `hal.Vendor` adds the op methods
on top of this; a vendor plugin subclasses `hal.Vendor`.
"""

from __future__ import annotations

import abc
import os
import reprlib
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from hal.capabilities import Capabilities
from hal.dtypes import DispatchDtype
from hal.entry_points import guarded
from hal.errors import HalError, InvalidInput, VendorUnavailable, names

if TYPE_CHECKING:
    from hal.ops import VendorOps

#: The device memory assumed where a vendor does not state it (`Platform.device_memory_bytes` None):
#: 1 TiB, more than any single accelerator has (the largest hold under 300 GB).
MAX_DEVICE_MEMORY_BYTES = 2**40


class DispatchFallbackWarning(UserWarning):
    """A requested dispatch dtype was replaced by the vendor's declared fallback."""


@dataclass(frozen=True)
class ProbeResult:
    """Whether a vendor can run here, and if not, why (in words a person can act on)."""

    available: bool
    reason: str = ""

    @classmethod
    def ok(cls, detail: str = "") -> ProbeResult:
        """An available vendor; `detail` may name the device found."""
        return cls(True, detail)

    @classmethod
    def unavailable(cls, reason: str) -> ProbeResult:
        """An unavailable vendor and the reason."""
        return cls(False, reason)


class Platform(abc.ABC):
    """Probe, device, capabilities, declared tables and the choice of op implementations.

    Subclasses set `name`, `priority` and `description` and implement `_probe_once`,
    `devices`, `_detect_capabilities` and `declared_models`; `_make_ops` picks the op
    implementations (default: `hal.reference.ReferenceOps`). Everything is resolved once
    per instance (one instance drives one device) and never changes afterwards.
    """

    def __deepcopy__(self, memo: dict[int, object]) -> Platform:
        """Itself: a vendor stands for a device and its runtime, which a deep copy of a layer (or of a
        model holding layers) shares rather than duplicates."""
        return self

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    description: ClassVar[str] = ""

    def __init__(self) -> None:
        self._capabilities: Capabilities | None = None
        self._capabilities_error: HalError | None = None
        self._probe: ProbeResult | None = None
        self._ops: VendorOps | None = None
        self._device: torch.device | None = None
        self._warned: set[tuple[DispatchDtype, DispatchDtype]] = set()
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    # -- discovery -------------------------------------------------------------------------------

    @abc.abstractmethod
    def _probe_once(self) -> ProbeResult:
        """Check for hardware and libraries; must not raise for a missing runtime."""

    def probe(self, timeout: float | None = None) -> ProbeResult:
        """Whether this vendor can run here (the first answer is cached per instance).

        A probe that raises anything (`SystemExit` too) or returns something other than a
        `ProbeResult` answers "unavailable" with the reason. With `timeout` (seconds) the probe
        runs in a daemon thread, and one still running after that long is unavailable ("probe did
        not finish within N s"); the registry passes its `probe_timeout` here.
        """
        if self._probe is None:
            result = probe_within(self._probe_once, timeout)
            with self._lock:
                if self._probe is None:
                    self._probe = result
        return self._probe

    def require_available(self) -> None:
        """Raise `VendorUnavailable` with the probe's reason unless the vendor can run here."""
        result = self.probe()
        if not result.available:
            raise VendorUnavailable(f"vendor {self.name!r} is unavailable: {result.reason}")

    @abc.abstractmethod
    def devices(self) -> list[torch.device]:
        """The devices this vendor drives (requires availability)."""

    @property
    def device(self) -> torch.device:
        """The device this instance computes on (the first of `devices()`, resolved once)."""
        if self._device is None:
            found = self.devices()
            if not isinstance(found, (list, tuple)) or not found or not isinstance(found[0], torch.device):
                shown = type(found).__name__ if not isinstance(found, (list, tuple)) else f"{len(found)} item(s)"
                raise VendorUnavailable(
                    f"vendor {self.name!r}: devices() returned {shown}, expected a non-empty list of torch.device"
                )
            self._device = found[0]
        return self._device

    # -- capabilities ----------------------------------------------------------------------------

    @abc.abstractmethod
    def _detect_capabilities(self) -> Capabilities:
        """Read the device and build its capabilities (called once)."""

    def capabilities(self) -> Capabilities:
        """The capabilities of this instance's device, resolved once.

        Raises `VendorUnavailable` when the vendor is unavailable, its detection fails, or the table it
        detects contradicts itself (`Capabilities.consistency_problems`, every reason named); a failure
        is kept: detection is not retried.
        """
        if self._capabilities is None:
            self.require_available()
            with self._lock:
                if self._capabilities is None and self._capabilities_error is None:
                    try:
                        self._capabilities = self._checked_detection()
                    except HalError as exc:
                        self._capabilities_error = exc
                if self._capabilities_error is not None:
                    raise self._capabilities_error
        return self._capabilities

    def _checked_detection(self) -> Capabilities:
        try:
            caps = self._detect_capabilities()
        except (HalError, KeyboardInterrupt):
            raise
        except BaseException as exc:  # a plugin's bug (even sys.exit) is reported as its unavailability
            raise VendorUnavailable(
                f"vendor {self.name!r}: capability detection failed: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(caps, Capabilities):
            raise VendorUnavailable(
                f"vendor {self.name!r}: capability detection returned "
                f"{type(caps).__name__}, expected a hal.Capabilities"
            )
        problems = caps.consistency_problems()
        if problems:  # a contradictory table would resolve plans by whichever entry is read first
            raise VendorUnavailable(
                f"vendor {self.name!r}: its capability table contradicts itself: " + "; ".join(problems)
            )
        return caps

    @abc.abstractmethod
    def declared_models(self) -> Mapping[str, Capabilities]:
        """Capability tables for named device models, usable without the hardware."""

    @property
    def default_model(self) -> str:
        """The declared model shown when the hardware is absent."""
        return next(iter(self._checked_models()))

    def _checked_models(self) -> Mapping[str, Capabilities]:
        """`declared_models()`, or `VendorUnavailable` saying how a plugin's table is broken (it raised, is
        empty, or is not a mapping of model names to `Capabilities`)."""
        try:
            models = self.declared_models()
        except HalError:
            raise
        except Exception as exc:  # noqa: BLE001 - a plugin's fault, reported as its own
            raise VendorUnavailable(
                f"vendor {self.name!r}: its declared_models() raised {type(exc).__name__}: {exc}"
            ) from exc
        if (
            not isinstance(models, Mapping)
            or not models
            or not all(isinstance(k, str) and isinstance(v, Capabilities) for k, v in models.items())
        ):
            given = "an empty mapping" if isinstance(models, Mapping) and not models else type(models).__name__
            raise VendorUnavailable(
                f"vendor {self.name!r}: expected declared_models() to map device model names to "
                f"hal.Capabilities (at least one), got {given}"
            )
        return models

    def declared_capabilities(self, model: str | None = None) -> Capabilities:
        """The declared table of a named device model (case-insensitive)."""
        models = self._checked_models()
        if model is None:
            model = self.default_model
        for key, caps in models.items():
            if key.lower() == model.strip().lower():
                return caps
        raise InvalidInput(f"device model: expected one of {', '.join(models)} for vendor {self.name!r}, got {model!r}")

    # -- op implementations ----------------------------------------------------------------------

    def _make_ops(self) -> VendorOps:
        """Build the op implementations for this instance (called once, after a successful probe).

        The default computes everything with the reference; a vendor returns its own ops
        object, chosen from what its probe found (kernels present or not, device generation).
        """
        from hal.reference import ReferenceOps

        return ReferenceOps()

    @property
    def ops(self) -> VendorOps:
        """The op implementations of this instance, built once and never replaced."""
        if self._ops is None:
            self.capabilities()  # availability first, and the table the ops may read
            with self._lock:
                if self._ops is None:
                    self._ops = self._built_ops()
        return self._ops

    def _built_ops(self) -> VendorOps:
        """`_make_ops()`, or `VendorUnavailable` naming what went wrong (a plugin's fault, said as such)."""
        from hal.ops import VendorOps

        try:
            ops = self._make_ops()
        except HalError:
            raise
        except Exception as exc:  # a plugin's failure, whatever it raises, is reported as the vendor's
            raise VendorUnavailable(
                f"vendor {self.name!r}: building its ops failed: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(ops, VendorOps):
            raise VendorUnavailable(
                f"vendor {self.name!r}: _make_ops() returned {type(ops).__name__}, expected a hal.VendorOps"
            )
        return ops

    # -- memory ----------------------------------------------------------------------------------

    def device_memory_bytes(self) -> int | None:
        """The total memory of this instance's device in bytes, or None where unknown (the default).

        Callers bound what they allocate by it (a layer's low-latency dispatch buffers); a vendor
        answers for its device (a host device: `host_memory_bytes()`). Where it is unknown, callers
        bound allocations by `MAX_DEVICE_MEMORY_BYTES` instead, so a request for petabytes is refused.
        """
        return None

    def stated_memory_bytes(self) -> int | None:
        """`device_memory_bytes()` checked: a positive int or None, else `VendorUnavailable` (a plugin's fault)."""
        memory = self.device_memory_bytes()
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0):
            raise VendorUnavailable(
                f"vendor {self.name!r}: device_memory_bytes() returned {memory!r}, expected a positive int or None"
            )
        return memory

    @staticmethod
    def host_memory_bytes() -> int | None:
        """The host's physical memory in bytes (sysconf, else /proc/meminfo), or None where neither answers."""
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            pass
        try:
            with open("/proc/meminfo", encoding="ascii") as meminfo:
                for line in meminfo:
                    if line.startswith("MemTotal:"):
                        return int(line.split()[1]) * 1024  # reported in kB
        except (OSError, ValueError, IndexError):
            pass
        return None

    # -- fallback warnings (per instance, never global) ------------------------------------------

    def warn_fallback_once(self, source: DispatchDtype, target: DispatchDtype, why: str) -> bool:
        """Warn that `source` dispatch becomes `target`, once per (this vendor, source, target)."""
        key = (source, target)
        with self._lock:
            if key in self._warned:
                return False
            self._warned.add(key)
        warnings.warn(
            f"vendor {self.name!r}: dispatch dtype {source} is not supported; using {target} ({why})",
            DispatchFallbackWarning,
            stacklevel=4,  # warn_fallback_once <- _validate <- resolve_dispatch_plan <- the caller
        )
        return True


def probe_within(probe: Callable[[], object], timeout: float | None) -> ProbeResult:
    """Run `probe` (in a daemon thread when `timeout` is given) and turn whatever it does into a `ProbeResult`."""
    if timeout is None:
        return _guarded(probe)
    answer: list[ProbeResult] = []
    # A daemon thread: one that never returns is abandoned here and does not keep the process alive at exit.
    thread = threading.Thread(target=lambda: answer.append(_guarded(probe)), name="hal-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return answer[0] if answer else ProbeResult.unavailable(f"probe did not finish within {timeout:g} s")


def _guarded(probe: Callable[[], object]) -> ProbeResult:
    result, error = guarded(probe)  # a broken runtime (or a plugin calling sys.exit) must not break discovery
    if error is not None:
        return ProbeResult.unavailable(f"probe failed: {error}")
    if not isinstance(result, ProbeResult) or not isinstance(result.available, bool):
        return ProbeResult.unavailable(f"probe returned {reprlib.repr(result)}, expected a hal.ProbeResult")
    return result


def unsupported_dispatch_message(vendor: str, dtype: DispatchDtype, caps: Capabilities) -> str:
    """The house message for a rejected dispatch dtype."""
    reason = caps.fallback_reasons.get(dtype)
    return (
        f"vendor {vendor!r} ({caps.device_name}) cannot dispatch {dtype}: it is not supported and "
        f"has no declared fallback{f' ({reason})' if reason else ''}; "
        f"supported dispatch dtypes: {names(caps.dispatch_dtypes)}"
    )
