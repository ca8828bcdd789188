"""One rank of a gloo world for `tests/moe/test_ep_dispatch_caches.py`: dispatchers that keep buffers and
constants between calls give, call after call, what a fresh dispatcher gives.

Run as `python tests/support/ep_cache_worker.py --rank R --world W --init file://... --out DIR`. Each case
calls one long-lived dispatcher (or two, alternately) with batches that grow, shrink, go empty and
change top-k, synchronously and asynchronously, and compares every output bit for bit with a
normal-mode dispatcher built for that call alone (which keeps nothing between calls; every mode hands
the experts the same rows in the same order, and returns the same sums); it records the calls that
differ (none: an empty list).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

EXPERTS = 8


@dataclass(frozen=True)
class Layer:
    """What a dispatcher is built for: scheme, dispatch dtype, hidden size, top-k, mode, capacity."""

    scheme: str
    dtype: str
    hidden: int
    top_k: int
    mode: str  #: "normal" | "low-latency" | "auto"
    capacity: int | None = None


@dataclass(frozen=True)
class Case:
    name: str
    layers: tuple[Layer, ...]  #: called in turn, one call each per batch
    tokens: tuple[int, ...]  #: the batch per call, plus the rank (at most the capacity on every rank)
    top_ks: tuple[int, ...] = ()  #: the routing's top-k per call (default: the layer's)


BF16 = Layer("unquantized", "bf16", 64, 2, "normal")
CASES = [
    Case("normal-grows-and-shrinks", (BF16,), (5, 0, 33, 2, 33, 1)),
    Case("low-latency-full-then-fewer", (Layer("unquantized", "bf16", 64, 3, "low-latency", 16),), (15, 3, 0, 15, 7)),
    Case("low-latency-scales", (Layer("w8a8-fp8-block", "fp8", 200, 2, "low-latency", 12),), (11, 2, 0, 9)),
    # int8 rows of 130 channels: the scales sit at a byte offset no fp32 view takes (copied per call)
    Case("low-latency-unaligned-scales", (Layer("w8a8-int8", "int8", 130, 2, "low-latency", 8),), (7, 1, 5)),
    Case("normal-unaligned-scales", (Layer("w8a8-int8", "int8", 130, 2, "normal"),), (1, 0, 6)),
    Case("auto-switches-modes", (Layer("unquantized", "bf16", 64, 2, "auto", 8),), (3, 12, 0, 8, 20, 1)),
    Case(
        "low-latency-top-k-changes",
        (Layer("unquantized", "bf16", 64, 2, "low-latency", 8),),
        (5, 6, 4, 7),
        top_ks=(2, 3, 2, 3),
    ),
    Case(
        "two-layers-alternate",
        (
            Layer("unquantized", "bf16", 64, 2, "low-latency", 8),
            Layer("w8a8-fp8-block", "fp8", 128, 3, "low-latency", 10),
        ),
        (7, 2, 6),
    ),
    Case("two-normal-layers-alternate", (BF16, Layer("w8a8-fp8-block", "fp8", 128, 3, "normal")), (9, 40, 3)),
]


def build(layer: Layer, vendor: Any) -> tuple[Any, Any]:
    """(dispatcher, dispatch quantizer) of `layer` on the world group."""
    import hal
    import moe

    g = torch.Generator().manual_seed(layer.hidden)
    w13 = torch.randn(EXPERTS, layer.hidden, 32, generator=g) / layer.hidden**0.5
    w2 = torch.randn(EXPERTS, 16, layer.hidden, generator=g) / 4
    config = hal.DispatchConfig(
        dtype=layer.dtype, max_dispatch_tokens_per_rank=layer.capacity, ep_mode="auto" if layer.mode == "auto" else None
    )
    built = moe.MoELayer.from_float(
        w13,
        w2,
        layer.top_k,
        scheme=layer.scheme,
        vendor=vendor,
        dispatch=config,
        process_group=dist.group.WORLD,
        environ={},
    )
    return built.dispatcher, built.scheme.dispatch_quantizer(built.vendor, built.plan, built.expert_weights)


def call_once(
    dispatcher: Any, quantize: Any, x: torch.Tensor, routing: Any, expert_output: Any, asynchronous: bool
) -> dict[str, torch.Tensor]:
    """One dispatch and combine: what the experts got and what came back."""
    out = (
        dispatcher.dispatch_async(x, routing, quantize).wait()
        if asynchronous
        else dispatcher.dispatch(x, routing, quantize)
    )
    payload = out.payload
    y = expert_output(payload.data)
    res = dispatcher.combine_async(y, out, x.dtype).wait() if asynchronous else dispatcher.combine(y, out, x.dtype)
    return {
        "counts": out.expert_counts,
        "res": res,
        "payload": payload.data.contiguous().view(torch.uint8),
        "scale": torch.zeros(0) if payload.scale is None else payload.scale.contiguous(),
    }


def expert_output(rows: torch.Tensor) -> torch.Tensor:
    """A stand-in for the experts: a function of each row's stored values."""
    values = rows.to(torch.float32)
    return values * 0.01 - values.flip(-1) * 0.02


def run(case: Case, rank: int, world: int) -> list[str]:
    """The calls where the long-lived dispatcher differs from a fresh one."""
    import hal
    from moe.routing import Routing

    vendor = hal.get_vendor("cpu")
    kept = [build(layer, vendor) for layer in case.layers]
    differ = []
    for call, base in enumerate(case.tokens):
        for which, layer in enumerate(case.layers):
            tokens, top_k = base + rank, case.top_ks[call] if case.top_ks else layer.top_k
            g = torch.Generator().manual_seed(100 * call + 10 * which + rank)
            x = torch.randn(tokens, layer.hidden, generator=g)
            ids = (
                torch.stack([torch.randperm(EXPERTS, generator=g)[:top_k] for _ in range(tokens)])
                if tokens
                else torch.zeros((0, top_k), dtype=torch.int64)
            )
            routing = Routing(ids, torch.rand(tokens, top_k, generator=g))

            got = call_once(*kept[which], x, routing, expert_output, asynchronous=call % 2 == 1)
            fresh = build(replace(layer, mode="normal", capacity=None), vendor)
            want = call_once(*fresh, x, routing, expert_output, asynchronous=False)
            differ += [f"call {call}, layer {which}: {name}" for name in want if not torch.equal(got[name], want[name])]
    return differ


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.support.gloo_world import worker_main

    raise SystemExit(worker_main(lambda world: CASES, run))
