"""The `hal` command line: which vendor, which capabilities, why this dispatch dtype.

Public for command plugins (the `hal.commands` entry-point group): `register(subparsers)`
adds a command; `positive_int_argument` is the shared argparse type for counts.
"""

from hal.cli.app import main, positive_int_argument

__all__ = ["main", "positive_int_argument"]
