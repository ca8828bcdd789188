"""The error of FP8 layers whose weights a vendor converts at load (its scheme fallbacks), against the float64
layer of the original FP8 weights, on realistic shapes; prints the table docs/ascend.md shows.

    python docs/scripts/fp8_conversion_error.py [--tokens 64] [--shapes deepseek-v3,qwen3-30b-a3b]

Each layer is built with `from_float` from random weights (1/sqrt(fan-in)); "original" is those weights as
the FP8 scheme stores them (`moe.scheme_conversion.as_stored`), computed in float64 with the same routing.
The FP8 layer on the cpu vendor (no conversion: fp8 activations and weights) is shown for scale.
"""

from __future__ import annotations

import argparse
import warnings

import torch

import moe
from conformance import reference
from conformance.reference import relative_error
from moe.scheme_conversion import as_stored
from vendors.ascend.emulation.vendor import EmulatedAscendVendor

#: (experts, hidden, intermediate, top-k): DeepSeek-V3's sizes with 16 of its experts (memory: the float
#: weights, their stored form and four layers are held at once), Qwen3-30B-A3B's whole layer
SHAPES = {"deepseek-v3": (16, 7168, 2048, 8), "qwen3-30b-a3b": (128, 2048, 768, 8)}
CHIPS = {"A3": "Ascend910_9392", "A2": "Ascend910B3", "A5": "Ascend950PR"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--outliers", action="store_true", help="1 %% of the weights 8x larger, as trained ones have")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print("| shape | scheme | vendor | runs as | error vs the original (float64) |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        e, h, i, k = SHAPES[shape]
        gen = torch.Generator().manual_seed(0)
        w13 = torch.randn(e, h, 2 * i, generator=gen) / h**0.5
        w2 = torch.randn(e, i, h, generator=gen) / i**0.5
        if args.outliers:
            for w in (w13, w2):
                w.mul_(torch.where(torch.rand(w.shape, generator=gen) < 0.01, 8.0, 1.0))
        x = torch.randn(args.tokens, h, generator=gen).to(torch.bfloat16)
        logits = torch.randn(args.tokens, e, generator=gen)
        for scheme in ("w8a8-fp8-block", "w8a8-fp8"):
            source = moe.make_scheme(scheme)
            original = [torch.cat([as_stored(source, w[j : j + 1]) for j in range(e)]) for w in (w13, w2)]
            ids, weights = reference.softmax_topk(logits, k)
            exact = reference.moe_by_expert(x, ids, weights, *original)
            vendors = [("cpu", "cpu")] + [(f"ascend-emulated {c}", EmulatedAscendVendor(s)) for c, s in CHIPS.items()]
            if args.outliers:  # A2 and A5 convert the same way as A3
                vendors = vendors[:2]
            for label, vendor in vendors:
                layer = moe.MoELayer.from_float(w13, w2, k, scheme=scheme, vendor=vendor, fused=False)
                error = relative_error(layer(x, logits), exact)
                label = f"{label}, outliers" if args.outliers else label
                print(f"| {shape} | {scheme} | {label} | {layer.scheme.name} | {error:.4f} |", flush=True)


if __name__ == "__main__":
    main()
