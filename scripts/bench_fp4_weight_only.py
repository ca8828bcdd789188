"""Weight-only 4-bit experts (MXFP4 / NVFP4 weights, bf16 activations) against the bf16 experts on a GPU.

gpt-oss-20b's MoE shape (32 experts, top-4, hidden 2880, intermediate 2880): the experts' path of the
layer (sort by expert, first projection with SiLU-GLU reading the tokens through the dispatch's index,
second projection, weighted combine), CUDA-graph replays of `LAYERS` layers with their own weights (so
no layer's weights are still in L2), per layer. "roofline": the bytes of the touched experts' weights
(with their scales) and of the GEMMs' activations read, over the GPU's HBM bandwidth (`PEAKS`), as a share of
the time.

    PYTHONPATH=. python scripts/bench_fp4_weight_only.py [--sweep] [--one-share]
"""

from __future__ import annotations

import statistics
import sys

import torch

from hal import Activation, GemmKind, Groups, QuantizedWeight, ScaleLayout
from tests.support.fp4_weights import Fp4Weights, grouped_reference
from vendors.cuda import CudaVendor
from vendors.cuda.kernels.grouped_gemm import TileConfig
from vendors.cuda.kernels.grouped_gemm_fp4 import Fp4Tiles, default_fp4_tiles, grouped_gemm_fp4

E, TOP_K, H, I = 32, 4, 2880, 2880
LAYERS = 4
#: K shares of the FP4 GEMMs: the decode rule the CUDA vendor applies by default (None), or 1 with
#: `--one-share` (`CudaVendor(split_fp4_decode=False)`).
SPLIT_K = 1 if "--one-share" in sys.argv else None
#: HBM bytes per second of the GPUs measured (the H100 SXM's 3.35 TB/s for any other).
PEAKS = {"H200": 4.8e12, "H100": 3.35e12}
TOKENS = (1, 8, 64, 512, 4096)
DEV = "cuda"


