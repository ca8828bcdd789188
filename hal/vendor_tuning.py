"""`hal.Vendor.tune`: the checked entry point of a vendor's kernel tuning (a mixin of `Vendor`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hal.errors import UnsupportedCapability, invalid
from hal.ops import VendorOps
from hal.tuning import GemmProblem

if TYPE_CHECKING:
    from hal.capabilities import Capabilities


class TuningOps:
    """Tuning, checked once for every vendor before its ops' `tune` runs."""

    name: str
    ops: VendorOps
    device: Any

    capabilities: Callable[[], Capabilities]  # provided by `hal.Platform`

    def check_tunable(self) -> None:
        """Raise `UnsupportedCapability` when this vendor has no kernel configurations to tune (its ops do not
        implement `tune`): callers ask before announcing or preparing a tuning run."""
        if type(self.ops).tune is VendorOps.tune:
            raise UnsupportedCapability(
                f"vendor {self.name!r} ({self.capabilities().device_name}) has no kernel configurations "
                "to tune (its ops do not implement tune); `hal caps` lists what it declares"
            )

    def tune(self, problems: Sequence[GemmProblem], *, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Time this vendor's kernel configurations for `problems` on its device and return its tuning
        table (JSON-able; the vendor documents where it reads tables from). `progress` receives a line
        per case. Vendors without tunable kernels raise `UnsupportedCapability`."""
        if not isinstance(problems, Sequence) or not problems or not all(isinstance(p, GemmProblem) for p in problems):
            raise invalid("problems", "a non-empty sequence of hal.GemmProblem", type(problems).__name__)
        problems = list(problems)
        if progress is not None and not callable(progress):
            raise invalid("progress", "a callable or None", type(progress).__name__)
        self.check_tunable()
        caps = self.capabilities()
        for problem in problems:
            if problem.kind not in caps.grouped_matmul:
                raise UnsupportedCapability(
                    f"vendor {self.name!r} ({caps.device_name}) does not declare the "
                    f"{problem.kind} grouped matmul, so it cannot tune it"
                )
        return self.ops.tune(problems, device=self.device, device_name=caps.device_name, progress=progress)
