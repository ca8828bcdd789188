"""How a first projection's Triton GEMM reads the dispatch's rows: through the row index inside the GEMM, or from
a copy gathered first (the tuned table's `Choice.gather`, else the built-in rule below)."""

from __future__ import annotations

from vendors.cuda.tuning import Choice

#: Most rows per group at which the Triton GEMM reads one-byte rows (fp8, int8) through the dispatch's index;
#: above, they are gathered first (16-bit rows are always read through it). Measured on an H200, the gated
#: first projection, gather + GEMM against the GEMM's own gathered loads (interleaved graph replays): bf16
#: 1.00-1.23x faster at every size of qwen3-30b-a3b, mixtral-8x7b and deepseek-v3-ep8; fp8 block-128 1.03-1.23x
#: up to 32 rows per group, but 0.93-0.98x at 64-256 (mixtral at 512 tokens: 577 -> 622 us).
ONE_BYTE_GATHER_MAX_ROWS_PER_GROUP = 32


def gather_in_gemm(rows: int, groups: int, element_bytes: int) -> bool:
    """Whether the Triton GEMM reads its rows through the index (16-bit and wider rows always, one-byte rows
    up to `ONE_BYTE_GATHER_MAX_ROWS_PER_GROUP` per group); else they are gathered first."""
    return element_bytes > 1 or rows <= ONE_BYTE_GATHER_MAX_ROWS_PER_GROUP * groups


def reads_through_index(choice: Choice | None, rows: int, groups: int, element_bytes: int) -> bool:
    """Whether a first projection's Triton GEMM reads its rows through the dispatch's index: as the table's
    choice says (`Choice.gather`), else by `gather_in_gemm`. The other backends gather in `CudaOps._grouped`."""
    if choice is not None and choice.gather is not None:
        return not choice.gather
    return gather_in_gemm(rows, groups, element_bytes)
