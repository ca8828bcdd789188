"""Unquantized experts: bf16, fp16 or fp32 weights, dispatched in the model's own dtype.

The class's `traits` are the unquantized scheme's row (bf16 dispatch); an instance's
`traits` carry its weights' dtype as the model dtype (`SchemeTraits.with_model_dtype`), so
that an fp16 or fp32 model asks for fp16 or fp32 dispatch where the vendor carries it
(bf16 stays the default for bf16 weights). Explicit settings still win.
"""

from __future__ import annotations

import torch

from hal import KNOWN_SCHEMES, GemmKind, SchemeTraits, invalid
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
        #: This instance's traits: the scheme's row with the weights' dtype as the model dtype.
        self.traits: SchemeTraits = KNOWN_SCHEMES["unquantized"].with_model_dtype(dtype)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Unquantized(dtype={self.dtype})"

    def gemm_kind(self) -> GemmKind:
        """bf16, fp16 or fp32, after the weight dtype."""
        return _KINDS[self.dtype]
