"""The Ascend vendor: Huawei NPUs through torch_npu (imported lazily, only when probing).

`vendors.ascend.emulation` holds the torch_npu emulation and `EmulatedAscendVendor`
(entry point `ascend-emulated`), the same vendor bound to it on the CPU.
"""

from vendors.ascend.vendor import AscendVendor

__all__ = ["AscendVendor"]
