"""Every error bound of the conformance suite, in one place.

References are float64. A bound is what the format or the output dtype cannot avoid
(one rounding of each quantized value, one rounding of each output), with a small
allowance for fp32 arithmetic; a wrong group, a wrong scale or a lost token exceeds
every bound by orders of magnitude.

The bound on the absolute error of each element (unless stated), by check:

- quantize (per dtype): one rounding of each value: the list in `conformance.dtype_facts`
- grouped matmul: `r(out) * |ref| + 2^-12 * (|a| @ |b|)`: output rounding plus fp32 accumulation
- swiglu: `2 * r(out) * |ref| + 2^-16 * |gate * up|`: at most two roundings to the output dtype
- weighted combine: `r(out) * |ref| + 4 * SLACK * sum |w * row|`: one output rounding, fp32
  accumulation
- dispatch round trip (identity experts): the dtype's quantize bound plus `r(out) * |x|`
- MoE layer: `||y - ref|| / ||ref||` at most `LAYER_TOLERANCE[(scheme, dispatch dtype)]`
- MoE layer, integer schemes: also at most `EMULATED_LAYER_TOLERANCE` against the MoE rounded where
  the scheme rounds
- MoE layer, weight-only schemes carried as bf16: also at most `WEIGHT_ONLY_LAYER_TOLERANCE` against the
  float64 MoE of the layer's stored (quantized) weights
- MoE layer of an fp16 / fp32 model in its own dtype: `||y - ref|| / ||ref||` at most
  `MODEL_DTYPE_LAYER_TOLERANCE[dtype]`
- fused_deep_moe: `||fused - unfused|| / ||unfused||` at most `FUSED_TOLERANCE`
- quantize_weight (per kind): one rounding of each weight in its scale group
  (`weight_quantize_bound`)
- nvfp4, any quantization: plus `NVFP4_SCALE_FLOOR * amax` of the global scale's tensor (e4m3 block
  scales underflow)

`r(out)`, the relative rounding of an output dtype, is `OUTPUT_ROUNDING[out]` (plus one
subnormal step, `OUTPUT_SUBNORMAL_STEP[out]`, absolute); every bound also allows
`SLACK * amax` for fp32 scale arithmetic.
"""

from __future__ import annotations

import torch

from conformance import dtype_facts
from hal import GemmKind

#: Relative rounding of one result stored in each output dtype (half a step, with margin).
OUTPUT_ROUNDING: dict[torch.dtype, float] = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-22}

