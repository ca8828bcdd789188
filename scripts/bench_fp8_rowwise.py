"""Row-wise fp8 experts on Hopper: torch._scaled_grouped_mm against the Triton grouped GEMM (GPU only).

Two tables, CUDA-graph replay medians:
- `--crossover`: the vendor's call per projection at a number of rows per expert, with torch's kernel forced
  on and off (first projections gathered through the dispatch's index, SiLU-GLU applied, as the layer calls them);
- the layers (default): `moe.MoELayer` per scheme (bf16, row-wise fp8 as shipped and with the Triton kernel
  only, fp8 block-128) at each token count.

    PYTHONPATH=. python scripts/bench_fp8_rowwise.py --tokens 512 4096 16384 --json out.json
    PYTHONPATH=. python scripts/bench_fp8_rowwise.py --crossover 64 128 256
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch

import moe
from hal import ActivationKind, DispatchDtype, Groups
from scripts.peer_eager import graphed  # the same capture
from vendors.cuda import CudaVendor, torch_grouped

SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "deepseek-v3-ep8": (7168, 2048, 32, 8),
}
SCHEMES = ("unquantized", "w8a8-fp8", "w8a8-fp8-block")


def replay_us(fn, reps: int = 15) -> float:
    """Median µs of one CUDA-graph replay of `fn`, each replay queued behind a short device sleep."""
    replay = graphed(fn)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(40_000)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def crossover(vendor: CudaVendor, per_expert: list[int]) -> list[dict]:
    """Each projection of each shape at `per_expert` rows per expert: torch's kernel against the Triton one."""
    rows, ops, dev = [], vendor.ops, vendor.device
    for name, (h, i, experts, top_k) in SHAPES.items():
        for proj, (k, n, gated) in {"gate/up": (h, 2 * i, True), "down": (i, h, False)}.items():
            w = vendor.quantize_weight(
                torch.randn(experts, k, n, device=dev) / k**0.5, "per-channel", torch.float8_e4m3fn
            )
            for per in per_expert:
                tokens = per * experts // top_k
                picks = torch.randn(tokens, experts, device=dev).topk(top_k, dim=1).indices.flatten()
                groups = Groups.from_counts(torch.bincount(picks, minlength=experts))
                index = torch.sort(picks, stable=True).indices // top_k
                x = torch.randn(tokens if gated else tokens * top_k, k, device=dev).bfloat16()
                xq = vendor.quantize(x, DispatchDtype.FP8, layout="per-token")
                extra = {"activation": ActivationKind.SILU_GLU, "row_index": index} if gated else {}
                call = functools.partial(vendor.grouped_matmul, xq, w, groups, **extra)
                saved, torch_grouped.SCALED_GROUPED_MM_MIN_ROWS_PER_GROUP = (
                    torch_grouped.SCALED_GROUPED_MM_MIN_ROWS_PER_GROUP,
                    0,
                )
                try:
                    ops.torch_scaled_grouped_mm = True
                    fast, fast_us = call().clone(), replay_us(call)
                    ops.torch_scaled_grouped_mm = False
                    exact, triton_us = call().clone(), replay_us(call)
                finally:
                    torch_grouped.SCALED_GROUPED_MM_MIN_ROWS_PER_GROUP = saved
                    ops.torch_scaled_grouped_mm = True
                row = {"shape": name, "projection": proj, "rows_per_expert": per, "torch_us": round(fast_us, 1),
                       "triton_us": round(triton_us, 1), "speed_up": round(triton_us / fast_us, 2),
                       "rel_diff": float(f"{relative(fast, exact):.2e}")}  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
            torch.cuda.empty_cache()
    return rows


def layers(vendor: CudaVendor, tokens: list[int]) -> list[dict]:
    """The layer per scheme at each token count; row-wise fp8 also with the Triton kernel only."""
    rows, ops, dev = [], vendor.ops, vendor.device
    for name, (h, i, experts, top_k) in SHAPES.items():
        w13, w2 = torch.randn(experts, h, 2 * i, device=dev) / h**0.5, torch.randn(experts, i, h, device=dev) / i**0.5
        built = {s: moe.MoELayer.from_float(w13, w2, top_k, scheme=s, vendor=vendor) for s in SCHEMES}
        for t in tokens:
            x, logits = torch.randn(t, h, device=dev).bfloat16(), torch.randn(t, experts, device=dev)
            row = {"shape": name, "tokens": t}
            for scheme, layer in built.items():
                row[f"{scheme}_us"] = round(replay_us(functools.partial(layer, x, logits)), 1)
            shipped = built["w8a8-fp8"](x, logits)
            ops.torch_scaled_grouped_mm = False
            try:
                triton_only = built["w8a8-fp8"](x, logits)
                row["w8a8-fp8 triton-only_us"] = round(replay_us(functools.partial(built["w8a8-fp8"], x, logits)), 1)
            finally:
                ops.torch_scaled_grouped_mm = True
            row["rel_diff"] = float(f"{relative(shipped, triton_only):.2e}")
            row["fp8-rowwise vs bf16"] = round(row["unquantized_us"] / row["w8a8-fp8_us"], 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
        torch.cuda.empty_cache()
    return rows


def write_rows(path: str | None, rows: list[dict]) -> None:
    """The rows, with the device and torch they ran on, as JSON at `path` (None: nowhere)."""
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096, 16384])
    parser.add_argument("--crossover", type=int, nargs="+", metavar="ROWS_PER_EXPERT")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    vendor = CudaVendor()
    if not vendor.ops.torch_scaled_grouped_mm:
        raise SystemExit("torch._scaled_grouped_mm does not serve this device (sm90 only)")
    rows = crossover(vendor, args.crossover) if args.crossover else layers(vendor, args.tokens)
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
