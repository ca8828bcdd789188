"""gpt-oss-20b's experts as its layers run them (swiglu-oai, a bias on both projections), MXFP4 weights, on a GPU.

The bias and the activation in the FP4 kernel's epilogue (the CUDA vendor's `grouped_matmul_biased`) against
the default composition (`hal.VendorOps.grouped_matmul_biased`: the rows gathered, the product, the reference's
bias, the reference's activation): the experts' path (sort, both projections, combine), CUDA-graph replays of
4 layers with their own weights, per layer, and the relative difference of the two outputs.

    PYTHONPATH=. python scripts/bench_fp4_bias_epilogue.py 1,8,64,512,4096
"""

from __future__ import annotations

import sys

import torch

from hal import Activation, GemmKind, Groups, VendorOps
from scripts.bench_fp4_weight_only import LAYERS, replay_us  # the same replays, per layer
from vendors.cuda import CudaVendor

E, TOP_K, H, I = 32, 4, 2880, 2880


def main() -> None:
    vendor = CudaVendor()
    ops = vendor.ops
    g = torch.Generator(device="cuda").manual_seed(0)
    oai = Activation("swiglu-oai")
    layers = []
    for _ in range(LAYERS):
        w1 = vendor.quantize_weight(torch.randn(E, H, 2 * I, device="cuda", generator=g) * 0.02, "block-32")
        w2 = vendor.quantize_weight(torch.randn(E, I, H, device="cuda", generator=g) * 0.02, "block-32")
        b1 = (torch.randn(E, 2 * I, device="cuda", generator=g) * 0.1).bfloat16()
        b2 = (torch.randn(E, H, device="cuda", generator=g) * 0.1).bfloat16()
        layers.append((w1, w2, b1, b2))
    kind = GemmKind.BF16_MXFP4
    for T in [int(t) for t in sys.argv[1].split(",")]:
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        ids = torch.rand(T, E, device="cuda", generator=g).topk(TOP_K, dim=1).indices
        weights = torch.softmax(torch.randn(T, TOP_K, device="cuda", generator=g), dim=1)

        def layer(i, biased):
            w1, w2, b1, b2 = layers[i]
            _, inverse, counts, tok = ops.sort_by_expert_tokens(ids, num_experts=E)
            groups = Groups.from_counts(counts)
            h = biased(ops, x, w1, groups, b1, kind=kind, out_dtype=torch.bfloat16, activation=oai, row_index=tok)
            y = biased(ops, h, w2, groups, b2, kind=kind, out_dtype=torch.bfloat16, activation=None, row_index=None)
            return ops.weighted_combine(y, inverse, weights, out_dtype=torch.bfloat16)

        fused = type(ops).grouped_matmul_biased
        composed = VendorOps.grouped_matmul_biased
        a, b = layer(0, fused).float(), layer(0, composed).float()
        diff = ((a - b).norm() / b.norm()).item()
        tf = replay_us(lambda: [layer(i, fused) for i in range(LAYERS)])
        tc = replay_us(lambda: [layer(i, composed) for i in range(LAYERS)])
        print(
            f"T={T}: epilogue {tf:.1f} us, composed {tc:.1f} us, speed-up {tc / tf:.2f}x, rel diff {diff:.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
