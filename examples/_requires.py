"""What every example does first: check its optional dependencies and name the extra that installs them."""

from __future__ import annotations

import importlib
import sys


def require(module: str, extra: str, purpose: str) -> None:
    """Exit with one line naming `extra` unless `module` can be imported (checked before anything runs)."""
    try:
        importlib.import_module(module)
    except ImportError:
        sys.stderr.write(f"{purpose} needs {module}, which is not installed: pip install 'moe-hal[{extra}]'\n")
        raise SystemExit(1)
