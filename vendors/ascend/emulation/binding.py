"""`emulated_binding`: the Ascend vendor's binding on the torch_npu emulation (CPU tensors)."""

from __future__ import annotations

import torch

from vendors.ascend.binding import NpuBinding
from vendors.ascend.emulation.deep_ep import EmulatedDeepEp
from vendors.ascend.emulation.torch_npu_ops import EmulatedTorchNpu

#: The SoC the emulated binding reports unless told otherwise (an Atlas A2 part).
DEFAULT_SOC = "Ascend910B3"


def emulated_binding(soc_name: str = DEFAULT_SOC, *, deep_ep: bool = True) -> NpuBinding:
    """A binding whose ops are the torch_npu emulation on the CPU, for the SoC `soc_name`.

    `deep_ep` adds the emulated Ascend DeepEP port (so W8A8-INT8 `fused_deep_moe` is declared).
    """
    npu = EmulatedTorchNpu(soc_name)
    return NpuBinding(
        ops=npu,
        device=torch.device("cpu"),
        soc_name=soc_name,
        device_count=1,
        deep_ep=EmulatedDeepEp(npu) if deep_ep else None,
        label=f"torch_npu{' and the Ascend DeepEP port' if deep_ep else ''} EMULATED on the CPU",
    )
