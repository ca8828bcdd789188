"""A grouped GEMM over rows sorted by group, scheduled on the device (Triton).

`y[rows of g] = x[rows of g] @ w[g]` for `x` `[M, K]` and `w` `[E, K, N]` (N contiguous).
The group sizes stay on the device: the grid has a fixed upper bound of row blocks
(`M // BLOCK_M + min(E, M)`), and each program finds its group from a cumulative sum of
per-group block counts computed in the kernel; programs past the last block return at
once. Nothing is read back on the host, so a call can be captured in a CUDA graph.

The grid is one-dimensional, in one of three orders (`N_FASTEST`, `GROUP_M`: see `schedule.py`).

`GATED`: the experts' SiLU-GLU in the epilogue. w's columns are `[gate | up]` (2N of them);
a program accumulates the same column block of both halves and writes `silu(gate) * up`,
`[M, N]`, from the fp32 accumulators: the `[M, 2N]` product is never written, read back
and rounded, and the separate activation pass and its launch are gone.

`GATHER`: the product's row i is x's row `index[i]` (the rows of a dispatch sorted by
expert, read straight from the tokens): the gather is done by the GEMM's loads, and the
`[M, K]` copy of the tokens is never written and read back. Row scales follow the index.

Scales (`SCALE_MODE`): 0 none (float operands); 1 per row of x times per column of each
group's w (int8 or fp8 row-wise); 2 per 128 channels of x times per 128x128 tile of w
(fp8 block-scaled, `BLOCK_K` = 128). Block scales are applied to each K step's product
before it is added; where a program's columns lie in one 128-column scale block
(`SCALAR_WS`), the weight scale is one number and each product value takes a single
multiply-add (two multiplies and a per-column scale load otherwise: 1.2-1.35x slower at
131072 rows on an H100). A block-scaled call whose tiles say `tma` runs the TMA-fed kernel of
`grouped_gemm_tma.py` where its operands fit it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from vendors.cuda.kernels.launch import cdiv, launch, next_power_of_2
from vendors.cuda.kernels.dependent import release_next, wait_for_previous
from vendors.cuda.kernels.grouped_gemm_tma import grouped_gemm_tma, tma_fits
from vendors.cuda.kernels.schedule import program_tile

#: Most groups the kernel schedules (the per-group counts are loaded as one block).
MAX_GROUPS = 1024
SCALE_NONE, SCALE_ROWWISE, SCALE_BLOCK128 = 0, 1, 2


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration of the grouped GEMM (what `hal tune` searches over)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    n_fastest: bool = False  #: order the grid column blocks first (see `schedule.py`)
    group_m: int = 1  #: > 1: the grid in bands of this many row blocks (overrides `n_fastest`)
    tma: bool = False  #: block-scaled calls: the TMA kernel where it fits (`grouped_gemm_tma.py`)

    def as_list(self) -> list[int]:
        """`[block_m, block_n, block_k, warps, stages, n_fastest(, group_m(, tma))]`, the form tuning tables
        store (the trailing values only where they are not the defaults, so older tables read the same)."""
        values = [self.block_m, self.block_n, self.block_k, self.warps, self.stages, int(self.n_fastest)]
        if self.tma:
            return values + [self.group_m, 1]
        return values + [self.group_m] if self.group_m != 1 else values

    @classmethod
    def from_list(cls, values: list[int]) -> TileConfig:
        """The inverse of `as_list` (five elements mean `n_fastest=False`, six `group_m=1`, seven `tma=False`)."""
        sizes = list(values[:5])
        if (
            len(values) not in (5, 6, 7, 8)
            or not all(isinstance(v, int) and v > 0 for v in sizes)
            or not all(isinstance(v, int) for v in values[5:])
            or (len(values) >= 7 and values[6] <= 0)
            or (len(values) == 8 and values[7] not in (0, 1))
        ):
            raise ValueError(
                "a tile config is [block_m, block_n, block_k, warps, stages(, n_fastest(, group_m"
                f"(, tma)))] with tma 0 or 1, got {values}"
            )
        return cls(
            *sizes,
            n_fastest=bool(values[5]) if len(values) >= 6 else False,
            group_m=values[6] if len(values) >= 7 else 1,
            tma=bool(values[7]) if len(values) == 8 else False,
        )


# M, E and M_BLOCKS change with every batch and only bound loops and masks: specializing on their
# divisibility would compile a kernel per batch-size class and buy nothing.
@triton.jit(do_not_specialize=["M", "E", "M_BLOCKS"])
def _grouped_gemm(
    x_ptr,
    w_ptr,
    y_ptr,
    xs_ptr,
    ws_ptr,
    counts_ptr,
    index_ptr,
    M,
    N,
    K,
    E,
    M_BLOCKS,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wk,
    stride_wn,
    stride_ym,
    stride_yn,
    stride_xsm,
    stride_xsk,
    stride_wse,
    stride_wsk,
    stride_wsn,
    SCALE_MODE: tl.constexpr,
    INT_ACC: tl.constexpr,
    IEEE: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    N_FASTEST: tl.constexpr,
    GATED: tl.constexpr,
    GATHER: tl.constexpr,
    PDL: tl.constexpr,
    SCALAR_WS: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    wait_for_previous(PDL)
    group, row0, group_end, pid_n = program_tile(
        tl.program_id(0), counts_ptr, N, E, M_BLOCKS, E_PAD, BLOCK_M, BLOCK_N, N_FASTEST, GROUP_M
    )
    if group >= E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < group_end
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    if GATHER:  # the x row (and scale row) each output row reads
        src64 = tl.load(index_ptr + rows64, mask=row_ok, other=0).to(tl.int64)
    else:
        src64 = rows64
    group64 = group.to(tl.int64)
    x_rows = x_ptr + src64[:, None] * stride_xm
    w_cols = w_ptr + group64 * stride_we + cols[None, :] * stride_wn
    w_up = w_cols + N * stride_wn  # GATED: the up half's column block (N is the output width)
    acc_type = tl.int32 if INT_ACC else tl.float32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_type)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_type)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        b = tl.load(w_cols + ks[:, None] * stride_wk, mask=b_mask, other=0.0)
        if GATED:
            b_up = tl.load(w_up + ks[:, None] * stride_wk, mask=b_mask, other=0.0)
        if SCALE_MODE == 2:
            kb = k0 // BLOCK_K
            a_s = tl.load(xs_ptr + src64 * stride_xsm + kb * stride_xsk, mask=row_ok, other=0.0)
            w_s = ws_ptr + group64 * stride_wse + kb * stride_wsk
            if SCALAR_WS:  # the column block lies in one 128-column scale block: one multiply per value
                b_s = tl.load(w_s + (pid_n * BLOCK_N // 128) * stride_wsn)
                acc += tl.dot(a, b) * (a_s * b_s)[:, None]
            else:
                b_s = tl.load(w_s + (cols // 128) * stride_wsn, mask=col_ok, other=0.0)
                acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            if GATED and SCALAR_WS:
                b_s_up = tl.load(w_s + ((pid_n * BLOCK_N + N) // 128) * stride_wsn)
                acc_up += tl.dot(a, b_up) * (a_s * b_s_up)[:, None]
            elif GATED:
                b_s_up = tl.load(w_s + ((cols + N) // 128) * stride_wsn, mask=col_ok, other=0.0)
                acc_up += tl.dot(a, b_up) * a_s[:, None] * b_s_up[None, :]
        elif INT_ACC:
            acc += tl.dot(a, b, out_dtype=tl.int32)
            if GATED:
                acc_up += tl.dot(a, b_up, out_dtype=tl.int32)
        elif IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
            if GATED:
                acc_up += tl.dot(a, b_up, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
            if GATED:
                acc_up += tl.dot(a, b_up)
    release_next(PDL)  # after the main loop: the next kernel's programs never take the loop's SMs
    out = acc.to(tl.float32)
    up = acc_up.to(tl.float32)
    if SCALE_MODE == 1:
        a_s = tl.load(xs_ptr + src64 * stride_xsm, mask=row_ok, other=0.0)
        b_s = tl.load(ws_ptr + group64 * stride_wse + cols * stride_wsn, mask=col_ok, other=0.0)
        out = out * a_s[:, None] * b_s[None, :]
        if GATED:
            b_s_up = tl.load(ws_ptr + group64 * stride_wse + (cols + N) * stride_wsn, mask=col_ok, other=0.0)
            up = up * a_s[:, None] * b_s_up[None, :]
    if GATED:
        out = out / (1.0 + tl.exp(-out)) * up
    y = y_ptr + rows64[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y, out.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@lru_cache(maxsize=1024)  # a pure function of its integers, asked on every call without a table entry
def default_tiles(
    m: int, n: int, groups: int, element_bytes: int, block_scaled: bool, gated: bool = False, tma: bool = False
) -> TileConfig:
    """The built-in tile choice for a call's shape (used where no tuned table has an entry).

    Chosen from timings on an H100 (qwen3-30b-a3b projections, 1 to 4096 tokens): with few
    rows per group (decode) the call streams weights, and 16-row blocks with deep K tiles
    keep the most bytes in flight; with many rows, large tiles reuse each weight tile.
    `gated`: a program holds two accumulators, so tiles of 64 rows and more take half the
    columns (the same registers as the plain product's tile). `tma`: the call fits the TMA
    kernel with 64-column blocks (`grouped_gemm_tma.tma_fits`).
    """
    many = element_bytes == 1 and block_scaled and m / max(groups, 1) > 192
    if many and tma and not gated:  # the down projection at prefill: 1.05-1.25x the pointer kernel's tuned tiles
        return TileConfig(128, 64, 128, 4, 3, n_fastest=True, tma=True)
    bm, bn, bk, warps, stages = _default_tuple(m, groups, element_bytes, block_scaled)
    if gated and bm >= 64:
        bn //= 2
    # Block-scaled, many rows per group: column blocks first (deepseek-v3-ep8's gated first projection at
    # 131072 rows on an H100: 11.9 ms with 128x64 tiles in this order, 15.5 ms in the other).
    return TileConfig(bm, bn, bk, warps, stages, n_fastest=many)


def _default_tuple(m: int, groups: int, element_bytes: int, block_scaled: bool) -> tuple[int, int, int, int, int]:
    per_group = m / max(groups, 1)
    if element_bytes == 4:  # fp32 (exact, ieee): rare, kept small to fit shared memory
        return 32, 64, 32, 4, 3
    if element_bytes == 1:  # int8 / fp8: K tiles of 128 (one scale block)
        if per_group <= 4:
            return 16, 64, 128, 4, 4
        if per_group <= 16:
            return 32, 64, 128, 4, 4
        if per_group <= 64:
            return 64, 128, 128, 4, 3
        if per_group <= 192 or block_scaled:  # block-scaled: one weight scale per program (SCALAR_WS)
            return 128, 128, 128, 8, 3
        return 64, 256, 128, 8, 3
    block_k = 128 if block_scaled else 64
    if per_group <= 8:
        return 16, 128, 128, 4, 3
    if per_group <= 24:
        return 32, 128, 128, 4, 3
    if per_group <= 96:
        return 64, 128, block_k, 4, 3
    return 128, 256, block_k, 8, 3


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    counts: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    scale_mode: int = SCALE_NONE,
    config: TileConfig | None = None,
    gated: bool = False,
    row_index: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """`[M, N]` in `out_dtype` from x `[M, K]`, w `[E, K, N]` and per-group row counts `[E]` (on the device).

    `row_index` (int32/int64 `[M]`): row i of the product reads x's row `row_index[i]` (x is then
    `[T, K]`, its scales `[T, ...]`), as `x[row_index]` would, without writing that copy.

    `gated`: w's columns are `[gate | up]` and the result is `silu(x @ gate) * (x @ up)`,
    `[M, N / 2]`; a config's `block_n` counts output columns (each program reads that many
    columns of both halves).

    `x_scale` / `w_scale`: `[M]` and `[E, N]` (row-wise) or `[M, ceil(K/128)]` and
    `[E, ceil(K/128), ceil(N/128)]` (block-scaled). `config` overrides the built-in tile
    choice (a tuned table's entry, or a candidate being timed); its `tma` is honoured where the
    call fits the TMA kernel, else the same tiles run with pointer loads.
    """
    k = x.shape[1]
    m = x.shape[0] if row_index is None else row_index.numel()
    e, _, n = w.shape
    if gated:
        if n % 2:
            raise ValueError(f"grouped_gemm: a gated product needs an even number of columns [gate | up], got {n}")
        n //= 2
    y = x.new_empty((m, n), dtype=out_dtype)
    if m == 0 or n == 0:
        return y
    if e > MAX_GROUPS:
        raise ValueError(f"grouped_gemm: at most {MAX_GROUPS} groups, got {e}")
    if k == 0:
        return y.zero_()
    integer = x.dtype == torch.int8
    block_scaled = scale_mode == SCALE_BLOCK128
    tiles = config
    if tiles is None:  # the built-in choice takes the TMA kernel only where it was just found to fit
        tma = block_scaled and tma_fits(x, w, block_n=64, block_k=128, gated=gated, gathered=row_index is not None)
        tiles = default_tiles(m, n, e, x.element_size(), block_scaled, gated, tma)
    if block_scaled and tiles.block_k != 128:
        raise ValueError(f"grouped_gemm: block-scaled operands need BLOCK_K = 128 (one scale block), got {tiles}")
    if (
        tiles.tma
        and block_scaled
        and (
            config is None
            or tma_fits(x, w, block_n=tiles.block_n, block_k=tiles.block_k, gated=gated, gathered=row_index is not None)
        )
    ):
        return grouped_gemm_tma(
            x,
            w,
            counts,
            y,
            x_scale,
            w_scale,
            block_m=tiles.block_m,
            block_n=tiles.block_n,
            warps=tiles.warps,
            stages=tiles.stages,
            n_fastest=tiles.n_fastest,
            group_m=tiles.group_m,
            gated=gated,
            pdl=pdl,
        )
    # An upper bound on the row blocks: the groups' full blocks add up to at most M // BLOCK_M, and
    # each of the at most min(E, M) non-empty groups may end in one partial block. (At decode this
    # drops the programs of the untouched experts.)
    m_blocks = m // tiles.block_m + min(e, m)
    grid = (m_blocks * cdiv(n, tiles.block_n),)
    xs = x_scale if x_scale is not None else x
    ws = w_scale if w_scale is not None else x
    # one `stride()` per tensor (a call each: host time on every launch)
    xs_strides = (0, 0) if x_scale is None else (*x_scale.stride(), 0)[:2]
    if w_scale is None:
        ws_strides = (0, 0, 0)
    elif w_scale.dim() == 2:
        ws0, ws1 = w_scale.stride()
        ws_strides = (ws0, 0, ws1)
    else:
        ws_strides = w_scale.stride()
    index = row_index if row_index is not None else counts
    launch(
        _grouped_gemm,
        grid,
        x,
        w,
        y,
        xs,
        ws,
        counts,
        index,
        m,
        n,
        k,
        e,
        m_blocks,
        *x.stride(),
        *w.stride(),
        *y.stride(),
        *xs_strides,
        *ws_strides,
        SCALE_MODE=scale_mode,
        INT_ACC=integer,
        IEEE=x.dtype == torch.float32,
        E_PAD=max(16, next_power_of_2(e)),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        N_FASTEST=tiles.n_fastest,
        GATED=gated,
        GATHER=row_index is not None,
        PDL=pdl,
        GROUP_M=tiles.group_m,
        SCALAR_WS=scale_mode == SCALE_BLOCK128 and 128 % tiles.block_n == 0 and (not gated or n % 128 == 0),
        num_warps=tiles.warps,
        num_stages=tiles.stages,
        launch_pdl=pdl,
    )
    return y
