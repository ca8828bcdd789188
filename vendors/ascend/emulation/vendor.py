"""`EmulatedAscendVendor`: the Ascend vendor bound to the torch_npu emulation (entry point `ascend-emulated`)."""

from __future__ import annotations

from vendors.ascend.binding import NpuBinding
from vendors.ascend.emulation.binding import DEFAULT_SOC, emulated_binding
from vendors.ascend.vendor import AscendVendor


class EmulatedAscendVendor(AscendVendor):
    """The Ascend vendor bound to the torch_npu EMULATION on the CPU: for tests and CI, not an NPU.

    `soc_name` picks the emulated chip (default an Atlas A2 part); `deep_ep=False` leaves out
    the emulated Ascend DeepEP port, so no fused op is declared.
    """

    name = "ascend-emulated"
    # Far below the CPU reference vendor: never selected unless asked for by name.
    priority = -50
    description = "EMULATED: the Ascend vendor on a CPU emulation of torch_npu (tests and CI, not an NPU)"

    def __init__(self, soc_name: str | None = None, *, deep_ep: bool = True) -> None:
        def bind() -> NpuBinding:
            return emulated_binding(soc_name or DEFAULT_SOC, deep_ep=deep_ep)

        super().__init__(bind)
