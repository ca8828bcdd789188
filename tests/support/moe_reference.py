"""The float64 MoE reference of the layer tests: the conformance suite's own, re-exported here."""

from __future__ import annotations

from conformance.reference import (
    bf16,
    emulated_integer_moe,
    moe as reference_moe,
    random_weights,
    relative_error,
    seed_of,
    softmax_topk,
    symmetric_roundtrip,
)
from conformance.tolerances import LAYER_TOLERANCE as TOLERANCE

#: Bounds against `emulated_integer_moe` on the CPU reference vendor, tighter than the suite's
#: (which leaves room for other vendors' rounding): what is left is the bf16 outputs' rounding.
EMULATED_TOLERANCE = {"w8a8-int8": 0.006, "w4a4-int4": 0.006}  # 0.0026 worst measured

__all__ = [
    "EMULATED_TOLERANCE",
    "TOLERANCE",
    "bf16",
    "emulated_integer_moe",
    "reference_moe",
    "random_weights",
    "relative_error",
    "seed_of",
    "softmax_topk",
    "symmetric_roundtrip",
]
