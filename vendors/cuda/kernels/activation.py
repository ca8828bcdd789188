"""swiglu in one pass (Triton): `silu(gate) * up` for `[M, 2I]` rows, gate first, fp32 inside; optionally over
rows read through an index (a product left in another row order is activated and reordered in the same pass)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vendors.cuda.kernels.launch import cdiv, launch, next_power_of_2
from vendors.cuda.kernels.dependent import release_next, wait_for_previous


@triton.jit
def _swiglu(
    x_ptr, rows_ptr, y_ptr, I, stride_x, stride_y, BLOCK: tl.constexpr, INDEXED: tl.constexpr, PDL: tl.constexpr
):
    wait_for_previous(PDL)
    release_next(PDL)
    row = tl.program_id(0).to(tl.int64)
    source = tl.load(rows_ptr + row).to(tl.int64) if INDEXED else row
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + source * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + source * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + row * stride_y + cols, out.to(y_ptr.dtype.element_ty), mask=mask)


def swiglu(x: torch.Tensor, rows: torch.Tensor | None = None, *, pdl: bool = False) -> torch.Tensor:
    """`silu(x[:, :I]) * x[:, I:]` for 2-D `x` `[M, 2I]` with a contiguous last dimension; with `rows` (a 1-D
    integer index into x's rows), of `x[rows]`, without materialising the gathered copy."""
    m, two_i = x.shape
    i = two_i // 2
    out_rows = m if rows is None else rows.numel()
    y = torch.empty((out_rows, i), dtype=x.dtype, device=x.device)
    if out_rows and i:
        block = min(1024, next_power_of_2(i))
        launch(
            _swiglu,
            (out_rows, cdiv(i, block)),
            x,
            x if rows is None else rows,
            y,
            i,
            x.stride(0),
            y.stride(0),
            BLOCK=block,
            INDEXED=rows is not None,
            PDL=pdl,
            num_warps=4,
            launch_pdl=pdl,
        )
    return y
