"""A grouped GEMM of bf16 activations times 4-bit float weights, dequantized in the kernel (Triton).

`y[rows of g] = x[rows of g] @ dequant(w[g])` for x `[M, K]` bf16 and packed weights `[E, K/2, N]`
uint8 (two e2m1 codes along K, even k in the low nibble). The weights are decoded tile by tile in
registers and never exist in full precision in memory: a call reads 4.25 (MXFP4) or 4.5 (NVFP4)
bits per weight value.

Formats (`MX`):
- MXFP4 (`MX=True`): scale `[E, K/32, N]` uint8 e8m0 (a biased exponent: `2 ** (s - 127)`).
- NVFP4 (`MX=False`): scale `[E, K/16, N]` float8_e4m3fn, and a global scale `[E]` or `[E, N]` fp32
  that the dequantized value is divided by (applied once to the fp32 accumulators in the epilogue).

A code times its block scale is exact in bf16 (2 mantissa bits times a power of two, or times an
e4m3 scale's 4 bits), so the tensor cores multiply the exact dequantized weights, accumulating in
fp32. Two decodes (`asm_decode`): inline PTX, four bytes at a time (a byte-permute table lookup per
four codes, bf16x2 scaling; the default), or Triton operations on each value.

Each program computes the transposed tile `y[rows, cols]^T = w[:, cols]^T @ x[rows]^T`: the decoded
weights are the MMA's first operand, which Hopper's tensor cores take from registers, where the
decode leaves them; x's rows are the second, staged through shared memory. (Taking the weights as the
second operand, as a plain GEMM would, cost 1.3-1.8x the time at 8-64 tokens of gpt-oss-20b's experts
on an H100 and 1.9-3.3x at 512-4096.) A K step either takes one product per nibble, reading x's even and
odd k apart, or joins the two nibbles' values in k order and takes one product over x read
contiguously (`interleave`): which is faster depends on the tiles (`default_fp4_tiles`).

The scheduling (groups found on the device, grid orders), `GATED` (SiLU-GLU in the epilogue, w's
columns `[gate | up]`) and `GATHER` (x's rows through an index) are those of `grouped_gemm.py`.

A decode call touches few experts, so few tiles exist, each streaming its columns' whole K. There the
K range may be split into `SPLIT_K` shares, one program each (`split_k`; `decode_split_k` is the rule
for decode calls): every share stores its fp32 product, and the share that finishes last (an atomic
count per tile) sums the shares in a fixed order, sets the count back to zero and runs the epilogue.
Repeats give the same bits; the result differs from one program's within fp32 rounding of the sum.
Since every launch leaves the counts at zero, eager calls on one stream can reuse one scratch
(`SplitScratch`) instead of allocating and zeroing it per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vendors.cuda.kernels.dependent import release_next, wait_for_previous
from vendors.cuda.kernels.fp4_decode import dequantize_nibbles
from vendors.cuda.kernels.grouped_gemm import MAX_GROUPS, TileConfig
from vendors.cuda.kernels.launch import cdiv, launch, next_power_of_2
from vendors.cuda.kernels.schedule import program_tile
from vendors.cuda.kernels.split_scratch import FreshScratch, SplitScratch

#: Values along K that share a scale: MXFP4, NVFP4.
MX_BLOCK, NV_BLOCK = 32, 16
_FRESH = FreshScratch()


@triton.jit(do_not_specialize=["M", "E", "M_BLOCKS"])
def _grouped_gemm_fp4(
    x_ptr,
    w_ptr,
    ws_ptr,
    gs_ptr,
    bias_ptr,
    y_ptr,
    counts_ptr,
    index_ptr,
    part_ptr,
    done_ptr,
    M,
    N,
    K,
    E,
    M_BLOCKS,
    K_CHUNK,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wk,
    stride_wn,
    stride_wse,
    stride_wsk,
    stride_wsn,
    stride_gse,
    stride_gsn,
    stride_bg,
    stride_bn,
    stride_ym,
    stride_yn,
    stride_pm,
    stride_ps,
    alpha,
    limit,
    MX: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF_K: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    ASM_DECODE: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    N_FASTEST: tl.constexpr,
    GATED: tl.constexpr,
    OAI: tl.constexpr,
    BIAS: tl.constexpr,
    GATHER: tl.constexpr,
    PDL: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    wait_for_previous(PDL)
    tile = tl.program_id(0) // SPLIT_K
    group, row0, group_end, pid_n = program_tile(
        tile, counts_ptr, N, E, M_BLOCKS, E_PAD, BLOCK_M, BLOCK_N, N_FASTEST, GROUP_M
    )
    if group >= E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < group_end
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    if GATHER:
        src64 = tl.load(index_ptr + rows64, mask=row_ok, other=0).to(tl.int64)
    else:
        src64 = rows64
    group64 = group.to(tl.int64)
    # The transposed product: weights (columns x k) are the MMA's first operand, taken from registers
    # where the decode leaves them; x's rows (k x rows) the second.
    x_rows = x_ptr + src64[None, :] * stride_xm
    w_cols = w_ptr + group64 * stride_we + cols[:, None] * stride_wn
    s_cols = ws_ptr + group64 * stride_wse + cols[:, None] * stride_wsn
    up = N * stride_wn  # GATED: the up half's columns (N is the output width)
    up_s = N * stride_wsn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    half_k = K // 2
    k_first = (tl.program_id(0) % SPLIT_K) * K_CHUNK  # SPLIT_K > 1: this program's share of K
    for k0 in range(k_first, tl.minimum(k_first + K_CHUNK, half_k), HALF_K):
        kp = k0 + tl.arange(0, HALF_K)  # packed rows: k = 2 * kp (low nibble) and 2 * kp + 1 (high)
        kp_ok = kp < half_k
        w_mask = col_ok[:, None] & kp_ok[None, :]
        w_at = w_cols + kp[None, :] * stride_wk
        s_at = s_cols + (kp // SCALE_ROWS)[None, :] * stride_wsk
        w_lo, w_hi = dequantize_nibbles(
            tl.load(w_at, mask=w_mask, other=0), tl.load(s_at, mask=w_mask, other=0), MX, ASM_DECODE
        )
        if INTERLEAVE:  # one product over k in order: the nibbles' values joined along k, x read contiguously
            kk = 2 * k0 + tl.arange(0, 2 * HALF_K)
            xt = tl.load(x_rows + kk[:, None] * stride_xk, mask=row_ok[None, :] & (kk < K)[:, None], other=0.0)
            acc = tl.dot(tl.reshape(tl.join(w_lo, w_hi), (BLOCK_N, 2 * HALF_K)), xt, acc)
        else:  # one product per nibble, x's even and odd k read apart
            x_mask = row_ok[None, :] & kp_ok[:, None]
            x_lo = tl.load(x_rows + (2 * kp)[:, None] * stride_xk, mask=x_mask, other=0.0)
            x_hi = tl.load(x_rows + (2 * kp + 1)[:, None] * stride_xk, mask=x_mask, other=0.0)
            acc = tl.dot(w_lo, x_lo, acc)
            acc = tl.dot(w_hi, x_hi, acc)
        # The up half is decoded only once the gate's products are taken: decoding both halves first took
        # 1.8x the time with 64 x 128 tiles at 512 tokens of gpt-oss-20b (H100), more registers live at once.
        if GATED:
            u_lo, u_hi = dequantize_nibbles(
                tl.load(w_at + up, mask=w_mask, other=0), tl.load(s_at + up_s, mask=w_mask, other=0), MX, ASM_DECODE
            )
            if INTERLEAVE:
                acc_up = tl.dot(tl.reshape(tl.join(u_lo, u_hi), (BLOCK_N, 2 * HALF_K)), xt, acc_up)
            else:
                acc_up = tl.dot(u_lo, x_lo, acc_up)
                acc_up = tl.dot(u_hi, x_hi, acc_up)
    release_next(PDL)
    if SPLIT_K > 1:  # store this share's fp32 product; the last share to finish sums all, in share order
        tile_ok = col_ok[:, None] & row_ok[None, :]
        part = part_ptr + rows64[None, :] * stride_pm + cols[:, None]
        share = part + (tl.program_id(0) % SPLIT_K) * stride_ps
        tl.store(share, acc, mask=tile_ok)
        if GATED:
            tl.store(share + N, acc_up, mask=tile_ok)
        tl.debug_barrier()  # every thread's stores are made before the count that may start the sum
        if tl.atomic_add(done_ptr + tile, 1, sem="acq_rel") != SPLIT_K - 1:
            return
        tl.store(done_ptr + tile, 0)  # every share has counted: the count is left at zero for the next call
        acc = tl.load(part, mask=tile_ok, other=0.0, cache_modifier=".cg")
        if GATED:
            acc_up = tl.load(part + N, mask=tile_ok, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):  # a fixed order: the same sums on every run
            acc += tl.load(part + s * stride_ps, mask=tile_ok, other=0.0, cache_modifier=".cg")
            if GATED:
                acc_up += tl.load(part + s * stride_ps + N, mask=tile_ok, other=0.0, cache_modifier=".cg")
    out = acc
    if not ASM_DECODE:  # the Triton decode's 2**-14
        out = out * 16384.0
        acc_up = acc_up * 16384.0
    if not MX:  # NVFP4's global scale divides each column (one number per expert, or per column)
        gs = gs_ptr + group64 * stride_gse
        out = out / tl.load(gs + cols * stride_gsn, mask=col_ok, other=1.0)[:, None]
        if GATED:
            acc_up = acc_up / tl.load(gs + (cols + N) * stride_gsn, mask=col_ok, other=1.0)[:, None]
    if BIAS:  # the group's bias row, on the product before the activation
        bias_row = bias_ptr + group64 * stride_bg
        out = out + tl.load(bias_row + cols * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        if GATED:
            acc_up = acc_up + tl.load(bias_row + (cols + N) * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    if GATED:
        if OAI:  # swiglu-oai: gate clamped above, up clamped both ways, (up + 1) * gate * sigmoid(alpha * gate)
            out = tl.minimum(out, limit)
            acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit) + 1.0
            out = out / (1.0 + tl.exp(-alpha * out)) * acc_up
        else:
            out = out / (1.0 + tl.exp(-out)) * acc_up
    y = y_ptr + rows64[None, :] * stride_ym + cols[:, None] * stride_yn
    tl.store(y, out.to(y_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])


@dataclass(frozen=True)
class Fp4Tiles:
    """A launch configuration of the FP4 kernel: the tiles, and whether a K step takes one product over
    the nibbles' values joined in k order (`interleave`) or one product per nibble."""

    tiles: TileConfig
    interleave: bool


