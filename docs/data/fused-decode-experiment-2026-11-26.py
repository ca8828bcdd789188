"""EXPERIMENT, NOT PART OF THE PACKAGE (measured slower than the shipped path; docs/performance.md, "CUDA round 2,
part 6"). Kept as the evidence behind that section: the kernels as timed on the H100 on 2026-11-26, with the
harness at the end of this file. Run it from the repository root on a CUDA machine:
`python docs/data/fused-decode-experiment-2026-11-26.py 1,2,4,8,16`.

The experts and the weighted combine of a few tokens in two launches (Triton): the decode path.

At decode a token's k experts are k different weight matrices, each read once for one row:
the work is streaming weights, and what costs is launches (sort, gather, two GEMMs, the
activation, the combine: each a few µs of an op whose math takes less). Here:

1. `_experts`: one program per (token-slot pair, block of `BLOCK_I` intermediate channels).
   It reads the token's row (no sort, no gather: the pair's expert id picks the weights),
   computes its block of `silu(x @ gate) * (x @ up)` from fp32 accumulators, rounds it as
   the unfused path does (to the output dtype; fp8: then quantized per 128 channels, the
   block's own group), and multiplies it by the matching `BLOCK_I` rows of the down
   projection: a partial `[H]` row of the pair's output, written in fp32.
2. `_reduce`: each token sums its k pairs' partial rows, weighted by the routing, in fp32,
   and writes `[T, H]` once.

Each product is a 16-row tensor-core tile whose row 0 is the pair's row (rows 1-15 are
masked zeros, never read), so the loads are software-pipelined as the grouped GEMM's are.
(A first version multiplied on the CUDA cores without `tl.dot`; its loads were not
pipelined and it ran at a third of this speed.) Nothing depends on
the routing's values on the host, and no atomics are used: two calls give bit-identical
results, and the pair can be captured in a CUDA graph.

Scales (`FP8`): weights in fp8 e4m3 with one fp32 scale per 128x128 tile (`[E, K/128,
N/128]`); activations quantized per 128 channels in the kernel (`scale = amax / 448`,
as the quantize kernel does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

#: The fp8 weights' and activations' scale block.
SCALE_BLOCK = 128
#: How the intermediate activation is rounded: to the output dtype, as the unfused path's first GEMM writes it.
_ROUND = {torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class FusedConfig:
    """One launch configuration: intermediate channels per program, the K tile of the first product, the
    column tile of the second, warps."""

    block_i: int
    block_k: int
    block_h: int
    warps: int
    stages: int


@triton.jit(do_not_specialize=["P"])  # P (pairs) changes per batch and only bounds the grid
def _experts(x_ptr, ids_ptr, w13_ptr, w2_ptr, s13_ptr, s2_ptr, part_ptr, P, H, I,
             stride_xt, stride_13e, stride_13k, stride_13n, stride_2e, stride_2k, stride_2n,
             stride_s13e, stride_s13k, stride_s13n, stride_s2e, stride_s2k, stride_s2n,
             stride_pp, stride_pi,
             TOPK: tl.constexpr, FP8: tl.constexpr, ROUND: tl.constexpr,
             BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
    tile = tl.program_id(0)  # fastest: a pair's column blocks run side by side (adjacent DRAM pages)
    pair = tl.program_id(1).to(tl.int64)
    token = pair // TOPK
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    # The pair's row is row 0 of a 16-row tile (the tensor cores' smallest); rows 1-15 are zeros, never read.
    lane = tl.arange(0, 16)
    first = lane == 0
    icols = tile * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = icols < I
    x_row = x_ptr + token * stride_xt + lane[:, None] * 0
    w_gate = w13_ptr + expert * stride_13e + icols[None, :] * stride_13n
    w_up = w_gate + I * stride_13n
    acc_g = tl.zeros((16, BLOCK_I), dtype=tl.float32)
    acc_u = tl.zeros((16, BLOCK_I), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        x = tl.load(x_row + ks[None, :], mask=first[:, None] & k_ok[None, :], other=0.0)
        mask = k_ok[:, None] & i_ok[None, :]
        g = tl.load(w_gate + ks[:, None] * stride_13k, mask=mask, other=0.0)
        u = tl.load(w_up + ks[:, None] * stride_13k, mask=mask, other=0.0)
        if FP8:  # BLOCK_K is one scale block: x's block quantized as the quantize kernel does
            xf = x.to(tl.float32)
            step = tl.max(tl.abs(xf), axis=1) / 448.0
            q = tl.minimum(tl.maximum(xf / tl.where(step == 0.0, 1.0, step)[:, None], -448.0), 448.0)
            q = q.to(tl.float8e4nv)
            s = s13_ptr + expert * stride_s13e + (k0 // BLOCK_K) * stride_s13k
            s_g = tl.load(s + (icols // 128) * stride_s13n, mask=i_ok, other=0.0)
            s_u = tl.load(s + ((icols + I) // 128) * stride_s13n, mask=i_ok, other=0.0)
            acc_g += tl.dot(q, g) * step[:, None] * s_g[None, :]
            acc_u += tl.dot(q, u) * step[:, None] * s_u[None, :]
        else:
            acc_g += tl.dot(x, g)
            acc_u += tl.dot(x, u)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # rows 1-15 stay zero
    if ROUND == 1:  # rounded to the output dtype, as the unfused path's first GEMM writes it
        h = h.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        h = h.to(tl.float16).to(tl.float32)
    h = tl.where(i_ok[None, :], h, 0.0)
    if FP8:  # BLOCK_I is one scale block of the intermediate channels
        step_h = tl.max(tl.abs(h), axis=1) / 448.0
        a = tl.minimum(tl.maximum(h / tl.where(step_h == 0.0, 1.0, step_h)[:, None], -448.0), 448.0)
        a = a.to(tl.float8e4nv)
    else:
        a = h.to(w2_ptr.dtype.element_ty)
    w_down = w2_ptr + expert * stride_2e + icols[:, None] * stride_2k
    out = part_ptr + pair * stride_pp + tile * stride_pi + lane[:, None] * 0
    for n0 in range(0, H, BLOCK_H):
        ns = n0 + tl.arange(0, BLOCK_H)
        n_ok = ns < H
        d = tl.load(w_down + ns[None, :] * stride_2n, mask=i_ok[:, None] & n_ok[None, :], other=0.0)
        y = tl.dot(a, d)
        if FP8:
            s2 = s2_ptr + expert * stride_s2e + tile * stride_s2k
            y = y * step_h[:, None] * tl.load(s2 + (ns // 128) * stride_s2n, mask=n_ok, other=0.0)[None, :]
        tl.store(out + ns[None, :], y, mask=first[:, None] & n_ok[None, :])


@triton.jit
def _reduce(part_ptr, w_ptr, y_ptr, H, stride_pp, stride_pi, stride_y,
            TOPK: tl.constexpr, TILES: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pair = token * TOPK + j
        row = tl.zeros((BLOCK,), dtype=tl.float32)
        for tile in range(TILES):
            row += tl.load(part_ptr + pair * stride_pp + tile * stride_pi + cols, mask=mask, other=0.0)
        acc += tl.load(w_ptr + pair) * row
    tl.store(y_ptr + token * stride_y + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


def default_config(pairs: int, intermediate: int, fp8: bool) -> FusedConfig:
    """The built-in launch configuration: fp8 takes one scale block of channels per program; bf16 blocks of
    64 (32 where the pairs are too few to fill the device's SMs otherwise)."""
    if fp8:
        return FusedConfig(SCALE_BLOCK, SCALE_BLOCK, 64, 4, 3)
    block_i = 32 if pairs * triton.cdiv(intermediate, 64) < 256 else 64
    return FusedConfig(block_i, 64, 128, 4, 3)


def fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, out_dtype: torch.dtype, *, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, config: FusedConfig | None = None) -> torch.Tensor:
    """`[T, H]`: `sum_j w[t, j] * (silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ w2[e]` for `e = topk_ids[t, j]`.

    x `[T, H]` (contiguous last dim), w13 `[E, H, 2I]` (`[gate | up]`), w2 `[E, I, H]`; fp8 weights come with
    their 128x128 block scales (`[E, ceil(H/128), ceil(2I/128)]`, `[E, ceil(I/128), ceil(H/128)]`) and the
    activations are quantized per 128 channels in the kernel. Ids must lie in `[0, E)` (not checked here).
    """
    t, h = x.shape
    k = topk_ids.shape[1]
    inter = w2.shape[1]
    fp8 = w13_scale is not None
    y = torch.empty((t, h), dtype=out_dtype, device=x.device)
    if t == 0 or h == 0:
        return y
    pairs = t * k
    cfg = config or default_config(pairs, inter, fp8)
    if fp8 and (cfg.block_i != SCALE_BLOCK or cfg.block_k != SCALE_BLOCK):
        raise ValueError(f"fused_experts: fp8 weights need block_i = block_k = {SCALE_BLOCK}, got {cfg}")
    tiles = triton.cdiv(inter, cfg.block_i)
    part = torch.empty((pairs, tiles, h), dtype=torch.float32, device=x.device)
    ids = topk_ids.reshape(-1)
    s13 = w13_scale if fp8 else w13
    s2 = w2_scale if fp8 else w2
    s13_strides = tuple(w13_scale.stride()) if fp8 else (0, 0, 0)
    s2_strides = tuple(w2_scale.stride()) if fp8 else (0, 0, 0)
    _experts[(tiles, pairs)](
        x, ids, w13, w2, s13, s2, part, pairs, h, inter,
        x.stride(0), *w13.stride(), *w2.stride(), *s13_strides, *s2_strides, part.stride(0), part.stride(1),
        TOPK=k, FP8=fp8, ROUND=_ROUND.get(out_dtype, 0), BLOCK_I=cfg.block_i, BLOCK_K=cfg.block_k, BLOCK_H=cfg.block_h, num_warps=cfg.warps,
        num_stages=cfg.stages)
    block = min(1024, triton.next_power_of_2(h))
    _reduce[(t, triton.cdiv(h, block))](
        part, topk_weights.contiguous(), y, h, part.stride(0), part.stride(1), y.stride(0),
        TOPK=k, TILES=tiles, BLOCK=block, num_warps=4)
    return y


