"""W8A8-INT8: per-channel int8 weights, dynamic per-token int8 activations; dispatch int8."""

from __future__ import annotations

from hal import KNOWN_SCHEMES, GemmKind
from moe.schemes.base import QuantScheme


class W8A8Int8(QuantScheme):
    """int8 x int8 grouped GEMMs with per-token activation and per-channel weight scales.

    Where the vendor carries int8 as another dtype (CUDA carries it as fp8), the
    dispatched rows are dequantized and quantized to int8 again before the GEMM.
    """

    traits = KNOWN_SCHEMES["w8a8-int8"]
    gemm_kinds = (GemmKind.INT8,)
