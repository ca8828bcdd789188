"""`hal bench --ep`: expert-parallel dispatch, combine and the whole EP MoE layer, timed under torchrun
beside plain `torch.distributed.all_to_all_single` of the same bytes, in the same run.

One process per device (a torchrun world); every rank runs the same cases in the same order:

    torchrun --nproc-per-node 2 -m bench.ep [--vendor cuda] [--hidden 7168] [--intermediate 2048]
        [--experts 256] [--top-k 8] [--tokens 128 4096] [--dtype bf16 fp8] [--mode normal low-latency auto]
        [--ep-dispatcher NAME ...] [--max-ll-tokens 512] [--json FILE] [--repeats N]
    torchrun --nproc-per-node 2 $(which hal) bench --ep [the same options]

On the CPU (gloo), small shapes:

    torchrun --nproc-per-node 2 -m bench.ep --vendor cpu --hidden 256 --intermediate 128 --experts 8 \\
        --top-k 2 --tokens 16 64 --repeats 3

Each row (dispatcher, mode, dtype, tokens per rank) times `dispatcher.dispatch`, `dispatcher.combine` and
`layer(x, logits)`, and `all_to_all_single` of the dispatch bytes (tokens x top-k x the plan's bytes per
token) and of the combine bytes (tokens x top-k x H x 2, bf16); beside them a single-rank layer holding
only this rank's experts (no process group) on the same tokens. Times are per-rank medians after a
warm-up, every sample started behind a barrier; the slowest rank's median is the row's figure. Rank 0
prints a table per dtype (and `--json FILE`); progress goes to stderr. Outside a torchrun world (no
WORLD_SIZE) it prints the torchrun command line to use and exits 2. docs/bench-ep.md explains the columns.
"""

from __future__ import annotations

import argparse
import gc
import datetime
import json
import math
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

import hal
import moe
from bench.ep_rebalance import print_rebalance, rebalance_rows
from bench.ep_report import Row, print_tables, us
from bench.ep_world import WARMUP, World

from bench.ep_args import MODES, SCHEMES, TORCH_PATH, add_arguments, build_parser  # noqa: F401  (the module's API)


@dataclass(frozen=True)
class Case:
    """One row to measure."""

    dispatcher: str
    mode: str
    dtype: str
    tokens: int

    def capacity(self, max_ll_tokens: int) -> int | None:
        """The low-latency capacity this case's layer is built with (None: normal mode)."""
        if self.mode == "normal":
            return None
        return self.tokens if self.mode == "low-latency" else min(self.tokens, max_ll_tokens)


def cases(args: argparse.Namespace, caps: hal.Capabilities) -> list[Case]:
    """Every (dispatcher, mode, dtype, tokens) to measure, in the order every rank runs them."""
    names = args.dispatchers or [TORCH_PATH, *sorted(caps.ep_dispatchers)]
    out = []
    for dtype in args.dtypes:
        for name in dict.fromkeys(names):
            if args.modes:
                modes = list(args.modes)
            elif name == TORCH_PATH or name in caps.ep_low_latency:
                modes = ["normal", "low-latency"]
            else:
                modes = ["normal"]
            out += [Case(name, mode, dtype, tokens) for mode in modes for tokens in args.tokens]
    return out


