"""Activation quantization in one pass over the input (Triton).

Per token: a program loads a tile of rows once, takes each row's max |x|, and writes the
scaled, rounded (int8) or cast (fp8 e4m3) values and the rows' fp32 scales. Per 128-channel
group: a program takes a tile of rows of one group. Tiles hold about `TILE_ELEMENTS` values
so that each program moves kilobytes, not one group's 256 bytes (one program per (row,
group) ran at a fifth of the copy bandwidth on an H100). `scale = amax / qmax`; an all-zero row or group gets
scale 0 and data 0. Every row is independent (a non-finite row never touches another),
and nothing is read back on the host, so the kernels can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vendors.cuda.kernels.launch import cdiv, launch, next_power_of_2
from vendors.cuda.kernels.dependent import release_next, wait_for_previous

#: Rows longer than this are quantized per token in a two-pass loop instead of one load.
MAX_SINGLE_PASS = 16384
#: Values one program loads (rows x channels), where rows are short enough to share a program.
TILE_ELEMENTS = 4096
#: Adding and subtracting 1.5 * 2^23 rounds an fp32 of magnitude below 2^22 to the nearest
#: integer, ties to even (the fp32 adder's own rounding), without a libdevice call.
_RNE_SHIFT: tl.constexpr = tl.constexpr(12582912.0)


# M changes with every batch and only bounds a mask.
@triton.jit(do_not_specialize=["M"])
def _quantize_rows(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    H,
    stride_x,
    stride_q,
    stride_s,
    stride_sg,
    QMAX: tl.constexpr,
    ROUND: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    LOOP: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    release_next(PDL)
    group = tl.program_id(1)
    if LOOP:  # a row too long for one block: max first, then quantize (reads the row twice)
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * stride_x
        q_row = q_ptr + row.to(tl.int64) * stride_q
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, H, BLOCK):
            c = start + tl.arange(0, BLOCK)
            v = tl.load(x_row + c, mask=c < H, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        top = tl.max(amax, axis=0)
        step = top / QMAX
        inv = tl.where(step == 0.0, 0.0, 1.0 / tl.where(step == 0.0, 1.0, step))
        for start in range(0, H, BLOCK):
            c = start + tl.arange(0, BLOCK)
            v = tl.load(x_row + c, mask=c < H, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(v * inv, -QMAX), QMAX)
            if ROUND:
                q = (q + _RNE_SHIFT) - _RNE_SHIFT
            tl.store(q_row + c, q.to(q_ptr.dtype.element_ty), mask=c < H)
        tl.store(s_ptr + row.to(tl.int64) * stride_s, step)
    else:
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        cols = group * BLOCK + tl.arange(0, BLOCK)
        mask = (rows < M)[:, None] & (cols < H)[None, :]
        v = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        top = tl.max(tl.abs(v), axis=1)
        step = top / QMAX
        q = v / tl.where(step == 0.0, 1.0, step)[:, None]
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
        if ROUND:
            q = (q + _RNE_SHIFT) - _RNE_SHIFT
        tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + rows * stride_s + group * stride_sg, step, mask=rows < M)


def quantize_rows(
    x: torch.Tensor, target: torch.dtype, group: int | None, *, qmax: float, rounds: bool, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization of `x` `[M, H]` (contiguous last dim) to a one-byte `target` (int8, float8_e4m3fn).

    `group=None`: one fp32 scale per row `[M]`; `group=128`: one per row and 128 channels
    `[M, ceil(H/128)]`. `scale = amax / qmax`; values rounded half to even when `rounds`.
    Returns `(data, scale)`.
    """
    m, h = x.shape
    q = torch.empty((m, h), dtype=target, device=x.device)
    if group is None:
        scale = torch.empty((m,), dtype=torch.float32, device=x.device)
        block = next_power_of_2(h)
        loop = block > MAX_SINGLE_PASS
        block = min(block, 4096) if loop else block
        groups, stride_sg = 1, 0
    else:
        groups = cdiv(h, group)
        scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
        block, loop, stride_sg = group, False, scale.stride(1) if m else 1
    rows = 1 if loop else max(1, TILE_ELEMENTS // block)  # one variant per width: masked rows cost no traffic
    if m:
        launch(
            _quantize_rows,
            (cdiv(m, rows), groups),
            x,
            q,
            scale,
            m,
            h,
            x.stride(0),
            q.stride(0),
            scale.stride(0),
            stride_sg,
            QMAX=qmax,
            ROUND=rounds,
            ROWS=rows,
            BLOCK=block,
            LOOP=loop,
            PDL=pdl,
            num_warps=4 if rows * block <= 4096 else 8,
            launch_pdl=pdl,
        )
    return q, scale


# M changes with every batch and only bounds a mask.
@triton.jit(do_not_specialize=["M"])
def _dequantize_rows(
    q_ptr,
    s_ptr,
    out_ptr,
    M,
    H,
    stride_q,
    stride_s,
    stride_sg,
    stride_out,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    release_next(PDL)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < M)[:, None] & (cols < H)[None, :]
    v = tl.load(q_ptr + rows[:, None] * stride_q + cols[None, :], mask=mask).to(tl.float32)
    s = tl.load(s_ptr + rows[:, None] * stride_s + (cols // GROUP)[None, :] * stride_sg, mask=mask, other=0.0)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], (v * s).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_rows(
    q: torch.Tensor, scale: torch.Tensor, group: int | None, out_dtype: torch.dtype, *, pdl: bool = False
) -> torch.Tensor:
    """`q` `[M, H]` (one-byte, contiguous last dim) times its fp32 `scale` (`group=None`: `[M, 1]` or `[M]`, one per
    row; `group=128`: `[M, ceil(H/128)]`), the product taken in fp32 and rounded once to `out_dtype`."""
    m, h = q.shape
    out = torch.empty((m, h), dtype=out_dtype, device=q.device)
    block = min(next_power_of_2(h), 1024)
    rows = max(1, TILE_ELEMENTS // block)
    scale = scale.reshape(m, -1)
    if m and h:
        launch(
            _dequantize_rows,
            (cdiv(m, rows), cdiv(h, block)),
            q,
            scale,
            out,
            m,
            h,
            q.stride(0),
            scale.stride(0),
            0 if group is None else scale.stride(1),
            out.stride(0),
            GROUP=1 if group is None else group,
            ROWS=rows,
            BLOCK=block,
            PDL=pdl,
            num_warps=4,
            launch_pdl=pdl,
        )
    return out
