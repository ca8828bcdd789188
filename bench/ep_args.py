"""The arguments of `hal bench --ep` / `python -m bench.ep` (see `bench.ep`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hal.cli import positive_int_argument

#: The scheme each dispatch dtype is measured with (the dispatch dtype is requested explicitly too).
SCHEMES = {"bf16": "unquantized", "fp8": "w8a8-fp8-block"}
MODES = ("normal", "low-latency", "auto")
#: `--ep-dispatcher` name of the torch.distributed path (`DispatchConfig(ep_dispatcher=None)`).
TORCH_PATH = "torch"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The EP benchmark's options (the same for `python -m bench.ep` and `hal bench --ep`)."""
    parser.add_argument("--vendor", help="vendor to run (default: HAL_VENDOR, then the highest-priority available)")
    parser.add_argument("--hidden", type=positive_int_argument, default=7168, help="hidden size H (default 7168)")
    parser.add_argument(
        "--intermediate", type=positive_int_argument, default=2048, help="expert intermediate size I (default 2048)"
    )
    parser.add_argument(
        "--experts",
        type=positive_int_argument,
        default=256,
        help="routed experts in all, a multiple of the world size (default 256)",
    )
    parser.add_argument("--top-k", type=positive_int_argument, default=8, help="experts per token (default 8)")
    parser.add_argument(
        "--tokens",
        nargs="+",
        type=positive_int_argument,
        default=[128, 4096],
        metavar="N",
        help="tokens per rank (default 128 4096)",
    )
    parser.add_argument(
        "--dtype",
        nargs="+",
        choices=sorted(SCHEMES),
        default=["bf16", "fp8"],
        dest="dtypes",
        help="dispatch dtypes: bf16 (scheme unquantized), fp8 (scheme w8a8-fp8-block); default both",
    )
    parser.add_argument(
        "--mode",
        nargs="+",
        choices=MODES,
        dest="modes",
        help="expert-parallel modes (default: normal and low-latency for the torch path; for a "
        "vendor dispatcher normal, plus low-latency where it declares it)",
    )
    parser.add_argument(
        "--ep-dispatcher",
        nargs="+",
        dest="dispatchers",
        metavar="NAME",
        help=f"dispatchers: {TORCH_PATH!r} (torch.distributed) and/or a vendor's own "
        "(`hal caps` lists them; default: torch and every one the vendor declares)",
    )
    parser.add_argument(
        "--max-ll-tokens",
        type=positive_int_argument,
        default=512,
        metavar="N",
        help="skip low-latency rows above N tokens per rank (its buffers grow with the "
        "capacity, = tokens); auto mode uses capacity min(tokens, N) (default 512)",
    )
    parser.add_argument(
        "--json", type=Path, metavar="FILE", dest="json_file", help="also write the rows as JSON to FILE (rank 0)"
    )
    parser.add_argument(
        "--repeats",
        type=positive_int_argument,
        default=20,
        help="timed samples per measurement, after 3 warm-up calls (default 20)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (default 0)")
    parser.add_argument(
        "--routing",
        metavar="PATTERN",
        help="also time skewed routing and a rebalance (uniform, zipf:S, hot:N:F, rank-skew:F; "
        "moe.routing_traces): the layer on uniform and skewed routing, then after layer.rebalance()",
    )
    parser.add_argument(
        "--redundant",
        type=int,
        default=0,
        metavar="R",
        help="redundant expert slots of the --routing layers (experts + R must divide by the world size; default 0)",
    )


def build_parser(prog: str = "python -m bench.ep") -> argparse.ArgumentParser:
    """The standalone parser (`torchrun ... -m bench.ep`)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="run under torchrun, e.g. torchrun --nproc-per-node 2 -m bench.ep ...; see docs/bench-ep.md",
    )
    add_arguments(parser)
    return parser
