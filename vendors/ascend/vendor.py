"""The Ascend vendor: Huawei NPUs through torch_npu, bound through one `NpuBinding` object.

`AscendVendor()` binds the real torch_npu when probed (imported only then);
`vendors.ascend.emulation.vendor.EmulatedAscendVendor` is the same class bound to the
torch_npu emulation on the CPU. Nothing here asks which of the two it is: every op goes
through the binding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from hal import Capabilities, ProbeResult, UnsupportedCapability, Vendor, VendorOps
from vendors.ascend.binding import BindingUnavailable, NpuBinding, load_torch_npu
from vendors.ascend.capabilities import DECLARED_MODELS, ascend_capabilities, generation_of
from vendors.ascend.ops import AscendOps


class AscendVendor(Vendor):
    """Huawei Ascend NPUs (Atlas A2/A3; A5 with fp8) through torch_npu.

    `binding` is the runtime to drive: an `NpuBinding`, or a function building one (it may
    raise `BindingUnavailable`, which becomes the probe's reason). Default: the real
    torch_npu of this host.
    """

    name = "ascend"
    priority = 90
    description = "Huawei Ascend NPUs through torch_npu (Atlas A2/A3)"

    def __init__(self, binding: NpuBinding | Callable[[], NpuBinding] | None = None) -> None:
        super().__init__()
        if binding is None:
            binding = load_torch_npu
        self._load: Callable[[], NpuBinding] = binding if callable(binding) else (lambda: binding)
        self._binding: NpuBinding | None = None

    def _probe_once(self) -> ProbeResult:
        try:
            binding = self._load()
        except BindingUnavailable as exc:
            return ProbeResult.unavailable(str(exc))
        self._binding = binding
        return ProbeResult.ok(binding.summary())

    @property
    def binding(self) -> NpuBinding:
        """The bound runtime (requires availability)."""
        self.require_available()
        if self._binding is None:  # the probe succeeded, so it set the binding
            raise UnsupportedCapability(f"vendor {self.name!r}: no runtime is bound")
        return self._binding

    def devices(self) -> list[torch.device]:
        return [self.binding.device]

    def _detect_capabilities(self) -> Capabilities:
        binding = self.binding
        soc = binding.soc_name
        name = f"{soc} ({binding.label})"
        fused, mc2 = binding.deep_ep is not None, binding.comm_name is not None
        generation = generation_of(soc)
        if generation is None:
            return ascend_capabilities(
                name, "A2", (f"unrecognised SoC {soc!r}: using the A2 table",), fused=fused, mc2=mc2
            )
        return ascend_capabilities(name, generation, fused=fused, mc2=mc2)

    def declared_models(self) -> Mapping[str, Capabilities]:
        return DECLARED_MODELS

    def _make_ops(self) -> VendorOps:
        """The torch_npu ops of the bound runtime."""
        return AscendOps(self.binding)
