"""W4A4-INT4: packed int4 weights, per-token int4 activations quantized after dispatch."""

from __future__ import annotations

import torch

from hal import KNOWN_SCHEMES, GemmKind
from moe.schemes.base import QuantScheme


class W4A4Int4(QuantScheme):
    """int4 x int4 grouped GEMMs. No dispatcher carries int4, so rows travel as bf16 and are
    quantized to int4 on the expert's side; H and I must be multiples of 8 (the packing).
    """

    traits = KNOWN_SCHEMES["w4a4-int4"]
    gemm_kinds = (GemmKind.INT4,)
    staging_dtype = torch.bfloat16
