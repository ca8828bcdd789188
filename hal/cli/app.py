"""Argument parsing, command plugins and error handling for the `hal` command."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import NoReturn

from typing import TYPE_CHECKING, Any

from hal.activations import ActivationKind
from hal.cli.names import DISPATCH_DTYPE_NAMES, SCHEME_NAMES, known_dispatch_dtype, known_scheme
from hal.entry_points import guarded, load_plugins
from hal.errors import HalError, InvalidInput

if TYPE_CHECKING:
    from rich.console import Console

#: Entry-point group where upper layers (conformance, bench) register extra commands.
COMMAND_GROUP = "hal.commands"


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def lazy(target: str) -> Callable[..., Any]:
    """A callable that imports `"module:name"` when first called and calls it: command handlers and
    argument types that need torch are named this way, so that `hal --help` does not import it."""

    def call(*args: Any, **kwargs: Any) -> Any:
        module, _, path = target.partition(":")
        found: Any = importlib.import_module(module)
        for name in path.split("."):
            found = getattr(found, name)
        return found(*args, **kwargs)

    call.__name__ = target.rpartition(":")[2]
    return call


def _converter(  # type: ignore[no-untyped-def]
    parse: str, what: str, known: Callable[[str], bool] | None = None, names: Sequence[str] = ()
):
    """An argparse type: a name `known` refuses is an error without importing torch; others are parsed."""

    def convert(value: str):  # type: ignore[no-untyped-def]
        if known is not None and not known(value):
            raise argparse.ArgumentTypeError(f"{what}: expected one of {', '.join(names)}, got {value!r}")
        try:
            return lazy(parse)(value)
        except InvalidInput as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = what
    return convert


def scheme_name_argument(value: str) -> str:
    """argparse type for a quant scheme's name, checked without importing torch (kept as given)."""
    if not known_scheme(value):
        raise argparse.ArgumentTypeError(f"scheme: expected one of {', '.join(SCHEME_NAMES)}, got {value!r}")
    return value


def dispatch_dtype_name_argument(value: str) -> str:
    """argparse type for a dispatch dtype's name, checked without importing torch (kept as given)."""
    if not known_dispatch_dtype(value):
        raise argparse.ArgumentTypeError(
            f"dispatch dtype: expected one of {', '.join(DISPATCH_DTYPE_NAMES)}, got {value!r}"
        )
    return value


def positive_int_argument(value: str) -> int:
    """argparse type for a positive integer (commands registered by other packages use it too)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def installed_version() -> str:
    """The installed moe-hal distribution's version ("unknown" when run from a tree that is not installed)."""
    try:
        return metadata.version("moe-hal")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> OneLineParser:
    """The full parser, with the built-in commands and any registered command plugins."""
    parser = OneLineParser(
        prog="hal",
        description="moe-hal: vendors, capabilities and dispatch plans.",
        epilog="exit status: 0 done, 1 refused (unsupported, unavailable, checks failed), "
        "2 bad arguments, 130 interrupted",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s (moe-hal) {installed_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help_text: str) -> OneLineParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", action="store_true", help="print JSON instead of tables")
        return p

    vendors = command("vendors", "list every discovered vendor: available, or why not")
    vendors.set_defaults(handler=lazy("hal.cli.commands:vendors"))

    caps = command("caps", "show a vendor's capability table")
    caps.add_argument("--vendor", help="vendor name (default: HAL_VENDOR, then the highest-priority available)")
    caps.add_argument("--device-model", help="show the declared table of a named device model (e.g. H100, A3)")
    caps.set_defaults(handler=lazy("hal.cli.commands:caps"))

    explain = command("explain", "trace how the dispatch dtype is resolved")
    explain.add_argument("--vendor", help="vendor name (default: HAL_VENDOR, then the highest-priority available)")
    explain.add_argument("--device-model", help="plan for a named device model's declared table")
    explain.add_argument(
        "--scheme",
        type=_converter("hal.schemes:parse_scheme", "scheme", known_scheme, SCHEME_NAMES),
        help=f"quant scheme: {', '.join(SCHEME_NAMES)}; fp16 / fp32: unquantized over weights of that dtype",
    )
    explain.add_argument(
        "--model-dtype",
        type=_converter("hal.dtypes:DispatchDtype.parse", "dispatch dtype", known_dispatch_dtype, DISPATCH_DTYPE_NAMES),
        help="the model's float dtype (bf16, fp16, fp32): an unquantized model asks to dispatch "
        "in it (--scheme defaults to unquantized)",
    )
    explain.add_argument(
        "--dispatch-dtype",
        type=_converter("hal.dtypes:DispatchDtype.parse", "dispatch dtype", known_dispatch_dtype, DISPATCH_DTYPE_NAMES),
        help=f"requested dtype (default auto): {', '.join(DISPATCH_DTYPE_NAMES)}",
    )
    explain.add_argument(
        "--runner-dtype",
        type=_converter("hal.dtypes:DispatchDtype.parse", "dispatch dtype", known_dispatch_dtype, DISPATCH_DTYPE_NAMES),
        help="dtype the expert runner requires, if any",
    )
    explain.add_argument("--hidden", type=positive_int_argument, default=4096, help="hidden size (default 4096)")
    explain.add_argument(
        "--ep-dispatcher",
        metavar="NAME",
        help="a vendor's own expert-parallel dispatcher the layer would use (e.g. deepep, mc2)",
    )
    explain.add_argument(
        "--activation",
        type=_converter("hal.activations:Activation.parse", "activation"),
        help=f"the experts' activation (default silu-glu): {', '.join(k.value for k in ActivationKind)}",
    )
    layer = explain.add_argument_group("layer settings (checked where given)")
    for flag, what in (
        ("--intermediate", "the experts' intermediate size"),
        ("--experts", "the number of experts"),
        ("--top-k", "experts per token"),
        ("--ep-ranks", "expert-parallel ranks (default 1)"),
        ("--tp-ranks", "tensor-parallel ranks (default 1)"),
    ):
        layer.add_argument(flag, type=positive_int_argument, help=what)
    layer.add_argument("--bias", action="store_true", help="the experts have biases")
    explain.set_defaults(handler=lazy("hal.cli.commands:explain"))

    _load_command_plugins(sub)
    return parser


def _load_command_plugins(sub: argparse._SubParsersAction) -> None:
    """Add every registered command; one that fails to load or to register is a warning, not an end."""
    loaded, failures = load_plugins(COMMAND_GROUP)
    for name, register in loaded:
        _, error = guarded(lambda: register(sub)) if callable(register) else (None, f"{register!r} is not callable")
        if error is not None:
            sys.stderr.write(f"hal: warning: command plugin {name!r} failed to register: {error}\n")
    for failure in failures:
        sys.stderr.write(f"hal: warning: command plugin {failure.name!r} failed to load: {failure.error}\n")


def make_console() -> Console:
    """A console for tables: a fixed, roomy width when the output is not a terminal."""
    from rich.console import Console

    return Console(highlight=False, width=None if sys.stdout.isatty() else 120)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hal` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        sys.stderr.write("hal: error: a command is required\n")
        return 2
    try:
        return int(args.handler(args, make_console()))
    except HalError as exc:
        status = 2 if isinstance(exc, InvalidInput) else 1
        if getattr(args, "json", False):
            print(json.dumps({"error": {"type": type(exc).__name__, "message": str(exc)}}, indent=2))
        sys.stderr.write(f"hal: error: {exc}\n")
        return status
    except KeyboardInterrupt:
        sys.stderr.write("hal: interrupted\n")
        return 130
    except BrokenPipeError:  # e.g. `hal caps --json | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
