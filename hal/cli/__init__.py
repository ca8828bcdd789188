"""The `hal` command line: which vendor, which capabilities, why this dispatch dtype.

Public for command plugins (the `hal.commands` entry-point group): `register(subparsers)`
adds a command; `positive_int_argument` is the shared argparse type for counts, `scheme_name_argument` and
`dispatch_dtype_name_argument` for names checked without torch; `lazy("module:name")`
names a handler or argument type imported only when called (so that `hal --help` does not import torch).
"""

from hal.cli.app import dispatch_dtype_name_argument, lazy, main, positive_int_argument, scheme_name_argument

__all__ = ["dispatch_dtype_name_argument", "lazy", "main", "positive_int_argument", "scheme_name_argument"]
