"""swiglu in one pass (Triton): `silu(gate) * up` for `[M, 2I]` rows, gate first, fp32 inside."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vendors.cuda.kernels.launch import cdiv, launch, next_power_of_2
from vendors.cuda.kernels.dependent import release_next, wait_for_previous


@triton.jit
def _swiglu(x_ptr, y_ptr, I, stride_x, stride_y, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    release_next(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + row * stride_y + cols, out.to(y_ptr.dtype.element_ty), mask=mask)


def swiglu(x: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """`silu(x[:, :I]) * x[:, I:]` for 2-D `x` `[M, 2I]` with a contiguous last dimension."""
    m, two_i = x.shape
    i = two_i // 2
    y = torch.empty((m, i), dtype=x.dtype, device=x.device)
    if m and i:
        block = min(1024, next_power_of_2(i))
        launch(
            _swiglu,
            (m, cdiv(i, block)),
            x,
            y,
            i,
            x.stride(0),
            y.stride(0),
            BLOCK=block,
            PDL=pdl,
            num_warps=4,
            launch_pdl=pdl,
        )
    return y