# ---- harness: MoELayer forward against softmax_topk + fused_experts (CUDA-graph replays, median) ----


# ---- harness: MoELayer forward against softmax_topk + fused_experts (CUDA-graph replays, median) ----

def _main() -> None:
    import statistics
    import sys

    from moe import MoELayer
    from vendors.cuda.kernels import routing as R

    TOKENS = [int(t) for t in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 2, 4, 8, 16]
    SHAPES = {"qwen3": (128, 2048, 768, 8), "mixtral": (8, 4096, 14336, 2), "deepseek": (32, 7168, 2048, 8)}

    def graph_time(fn, reps=15, inner=10):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3): fn()
        torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(inner): fn()
        ts = []
        for _ in range(reps):
            a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
            a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1000 / inner)
        return statistics.median(ts)

    BF16_CFGS = [FusedConfig(64, 64, 128, 4, 3), FusedConfig(128, 32, 128, 4, 4), FusedConfig(128, 64, 128, 8, 3),
                 FusedConfig(64, 128, 64, 4, 3), FusedConfig(64, 64, 256, 4, 4), FusedConfig(32, 64, 128, 4, 4),
                 FusedConfig(128, 32, 256, 8, 5), FusedConfig(64, 32, 128, 4, 6)]
    FP8_CFGS = [FusedConfig(128, 128, 128, 4, 3), FusedConfig(128, 128, 256, 8, 3), FusedConfig(128, 128, 128, 4, 4),
                FusedConfig(128, 128, 256, 4, 2)]
    torch.manual_seed(0)
    with torch.no_grad():
        for name, (E, H, I, k) in SHAPES.items():
            w13 = torch.randn(E, H, 2 * I, device="cuda", dtype=torch.bfloat16) * 0.02
            w2 = torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16) * 0.02
            for scheme in ("unquantized", "w8a8-fp8-block"):
                layer = MoELayer.from_float(w13, w2, top_k=k, scheme=scheme, vendor="cuda")
                ew = layer.expert_weights
                fp8 = scheme != "unquantized"
                a13, a2 = ew.w13.data, ew.w2.data
                s13 = ew.w13.scale if fp8 else None
                s2 = ew.w2.scale if fp8 else None
                if fp8 and name == "qwen3":
                    print("fp8 strides", a13.stride(), a13.dtype, s13.shape, s2.shape, flush=True)
                for T in TOKENS:
                    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
                    logits = torch.randn(T, E, device="cuda")
                    base = layer(x, logits)
                    def fused(cfg=None):
                        w, ids = R.softmax_topk(logits, k, True)
                        return fused_experts(x, ids, w, a13, a2, torch.bfloat16, w13_scale=s13, w2_scale=s2, config=cfg)
                    err = ((fused().float() - base.float()).abs().max() / base.float().abs().max()).item()
                    t_layer = graph_time(lambda: layer(x, logits))
                    row = []
                    for cfg in (FP8_CFGS if fp8 else BF16_CFGS):
                        try:
                            row.append((graph_time(lambda: fused(cfg)), cfg))
                        except Exception as exc:
                            print("cfg failed", cfg, repr(exc)[:200], flush=True)
                    t_def = graph_time(lambda: fused(None))
                    best = min(row, key=lambda r: r[0])
                    print(f"{name:8s} {scheme[:6]:6s} T={T:4d} layer {t_layer:7.1f}  fused default {t_def:7.1f} "
                          f"({t_layer / t_def:4.2f}x)  best {best[0]:7.1f} {best[1]}  err {err:.2e}  all "
                          + " ".join(f"{t:.1f}" for t, _ in row), flush=True)
                if name == "qwen3" and not fp8:
                    T = 8
                    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
                    logits = torch.randn(T, E, device="cuda")
                    w, ids = R.softmax_topk(logits, k, True)
                    y = fused_experts(x, ids, w, a13, a2, torch.bfloat16).double()
                    xd, g64, d64 = x.double(), w13.double(), w2.double()
                    ref = torch.zeros_like(y)
                    for t in range(T):
                        for j in range(k):
                            e = ids[t, j]
                            hh = xd[t] @ g64[e]
                            a = torch.nn.functional.silu(hh[:I]) * hh[I:]
                            ref[t] += w[t, j].double() * (a @ d64[e])
                    print("float64 check qwen3 bf16 T=8: rel max err fused", ((y - ref).abs().max() / ref.abs().max()).item(),
                          "layer", ((layer(x, logits).double() - ref).abs().max() / ref.abs().max()).item(), flush=True)
                del layer
            del w13, w2
            torch.cuda.empty_cache()


if __name__ == "__main__":
    _main()
