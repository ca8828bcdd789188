"""Quant schemes: each owns its weight format, declares its dispatch dtype, computes its experts."""

from __future__ import annotations

import torch

from hal import InvalidInput, invalid, parse_scheme
from moe.schemes.base import ExpertWeights, GemmOperand, QuantScheme, Quantizer, check_float_weights
from moe.schemes.nvfp4 import NvFp4, nvfp4_global_scale
from moe.schemes.unquantized import Unquantized
from moe.schemes.w4a4_int4 import W4A4Int4
from moe.schemes.w8a8_fp8 import W8A8Fp8
from moe.schemes.w8a8_fp8_block import W8A8Fp8Block
from moe.schemes.w8a8_int8 import W8A8Int8
from moe.schemes.weight_only import W4A16MxFp4, W4A16NvFp4

#: Every scheme class, by the name `hal` knows it under (`hal.KNOWN_SCHEMES`).
SCHEMES: dict[str, type[QuantScheme]] = {
    cls.traits.name: cls
    for cls in (Unquantized, W8A8Int8, W8A8Fp8Block, W8A8Fp8, W4A4Int4, NvFp4, W4A16MxFp4, W4A16NvFp4)
}


_FLOAT_ALIASES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_scheme(spec: QuantScheme | str) -> QuantScheme:
    """A scheme object from a name (`"w8a8-int8"`, aliases as `hal` accepts) or the object itself.

    NVFP4 needs its checkpoint's global scales, so it is built as `NvFp4(...)`, not by name.
    """
    if isinstance(spec, QuantScheme):
        return spec
    if not isinstance(spec, str):
        raise invalid("scheme", "a moe.QuantScheme or a scheme name", type(spec).__name__)
    float_dtype = _FLOAT_ALIASES.get(str(spec).strip().lower())
    if float_dtype is not None:
        return Unquantized(float_dtype)
    traits = parse_scheme(spec)
    if traits.model_dtype is not None:  # a float dtype's other names ("float32", "half", ...)
        return Unquantized(traits.model_dtype.spec.storage)
    if traits.name == NvFp4.traits.name:
        raise InvalidInput(
            "scheme: 'nvfp4' needs the checkpoint's global scales; pass "
            "NvFp4(input_global_scale=..., intermediate_global_scale=...) instead of the name"
        )
    return SCHEMES[traits.name]()


__all__ = [
    "ExpertWeights",
    "GemmOperand",
    "QuantScheme",
    "Quantizer",
    "check_float_weights",
    "NvFp4",
    "nvfp4_global_scale",
    "Unquantized",
    "W4A4Int4",
    "W4A16MxFp4",
    "W4A16NvFp4",
    "W8A8Fp8",
    "W8A8Fp8Block",
    "W8A8Int8",
    "make_scheme",
    "SCHEMES",
]
