"""`hal bench --ep --routing PATTERN`: what skewed routing costs the expert-parallel layer, and what a
rebalance wins back.

For every (dtype, tokens per rank) on the torch.distributed path in normal mode: the layer with
`--redundant` slots on uniform routing (the reference), on the skewed routing of `--routing`
(`moe.routing_traces`) before a rebalance, and after `layer.rebalance()` from the load it recorded
on those calls; beside the times, the busiest rank's share of the pairs (max / mean over ranks) under
the layer's placement, and the wall time of the rebalance itself (statistics read, placement
computed, experts migrated).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch.distributed as dist
from rich import box
from rich.console import Console
from rich.table import Table

import hal
import moe
from bench.ep_args import SCHEMES
from bench.ep_world import World
from moe.routing_traces import RoutingTrace


def rebalance_rows(bench: Any, args: argparse.Namespace, world: World) -> list[dict[str, Any]]:
    """One row per (dtype, tokens): layer µs uniform / skewed / rebalanced, rank imbalance before and after."""
    trace = RoutingTrace.parse(args.routing)
    uniform = RoutingTrace("uniform")
    w13, w2 = bench.weights()
    rows = []
    for dtype in args.dtypes:
        for tokens in args.tokens:
            layer = moe.MoELayer.from_float(
                w13,
                w2,
                args.top_k,
                scheme=SCHEMES[dtype],
                vendor=bench.vendor,
                process_group=dist.group.WORLD,
                dispatch=hal.DispatchConfig(dtype=dtype),
                redundant_experts=args.redundant,
                load_stats=moe.LoadStats(window=world.repeats + world.warmup),
            )
            x = bench.inputs(tokens)[0]
            seed = args.seed + 17 * world.rank
            device = str(bench.vendor.device)
            flat = uniform.logits(tokens, args.experts, seed=seed, device=device)
            skewed = trace.logits(tokens, args.experts, seed=args.seed, ranks=world.size, device=device)
            uniform_us = world.median_us(lambda: layer(x, flat))
            layer.expert_load.reset()
            before_us = world.median_us(lambda: layer(x, skewed))
            load = layer.expert_load.snapshot(dist.group.WORLD).expert_window
            before_balance = _balance(layer.placement, load, world.size)
            world.synchronize()
            dist.barrier()
            start = time.perf_counter()
            placement = layer.rebalance()
            world.synchronize()
            migrate_ms = (time.perf_counter() - start) * 1e3
            after_us = world.median_us(lambda: layer(x, skewed))
            slowest = world.slowest([uniform_us, before_us, after_us, migrate_ms * 1e3])
            rows.append(
                {
                    "dtype": dtype,
                    "tokens": tokens,
                    "routing": args.routing,
                    "redundant": args.redundant,
                    "uniform_us": slowest[0],
                    "skewed_us": slowest[1],
                    "rebalanced_us": slowest[2],
                    "rebalance_ms": slowest[3] / 1e3,
                    "rank_imbalance_before": before_balance,
                    "rank_imbalance_after": _balance(placement, load, world.size),
                }
            )
    return rows


def _balance(placement: moe.ExpertPlacement, load: list[int], ranks: int) -> float | None:
    loads = placement.rank_loads(load, ranks)
    total = sum(loads)
    return None if not total else max(loads) / (total / ranks)


def print_rebalance(console: Console, rows: list[dict[str, Any]]) -> None:
    """The rebalance table (rank 0)."""
    if not rows:
        return
    table = Table(
        title=f"skewed routing ({rows[0]['routing']}) and rebalancing, {rows[0]['redundant']} redundant slots; "
        "torch path, normal mode, slowest rank's median µs",
        box=box.SIMPLE_HEAD,
        title_justify="left",
    )
    for column in (
        "dtype",
        "tokens",
        "uniform",
        "skewed",
        "rebalanced",
        "skewed/uniform",
        "rebalanced/uniform",
        "ranks max/mean before",
        "after",
        "rebalance ms",
    ):
        table.add_column(column, justify="left" if column == "dtype" else "right")
    for r in rows:
        table.add_row(
            r["dtype"],
            str(r["tokens"]),
            f"{r['uniform_us']:.1f}",
            f"{r['skewed_us']:.1f}",
            f"{r['rebalanced_us']:.1f}",
            f"{r['skewed_us'] / r['uniform_us']:.2f}",
            f"{r['rebalanced_us'] / r['uniform_us']:.2f}",
            "-" if r["rank_imbalance_before"] is None else f"{r['rank_imbalance_before']:.2f}",
            "-" if r["rank_imbalance_after"] is None else f"{r['rank_imbalance_after']:.2f}",
            f"{r['rebalance_ms']:.1f}",
        )
    console.print(table)