def fp4_weights(k: int, n: int, mx: bool, seed: int) -> Fp4Weights:
    g = torch.Generator(device=DEV).manual_seed(seed)
    data = torch.randint(0, 256, (E, k // 2, n), generator=g, device=DEV, dtype=torch.int32).to(torch.uint8)
    if mx:
        scale = torch.randint(118, 124, (E, k // 32, n), generator=g, device=DEV, dtype=torch.int32).to(torch.uint8)
        return Fp4Weights(data, scale, None, True)
    scale = (torch.rand((E, k // 16, n), generator=g, device=DEV) * 2 + 0.5).to(torch.float8_e4m3fn)
    return Fp4Weights(data, scale, torch.full((E,), 64.0, device=DEV), False)


def replay_us(fn, reps: int = 20) -> float:
    """Median time of one graph replay of `fn` over `LAYERS` layers, per layer (µs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / LAYERS)
    return statistics.median(times)


def timed(fn) -> float:
    """`replay_us(fn)`, or infinity where it fails (printed: a candidate out of shared memory, a decode that
    does not compile)."""
    try:
        return replay_us(fn)
    except Exception as exc:  # noqa: BLE001
        print("  failed:", type(exc).__name__, str(exc)[:300], flush=True)
        return float("inf")


def candidates(per_group: float) -> tuple[list[Fp4Tiles], list[Fp4Tiles]]:
    """Configurations of the first (gated) and second projections to try at `per_group` rows per expert
    (`[block_m, block_n, block_k, warps, stages(, n_fastest, group_m)]`, interleave)."""
    if per_group <= 16:
        gated = [
            ((16, 64, 128, 4, 4), False),
            ((16, 64, 64, 4, 4), False),
            ((16, 32, 128, 4, 4), False),
            ((16, 64, 128, 4, 5), False),
            ((16, 64, 128, 8, 4), False),
        ]
        plain = [
            ((16, 128, 128, 4, 3), False),
            ((16, 64, 128, 4, 4), False),
            ((16, 128, 64, 4, 4), False),
            ((16, 128, 128, 4, 4), False),
            ((16, 256, 64, 8, 3), False),
        ]
    elif per_group <= 96:
        gated = [
            ((64, 128, 64, 4, 3), False),
            ((64, 64, 64, 4, 3), False),
            ((64, 64, 128, 4, 3), True),
            ((32, 128, 64, 4, 3), False),
            ((64, 128, 64, 4, 4), False),
        ]
        plain = [
            ((64, 128, 64, 4, 3), False),
            ((64, 64, 128, 4, 3), True),
            ((64, 128, 64, 4, 4), False),
            ((128, 128, 64, 8, 3), True),
            ((64, 256, 64, 8, 3), False),
        ]
    else:
        gated = [
            ((128, 128, 64, 8, 3), False),
            ((128, 64, 64, 4, 3), True),
            ((256, 64, 64, 8, 3), True),
            ((128, 128, 64, 8, 4), False),
            ((128, 128, 64, 8, 3, 1), False),
            ((64, 128, 64, 4, 4), False),
        ]
        plain = [
            ((256, 128, 64, 8, 3), True),
            ((128, 64, 64, 4, 3), True),
            ((256, 64, 64, 8, 3), True),
            ((256, 128, 64, 8, 4), True),
            ((256, 128, 64, 8, 3, 1), True),
            ((128, 128, 64, 8, 4, 1), True),
        ]
    return (
        [Fp4Tiles(TileConfig.from_list(list(c)), il) for c, il in gated],
        [Fp4Tiles(TileConfig.from_list(list(c)), il) for c, il in plain],
    )


def measure(tokens, ops, act, bf16, fp4, per_expert, sweep):
    """One row of the table: timings and errors at `tokens` tokens."""
    g = torch.Generator(device=DEV).manual_seed(tokens)
    x = torch.randn(tokens, H, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.rand(tokens, E, device=DEV, generator=g).topk(TOP_K, dim=1).indices
    weights = torch.softmax(torch.randn(tokens, TOP_K, device=DEV, generator=g), dim=1)
    touched = int(torch.unique(ids).numel())
    rows = tokens * TOP_K

    def sort():
        return ops.sort_by_expert_tokens(ids, num_experts=E)

    def bf16_layer(i):
        _, inverse, counts, tok = sort()
        groups = Groups.from_counts(counts)
        w1, w2 = bf16[i]
        h = ops.grouped_matmul_gathered(
            x, tok, w1, groups, kind=GemmKind.BF16, out_dtype=torch.bfloat16, activation=act
        )
        y = ops.grouped_matmul(h, w2, groups, kind=GemmKind.BF16, out_dtype=torch.bfloat16)
        return ops.weighted_combine(y, inverse, weights, out_dtype=torch.bfloat16)

    def fp4_layer(i, mx, t1=None, t2=None, f1=False, f2=False):
        _, inverse, counts, tok = sort()
        w1, w2 = fp4[mx][i]
        h = grouped_gemm_fp4(
            x,
            w1.data,
            w1.scale,
            counts,
            torch.bfloat16,
            mx=mx,
            global_scale=w1.global_scale,
            gated=True,
            row_index=tok,
            config=t1.tiles,
            interleave=t1.interleave,
            pdl=ops.pdl,
            asm_decode=f1,
            split_k=SPLIT_K,
        )
        y = grouped_gemm_fp4(
            h,
            w2.data,
            w2.scale,
            counts,
            torch.bfloat16,
            mx=mx,
            global_scale=w2.global_scale,
            config=t2.tiles,
            interleave=t2.interleave,
            pdl=ops.pdl,
            asm_decode=f2,
            split_k=SPLIT_K,
        )
        return ops.weighted_combine(y, inverse, weights, out_dtype=torch.bfloat16)

    # GEMMs alone: tile sweep (MXFP4), default tiles
    _, inverse, counts, tok = sort()
    h = torch.randn(rows, I, device=DEV).to(torch.bfloat16)

    def gemm1(mx, cfg, asm=False):
        return lambda: [
            grouped_gemm_fp4(
                x,
                w1.data,
                w1.scale,
                counts,
                torch.bfloat16,
                mx=mx,
                global_scale=w1.global_scale,
                gated=True,
                row_index=tok,
                config=cfg.tiles,
                interleave=cfg.interleave,
                pdl=ops.pdl,
                asm_decode=asm,
                split_k=SPLIT_K,
            )
            for w1, _ in fp4[mx]
        ]

    def gemm2(mx, cfg, asm=False):
        return lambda: [
            grouped_gemm_fp4(
                h,
                w2.data,
                w2.scale,
                counts,
                torch.bfloat16,
                mx=mx,
                global_scale=w2.global_scale,
                config=cfg.tiles,
                interleave=cfg.interleave,
                pdl=ops.pdl,
                asm_decode=asm,
                split_k=SPLIT_K,
            )
            for _, w2 in fp4[mx]
        ]

    d1, d2 = default_fp4_tiles(rows, E, True), default_fp4_tiles(rows, E, False)
    runs1 = [(d1, f, timed(gemm1(True, d1, f))) for f in (False, True)]
    runs2 = [(d2, f, timed(gemm2(True, d2, f))) for f in (False, True)]
    best1, best2 = min(runs1, key=lambda r: r[2]), min(runs2, key=lambda r: r[2])
    print(
        f"tokens {tokens}: MXFP4 GEMMs at the default tiles, Triton / PTX decode: gemm1 {runs1[0][2]:.1f} / "
        f"{runs1[1][2]:.1f} us, gemm2 {runs2[0][2]:.1f} / {runs2[1][2]:.1f} us",
        flush=True,
    )
    if sweep:
        print(f"tokens {tokens}: default gemm1 {d1}, gemm2 {d2}", flush=True)
        c1, c2 = candidates(rows / E)
        for cands, which in ((c1, 1), (c2, 2)):
            for cfg in cands:
                for asm in (True,):
                    t = timed(gemm1(True, cfg, asm) if which == 1 else gemm2(True, cfg, asm))
                    if which == 1 and t < best1[2]:
                        best1 = (cfg, asm, t)
                    if which == 2 and t < best2[2]:
                        best2 = (cfg, asm, t)
        print(
            f"tokens {tokens}: best gemm1 {best1[0]} asm={best1[1]} {best1[2]:.1f} us, "
            f"gemm2 {best2[0]} asm={best2[1]} {best2[2]:.1f} us",
            flush=True,
        )
    gemm_mx = best1[2] + best2[2]
    gemm_nv = timed(gemm1(False, best1[0], best1[1])) + timed(gemm2(False, best2[0], best2[1]))

    def bf16_gemms():
        counts_g = Groups.from_counts(counts)
        for w1, w2 in bf16:
            ops.grouped_matmul_gathered(
                x, tok, w1, counts_g, kind=GemmKind.BF16, out_dtype=torch.bfloat16, activation=act
            )
            ops.grouped_matmul(h, w2, counts_g, kind=GemmKind.BF16, out_dtype=torch.bfloat16)

    gemm_bf16 = replay_us(bf16_gemms)
    layer_bf16 = replay_us(lambda: [bf16_layer(i) for i in range(LAYERS)])
    layer_mx = replay_us(lambda: [fp4_layer(i, True, best1[0], best2[0], best1[1], best2[1]) for i in range(LAYERS)])
    layer_nv = timed(lambda: [fp4_layer(i, False, best1[0], best2[0], best1[1], best2[1]) for i in range(LAYERS)])
    # correctness against float64 (layer 0, both formats)
    errs = {}
    if tokens in (8, 512):
        _, inverse, counts, tok = sort()
        cl = counts.tolist()
        for mx in (True, False):
            w1, w2 = fp4[mx][0]
            h64 = grouped_reference(x, w1.values(), cl, gated=True, row_index=tok)
            y64 = grouped_reference(h64, w2.values(), cl)
            out64 = (y64[inverse].reshape(tokens, TOP_K, H) * weights.double()[..., None]).sum(1)
            del h64, y64
            try:
                out = fp4_layer(0, mx, best1[0], best2[0], best1[1], best2[1]).double()
            except Exception as exc:  # noqa: BLE001
                print("  failed:", type(exc).__name__, str(exc)[:300], flush=True)
                continue
            errs[mx] = (torch.linalg.norm(out - out64) / torch.linalg.norm(out64)).item()

    act_bytes = tokens * H * 2 + rows * I * 2

    peak = next((v for k, v in PEAKS.items() if k in torch.cuda.get_device_name()), PEAKS["H100"])
    roof = {kind: (touched * per_expert[kind] + act_bytes) / peak * 1e8 for kind in per_expert}  # % x µs

    print(f"tokens {tokens}: bf16 layer {layer_bf16:.1f} us, mxfp4 {layer_mx:.1f}, nvfp4 {layer_nv:.1f}", flush=True)
    return (tokens, touched, gemm_bf16, gemm_mx, gemm_nv, layer_bf16, layer_mx, layer_nv, roof, errs)


def main() -> None:
    sweep = "--sweep" in sys.argv
    vendor = CudaVendor()
    ops = vendor.ops
    print(torch.cuda.get_device_name(), torch.__version__)
    act = Activation()
    bf16 = [
        (
            QuantizedWeight(torch.randn(E, H, 2 * I, device=DEV, dtype=torch.bfloat16) * 0.02, ScaleLayout.NONE),
            QuantizedWeight(torch.randn(E, I, H, device=DEV, dtype=torch.bfloat16) * 0.02, ScaleLayout.NONE),
        )
        for _ in range(LAYERS)
    ]
    fp4 = {
        mx: [(fp4_weights(H, 2 * I, mx, 2 * i), fp4_weights(I, H, mx, 2 * i + 1)) for i in range(LAYERS)]
        for mx in (True, False)
    }

    def expert_bytes(w1, w2) -> float:
        return sum(t.numel() * t.element_size() for t in (w1.data, w1.scale, w2.data, w2.scale)) / E

    per_expert = {
        "bf16": 2 * (H * 2 * I + I * H),
        "mx": expert_bytes(*fp4[True][0]),
        "nv": expert_bytes(*fp4[False][0]),
    }
    print("bytes per expert (w1+w2, scales):", {k: f"{v / 1e6:.2f} MB" for k, v in per_expert.items()})

    rows = []
    for t in TOKENS:
        rows.append(table_row(measure(t, ops, act, bf16, fp4, per_expert, sweep)))
        print(rows[-1], flush=True)
    print()
    print(
        "| tokens | experts touched | bf16 GEMMs µs | MXFP4 GEMMs µs (roofline %) | NVFP4 GEMMs µs (roofline %) "
        "| bf16 layer µs (roofline %) | MXFP4 layer µs (roofline %) | speed-up | NVFP4 layer µs | err vs fp64 mx/nv |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def table_row(result) -> str:
    """One Markdown row of `measure`'s result."""
    tokens, touched, gb, gm, gn, lb, lm, ln, roof, errs = result
    err = "/".join(f"{errs[m]:.1e}" if m in errs else "-" for m in (True, False)) if tokens in (8, 512) else ""
    return (
        f"| {tokens} | {touched} | {gb:.1f} | {gm:.1f} ({roof['mx'] / gm:.0f}%) | {gn:.1f} ({roof['nv'] / gn:.0f}%) "
        f"| {lb:.1f} ({roof['bf16'] / lb:.0f}%) | {lm:.1f} ({roof['mx'] / lm:.0f}%) | {lb / lm:.2f}x "
        f"| {ln:.1f} | {err} |"
    )


if __name__ == "__main__":
    main()
