"""Unquantized experts: bf16, fp16 or fp32 weights; dispatch bf16 unless configured otherwise."""

from __future__ import annotations

import torch

from hal import KNOWN_SCHEMES, GemmKind, invalid
from moe.schemes.base import QuantScheme

_KINDS = {torch.bfloat16: GemmKind.BF16, torch.float16: GemmKind.FP16, torch.float32: GemmKind.FP32}


class Unquantized(QuantScheme):
    """Float expert weights stored in `dtype`; dispatched rows are brought to that dtype."""

    traits = KNOWN_SCHEMES["unquantized"]
    gemm_kinds = tuple(_KINDS.values())

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        if dtype not in _KINDS:
            raise invalid("dtype", "torch.bfloat16, torch.float16 or torch.float32", dtype)
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"Unquantized(dtype={self.dtype})"

    def gemm_kind(self) -> GemmKind:
        """bf16, fp16 or fp32, after the weight dtype."""
        return _KINDS[self.dtype]
