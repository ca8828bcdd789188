"""Plugins of an entry-point group, found by stevedore and loaded one by one, each guarded.

The one loader of the project's plugin groups (vendors, commands, expert runners, `hal caps`
sections). stevedore lists a group without importing anything; an entry point is imported only
when asked for, through a stevedore manager that names it alone. A plugin that raises anything
while it is imported or called (`SystemExit` and `AssertionError` included; only
`KeyboardInterrupt` goes through) becomes a `PluginFailure` and hides no other plugin, and a
name registered with two targets is a failure that names both distributions rather than one
silently shadowing the other by `sys.path` order.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from stevedore import ExtensionManager
from stevedore.named import NamedExtensionManager

T = TypeVar("T")


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded, and why."""

    name: str
    target: str
    error: str


def describe(error: BaseException) -> str:
    """`Type: message`, the way failures are reported."""
    return f"{type(error).__name__}: {error}"


def guarded(call: Callable[[], T]) -> tuple[T | None, str | None]:
    """`(result, None)`, or `(None, reason)` when `call` raises anything but `KeyboardInterrupt`."""
    try:
        return call(), None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit too: a plugin must not end the process that loads it
        return None, describe(exc)


def _distributions(group: str, name: str, target: str) -> str:
    """The distributions that register `name = target` in `group` (for messages; read only on failure)."""
    found = sorted(
        {
            d.metadata["Name"] or "an unnamed distribution"
            for d in importlib.metadata.distributions()
            for e in d.entry_points
            if e.group == group and e.name == name and e.value == target
        }
    )
    return " and ".join(found) or "an unnamed distribution"


def _listed(group: str) -> list[importlib.metadata.EntryPoint]:
    """Every entry point of `group`, none imported (stevedore's per-process list is refreshed first, so a
    distribution installed since the last call is seen)."""
    ExtensionManager.ENTRY_POINT_CACHE.pop(group, None)
    return NamedExtensionManager(
        group, names=(), on_missing_entrypoints_callback=lambda _names: None
    ).list_entry_points()


def entry_points(group: str) -> tuple[dict[str, importlib.metadata.EntryPoint], list[PluginFailure]]:
    """The entry points of `group` by lower-cased name, none imported, and the names registered twice.

    A name registered with two targets (by two distributions, or one) is a failure naming the
    distributions and their targets, and neither entry point is kept.
    """
    by_name: dict[str, dict[str, importlib.metadata.EntryPoint]] = {}
    for entry_point in _listed(group):
        by_name.setdefault(entry_point.name.strip().lower(), {}).setdefault(entry_point.value, entry_point)
    found: dict[str, importlib.metadata.EntryPoint] = {}
    failures: list[PluginFailure] = []
    for name in sorted(by_name):
        candidates = list(by_name[name].values())
        if len(candidates) == 1:
            found[name] = candidates[0]
            continue
        origins = [f"{_distributions(group, c.name, c.value)} ({c.value})" for c in candidates]
        failures.append(
            PluginFailure(
                name,
                "; ".join(c.value for c in candidates),
                (
                    f"the name {name!r} is registered in entry-point group {group!r} {len(candidates)} times: by "
                    f"{' and by '.join(origins)}; uninstall all but one of these distributions"
                ),
            )
        )
    return found, failures


def _import(entry_point: importlib.metadata.EntryPoint) -> object:
    """What `entry_point` names, imported by a stevedore manager of that name alone; its error re-raised."""
    errors: list[BaseException] = []
    manager = NamedExtensionManager(
        entry_point.group,
        names=[entry_point.name],
        on_missing_entrypoints_callback=lambda _names: None,
        on_load_failure_callback=lambda _m, _ep, error: errors.append(error),
    )
    for extension in manager.extensions:
        if extension.entry_point.value == entry_point.value:
            return extension.plugin
    if errors:
        raise errors[0]
    raise LookupError(f"entry point {entry_point.name!r} ({entry_point.value}) is no longer installed")


def load(entry_point: importlib.metadata.EntryPoint) -> tuple[object | None, PluginFailure | None]:
    """Import what `entry_point` names: `(object, None)`, or `(None, failure)`."""
    loaded, error = guarded(lambda: _import(entry_point))
    if error is not None:
        return None, PluginFailure(entry_point.name, entry_point.value, error)
    return loaded, None


def load_plugins(group: str) -> tuple[list[tuple[str, object]], list[PluginFailure]]:
    """Load every entry point of `group`, sorted by name: `(name, object)` pairs and failures.

    Upper layers use this for their own plugin groups (expert runners, `hal caps` sections) so
    that only `hal` talks to the entry-point machinery.
    """
    found, failures = entry_points(group)
    loaded: list[tuple[str, object]] = []
    for name, entry_point in found.items():
        plugin, failure = load(entry_point)
        if failure is not None:
            failures.append(failure)
        else:
            loaded.append((name, plugin))
    return loaded, failures
