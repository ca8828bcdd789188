"""The CUDA vendor's load counters (`hal.Vendor.accumulate_counts`): a Triton launch or two, no host read."""

from __future__ import annotations

import torch

from vendors.cuda.kernels import counting


class CountingOps:
    """`accumulate_counts` on the device (a mixin of the CUDA vendor's ops)."""

    pdl: bool
    notes = {
        "accumulate_counts": f"Triton: one launch up to {counting.ONE_PROGRAM_IDS} ids (histogram, ring row, "
        "step), a launch of many programs with atomics and a one-program step above"
    }

    def accumulate_counts(
        self, values: torch.Tensor, total: torch.Tensor, ring: torch.Tensor, step: torch.Tensor, *, ids: bool
    ) -> None:
        """Histogram (or add) `values` into the counters in place (see `hal.Vendor.accumulate_counts`)."""
        counting.accumulate_counts(values.contiguous(), total, ring, step, ids=ids, pdl=self.pdl)
