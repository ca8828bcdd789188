"""The Ascend vendor: Huawei NPUs through torch_npu (imported lazily, only when probing)."""

from vendors.ascend.vendor import AscendVendor

__all__ = ["AscendVendor"]
