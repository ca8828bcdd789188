"""The fp8 block-128 grouped GEMM with its tiles loaded by the tensor memory accelerator (sm90+, Triton).

The same product, schedule and scales as `grouped_gemm`'s block-scaled path (`SCALE_BLOCK128`),
for the calls whose operands a TMA descriptor can describe: x contiguous `[M, K]` (its rows not
read through an index), w stored K-major (`[E, N, K]` in memory, as `CudaOps.prepare_weight`
keeps one-byte weights), K a multiple of 16 (16-byte row strides). Each K step's x and w tiles
arrive as bulk copies instead of per-thread loads; rows past a group's end are read from the
next group (or zero-filled past the tensor) and never stored.

Measured on an H100 (graph replays, top-8 routing), the down projection at prefill:
qwen3-30b-a3b 622 against 775 µs (pointer loads, its tuned tiles) at 131072 rows, 199 against 250
at 32768; deepseek-v3-ep8 4850 against 5086 at 131072. The gated first projection was no faster
this way (389-1111 µs with pointer loads, 395-1310 with TMA), so which kernel runs is a tile
setting (`TileConfig.tma`) that `hal tune` measures per problem and row count.

A program's columns must lie in one 128-column weight-scale block (`block_n` dividing 128; gated:
the output width a multiple of 128), so each K step's weight scale is one number.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vendors.cuda.kernels.launch import cdiv, launch, next_power_of_2
from vendors.cuda.kernels.dependent import release_next, wait_for_previous
from vendors.cuda.kernels.schedule import program_tile

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host-side tensor descriptors: the pointer kernel runs instead
    TensorDescriptor = None

#: A descriptor's strides must be multiples of 16 bytes (one-byte elements: K a multiple of 16).
TMA_ALIGN = 16


@triton.jit(do_not_specialize=["M", "E", "M_BLOCKS"])
def _grouped_gemm_tma(
    x_desc,
    w_desc,
    y_ptr,
    xs_ptr,
    ws_ptr,
    counts_ptr,
    M,
    N,
    K,
    E,
    M_BLOCKS,
    W_ROWS,
    stride_ym,
    stride_xsm,
    stride_xsk,
    stride_wse,
    stride_wsk,
    stride_wsn,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    N_FASTEST: tl.constexpr,
    GROUP_M: tl.constexpr,
    GATED: tl.constexpr,
    PDL: tl.constexpr,
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
    w_row = group * W_ROWS + pid_n * BLOCK_N  # the column block's first row of w's [E * N_all, K] view
    xs_rows = xs_ptr + rows.to(tl.int64) * stride_xsm
    w_s = ws_ptr + group.to(tl.int64) * stride_wse
    gate_s = w_s + (pid_n * BLOCK_N // 128) * stride_wsn
    up_s = w_s + ((pid_n * BLOCK_N + N) // 128) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // BLOCK_K
        a = x_desc.load([row0, k0])
        a_s = tl.load(xs_rows + kb * stride_xsk, mask=row_ok, other=0.0)
        b = w_desc.load([w_row, k0])
        acc += tl.dot(a, b.T) * (a_s * tl.load(gate_s + kb * stride_wsk))[:, None]
        if GATED:
            b_up = w_desc.load([w_row + N, k0])
            acc_up += tl.dot(a, b_up.T) * (a_s * tl.load(up_s + kb * stride_wsk))[:, None]
    release_next(PDL)
    out = acc
    if GATED:
        out = out / (1.0 + tl.exp(-out)) * acc_up
    y = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y, out.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


def tma_fits(x: torch.Tensor, w: torch.Tensor, *, block_n: int, block_k: int, gated: bool, gathered: bool) -> bool:
    """Whether the TMA kernel can run this block-scaled call (else the pointer kernel runs it)."""
    if TensorDescriptor is None or gathered or block_k != 128 or 128 % block_n:
        return False
    _, k, n_all = w.shape
    if gated and (n_all // 2) % 128:
        return False
    if x.device.type == "cuda" and not _has_tma(x.device.index):  # (the interpreter's tensors are on the CPU)
        return False
    return (
        x.dim() == 2
        and x.stride(1) == 1
        and x.stride(0) % TMA_ALIGN == 0
        and k % TMA_ALIGN == 0
        and w.stride() == (k * n_all, 1, k)
        and x.data_ptr() % TMA_ALIGN == 0
        and w.data_ptr() % TMA_ALIGN == 0
    )


@functools.lru_cache(maxsize=None)
def _has_tma(device_index: int) -> bool:
    """Whether the device has the tensor memory accelerator (sm90+); asked once per device, as every
    block-scaled GEMM call checks it on the host."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def grouped_gemm_tma(
    x: torch.Tensor,
    w: torch.Tensor,
    counts: torch.Tensor,
    y: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    block_m: int,
    block_n: int,
    warps: int,
    stages: int,
    n_fastest: bool,
    group_m: int,
    gated: bool,
    pdl: bool,
) -> torch.Tensor:
    """Write `y` `[M, N]` (N: w's columns, halved when `gated`) from a call `tma_fits` accepted.

    `x_scale` `[M, ceil(K/128)]`, `w_scale` `[E, ceil(K/128), ceil(N_all/128)]`."""
    m, k = x.shape
    e, _, n_all = w.shape
    n = y.shape[1]
    x_desc = TensorDescriptor.from_tensor(x, [block_m, 128])
    w_desc = TensorDescriptor(w, [e * n_all, k], [k, 1], [block_n, 128])  # w's storage: [E, N_all, K]
    m_blocks = m // block_m + min(e, m)
    launch(
        _grouped_gemm_tma,
        (m_blocks * cdiv(n, block_n),),
        x_desc,
        w_desc,
        y,
        x_scale,
        w_scale,
        counts,
        m,
        n,
        k,
        e,
        m_blocks,
        n_all,
        y.stride(0),
        x_scale.stride(0),
        x_scale.stride(1),
        w_scale.stride(0),
        w_scale.stride(1),
        w_scale.stride(2),
        E_PAD=max(16, next_power_of_2(e)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=128,
        N_FASTEST=n_fastest,
        GROUP_M=group_m,
        GATED=gated,
        PDL=pdl,
        num_warps=warps,
        num_stages=stages,
        launch_pdl=pdl,
    )
    return y