class EpBench:
    """Weights, inputs and layers of one run; measures one `Case` at a time on every rank."""

    def __init__(self, vendor: hal.Vendor, args: argparse.Namespace, world: World) -> None:
        self.vendor, self.args, self.world = vendor, args, world
        self.local_experts = args.experts // world.size
        self._weights: tuple[torch.Tensor, torch.Tensor] | None = None
        self._local: dict[str, tuple[dict[int, float], str | None]] = {}

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts' bf16 weights (every dtype quantizes these), the same on every rank (same seed), made
        on the device; kept for the run."""
        if self._weights is None:
            a = self.args
            g = torch.Generator(device=self.vendor.device).manual_seed(a.seed)
            make = dict(device=self.vendor.device, generator=g, dtype=torch.bfloat16)
            w13 = torch.randn(a.experts, a.hidden, 2 * a.intermediate, **make) / math.sqrt(a.hidden)
            w2 = torch.randn(a.experts, a.intermediate, a.hidden, **make) / math.sqrt(a.intermediate)
            self._weights = (w13, w2)
        return self._weights

    def inputs(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's hidden states `[T, H]`, router logits over all experts and over the local ones."""
        g = torch.Generator(device=self.vendor.device).manual_seed(self.args.seed + 1 + self.world.rank)
        make = dict(device=self.vendor.device, generator=g)
        x = torch.randn(tokens, self.args.hidden, **make).to(torch.bfloat16)
        return x, torch.randn(tokens, self.args.experts, **make), torch.randn(tokens, self.local_experts, **make)

    def layer(self, case: Case, capacity: int | None, group: Any) -> moe.MoELayer:
        """The case's layer: expert parallel over `group`, or (no group) this rank's experts alone."""
        w13, w2 = self.weights()
        top_k = self.args.top_k
        if group is None:
            first = self.world.rank * self.local_experts
            w13, w2 = w13[first : first + self.local_experts], w2[first : first + self.local_experts]
            top_k = min(top_k, self.local_experts)
        config = hal.DispatchConfig(
            dtype=case.dtype,
            max_dispatch_tokens_per_rank=capacity,
            ep_mode=None if group is None else case.mode,
            ep_dispatcher=None if case.dispatcher == TORCH_PATH or group is None else case.dispatcher,
        )
        return moe.MoELayer.from_float(
            w13, w2, top_k, scheme=SCHEMES[case.dtype], vendor=self.vendor, process_group=group, dispatch=config
        )

    def local_us(self, dtype: str) -> tuple[dict[int, float], str | None]:
        """The single-rank layer holding only this rank's experts (no process group) at every token count, on
        the tokens the EP rows use (slowest rank; measured once per dtype), or why it could not run."""
        if dtype not in self._local:
            case = Case(TORCH_PATH, "normal", dtype, 0)
            layer, error = self.world.attempt(lambda: self.layer(case, None, None))
            times: dict[int, float] = {}
            for tokens in dict.fromkeys(self.args.tokens):
                if error is not None:
                    break
                x, _, logits = self.inputs(tokens)
                _, error = self.world.attempt(lambda: layer(x, logits))
                if error is None:
                    times[tokens] = self.world.slowest([self.world.median_us(lambda: layer(x, logits))])[0]
            self._local[dtype] = (times, error)
            del layer
            _empty_cache()
        return self._local[dtype]

    def local_graph_us(self, dtype: str, tokens: int) -> float | None:
        """The single-rank layer of this rank's experts at `tokens`, replayed from a CUDA graph (slowest rank)."""
        layer = self.layer(Case(TORCH_PATH, "normal", dtype, 0), None, None)
        x, _, logits = self.inputs(tokens)
        graphed = self.world.graph_median_us(lambda: layer(x, logits))
        return None if graphed is None else self.world.slowest([graphed])[0]

    def run(self, case: Case) -> Row:
        """Measure one case on every rank; a `hal.HalError` on any rank skips it with that message."""
        a, world = self.args, self.world
        capacity = case.capacity(a.max_ll_tokens)
        row = Row(case.dispatcher, case.mode, case.dtype, case.tokens, capacity)
        if case.mode == "low-latency" and case.tokens > a.max_ll_tokens:
            return row.skip(
                f"low-latency capacity {case.tokens} tokens per rank is above --max-ll-tokens {a.max_ll_tokens}"
            )
        local, row.local_reason = self.local_us(case.dtype)
        row.local_layer_us = local.get(case.tokens)
        layer, error = world.attempt(lambda: self.layer(case, capacity, dist.group.WORLD))
        if error:
            return row.skip(error)
        row.plan_dtype, row.bytes_per_token = str(layer.plan.resolved), layer.plan.bytes_per_token
        pairs = case.tokens * a.top_k
        row.dispatch_bytes, row.combine_bytes = pairs * row.bytes_per_token, pairs * a.hidden * 2
        x, logits, _ = self.inputs(case.tokens)
        routing = layer.router(logits)
        quantize = layer.scheme.dispatch_quantizer(layer.vendor, layer.plan, layer.expert_weights)

        def probe() -> tuple[Any, torch.Tensor]:
            layer(x, logits)
            dispatched = layer.dispatcher.dispatch(x, routing, quantize)
            rows = torch.zeros(*dispatched.payload.data.shape[:-1], a.hidden, dtype=torch.bfloat16, device=x.device)
            layer.dispatcher.combine(rows, dispatched, torch.bfloat16)
            return dispatched, rows

        probed, error = world.attempt(probe)
        if error:
            return row.skip(error)
        dispatched, rows = probed
        send_d, recv_d = self._a2a_buffers(row.dispatch_bytes)
        send_c, recv_c = self._a2a_buffers(row.combine_bytes)
        medians = [
            world.median_us(lambda: layer.dispatcher.dispatch(x, routing, quantize)),
            world.median_us(lambda: dist.all_to_all_single(recv_d, send_d)),
            world.median_us(lambda: layer.dispatcher.combine(rows, dispatched, torch.bfloat16)),
            world.median_us(lambda: dist.all_to_all_single(recv_c, send_c)),
            world.median_us(lambda: layer(x, logits)),
        ]
        (row.dispatch_us, row.a2a_dispatch_us, row.combine_us, row.a2a_combine_us, row.layer_us) = world.slowest(
            medians
        )
        if case.mode == "low-latency":
            graphed = world.graph_median_us(lambda: layer(x, logits))
            if graphed is not None:
                alone = [
                    world.graph_median_us(lambda: layer.dispatcher.dispatch(x, routing, quantize)),
                    world.graph_median_us(lambda: layer.dispatcher.combine(rows, dispatched, torch.bfloat16)),
                ]
                row.layer_graph_us, row.dispatch_graph_us, row.combine_graph_us = world.slowest([graphed, *alone])
                row.local_layer_graph_us = self.local_graph_us(case.dtype, case.tokens)
        del layer, dispatched, rows
        _empty_cache()
        return row.finish()

    def _a2a_buffers(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Send and receive uint8 buffers of `nbytes` (rounded up to a multiple of the world size, the
        equal split `all_to_all_single` needs)."""
        size = -(-nbytes // self.world.size) * self.world.size
        send = torch.ones(size, dtype=torch.uint8, device=self.vendor.device)
        return send, torch.empty_like(send)


def _empty_cache() -> None:
    empty = getattr(torch.accelerator, "empty_cache", None)  # torch >= 2.8
    if empty is not None and torch.accelerator.is_available():
        empty()


def run(args: argparse.Namespace) -> int:
    """Run the benchmark on this rank (call it inside a torchrun world: `main` and `from_hal` check);
    rank 0 prints and writes the JSON."""
    if args.json_file is not None:
        from bench.cli import writable_file

        writable_file("--json", args.json_file)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.accelerator.is_available():  # one device per process, without naming the device type
        torch.accelerator.set_device_index(local_rank)
    vendor = hal.VendorRegistry.discover().select(args.vendor).vendor
    caps = vendor.capabilities()
    started = not dist.is_initialized()
    if started:
        dist.init_process_group(caps.collective_backend)
    try:
        return _run(args, vendor, caps)
    finally:
        if started:
            gc.collect()  # whatever still holds the group goes first: gloo can abort when it outlives it
            dist.destroy_process_group()


def _run(args: argparse.Namespace, vendor: hal.Vendor, caps: hal.Capabilities) -> int:
    world = World(vendor.device, args.repeats)
    if args.experts % world.size:
        raise hal.InvalidInput(
            f"--experts: expected a multiple of the world size ({world.size}) so that every "
            f"rank holds the same number of experts, got {args.experts}"
        )
    if args.routing is not None:
        from moe.routing_traces import RoutingTrace

        RoutingTrace.parse(args.routing)  # refused before any measurement
        if args.redundant < 0 or (args.experts + args.redundant) % world.size:
            raise hal.InvalidInput(
                f"--redundant: expected an int >= 0 with --experts + --redundant a multiple of the world size "
                f"({world.size}), got {args.redundant}"
            )
    todo = cases(args, caps)
    bench = EpBench(vendor, args, world)
    progress = Console(stderr=True, highlight=False, soft_wrap=True)
    rows: list[Row] = []
    with torch.inference_mode():
        for i, case in enumerate(todo, 1):
            if world.rank == 0:
                progress.print(
                    f"[{i}/{len(todo)}] {case.dtype} {case.dispatcher}/{case.mode}, {case.tokens} tokens per rank ...",
                    markup=False,
                )
            row = bench.run(case)
            rows.append(row)
            if world.rank == 0:
                done = (
                    f"skipped: {row.reason}"
                    if row.status != "ok"
                    else (
                        f"dispatch {us(row.dispatch_us)} µs, combine {us(row.combine_us)} µs, "
                        f"layer {us(row.layer_us)} µs"
                    )
                )
                progress.print(f"    {done}", markup=False)
    meta = {
        "vendor": vendor.name,
        "device": caps.device_name,
        "backend": caps.collective_backend,
        "world_size": world.size,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "experts": args.experts,
        "top_k": args.top_k,
        "local_experts": args.experts // world.size,
        "repeats": args.repeats,
        "warmup": WARMUP,
        "max_ll_tokens": args.max_ll_tokens,
        "seed": args.seed,
        "schemes": SCHEMES,
    }
    rebalance: list[dict[str, Any]] = []
    if args.routing is not None:
        if world.rank == 0:
            progress.print(f"skewed routing {args.routing} and a rebalance ...", markup=False)
        with torch.inference_mode():
            rebalance = rebalance_rows(bench, args, world)
    if world.rank == 0:
        if args.json_file is not None:
            payload = {**meta, "rows": [r.as_dict() for r in rows], "rebalance": rebalance}
            args.json_file.write_text(json.dumps(payload, indent=2) + "\n")
        console = Console(highlight=False, width=None if sys.stdout.isatty() else 140)
        print_tables(console, rows, meta)
        print_rebalance(console, rebalance)
    return 0


def torchrun_command(argv: Sequence[str], *, hal_command: bool = False) -> str:
    """The command line that runs these options under torchrun, one process per device (at least 2)."""
    count = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    launcher = ["torchrun", "--nproc-per-node", str(max(count, 2))]
    if hal_command:
        return f"{shlex.join(launcher)} $(which hal) bench --ep {shlex.join(argv)}".rstrip()
    return shlex.join([*launcher, "-m", "bench.ep", *argv])


def refuse_outside_torchrun(argv: Sequence[str], what: str = "python -m bench.ep") -> int:
    """Say how to launch under torchrun (this process is not in a torchrun world); return 2."""
    sys.stderr.write(
        f"{what}: error: not inside a torchrun world (WORLD_SIZE is not set): the expert-parallel "
        "benchmark runs one process per device. Run:\n"
        f"  {torchrun_command(argv)}\n"
        f"or\n  {torchrun_command(argv, hal_command=True)}\n"
    )
    return 2


def from_hal(args: argparse.Namespace) -> int:
    """`hal bench --ep ...`: everything after `--ep` is this benchmark's (`--vendor` / `--tokens` given before
    it are passed on); other `hal bench` options are refused."""
    given = [
        o
        for o, v in (
            ("--model", args.models),
            ("--precision", args.precisions),
            ("--output", args.output),
            ("--markdown", args.markdown),
            ("--routing (before --ep; give it after --ep)", args.routing),
            ("--json", args.json or None),
        )
        if v
    ]
    if given:
        raise hal.InvalidInput(
            f"hal bench --ep: {', '.join(given)}: options of the single-device bench; give "
            "the EP benchmark's own options after --ep (see hal bench --ep --help)"
        )
    argv = (
        ([] if args.vendor is None else ["--vendor", args.vendor])
        + ([] if not args.tokens else ["--tokens", *map(str, args.tokens)])
        + list(args.ep)
    )
    options = build_parser("hal bench --ep").parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        return refuse_outside_torchrun(argv, "hal bench --ep")
    return run(options)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.ep`: parse, refuse outside torchrun, run; a `hal.HalError` exits 2 (bad input) or 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        return refuse_outside_torchrun(argv)
    try:
        return run(args)
    except hal.HalError as exc:
        sys.stderr.write(f"bench.ep: error: {exc}\n")
        return 2 if isinstance(exc, hal.InvalidInput) else 1


if __name__ == "__main__":
    sys.exit(main())
