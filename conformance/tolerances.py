"""Every error bound of the conformance suite, in one place.

References are float64. A bound is what the format or the output dtype cannot avoid
(one rounding of each quantized value, one rounding of each output), with a small
allowance for fp32 arithmetic; a wrong group, a wrong scale or a lost token exceeds
every bound by orders of magnitude.

| check | bound on the absolute error of each element (unless stated) |
|---|---|
| quantize (per dtype) | one rounding of each value: the table in `conformance.dtype_facts` |
| grouped matmul | `r(out) * |ref| + 2^-12 * (|a| @ |b|)`: output rounding plus fp32 accumulation |
| swiglu | `2 * r(out) * |ref| + 2^-16 * |gate * up|`: at most two roundings to the output dtype |
| weighted combine | `r(out) * |ref| + 4 * SLACK * sum |w * row|`: one output rounding, fp32 accumulation |
| dispatch round trip (identity experts) | the dtype's quantize bound plus `r(out) * |x|` |
| MoE layer | `||y - ref|| / ||ref||` at most `LAYER_TOLERANCE[(scheme, dispatch dtype)]` |
| MoE layer, integer schemes | also at most `EMULATED_LAYER_TOLERANCE` against the MoE rounded where the scheme rounds |
| MoE layer of an fp16 / fp32 model in its own dtype | `||y - ref|| / ||ref||` at most `MODEL_DTYPE_LAYER_TOLERANCE[dtype]` |
| fused_deep_moe | `||fused - unfused|| / ||unfused||` at most `FUSED_TOLERANCE` |

`r(out)`, the relative rounding of an output dtype, is `OUTPUT_ROUNDING[out]`; every
bound also allows `SLACK * amax` for fp32 scale arithmetic.
"""

from __future__ import annotations

import torch

from conformance import dtype_facts

#: Relative rounding of one result stored in each output dtype (half a step, with margin).
OUTPUT_ROUNDING: dict[torch.dtype, float] = {
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
    torch.float32: 2.0**-22,
}

#: fp32 accumulation error allowed in a grouped matmul, relative to `|a| @ |b|`.
GEMM_ACCUMULATION = 2.0**-12

#: swiglu may round to the output dtype twice (silu, then the product).
SWIGLU_ROUNDINGS = 2

#: fp32 arithmetic on scales, relative to the largest magnitude involved.
SLACK = dtype_facts.SLACK

#: `||y - ref|| / ||ref||` of the MoE layer against the float64 MoE of its float weights,
#: per (scheme, dispatch dtype). Each bound covers the quantization of the weights, of the
#: dispatched rows and of the intermediate activation, plus bf16 outputs (the measured
#: error on the CPU reference is about half of each); int4 is that lossy by nature. A pair
#: not listed gets `layer_tolerance`'s rule.
LAYER_TOLERANCE: dict[tuple[str, str], float] = {
    ("w8a8-int8", "int8"): 0.04,
    ("w8a8-int8", "fp8"): 0.07,
    ("w8a8-int8", "bf16"): 0.04,
    ("w8a8-fp8-block", "fp8"): 0.10,
    ("w8a8-fp8-block", "int8"): 0.10,
    ("w8a8-fp8-block", "bf16"): 0.10,
    ("w8a8-fp8", "fp8"): 0.10,
    ("w8a8-fp8", "int8"): 0.10,
    ("w8a8-fp8", "bf16"): 0.10,
    ("w4a4-int4", "bf16"): 0.6,
    ("nvfp4", "nvfp4"): 0.30,
    ("nvfp4", "bf16"): 0.30,
}
LAYER_TOLERANCE.update({("unquantized", name): row.layer_error for name, row in dtype_facts.FACTS.items()})


def layer_tolerance(scheme: str, dtype: str) -> float:
    """The layer bound of (scheme, dispatch dtype): the table's, else the larger of what the scheme
    allows with bf16 dispatch and what carrying `dtype` costs an unquantized layer."""
    found = LAYER_TOLERANCE.get((scheme, dtype))
    if found is not None:
        return found
    return max(LAYER_TOLERANCE.get((scheme, "bf16"), 0.0), dtype_facts.facts(dtype).layer_error)


#: `||y - ref|| / ||ref||` of integer schemes against `reference.emulated_integer_moe`, which
#: rounds where the scheme does (checked where the dispatch dtype adds no rounding of its own:
#: int8 or bf16). The CPU reference measures 0.0026. A vendor rounding its intermediates
#: elsewhere flips some int4 steps of the swiglu output (a swiglu rounded twice to bf16 measures
#: 0.02-0.065), so int4 gets room for that; an expert whose rows are lost measures 0.09-0.44.
EMULATED_LAYER_TOLERANCE: dict[str, tuple[int, float]] = {
    "w8a8-int8": (127, 0.02),  # (levels each side, bound)
    "w4a4-int4": (7, 0.075),
}

#: `||y - ref|| / ||ref||` of an unquantized model whose weights, inputs and outputs are all in
#: fp16 or fp32, carried in that dtype, against the float64 MoE of the same values: only the
#: outputs of the two GEMMs, the activation and the combine are rounded. The CPU reference
#: measures 4.7e-4 (fp16) and 4e-7 (fp32); carrying the rows as bf16 instead measures 2.4e-3,
#: which both bounds refuse (so does fp32 computed with TF32 operands, fp16's 10-bit mantissa).
MODEL_DTYPE_LAYER_TOLERANCE: dict[str, float] = {"fp16": 1.5e-3, "fp32": 1e-5}

#: `||fused - unfused|| / ||unfused||`: the same arithmetic in another order, bf16 outputs.
FUSED_TOLERANCE = 0.01


#: The per-element bound of one quantization round trip (see `conformance.dtype_facts`).
quantize_bound = dtype_facts.quantize_bound


def gemm_bound(ref: torch.Tensor, magnitude: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound of a grouped matmul: `ref` its float64 result, `magnitude` `|a| @ |b|`."""
    return OUTPUT_ROUNDING[out_dtype] * ref.abs() + GEMM_ACCUMULATION * magnitude


def swiglu_bound(ref: torch.Tensor, gate_times_up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound of swiglu: `ref` its float64 result, `gate_times_up` `|gate * up|`."""
    return SWIGLU_ROUNDINGS * OUTPUT_ROUNDING[out_dtype] * ref.abs() + 2.0**-16 * gate_times_up
