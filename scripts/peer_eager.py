"""Eager calls beside the peer: moe-hal's `MoELayer` and SGLang's Triton `fused_moe` kernels, bf16, same inputs, one process.

For each shape and token count: wall time per call of 50 back-to-back calls and one synchronisation (what an
eager caller sees; median of 5 rounds) for the plain layer (its router included), for the peer's two kernels
(routing and block alignment prepared outside the timed calls, which flatters the peer) and for a layer built
with `graphs=moe.GraphConfig()`; then the GPU time of a CUDA-graph replay of the plain layer and of the peer
(median of 100). One JSON line per row; `--output` writes them all as one JSON file.

The peer is the module `sglang_kernel.py` of the peer scripts (`../shared/peer/`, see their README for
fetching SGLang's kernel files into `.peer/sgl`):

    python scripts/peer_eager.py --peer ../shared/peer --tokens 1 8 64 512 4096
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import moe

SHAPES = {  # name: hidden, intermediate, experts, top-k, the peer's config file N (None: its default tiles)
    "qwen3-30b-a3b": (2048, 768, 128, 8, 768),
    "mixtral-8x7b": (4096, 14336, 8, 2, 7168),
    "deepseek-v3-ep8": (7168, 2048, 32, 8, None),
}


def wall_us(fn: Callable[[], object], calls: int = 50, rounds: int = 5) -> float:
    """Median over `rounds` of the wall time per call of `calls` back-to-back calls and one synchronisation."""
    times = []
    for r in range(rounds + 1):  # the first round warms up
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        if r:
            times.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(times)


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """`fn` captured in a CUDA graph (after warm-up on a side stream); returns the replay."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def load_peer(folder: Path):
    """The peer scripts' `sglang_kernel` module."""
    path = folder / "sglang_kernel.py"
    if not path.is_file():
        raise SystemExit(f"peer_eager: no sglang_kernel.py in {folder} (pass --peer, the peer scripts' folder)")
    spec = importlib.util.spec_from_file_location("sglang_kernel", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def rows_for(peer, name: str, tokens: list[int]):
    """Yield one result row per token count of shape `name`."""
    hidden, inter, experts, top_k, config_n = SHAPES[name]
    torch.manual_seed(0)
    w13 = torch.randn(experts, hidden, 2 * inter, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    layer = moe.MoELayer.from_float(w13, w2, top_k=top_k, scheme="unquantized", vendor="cuda")
    replaying = moe.MoELayer.from_float(
        w13, w2, top_k=top_k, scheme="unquantized", vendor="cuda", graphs=moe.GraphConfig()
    )
    p13, p2 = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()  # the peer's [E, N, K] layout
    del w13, w2
    up = peer.load_cfg(experts, config_n) if config_n else None
    down = peer.load_cfg(experts, config_n, down=True) if config_n else None
    for t in tokens:
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(t, experts, device="cuda", dtype=torch.float32)
        probs, ids = torch.topk(torch.softmax(logits, -1), top_k)
        weights = (probs / probs.sum(-1, keepdim=True)).float()
        ids = ids.to(torch.int32)
        prep = peer.sgl_prep(ids, experts, up, down or up)

        def ours():
            return layer(x, logits)

        def theirs():
            return peer.sgl_moe(x, p13, p2, weights, ids, prep)

        with torch.no_grad():
            y, y_replayed, y_peer = ours(), replaying(x, logits), theirs()
            row = {
                "shape": name,
                "tokens": t,
                "hal_eager_us": round(wall_us(ours), 1),
                "peer_eager_us": round(wall_us(theirs), 1),
                "hal_graphconfig_us": round(wall_us(lambda: replaying(x, logits)), 1),
                "hal_replay_us": round(peer.bench(graphed(ours)), 1),
                "peer_replay_us": round(peer.bench(graphed(theirs)), 1),
                "graphconfig_equal": bool(torch.equal(y, y_replayed)),
                "rel_diff_vs_peer": round(float((y.float() - y_peer.float()).norm() / y_peer.float().norm()), 5),
            }
        row["eager_speedup_vs_peer"] = round(row["peer_eager_us"] / row["hal_eager_us"], 2)
        yield row
    del layer, replaying, p13, p2
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", type=Path, default=Path("../shared/peer"), help="the peer scripts' folder")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--output", type=Path, help="write every row to this JSON file")
    args = parser.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        parser.error("--tokens: every count must be >= 1")
    if not torch.cuda.is_available():
        raise SystemExit("peer_eager: needs a CUDA device")
    peer = load_peer(args.peer)
    rows = []
    for name in args.shapes:
        for row in rows_for(peer, name, args.tokens):
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.output:
        args.output.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
