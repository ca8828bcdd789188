"""Load counters updated on the device (Triton): one call's per-expert counts added to a cumulative
vector and to the current row of a ring, the ring's step advanced and its next row zeroed.

Up to `ONE_PROGRAM_IDS` ids (decode and small prefill) one program does all of it in one launch: it
histograms the ids in chunks, so nothing else needs ordering. Above, programs of `BLOCK` ids add their
histograms with atomics and a second one-program launch advances the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vendors.cuda.kernels.launch import cdiv, launch, next_power_of_2
from vendors.cuda.kernels.dependent import release_next, wait_for_previous

#: The most ids counted by one program (one launch); more take a launch of many programs and a second.
ONE_PROGRAM_IDS = 16384
#: Ids per histogram chunk.
BLOCK = 2048


@triton.jit(do_not_specialize=["N"])
def _accumulate(
    values_ptr,
    N,
    total_ptr,
    ring_ptr,
    step_ptr,
    B,
    R,
    IDS: tl.constexpr,
    BINS: tl.constexpr,
    BLOCK: tl.constexpr,
    FINISH: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    release_next(PDL)
    step = tl.load(step_ptr)
    row = step % R
    bins = tl.arange(0, BINS)
    in_range = bins < B
    if IDS:
        offs = tl.arange(0, BLOCK)
        counts = tl.zeros((BINS,), dtype=tl.int32)
        if FINISH:  # one program: every chunk
            for start in range(0, N, BLOCK):
                ids = tl.load(values_ptr + start + offs, mask=start + offs < N, other=-1).to(tl.int32)
                counts += tl.histogram(ids, BINS, mask=(ids >= 0) & (ids < B))
        else:  # one chunk per program
            start = tl.program_id(0).to(tl.int64) * BLOCK
            ids = tl.load(values_ptr + start + offs, mask=start + offs < N, other=-1).to(tl.int32)
            counts = tl.histogram(ids, BINS, mask=(ids >= 0) & (ids < B))
        counts = counts.to(tl.int64)
    else:
        counts = tl.load(values_ptr + bins, mask=in_range, other=0).to(tl.int64)
    if FINISH:
        tl.store(total_ptr + bins, tl.load(total_ptr + bins, mask=in_range) + counts, mask=in_range)
        here = ring_ptr + row * B + bins
        tl.store(here, tl.load(here, mask=in_range) + counts, mask=in_range)
        tl.store(step_ptr, step + 1)
        tl.store(ring_ptr + ((step + 1) % R) * B + bins, tl.zeros((BINS,), dtype=tl.int64), mask=in_range)
    else:
        hit = in_range & (counts > 0)
        tl.atomic_add(total_ptr + bins, counts, mask=hit)
        tl.atomic_add(ring_ptr + row * B + bins, counts, mask=hit)


def accumulate_counts(
    values: torch.Tensor, total: torch.Tensor, ring: torch.Tensor, step: torch.Tensor, *, ids: bool, pdl: bool = False
) -> None:
    """`hal.Vendor.accumulate_counts` on the device (checked arguments; contiguous `values`)."""
    n = values.shape[0]
    bins, rows = total.shape[0], ring.shape[0]
    common = {"BINS": next_power_of_2(bins), "BLOCK": BLOCK, "PDL": pdl, "launch_pdl": pdl}
    warps = 4 if common["BINS"] <= 1024 else 8
    if not ids or n <= ONE_PROGRAM_IDS:
        launch(
            _accumulate, (1,), values, n, total, ring, step, bins, rows, IDS=ids, FINISH=True, num_warps=warps, **common
        )
        return
    launch(
        _accumulate,
        (cdiv(n, BLOCK),),
        values,
        n,
        total,
        ring,
        step,
        bins,
        rows,
        IDS=True,
        FINISH=False,
        num_warps=warps,
        **common,
    )
    # the step and the next row, after every program's atomics (N = 0: nothing more is counted)
    launch(
        _accumulate, (1,), values, 0, total, ring, step, bins, rows, IDS=True, FINISH=True, num_warps=warps, **common
    )
