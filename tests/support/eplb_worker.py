"""One rank of a gloo world for `tests/moe/test_expert_rebalance_ranks.py`: redundant experts, load
statistics and rebalancing under expert parallelism.

Run as `python tests/support/eplb_worker.py --rank R --world W --init file://... --out DIR`. For every case each
rank builds the expert-parallel layer with `world` redundant experts and load statistics, and the
single-process layer (no redundancy) from the same global weights; runs its own Zipf-skewed tokens
through both; reads the gathered statistics; rebalances (every rank computes the same placement);
checks that every moved buffer now holds exactly the single-process layer's tensors of its slot's
expert, and runs the tokens again. It records the relative differences and the counts checked.
"""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, TOKENS = 160, 128, 8, 3, 96


@dataclass(frozen=True)
class Case:
    """One scheme and dispatch mode."""

    name: str
    scheme: str = "fp32"
    capacity: int | None = None  #: low-latency mode


def cases(world: int) -> list[Case]:
    """The cases a world of `world` ranks runs."""
    return [
        Case("fp32-normal"),
        Case("fp32-low-latency", capacity=TOKENS + 8),
        Case("int8-normal", scheme="w8a8-int8"),
        Case("fp8-block-normal", scheme="w8a8-fp8-block"),
        Case("bias-fp32", scheme="fp32"),
    ]


def run(case: Case, rank: int, world: int) -> dict:
    result = compare(case, rank, world)
    gc.collect()  # free the layer (it holds the group) now, not at exit, where gloo at times aborts
    return result


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def compare(case: Case, rank: int, world: int) -> dict:
    import moe
    from hal import DispatchConfig
    from moe.routing_traces import RoutingTrace
    from tests.support.moe_reference import random_weights

    w13, w2 = random_weights(EXPERTS, HIDDEN, INTERMEDIATE, 7)
    bias = case.name.startswith("bias")
    extra = {}
    if bias:
        g = torch.Generator().manual_seed(8)
        extra = {
            "w13_bias": torch.randn(EXPERTS, 2 * INTERMEDIATE, generator=g),
            "w2_bias": torch.randn(EXPERTS, HIDDEN, generator=g),
        }
    common = {"scheme": case.scheme, "vendor": "cpu", "environ": {}, "check_routing": False, **extra}
    single = moe.MoELayer.from_float(w13, w2, TOP_K, **common)
    layer = moe.MoELayer.from_float(
        w13,
        w2,
        TOP_K,
        process_group=dist.group.WORLD,
        redundant_experts=world,
        load_stats=moe.LoadStats(window=4),
        dispatch=DispatchConfig(max_dispatch_tokens_per_rank=case.capacity),
        **common,
    )
    trace = RoutingTrace.parse("zipf:1.5")
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(100 + rank))
    logits = trace.logits(TOKENS, EXPERTS, seed=rank)
    expected = single(x, logits)
    before = layer(x, logits)
    snap = layer.expert_load.snapshot(dist.group.WORLD)
    mine = torch.bincount(single.router(logits).topk_ids.flatten(), minlength=EXPERTS)
    dist.all_reduce(mine)
    received = torch.tensor(layer.expert_load.snapshot().slot_window)
    all_received = [torch.zeros_like(received) for _ in range(world)]
    dist.all_gather(all_received, received)
    per_slot = torch.cat(all_received)
    replica_sums = torch.zeros(EXPERTS, dtype=torch.int64).index_add_(0, torch.tensor(layer.placement.slots), per_slot)
    old_slots = layer.placement.slots
    placement = layer.rebalance()
    gathered = [None] * world
    dist.all_gather_object(gathered, placement.slots)
    after = layer(x, logits)
    first = layer.local_experts.start
    moved_ok = True
    for name, t in layer.experts.named_buffers():
        if t.dim() >= 1 and t.shape[0] == len(layer.local_experts):
            ref = dict(single.experts.named_buffers())[name][list(placement.slots[first : first + t.shape[0]])]
            moved_ok &= torch.equal(t, ref)
    return {
        "before": relative(before, expected),
        "after": relative(after, expected),
        "stats_equal": snap.expert_window == mine.tolist() and snap.forwards == 1,
        "received_equal": replica_sums.tolist() == mine.tolist(),
        "same_placement": all(g == placement.slots for g in gathered),
        "moved": placement.slots != old_slots,
        "buffers_equal": bool(moved_ok),
        "rank_balance_before": _balance(moe.ExpertPlacement(old_slots, EXPERTS), mine.tolist(), world),
        "rank_balance_after": _balance(placement, mine.tolist(), world),
    }


def _balance(placement, load, world) -> float:
    loads = placement.rank_loads(load, world)
    return max(loads) / (sum(loads) / world)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.support.gloo_world import worker_main

    raise SystemExit(worker_main(cases, run))
