"""An emulation of the torch_npu ops the Ascend vendor calls, emulated by computing on the CPU."""

from vendors.ascend.emulation.torch_npu_ops import EmulatedTorchNpu

__all__ = ["EmulatedTorchNpu"]
