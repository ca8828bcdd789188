"""fp8 block-128 experts on Hopper: the layer on DeepGEMM against its Triton-only run and bf16 (GPU only).

CUDA-graph replay medians of `moe.MoELayer` per shape and token count: bf16, `w8a8-fp8-block` on the Triton
kernels (`CudaVendor(deep_gemm=False)`), with DeepGEMM where installed (`docs/deep-gemm.md`) as the vendor's
table and built-in rule take it, and with DeepGEMM forced on both projections (table entries naming it at each
token count's rows): where "forced" wins, a `deep-gemm` table entry pays.

    PYTHONPATH=. python scripts/bench_fp8_block.py --tokens 512 4096 16384 --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

import moe
from scripts.bench_fp8_rowwise import SHAPES, relative, replay_us, write_rows
from vendors.cuda import CudaVendor
from vendors.cuda.tuning import DEEP_GEMM, Choice, TuningTable, problem_key


def layers(tokens: list[int], shapes: list[str]) -> list[dict]:
    """Each shape's layer per scheme and runner at each token count."""
    with_dg, without = CudaVendor(), CudaVendor(deep_gemm=False)
    if with_dg.ops.deep_gemm is None:
        raise SystemExit(
            f"DeepGEMM does not serve here: {[n for n in with_dg.capabilities().notes if 'DeepGEMM' in n]}"
        )
    rows, dev = [], with_dg.device
    shipped = with_dg.ops.tuning
    for name in shapes:
        h, i, experts, top_k = SHAPES[name]
        w13, w2 = torch.randn(experts, h, 2 * i, device=dev) / h**0.5, torch.randn(experts, i, h, device=dev) / i**0.5
        bf16 = moe.MoELayer.from_float(w13, w2, top_k, scheme="unquantized", vendor=with_dg)
        deep = moe.MoELayer.from_float(w13, w2, top_k, scheme="w8a8-fp8-block", vendor=with_dg)
        triton = moe.MoELayer.from_float(w13, w2, top_k, scheme="w8a8-fp8-block", vendor=without)
        table = forced_table(shipped, experts, h, i, [t * top_k for t in tokens])
        forced = moe.MoELayer.from_float(w13, w2, top_k, scheme="w8a8-fp8-block", vendor=CudaVendor(tuning=table))
        for t in tokens:
            x, logits = torch.randn(t, h, device=dev).bfloat16(), torch.randn(t, experts, device=dev)
            row = {"shape": name, "tokens": t}
            runs = (("bf16", bf16), ("fp8-block triton", triton), ("fp8-block deep-gemm", deep), ("forced", forced))
            for label, layer in runs:
                row[f"{label} us"] = round(replay_us(functools.partial(layer, x, logits)), 1)
            row["deep-gemm vs bf16"] = round(row["bf16 us"] / row["fp8-block deep-gemm us"], 2)
            row["deep-gemm vs triton"] = round(row["fp8-block triton us"] / row["fp8-block deep-gemm us"], 2)
            row["rel_diff"] = float(f"{relative(deep(x, logits), triton(x, logits)):.2e}")
            print(json.dumps(row), flush=True)
            rows.append(row)
        torch.cuda.empty_cache()
    return rows


def forced_table(shipped: TuningTable | None, experts: int, h: int, i: int, rows: list[int]) -> TuningTable:
    """The shipped table with `deep-gemm` entries for the shape's two fp8 block-128 problems at `rows`."""
    entries = {key: dict(by_rows) for key, by_rows in (shipped.entries if shipped else {}).items()}
    for key in (problem_key("fp8-block128", experts, h, 2 * i, "silu-glu"), problem_key("fp8-block128", experts, i, h)):
        entries.setdefault(key, {}).update({m: Choice(DEEP_GEMM) for m in rows})
    return TuningTable(shipped.device if shipped else "any", entries, {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096, 16384])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = layers(args.tokens, args.shapes)
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
