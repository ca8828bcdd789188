"""The `hal` command line: which vendor, which capabilities, why this dispatch dtype."""

from hal.cli.app import main

__all__ = ["main"]
