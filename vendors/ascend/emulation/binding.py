"""`emulated_binding`: the Ascend vendor's binding on the torch_npu emulation (CPU tensors)."""

from __future__ import annotations

import torch

from vendors.ascend.binding import NpuBinding
from vendors.ascend.emulation.deep_ep import EmulatedDeepEp
from vendors.ascend.emulation.torch_npu_ops import EmulatedTorchNpu
from vendors.ascend.emulation.versions import DEFAULT_VERSION

#: The SoC the emulated binding reports unless told otherwise: an Atlas A3 part, the first
#: generation the Ascend DeepEP port's fused kernel is built for (A2 has none).
DEFAULT_SOC = "Ascend910_9392"


def emulated_binding(
    soc_name: str = DEFAULT_SOC, *, deep_ep: bool = True, torch_npu_version: str = DEFAULT_VERSION
) -> NpuBinding:
    """A binding whose ops are the torch_npu emulation on the CPU, for the SoC `soc_name`.

    `deep_ep` adds the emulated Ascend DeepEP port (so W8A8-INT8 `fused_deep_moe` is declared);
    `torch_npu_version` picks the modelled torch-npu op schemas ("2.8", "2.10", "2.13").
    """
    npu = EmulatedTorchNpu(soc_name, torch_npu_version)
    return NpuBinding(
        ops=npu,
        device=torch.device("cpu"),
        soc_name=soc_name,
        device_count=1,
        deep_ep=EmulatedDeepEp(npu) if deep_ep else None,
        label=f"torch_npu {npu.version}{' and the Ascend DeepEP port' if deep_ep else ''} EMULATED on the CPU",
        comm_name=npu.register_group,
    )
