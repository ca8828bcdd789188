"""Versions and the date for a report's header (no pytest import: the expert-parallel ranks use it too)."""

from __future__ import annotations

import datetime
import importlib.metadata
import platform


def environment() -> dict[str, str]:
    """Versions and the date, for the report header."""

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "moe_hal": version("moe-hal"),
        "torch": version("torch"),
        "pytest": version("pytest"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
