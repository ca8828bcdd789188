"""Activation quantization in one pass over the input (Triton).

Per token: one program per row loads the row once, takes its max |x|, and writes the
scaled, rounded (int8) or cast (fp8 e4m3) values and the row's fp32 scale. Per 128-channel
group: one program per (row, group). `scale = amax / qmax`; an all-zero row or group gets
scale 0 and data 0. Every row is independent (a non-finite row never touches another),
and nothing is read back on the host, so the kernels can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Rows longer than this are quantized per token in a two-pass loop instead of one load.
MAX_SINGLE_PASS = 16384
#: Adding and subtracting 1.5 * 2^23 rounds an fp32 of magnitude below 2^22 to the nearest
#: integer, ties to even (the fp32 adder's own rounding), without a libdevice call.
_RNE_SHIFT: tl.constexpr = tl.constexpr(12582912.0)


@triton.jit
def _quantize_rows(x_ptr, q_ptr, s_ptr, H, stride_x, stride_q, stride_s, stride_sg,
                   QMAX: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr, LOOP: tl.constexpr):
    row = tl.program_id(0)
    group = tl.program_id(1)
    first = group * BLOCK
    cols = first + tl.arange(0, BLOCK)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    q_row = q_ptr + row.to(tl.int64) * stride_q
    if LOOP:  # a row too long for one block: max first, then quantize (reads the row twice)
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
    else:
        mask = cols < H
        v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        top = tl.max(tl.abs(v), axis=0)
        step = top / QMAX
        q = v / tl.where(step == 0.0, 1.0, step)
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
        if ROUND:
            q = (q + _RNE_SHIFT) - _RNE_SHIFT
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row.to(tl.int64) * stride_s + group * stride_sg, step)


def quantize_rows(x: torch.Tensor, target: torch.dtype, group: int | None, *, qmax: float,
                  rounds: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization of `x` `[M, H]` (contiguous last dim) to a one-byte `target` (int8, float8_e4m3fn).

    `group=None`: one fp32 scale per row `[M]`; `group=128`: one per row and 128 channels
    `[M, ceil(H/128)]`. `scale = amax / qmax`; values rounded half to even when `rounds`.
    Returns `(data, scale)`.
    """
    m, h = x.shape
    q = torch.empty((m, h), dtype=target, device=x.device)
    if group is None:
        scale = torch.empty((m,), dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(h)
        loop = block > MAX_SINGLE_PASS
        block = min(block, 4096) if loop else block
        grid, stride_sg = (m, 1), 0
    else:
        groups = triton.cdiv(h, group)
        scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
        block, loop, grid, stride_sg = group, False, (m, groups), scale.stride(1) if m else 1
    if m:
        _quantize_rows[grid](x, q, scale, h, x.stride(0), q.stride(0), scale.stride(0), stride_sg,
                             QMAX=qmax, ROUND=rounds, BLOCK=block, LOOP=loop,
                             num_warps=4 if block <= 2048 else 8)
    return q, scale
