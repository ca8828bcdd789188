"""The CUDA vendor's decode routing and sort in one launch against two, in one process (an A/B of the layer).

For each shape, scheme and token count: the eager wall time per call (40 back-to-back calls and one
synchronisation, median of 10 rounds, the two modes interleaved) and the GPU time of a captured forward's
replay, with `CudaOps.route_and_sort` off and on; whether the two modes' outputs are equal bit for bit, and
whether each mode's replay equals its eager call. Host speed drifts between processes, so compare only
within one run.

    python scripts/ab_route_sort.py out.json 1,8,64
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import moe

SHAPES = {  # name: hidden, intermediate, experts, top-k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "deepseek-v3-ep8": (7168, 2048, 32, 8),
}


def eager_us(layer: moe.MoELayer, call, rounds: int = 10, calls: int = 40) -> tuple[float, float]:
    """Median wall µs per call with the sort in its own launch and in the routing's, rounds interleaved."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for mode in (True, False) if r % 2 else (False, True):
            layer.vendor.ops.route_and_sort = mode
            call()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
            times[mode].append((time.perf_counter() - start) * 1e6 / calls)
    layer.vendor.ops.route_and_sort = True
    return statistics.median(times[False]), statistics.median(times[True])


def replay_us(layer: moe.MoELayer, call, mode: bool, replays: int = 200) -> tuple[float, torch.Tensor]:
    """GPU µs per replay of the forward captured with `route_and_sort=mode`, and the replay's output."""
    layer.vendor.ops.route_and_sort = mode
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    layer.vendor.ops.route_and_sort = True
    return start.elapsed_time(end) * 1e3 / replays, out.clone()


def main(output: Path, tokens: list[int]) -> None:
    rows = []
    for name, (h, i, e, k) in SHAPES.items():
        torch.manual_seed(0)
        w13 = torch.randn(e, h, 2 * i, device="cuda", dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(e, i, h, device="cuda", dtype=torch.bfloat16) * 0.02
        for scheme in ("unquantized", "fp8"):
            layer = moe.MoELayer.from_float(w13, w2, top_k=k, scheme=scheme, vendor="cuda", launch_plans=None)
            for t in tokens:
                x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
                logits = torch.randn(t, e, device="cuda")
                call = functools.partial(layer, x, logits)
                with torch.no_grad():
                    layer.vendor.ops.route_and_sort = False
                    two_out = call()
                    layer.vendor.ops.route_and_sort = True
                    one_out = call()
                    two, one = eager_us(layer, call)
                    graph_two, replay_two = replay_us(layer, call, False)
                    graph_one, replay_one = replay_us(layer, call, True)
                row = {
                    "shape": name,
                    "scheme": scheme,
                    "tokens": t,
                    "eager_two_us": round(two, 1),
                    "eager_one_us": round(one, 1),
                    "speedup": round(two / one, 3),
                    "graph_two_us": round(graph_two, 1),
                    "graph_one_us": round(graph_one, 1),
                    "equal": bool(torch.equal(two_out, one_out)),
                    "graph_equal": bool(torch.equal(replay_one, one_out) and torch.equal(replay_two, two_out)),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                output.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 8, 64])
