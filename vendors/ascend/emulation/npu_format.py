"""Emulated NPU storage formats: `npu_format_cast` / `get_npu_format` on CPU tensors.

On an NPU, `torch_npu.npu_format_cast(t, 29)` returns the tensor stored as FRACTAL_NZ (ACL
format 29; 2 is ND) and `torch_npu.get_npu_format(t)` reports it. A CPU tensor has no storage
format, so the emulation TAGS the cast result: it is a copy with the same values and
shape, marked with the format it was cast to. Untagged tensors are ND. The tag is an
attribute of the Python tensor object, so it is lost by any op that makes a new tensor
(`clone`, `.to`, slicing): on hardware those keep NZ or fail, which is not modelled
(unverified). The Ascend DeepEP port's `fused_deep_moe` emulation reads the tag to reject
ND weights, as the kernel does (sgl-kernel-npu `tests/python/deepep/test_fused_deep_moe.py`
casts every weight to 29 before the call).
"""

from __future__ import annotations

import torch

ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29
_TAG = "_npu_storage_format"


def npu_format_cast(self: object, tensor: torch.Tensor, acl_format: int) -> torch.Tensor:
    """A copy of `tensor` tagged with `acl_format` (ND 2 or FRACTAL_NZ 29 only are emulated)."""
    if not isinstance(tensor, torch.Tensor):
        raise RuntimeError(f"npu_format_cast: expected a tensor, got {type(tensor).__name__}")
    if acl_format not in (ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ):
        raise NotImplementedError(f"npu_format_cast: acl_format {acl_format} is not emulated (only 2 and 29)")
    if acl_format == ACL_FORMAT_FRACTAL_NZ and tensor.dim() < 2:
        raise RuntimeError(f"npu_format_cast: FRACTAL_NZ needs at least 2 dimensions, got {tensor.dim()}")
    out = tensor.detach().clone()
    setattr(out, _TAG, acl_format)
    return out


def get_npu_format(self: object, tensor: torch.Tensor) -> int:
    """The emulated storage format of `tensor`: its tag, else ND (2)."""
    return int(getattr(tensor, _TAG, ACL_FORMAT_ND))
