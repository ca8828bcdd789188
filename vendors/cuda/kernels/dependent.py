"""Programmatic dependent launch (sm90+, `launch_pdl=True`).

A kernel so launched may be scheduled before the kernel ahead of it in the stream has
finished: its launch overlaps that kernel's tail instead of following it. Every such kernel
first waits (`griddepcontrol.wait`) until the kernel ahead has finished and its writes are
visible; only then does it read anything, so results are bit-equal to plain launches.

When a kernel lets the next one launch is a measured choice (H100, qwen3-30b-a3b, mixtral-8x7b,
deepseek-v3-ep8 layers, 1-4096 tokens, CUDA-graph replays): the small kernels (routing, sort,
quantize, swiglu, combine) right after their wait; the grouped GEMM after its main loop. Letting
the GEMM release at its start slowed mixtral at 8 tokens by 1.1 %: the next kernel's programs
took places on the SMs while the GEMM's own still ran.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """The start of a kernel launched dependently: wait until the kernel ahead has finished."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    """Let the next kernel in the stream launch (its programs wait for this kernel to finish)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
