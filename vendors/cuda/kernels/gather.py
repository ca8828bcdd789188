"""Rows of activations taken through an index (Triton, one pass): `out[i] = src[index[i]]`.

The dispatch's gather before a grouped GEMM that does not read its rows through the index (one-byte rows
in large groups). torch's `index_select` / `aten.index` would do the same copy, but as a torch op it
cannot join a launch plan (`vendors.cuda.launch_plans`); this launch can. Rows move as 4-byte words
where their bytes divide by 4 (every fp8/int8 row of a hidden size that is a multiple of 4), else as
bytes, so the copy is the same bits whatever the dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vendors.cuda.kernels.dependent import release_next, wait_for_previous
from vendors.cuda.kernels.launch import cdiv, launch

#: Rows per program and words per row chunk (8 x 512 words: 16 KiB moved per program).
ROWS = 8
BLOCK = 512


@triton.jit(do_not_specialize=["M"])
def _gather_rows(src_ptr, index_ptr, out_ptr, M, W, ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    release_next(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = rows < M
    src_rows = tl.load(index_ptr + rows, mask=live, other=0).to(tl.int64)
    mask = live[:, None] & (cols[None, :] < W)
    words = tl.load(src_ptr + src_rows[:, None] * W + cols[None, :], mask=mask)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * W + cols[None, :], words, mask=mask)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous `[N, C]` tensor's rows as int32 words where they divide evenly, else as uint8 bytes."""
    raw = t.view(torch.uint8)
    return raw.view(torch.int32) if raw.shape[1] % 4 == 0 else raw


def gather_rows(src: torch.Tensor, index: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """`src[index]` for a 1-D or 2-D `src` and a 1-D int32/int64 `index` of rows that exist (not checked:
    the routing's sort wrote them). A `src` that is not contiguous is taken with `index_select`."""
    if src.dim() not in (1, 2) or not src.is_contiguous() or index.dim() != 1:
        return src.index_select(0, index)
    out = torch.empty((index.shape[0], *src.shape[1:]), dtype=src.dtype, device=src.device)
    if out.numel() == 0:
        return out
    words_in, words_out = _words(src.view(src.shape[0], -1)), _words(out.view(out.shape[0], -1))
    m, w = words_out.shape
    grid = (cdiv(m, ROWS), cdiv(w, BLOCK))
    launch(_gather_rows, grid, words_in, index, words_out, m, w, ROWS=ROWS, BLOCK=BLOCK, PDL=pdl, launch_pdl=pdl)
    return out
