"""Which tile a grouped-GEMM program computes: its group, first row and column block, found on the device.

The grouped GEMMs' grid has a fixed upper bound of row blocks (`M // BLOCK_M + min(E, M)`); a
program finds its group from a cumulative sum of per-group block counts, so the group sizes never
leave the device and a call can be captured in a CUDA graph. The grid order is one of three:
`N_FASTEST` runs the column blocks of one row block next to each other (a row block of x is read
from HBM once and served from L2 for its other column blocks: the order for many rows), otherwise
the row blocks of one column block (a weight tile shared by its group's row blocks: the order for
few rows); `GROUP_M` > 1 runs bands of that many row blocks, each band's column blocks in turn.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def program_tile(
    pid,
    counts_ptr,
    N,
    E,
    M_BLOCKS,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_FASTEST: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """`(group, row0, group_end, pid_n)` of program `pid`: its rows are `row0 + arange(BLOCK_M)` below
    `group_end`, its columns column block `pid_n`. `group == E`: past the last block, nothing to do."""
    if GROUP_M > 1:
        n_blocks = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * n_blocks
        first_m = (pid // width) * GROUP_M
        size = tl.minimum(M_BLOCKS - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size
        pid_n = (pid % width) // size
    elif N_FASTEST:
        n_blocks = tl.cdiv(N, BLOCK_N)
        pid_m = pid // n_blocks
        pid_n = pid % n_blocks
    else:
        pid_m = pid % M_BLOCKS
        pid_n = pid // M_BLOCKS
    idx = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + idx, mask=idx < E, other=0).to(tl.int32)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    group = tl.sum((block_end <= pid_m).to(tl.int32), axis=0)
    first_block = tl.sum(tl.where(idx == group, block_end - blocks, 0), axis=0)
    group_end = tl.sum(tl.where(idx == group, tl.cumsum(counts, axis=0), 0), axis=0)
    group_start = group_end - tl.sum(tl.where(idx == group, counts, 0), axis=0)
    row0 = group_start + (pid_m - first_block) * BLOCK_M
    return group, row0, group_end, pid_n
