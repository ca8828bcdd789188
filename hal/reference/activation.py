"""Reference activations of the experts' intermediate result."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hal import checks


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :I]) * x[..., I:]` for `x` of shape `[..., 2I]`, computed in fp32, returned in x.dtype."""
    return silu_glu(checks.swiglu_input(x))


def silu_glu(x: torch.Tensor) -> torch.Tensor:
    """`swiglu` of a checked input."""
    half = x.shape[-1] // 2
    xf = x.to(torch.float32)
    return (F.silu(xf[..., :half]) * xf[..., half:]).to(x.dtype)
