"""`hal.Vendor.accumulate_counts`: load counters updated on the device (a mixin of `Vendor`; checked here,
computed by the vendor's ops)."""

from __future__ import annotations

from typing import Any

import torch

from hal import checks
from hal.errors import invalid
from hal.ops import VendorOps

_INTEGER = (torch.int32, torch.int64)


class StatisticsOps:
    """Counters a layer keeps on the device, checked once for every vendor."""

    ops: VendorOps
    device: Any

    def accumulate_counts(
        self, values: torch.Tensor, total: torch.Tensor, ring: torch.Tensor, step: torch.Tensor, *, ids: bool
    ) -> None:
        """Add one call's counts to counters in place, with no host read.

        `values`: expert ids `[N]` in `[0, B)`, counted per id (`ids=True`; ids outside the range are not
        counted), or counts `[B]` (`ids=False`). They are added to `total` `[B]` and to row `step % R` of
        `ring` `[R, B]`; then `step` `[1]` grows by one and the ring's next row is zeroed, so `ring.sum(0)`
        holds the last `R - 1` calls. Counters are int64, `values` int32 or int64, all on the vendor's device.
        """
        for name, t in (("values", values), ("total", total), ("ring", ring), ("step", step)):
            if not isinstance(t, torch.Tensor):
                raise invalid(name, "a tensor", type(t).__name__)
            checks.on_device(name, t, self.device)
        if not isinstance(ids, bool):
            raise invalid("ids", "True or False", ids)
        for name, t in (("total", total), ("ring", ring), ("step", step)):
            if t.dtype != torch.int64 or not t.is_contiguous():
                raise invalid(name, "a contiguous int64 tensor", f"{t.dtype}, strides {tuple(t.stride())}")
        bins = total.shape[0] if total.dim() == 1 else -1
        if bins < 1 or ring.dim() != 2 or ring.shape[0] < 2 or ring.shape[1] != bins or step.shape != (1,):
            raise invalid(
                "counters",
                "total [B], ring [R >= 2, B] and step [1]",
                f"{tuple(total.shape)}, {tuple(ring.shape)}, {tuple(step.shape)}",
            )
        if values.dtype not in _INTEGER or values.dim() != 1 or (not ids and values.shape[0] != bins):
            want = "ids [N]" if ids else f"counts [{bins}]"
            raise invalid("values", f"int32 or int64 {want}", f"{values.dtype} {tuple(values.shape)}")
        self.ops.accumulate_counts(values, total, ring, step, ids=ids)