#: Absolute rounding of a result that lands among an output dtype's subnormals, where rounding is no
#: longer relative: one subnormal step (twice the half step, as margin).
OUTPUT_SUBNORMAL_STEP: dict[torch.dtype, float] = {
    dtype: torch.finfo(dtype).tiny * torch.finfo(dtype).eps for dtype in OUTPUT_ROUNDING
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
    ("w4a16-mxfp4", "bf16"): 0.30,
    ("w4a16-nvfp4", "bf16"): 0.25,
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

#: `||y - ref|| / ||ref||` of a weight-only scheme (bf16 activations) carried as bf16, against the float64 MoE
#: of the layer's own stored weights' values: only the bf16 outputs of the two GEMMs, the activation and the
#: combine are rounded (the CPU reference measures 0.0037 for mxfp4 and nvfp4 weights; a block scale read
#: from the neighbouring block or expert measures 0.4).
WEIGHT_ONLY_LAYER_TOLERANCE = 0.015

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
    return OUTPUT_ROUNDING[out_dtype] * ref.abs() + GEMM_ACCUMULATION * magnitude + OUTPUT_SUBNORMAL_STEP[out_dtype]


def swiglu_bound(ref: torch.Tensor, gate_times_up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound of swiglu: `ref` its float64 result, `gate_times_up` `|gate * up|`."""
    return (
        SWIGLU_ROUNDINGS * (OUTPUT_ROUNDING[out_dtype] * ref.abs() + OUTPUT_SUBNORMAL_STEP[out_dtype])
        + 2.0**-16 * gate_times_up
    )


def combine_bound(ref: torch.Tensor, terms_magnitude: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound of `weighted_combine`: `ref` the float64 sums, `terms_magnitude` `sum |w * row|`."""
    return OUTPUT_ROUNDING[out_dtype] * ref.abs() + 4 * SLACK * terms_magnitude + OUTPUT_SUBNORMAL_STEP[out_dtype]


#: nvfp4's e4m3 block scales are relative to the global scale `448 * 6 / amax`: a block much
#: smaller than the tensor's amax gets a subnormal or zero scale (absolute step 2^-9), which
#: moves each of its values by at most 7 half-steps over the global scale. A bound on that,
#: relative to the amax the global scale was taken from; nothing else a block of ordinary
#: magnitude may err gets near it.
NVFP4_SCALE_FLOOR = 8 * 2.0**-10 / (448 * 6)


def quantize_sweep_bound(dtype: str, layout: str, x: torch.Tensor) -> torch.Tensor:
    """`quantize_bound` for activations whose magnitudes span many decades: nvfp4 adds the
    underflow of block scales far below the tensor's amax (`NVFP4_SCALE_FLOOR`)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    bound = quantize_bound(dtype, layout, rows).reshape(x.shape)
    if dtype == "nvfp4" and x.numel():
        bound = bound + NVFP4_SCALE_FLOOR * float(x.abs().max())
    return bound


def weight_quantize_bound(kind: GemmKind | str, w: torch.Tensor) -> torch.Tensor:
    """Per-element bound on `|weight_value(quantize_weight(w)) - w|` for float64 `w` `[E, K, N]`
    quantized into the weight format of grouped-matmul kind `kind`: one rounding of each weight,
    its scale group being the whole column (per-channel: the weight's K), a 128x128 tile
    (block-128x128), 16 values along K under a per-expert global scale (nvfp4) or 32 values along K
    under a power-of-two scale (mxfp4). Restated from
    the activation bounds of `conformance.dtype_facts` on the weights' columns."""
    kind = GemmKind(kind)
    e, k, n = w.shape
    columns = w.transpose(1, 2).reshape(e * n, k)  # one row per (expert, output channel)

    def per_column(dtype: str, layout: str) -> torch.Tensor:
        return quantize_bound(dtype, layout, columns).reshape(e, n, k).transpose(1, 2)

    if kind in (GemmKind.BF16, GemmKind.FP16, GemmKind.FP32):
        return quantize_bound(kind.value, "none", w.reshape(-1, n)).reshape(w.shape)
    if kind is GemmKind.INT8:
        return per_column("int8", "per-token")
    if kind is GemmKind.FP8_ROWWISE:
        return per_column("fp8", "per-token")
    if kind is GemmKind.INT4:
        return per_column("int4", "per-token")
    if kind is GemmKind.FP8_BLOCK128:
        tile = _tile_amax(w.abs())
        return dtype_facts.FP8_RELATIVE * w.abs() + (dtype_facts.FP8_SUBNORMAL + SLACK) * tile
    if kind is GemmKind.BF16_MXFP4:
        # e8m0 scale 2^e, the smallest with amax_block / 2^e <= 6, so 2^e < amax_block / 3: an e2m1 value
        # rounds by at most a quarter of itself, or a quarter of 2^e below 2 (restated from the format).
        blocks = columns.abs().reshape(e * n, k // 32, 32).amax(dim=-1).repeat_interleave(32, dim=-1)
        per = torch.maximum(columns.abs(), blocks / 3) / 4 * 1.01 + SLACK * blocks
        return per.reshape(e, n, k).transpose(1, 2)
    if kind in (GemmKind.NVFP4, GemmKind.BF16_NVFP4):
        expert_amax = w.abs().amax(dim=(1, 2), keepdim=True) if w.numel() else w.abs()
        return per_column("nvfp4", "block-16") + NVFP4_SCALE_FLOOR * expert_amax
    raise ValueError(f"kind: expected a grouped-matmul kind, got {kind!r}")


def _tile_amax(a: torch.Tensor, tile: int = 128) -> torch.Tensor:
    """Each element's 128x128 tile maximum of `a` `[E, K, N]` (partial tiles at the ends)."""
    e, k, n = a.shape
    padded = torch.nn.functional.pad(a, (0, (-n) % tile, 0, (-k) % tile))
    amax = padded.reshape(e, padded.shape[1] // tile, tile, padded.shape[2] // tile, tile).amax(dim=(2, 4))
    return amax.repeat_interleave(tile, dim=1).repeat_interleave(tile, dim=2)[:, :k, :n]
