"""W8A8-FP8 block scaled (DeepSeek-V3 checkpoints): 128x128 weight tiles, 128-channel activation groups."""

from __future__ import annotations

from hal import KNOWN_SCHEMES, GemmKind
from moe.schemes.base import QuantScheme


class W8A8Fp8Block(QuantScheme):
    """fp8 e4m3 grouped GEMMs: weights with one scale per 128x128 tile, activations per 128 channels.

    Rows carried in another dtype (int8 on Ascend, or fp8 with per-token scales) are
    dequantized and quantized again in the 128-channel-group layout.
    """

    traits = KNOWN_SCHEMES["w8a8-fp8-block"]
    gemm_kinds = (GemmKind.FP8_BLOCK128,)
