"""`hal.Vendor.overlap`, `hal.Vendor.graph_set` and `hal.Vendor.launch_plan_set`: work beside the caller's, and captured calls (a mixin of
`Vendor`; checked here, computed by the vendor's ops)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hal.errors import UnsupportedCapability, invalid
from hal.graphs import GraphSet
from hal.ops import VendorOps

if TYPE_CHECKING:
    from hal.capabilities import Capabilities


class ConcurrencyOps:
    """Concurrent work and captured calls, checked once for every vendor."""

    name: str
    ops: VendorOps
    device: Any

    capabilities: Callable[[], Capabilities]  # provided by `hal.Platform`

    def overlap(self, work: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Run `work` (a function of hal ops returning a tensor) concurrently with what the caller issues
        next, where the vendor can (CUDA: a second stream); returns the function that joins it and gives
        its result. The MoE layer runs its shared experts this way beside the routed experts."""
        if not callable(work):
            raise invalid("work", "a callable", type(work).__name__)
        return self.ops.overlap(work)

    def graph_set(self) -> GraphSet:
        """A new `hal.GraphSet` on this vendor's device: calls captured once and replayed, sharing
        memory, one at a time. Needs `capabilities().graph_capture`."""
        caps = self.capabilities()
        if not caps.graph_capture:
            raise UnsupportedCapability(
                f"vendor {self.name!r} ({caps.device_name}) does not declare graph_capture (captured, replayed calls)"
            )
        graphs = self.ops.graph_set(self.device)
        if not isinstance(graphs, GraphSet):
            raise invalid(f"{self.name} graph_set result", "a hal.GraphSet", type(graphs).__name__)
        return graphs

    def launch_plan_set(self) -> GraphSet | None:
        """A new `hal.GraphSet` of launch plans on this vendor's device, or None where the vendor has none.

        A plan records one call's kernel launches and allocations and replays them with the caller's own
        tensors: no copies in or out, no memory held between calls, the output a new tensor equal to the
        plain call's bit for bit. A capture the set cannot record returns the function itself (it then runs
        as before). An eager `MoELayer` replays its forward this way (`moe.LaunchPlans`)."""
        plans = self.ops.launch_plan_set(self.device)
        if plans is not None and not isinstance(plans, GraphSet):
            raise invalid(f"{self.name} launch_plan_set result", "a hal.GraphSet or None", type(plans).__name__)
        return plans
