"""`EmulatedAscendVendor`: the Ascend vendor bound to the torch_npu emulation (entry point `ascend-emulated`)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from vendors.ascend.binding import NpuBinding
from vendors.ascend.emulation.binding import DEFAULT_SOC, emulated_binding
from vendors.ascend.emulation.versions import DEFAULT_VERSION, VERSION_VARIABLE, check_version
from vendors.ascend.vendor import AscendVendor


class EmulatedAscendVendor(AscendVendor):
    """The Ascend vendor bound to the torch_npu EMULATION on the CPU: for tests and CI, not an NPU.

    `soc_name` picks the emulated chip (default an Atlas A3 part); `deep_ep=False` leaves out
    the emulated Ascend DeepEP port, so no fused op is declared. `torch_npu_version` picks the
    modelled torch-npu op schemas ("2.8", "2.10", "2.13"); when it is None, the variable
    `MOE_HAL_EMULATED_TORCH_NPU` of `environ` (default: the process environment, read once
    here, never written) decides, else 2.13. An unmodelled version is refused here.
    """

    name = "ascend-emulated"
    # Far below the CPU reference vendor: never selected unless asked for by name.
    priority = -50
    description = "EMULATED: the Ascend vendor on a CPU emulation of torch_npu (tests and CI, not an NPU)"

    def __init__(
        self,
        soc_name: str | None = None,
        *,
        deep_ep: bool = True,
        torch_npu_version: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        if torch_npu_version is None:
            torch_npu_version = (os.environ if environ is None else environ).get(VERSION_VARIABLE) or DEFAULT_VERSION
        version = check_version(torch_npu_version)
        self.torch_npu_version = version

        def bind() -> NpuBinding:
            return emulated_binding(soc_name or DEFAULT_SOC, deep_ep=deep_ep, torch_npu_version=version)

        super().__init__(bind)
