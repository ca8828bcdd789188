"""Eager calls with and without launch plans, one process, same layer and inputs (CUDA).

For each shape, precision and token count: wall time per call of 50 back-to-back calls and one synchronisation
(median of `--rounds` rounds, the two modes interleaved) for the layer as built (`launch_plans`: the default) and
with its plans turned off (the plain eager forward); the GPU time of a CUDA-graph replay of the plain forward
(median of 100); whether the plan was used and whether its outputs equal the plain forward's bit for bit.
`--compiled` adds the wall time of `torch.compile(layer)` and of `torch.compile(layer, mode="reduce-overhead")`
(the layer as built, so the compiled op's calls take the plans too) and whether their outputs are equal.
One JSON line per row; `--output` also writes them as one JSON file.

    PYTHONPATH=. python scripts/ab_launch_plans.py --tokens 1 8 64 512 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import moe
from scripts.peer_eager import graphed  # the same capture

SHAPES = {  # name: hidden, intermediate, experts, top-k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "deepseek-v3-ep8": (7168, 2048, 32, 8),
}
PRECISIONS = {"bf16": "unquantized", "fp8": "w8a8-fp8-block", "int8": "w8a8-int8"}


def _wall(fn: Callable[[], object], calls: int = 50) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / calls


def _graph_us(fn: Callable[[], object]) -> float:
    replay = graphed(fn)
    times = []
    for _ in range(100):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _row(
    layer: moe.MoELayer, name: str, precision: str, tokens: int, rounds: int, compiled: dict[str, Callable]
) -> dict[str, object]:
    hidden, _, experts, _ = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, device="cuda", generator=g)
    planned = layer._graphs  # the layer's launch plans; None while timing the plain forward
    plain_out = None
    with torch.no_grad():
        layer._graphs = None
        plain_out = layer(x, logits)
        layer._graphs = planned
        known = set(planned._graphs) if planned is not None else set()
        refused_before = planned.refusals() if planned is not None else {}
        outs = [layer(x, logits) for _ in range(4)]  # recorded at the second call, its check read later
        same = all(torch.equal(o, plain_out) for o in outs)
        plans = [p for key, p in planned._graphs.items() if key not in known] if planned is not None else []
        used = any(getattr(p, "usable", False) for p in plans)  # this row's signature only
        refusals = {
            reason: count - refused_before.get(reason, 0)
            for reason, count in (planned.refusals() if planned is not None else {}).items()
            if count > refused_before.get(reason, 0)
        }
        on, off = [], []
        for _ in range(rounds):
            on.append(_wall(lambda: layer(x, logits)))
            layer._graphs = None
            off.append(_wall(lambda: layer(x, logits)))
            layer._graphs = planned
        layer._graphs = None
        graph = _graph_us(lambda: layer(x, logits))
        layer._graphs = planned
        extra: dict[str, object] = {}
        for mode, fn in compiled.items():
            outs = [fn(x, logits).clone() for _ in range(3)]
            extra[f"{mode}_equal"] = all(torch.equal(o, plain_out) for o in outs)
            extra[f"{mode}_us"] = round(statistics.median(_wall(lambda fn=fn: fn(x, logits)) for _ in range(rounds)), 1)
    return {
        "shape": name,
        "precision": precision,
        "tokens": tokens,
        "plain_eager_us": round(statistics.median(off), 1),
        "planned_eager_us": round(statistics.median(on), 1),
        "graph_us": round(graph, 1),
        "speedup": round(statistics.median(off) / statistics.median(on), 2),
        "planned_vs_graph": round(statistics.median(on) / graph, 2),
        "plan_used": used,
        "equal": same,
        "refusals": refusals,
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8"], choices=list(PRECISIONS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 512])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--compiled", action="store_true", help="also time torch.compile(layer), both modes")
    args = parser.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}; wall µs per call (50 back-to-back), medians of {args.rounds} rounds")
    print("| shape | prec | tokens | plain eager | planned eager | speed-up | graph replay | planned / graph | equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        hidden, inter, experts, top_k = SHAPES[name]
        g = torch.Generator().manual_seed(0)
        w13 = (torch.randn(experts, hidden, 2 * inter, generator=g) * 0.02).to(torch.bfloat16)
        w2 = (torch.randn(experts, inter, hidden, generator=g) * 0.02).to(torch.bfloat16)
        for precision in args.precisions:
            layer = moe.MoELayer.from_float(w13.cuda(), w2.cuda(), top_k, scheme=PRECISIONS[precision], vendor="cuda")
            compiled = (
                {
                    "compile": torch.compile(layer, dynamic=False),
                    "reduce_overhead": torch.compile(layer, dynamic=False, mode="reduce-overhead"),
                }
                if args.compiled
                else {}
            )
            for tokens in args.tokens:
                row = _row(layer, name, precision, tokens, args.rounds, compiled)
                rows.append(row)
                print(json.dumps(row), flush=True)
                print(
                    f"| {name} | {precision} | {tokens} | {row['plain_eager_us']} | {row['planned_eager_us']} | "
                    f"{row['speedup']}x | {row['graph_us']} | {row['planned_vs_graph']} | "
                    f"{row['equal']}{'' if row['plan_used'] else ' (no plan)'} |",
                    flush=True,
                )
            del layer
            torch.cuda.empty_cache()
    if args.output is not None:
        args.output.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
