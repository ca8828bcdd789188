"""The shared conformance suite every vendor runs: the contract between `hal` and a vendor.

- `conformance.suite`: the tests (pytest modules), run against one vendor through `hal`
  only, parametrized over every capability and skipped with the reason where the vendor
  declares one absent.
- `conformance.plugin`: the pytest plugin (entry point `pytest11`) adding `--hal-vendor`.
- `conformance.runner` and `conformance.report`: `hal conformance`, the capability matrix,
  `conformance.json` and `conformance.md`.

This module imports nothing heavy: pytest loads the plugin in every session of an
environment where moe-hal is installed.
"""

from pathlib import Path

#: The directory holding the suite's test modules.
SUITE_DIR = Path(__file__).resolve().parent / "suite"

__all__ = ["SUITE_DIR"]
