"""Reference activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hal.errors import invalid
from hal.formats import FLOAT_DTYPES


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :I]) * x[..., I:]` for `x` of shape `[..., 2I]`, computed in fp32, returned in x.dtype."""
    if not isinstance(x, torch.Tensor):
        raise invalid("x", "a torch.Tensor", type(x).__name__)
    if x.dtype not in FLOAT_DTYPES:
        raise invalid("x", "a bf16, fp16 or fp32 tensor", x.dtype)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise invalid("x", "a last dimension of even size [..., 2I]", tuple(x.shape))
    half = x.shape[-1] // 2
    xf = x.to(torch.float32)
    return (F.silu(xf[..., :half]) * xf[..., half:]).to(x.dtype)