#: About nine programs per multiprocessor of an H100 or H200 (132): the most a split adds up to.
SPLIT_PROGRAMS = 1200


def decode_split_k(m: int, groups: int, column_blocks: int) -> int:
    """The K shares (1, 2 or 4) of a call of `m` rows over `groups` groups with 16-row tiles: the most that
    keep the expected tiles (the groups `m` uniformly routed rows touch, times the column blocks) times
    the shares within `SPLIT_PROGRAMS`. From H200 timings of gpt-oss-20b's experts at 1 to 16 tokens
    (`scripts/bench_fp4_weight_only.py`): at 1 token 4 shares took the layer from 96 to 71 µs; with more
    tiles than this bound, the shares' stores and sums cost more than they gained."""
    touched = groups * (1.0 - (1.0 - 1.0 / max(groups, 1)) ** m)
    split = 4
    while split > 1 and touched * column_blocks * split > SPLIT_PROGRAMS:
        split //= 2
    return split


def default_fp4_tiles(m: int, groups: int, gated: bool) -> Fp4Tiles:
    """The built-in configuration for a call of `m` rows over `groups` groups. From H100 timings of
    gpt-oss-20b's experts at 8 to 4096 tokens (32 experts, top-4; `scripts/bench_fp4_weight_only.py`):
    with few rows per group the call streams the packed weights, 16-row tiles over 64 or 128 weight
    columns; with many, large tiles decode each weight tile once for many rows."""
    per_group = m / max(groups, 1)
    if per_group <= 16:
        return (
            Fp4Tiles(TileConfig(16, 64, 128, 4, 4), False) if gated else Fp4Tiles(TileConfig(16, 128, 128, 4, 3), False)
        )
    if per_group <= 96:
        return Fp4Tiles(TileConfig(64, 128, 64, 4, 3), False)
    if gated:
        return Fp4Tiles(TileConfig(128, 128, 64, 8, 3), False)
    return Fp4Tiles(TileConfig(256, 128, 64, 8, 3), True)


