"""Plugins of an entry-point group, read with `importlib.metadata` and loaded one by one, each guarded.

Nothing is imported until it is asked for. A plugin that raises anything while it is imported
or called (`SystemExit` included; only `KeyboardInterrupt` goes through) becomes a
`PluginFailure` and hides no other plugin, and a name that two distributions register is a
failure that names both rather than one silently shadowing the other by `sys.path` order.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

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


def _origin(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry_point, "dist", None)
    return f"{dist.name if dist is not None else 'an unnamed distribution'} ({entry_point.value})"


def entry_points(group: str) -> tuple[dict[str, importlib.metadata.EntryPoint], list[PluginFailure]]:
    """The entry points of `group` by lower-cased name, none imported, and the names registered twice.

    A name that two distributions register (or one registers with two targets) is a failure
    naming both distributions and their targets, and neither entry point is kept.
    """
    by_name: dict[str, dict[tuple[str, str], importlib.metadata.EntryPoint]] = {}
    for entry_point in importlib.metadata.entry_points(group=group):
        dist = getattr(entry_point, "dist", None)
        key = (dist.name if dist is not None else "", entry_point.value)
        by_name.setdefault(entry_point.name.strip().lower(), {}).setdefault(key, entry_point)
    found: dict[str, importlib.metadata.EntryPoint] = {}
    failures: list[PluginFailure] = []
    for name in sorted(by_name):
        candidates = list(by_name[name].values())
        if len(candidates) == 1:
            found[name] = candidates[0]
            continue
        origins = [_origin(c) for c in candidates]
        failures.append(PluginFailure(name, "; ".join(c.value for c in candidates), (
            f"the name {name!r} is registered in entry-point group {group!r} {len(candidates)} times: by "
            f"{' and by '.join(origins)}; uninstall all but one of these distributions")))
    return found, failures


def load(entry_point: importlib.metadata.EntryPoint) -> tuple[object | None, PluginFailure | None]:
    """Import what `entry_point` names: `(object, None)`, or `(None, failure)`."""
    loaded, error = guarded(entry_point.load)
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
