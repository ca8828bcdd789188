"""Where a plain eager forward's host time goes (`launch_plans=None`): wall time per call and a profile of the Python.

For each shape, scheme and token count: the wall time per call of 50 back-to-back calls and one
synchronisation (median of 5 rounds), the host time per call (the same calls timed before the
synchronisation, so the GPU's own time is hidden while the host is the slower side), then one
`cProfile` pass over `--calls` calls whose own time is summed per area of the code (`moe/`, `hal/`,
`vendors/`, torch's Python, Triton, the C calls of torch, ...) and listed for the costliest functions.
cProfile's own overhead inflates every Python call about alike, so read the areas as shares.

    python scripts/profile_host.py --shapes qwen3-30b-a3b --schemes unquantized fp8 --tokens 1 8 --output host.json
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import moe

SHAPES = {  # name: hidden, intermediate, experts, top-k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "deepseek-v3-ep8": (7168, 2048, 32, 8),
}
ROOT = Path(__file__).resolve().parents[1]


def area(filename: str) -> str:
    """The part of the code a profiled function belongs to."""
    if filename.startswith(("~", "<built-in")):
        return "C calls"
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
        return "/".join(rel.parts[:2]) if rel.parts[0] == "vendors" else rel.parts[0]
    except ValueError:
        pass
    for name in ("triton", "torch"):
        if f"/{name}/" in filename:
            return name
    return "other Python"


def timed(fn, calls: int = 50, rounds: int = 5) -> tuple[float, float]:
    """Median wall and host µs per call over `rounds` of `calls` back-to-back calls."""
    walls, hosts = [], []
    for r in range(rounds + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        if r:
            walls.append((time.perf_counter() - start) * 1e6 / calls)
            hosts.append((issued - start) * 1e6 / calls)
    return statistics.median(walls), statistics.median(hosts)


def profile(fn, calls: int, top: int) -> dict:
    """Own time per area and the costliest functions, µs per call (cProfile's clock)."""
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    areas: dict[str, float] = defaultdict(float)
    rows = []
    for (filename, line, name), (_, ncalls, own, cumulative, _) in stats.items():
        areas[area(filename)] += own
        where = name if filename.startswith("~") else f"{Path(filename).name}:{line}({name})"
        rows.append((own, cumulative, ncalls, where))
    rows.sort(reverse=True)
    per_call = 1e6 / calls
    return {
        "areas_us": {k: round(v * per_call, 1) for k, v in sorted(areas.items(), key=lambda kv: -kv[1])},
        "top": [
            {"own_us": round(o * per_call, 2), "cum_us": round(c * per_call, 2), "calls": n / calls, "fn": w}
            for o, c, n, w in rows[:top]
        ],
    }


class StageClock:
    """Inclusive host time per call of the layer's hal calls, of the ops behind them and of the kernel
    launches (each wrapped on the instance or module for the measurement only): checks = hal - ops."""

    VENDOR = ("softmax_topk", "sort_by_expert", "quantize", "grouped_matmul", "weighted_combine", "swiglu")
    OPS = (
        "softmax_topk",
        "sort_by_expert",
        "sort_by_expert_tokens",
        "quantize",
        "grouped_matmul",
        "grouped_matmul_gathered",
        "grouped_matmul_activated",
        "weighted_combine",
        "swiglu",
    )

    def __init__(self, layer: moe.MoELayer) -> None:
        import importlib

        self.totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        vendor = layer.vendor
        self._undo: list = []
        for name in self.VENDOR:
            self._wrap(vendor, name, f"hal.{name}")
        for name in self.OPS:
            self._wrap(vendor.ops, name, f"ops.{name}")
        for module in ("routing", "sorting", "quantize", "grouped_gemm", "grouped_gemm_tma", "combine", "activation"):
            try:
                self._wrap(importlib.import_module(f"vendors.cuda.kernels.{module}"), "launch", "launch")
            except ImportError:  # no Triton: a vendor without these kernels
                continue
        self._wrap(torch, "empty", "torch.empty")

    def _wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name, None)
        if inner is None:
            return
        totals = self.totals[label]
        clock = time.perf_counter

        def timed(*args, **kwargs):
            start = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[0] += 1
                totals[1] += clock() - start

        had = name in vars(owner)
        setattr(owner, name, timed)
        self._undo.append((owner, name, inner, had))

    def restore(self) -> None:
        for owner, name, inner, had in reversed(self._undo):
            if had:
                setattr(owner, name, inner)
            else:
                delattr(owner, name)


def stages(layer: moe.MoELayer, fn, calls: int) -> dict:
    """Inclusive µs per forward of each wrapped stage (the wrappers add about a call each)."""
    clock = StageClock(layer)
    try:
        for _ in range(5):
            fn()
        for totals in clock.totals.values():
            totals[:] = [0, 0.0]
        torch.cuda.synchronize()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    finally:
        clock.restore()
    return {k: {"calls": n / calls, "us": round(t * 1e6 / calls, 1)} for k, (n, t) in clock.totals.items() if n}


def kernels(fn, calls: int = 10) -> dict:
    """torch.profiler's view of `calls` calls: the GPU kernels and the costliest CPU-side ops, per call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    cpu = sorted((e for e in events if e not in gpu), key=lambda e: -e.self_cpu_time_total)
    return {
        "kernels": {e.key[:80]: e.count / calls for e in gpu},
        "cpu_ops": [
            {"op": e.key[:80], "self_us": round(e.self_cpu_time_total / calls, 1), "calls": e.count / calls}
            for e in cpu[:15]
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["qwen3-30b-a3b"])
    parser.add_argument("--schemes", nargs="+", default=["unquantized", "fp8"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--calls", type=int, default=200, help="calls under the profiler")
    parser.add_argument("--top", type=int, default=25, help="functions listed per row")
    parser.add_argument("--quick", action="store_true", help="wall and host time only (no profiles)")
    parser.add_argument("--output", type=Path, help="write every row to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_host: needs a CUDA device")
    rows = []
    for name in args.shapes:
        hidden, inter, experts, top_k = SHAPES[name]
        torch.manual_seed(0)
        w13 = torch.randn(experts, hidden, 2 * inter, device="cuda", dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(experts, inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        for scheme in args.schemes:
            layer = moe.MoELayer.from_float(w13, w2, top_k=top_k, scheme=scheme, vendor="cuda", launch_plans=None)
            for t in args.tokens:
                x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
                logits = torch.randn(t, experts, device="cuda", dtype=torch.float32)
                with torch.no_grad():
                    call = functools.partial(layer, x, logits)
                    wall, host = timed(call)
                    row = {"shape": name, "scheme": scheme, "tokens": t, "wall_us": round(wall, 1)}
                    row["host_us"] = round(host, 1)
                    if not args.quick:
                        row |= profile(call, args.calls, args.top) | kernels(call)
                        row["stages"] = stages(layer, call, args.calls)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del layer
        del w13, w2
        torch.cuda.empty_cache()
    if args.output:
        args.output.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