def grouped_gemm_fp4(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    counts: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    mx: bool,
    global_scale: torch.Tensor | None = None,
    config: TileConfig | None = None,
    gated: bool = False,
    row_index: torch.Tensor | None = None,
    pdl: bool = False,
    asm_decode: bool = True,
    interleave: bool | None = None,
    split_k: int | None = 1,
    bias: torch.Tensor | None = None,
    swiglu_oai: tuple[float, float] | None = None,
    scratch: SplitScratch | None = None,
) -> torch.Tensor:
    """`[M, N]` in `out_dtype` from bf16 x `[M, K]`, packed weights `[E, K/2, N]` and per-group row counts `[E]`.

    `mx`: MXFP4 (`w_scale` uint8 `[E, K/32, N]`); else NVFP4 (`w_scale` e4m3 `[E, K/16, N]`, `global_scale`
    fp32 `[E]` or `[E, N]`). `gated`, `row_index`, `config`, `pdl`: as `grouped_gemm.grouped_gemm`.
    `asm_decode`: codes decoded four bytes at a time by inline PTX (`prmt` lookups, bf16x2 scaling; the
    default); else by Triton operations on each value (through fp16's bit layout, scaled in fp32).
    `interleave`: one product per K step over both nibbles' values in k order (None: the default
    configuration's choice; see `Fp4Tiles`). `split_k`: K in that many shares summed in fp32 before the
    epilogue (None: `decode_split_k` for 16-row tiles, else 1); a split takes its fp32 shares and counts
    from `scratch` (kept per stream, reused) outside CUDA-graph capture, else allocates and zeroes them. `bias`: `[E, N]` (all of w's columns,
    `[gate | up]` when gated), each row's group's row added to the product. `swiglu_oai`: with `gated`,
    gpt-oss's clamped activation with these `(alpha, limit)` in the epilogue instead of SiLU-GLU.
    """
    e, half_k, n = w.shape
    k = 2 * half_k
    m = x.shape[0] if row_index is None else row_index.numel()
    if x.shape[1] != k:
        raise ValueError(f"grouped_gemm_fp4: x has {x.shape[1]} columns, the packed weights hold K = {k}")
    if gated:
        if n % 2:
            raise ValueError(f"grouped_gemm_fp4: a gated product needs an even number of columns, got {n}")
        n //= 2
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if e > MAX_GROUPS:
        raise ValueError(f"grouped_gemm_fp4: at most {MAX_GROUPS} groups, got {e}")
    if k == 0 and bias is None:  # an empty product (a bias still runs the epilogue)
        return y.zero_()
    default = default_fp4_tiles(m, e, gated)
    tiles = config if config is not None else default.tiles
    if interleave is None:
        interleave = default.interleave if config is None else False
    if split_k is None:
        split_k = decode_split_k(m, e, cdiv(n, tiles.block_n)) if tiles.block_m <= 16 else 1
    if split_k < 1:
        raise ValueError(f"grouped_gemm_fp4: split_k must be at least 1, got {split_k}")
    block = MX_BLOCK if mx else NV_BLOCK
    if tiles.block_k % block or tiles.block_k < 32:
        raise ValueError(f"grouped_gemm_fp4: BLOCK_K must be a multiple of {block} and >= 32, got {tiles}")
    m_blocks = m // tiles.block_m + min(e, m)
    grid = (m_blocks * cdiv(n, tiles.block_n) * split_k,)
    k_chunk = cdiv(cdiv(half_k, split_k), tiles.block_k // 2) * (tiles.block_k // 2)  # packed rows per share
    if split_k > 1:  # each share's fp32 products (gate and up columns), and a count of finished shares per tile
        sums = n * (2 if gated else 1)
        part, done = (_FRESH if scratch is None else scratch).buffers(x.device, split_k * m * sums, grid[0] // split_k)
    else:
        sums, part, done = 0, y, counts
    if w_scale.dtype != torch.uint8:  # e4m3 scales are loaded as bytes (a masked load of fp8 takes no fill)
        w_scale = w_scale.view(torch.uint8)
    if swiglu_oai is not None and not gated:
        raise ValueError("grouped_gemm_fp4: swiglu_oai is a gated activation (pass gated=True)")
    if bias is not None and tuple(bias.shape) != (e, w.shape[2]):
        raise ValueError(f"grouped_gemm_fp4: bias must be [{e}, {w.shape[2]}], got {tuple(bias.shape)}")
    alpha, limit = swiglu_oai if swiglu_oai is not None else (1.0, 0.0)
    if global_scale is None:
        gs, gs_strides = w_scale, (0, 0)
    else:
        gs = global_scale
        gs_strides = (gs.stride(0), gs.stride(1) if gs.dim() == 2 else 0)
    launch(
        _grouped_gemm_fp4,
        grid,
        x,
        w,
        w_scale,
        gs,
        bias if bias is not None else w_scale,
        y,
        counts,
        row_index if row_index is not None else counts,
        part,
        done,
        m,
        n,
        k,
        e,
        m_blocks,
        k_chunk,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        w_scale.stride(0),
        w_scale.stride(1),
        w_scale.stride(2),
        *gs_strides,
        *(bias.stride() if bias is not None else (0, 0)),
        y.stride(0),
        y.stride(1),
        sums,
        m * sums,
        float(alpha),
        float(limit),
        MX=mx,
        E_PAD=max(16, next_power_of_2(e)),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        HALF_K=tiles.block_k // 2,
        SCALE_ROWS=block // 2,  # packed rows per scale row
        ASM_DECODE=asm_decode,
        INTERLEAVE=interleave,
        N_FASTEST=tiles.n_fastest,
        GATED=gated,
        OAI=swiglu_oai is not None,
        BIAS=bias is not None,
        GATHER=row_index is not None,
        PDL=pdl,
        GROUP_M=tiles.group_m,
        SPLIT_K=split_k,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
        launch_pdl=pdl,
    )
    return y
