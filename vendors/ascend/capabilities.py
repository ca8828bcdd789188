"""Ascend capability tables per SoC generation (Atlas A2, A3, and A5 where fp8 exists)."""

from __future__ import annotations

from hal import Capabilities, DeclaredFallback, DispatchDtype, GemmKind, KernelLimits, ScaleLayout, SchemeFallback

#: npu_grouped_matmul's inner-dimension limit on A2/A3: the last dimension of every x and
#: weight must stay below 65536.
MAX_INNER_DIM = 65535
#: Groups one npu_grouped_matmul call takes in the single-weight MoE form.
MAX_GROUPS = 1024

#: The quantization scheme the Ascend DeepEP port fuses (dispatch + two GEMMs + combine).
FUSED_SCHEME = "w8a8-int8"

#: No int4 x int4 (A4W4): npu_grouped_matmul's docs (torch-npu 2.8.0-2.13.0) list int4 weights only
#: for weight-only quantization with float x; an int4 x int4 path needs an NZ weight with a uint64
#: scale, which hal's format is not. Not declared until verified on hardware.
_BASE_GEMMS = frozenset({GemmKind.BF16, GemmKind.FP16, GemmKind.FP32, GemmKind.INT8})
#: Float dispatch dtypes of the unfused path: a cast, then npu_grouped_matmul (its non-quantized
#: dtype table lists fp16 x fp16 and fp32 x fp32, fp32 in the single-tensor form hal calls: one x,
#: one [E, K, N] weight, one output) and npu_swiglu (fp32/fp16/bf16); sorting and combine are torch.
_FLOAT_DISPATCH = frozenset({DispatchDtype.BF16, DispatchDtype.FP16, DispatchDtype.FP32})
_FP8_GENERATIONS = frozenset({"A5"})
#: Generations the port's fused kernel (aclnnFusedDeepMoe) is built for (sgl-kernel-npu
#: doc/FUSED_DEEP_MOE.md: A3 and A5, not A2). Its limits are `vendors.ascend.fused.FusedKernelLimits`.
FUSED_GENERATIONS = frozenset({"A3", "A5"})


def ascend_capabilities(
    device_name: str, generation: str, notes: tuple[str, ...] = (), *, fused: bool = True, mc2: bool = True
) -> Capabilities:
    """The table of one generation: bf16, fp16, fp32 and int8 dispatch everywhere; fp8 only where
    the chip computes it (A5), otherwise fp8 falls back to int8; nvfp4 is rejected.

    `fused` declares `fused_deep_moe` for W8A8-INT8 (the Ascend DeepEP port is installed);
    `mc2` declares the MC2 expert-parallel dispatcher (`npu_moe_distribute_dispatch` / `_combine`).
    """
    fp8 = generation in _FP8_GENERATIONS
    dispatch = {*_FLOAT_DISPATCH, DispatchDtype.INT8} | ({DispatchDtype.FP8} if fp8 else set())
    fallbacks = {DispatchDtype.NVFP4: DeclaredFallback(None, f"Atlas {generation} has no fp4 support")}
    if not fp8:
        fallbacks[DispatchDtype.FP8] = DeclaredFallback(
            DispatchDtype.INT8,
            f"Atlas {generation} has no fp8 matmul; activations are carried as int8 with per-token "
            "dynamic scales (npu_dynamic_quant)",
        )
    fused = fused and generation in FUSED_GENERATIONS
    fused_note = (
        (
            f"fused_deep_moe (W8A8-INT8, Ascend DeepEP port): the one-kernel low-latency op takes "
            f"{fused_limits_text(generation)}; other shapes run the port's normal mode",
        )
        if fused
        else (
            f"fused_deep_moe: not on {generation} (the port's fused kernel is built for A3 and A5)"
            if generation not in FUSED_GENERATIONS
            else "fused_deep_moe needs the Ascend DeepEP port (module deep_ep), which is not installed",
        )
    )
    return Capabilities(
        scheme_fallbacks=_scheme_fallbacks(generation, fp8),
        device_name=device_name,
        dispatch_dtypes=frozenset(dispatch),
        fallbacks=fallbacks,
        default_dispatch_dtype=DispatchDtype.BF16,
        scale_layouts={DispatchDtype.FP8: ScaleLayout.PER_TOKEN},  # fp8 (A5) is carried with per-token scales
        grouped_matmul=_BASE_GEMMS | ({GemmKind.FP8_ROWWISE} if fp8 else frozenset()),
        fused_deep_moe=frozenset({FUSED_SCHEME}) if fused else frozenset(),
        ep_dispatchers=frozenset({MC2}) if mc2 else frozenset(),
        limits=KernelLimits(max_inner_dim=MAX_INNER_DIM, max_groups=MAX_GROUPS),
        collective_backend="hccl",
        notes=(f"SoC generation {generation}", *notes, *fused_note),
    )


#: Declared bound of a converted layer's error (relative, norm) against the float64 layer of the original
#: FP8 weights: measured 0.027-0.030 on DeepSeek-V3- and Qwen3-shaped layers of gaussian weights, 0.067 where
#: 1 % of the weights are 8x larger (a channel's int8 scale follows its largest value; fp8 blocks keep
#: outliers local) (docs/ascend.md, "FP8 checkpoints").
INT8_FROM_FP8_BOUND = 0.08


def _scheme_fallbacks(generation: str, fp8: bool) -> dict[str, SchemeFallback]:
    """FP8 checkpoints on chips without the fp8 kind they need: their weights converted once at load to
    W8A8-INT8 (per-channel int8 weights, per-token int8 activations), the path every generation computes.

    Source: npu_grouped_matmul's docs in the torch-npu 2.8.0-2.13.0 wheels (summarised in
    shared/reference/torch_npu.md) list int8 x int8 with a per-token and a per-channel scale on A2/A3 and an
    fp8 path with a per-channel float32 scale on A5, and no 128x128 block-scale form on any generation. The
    conversion is plain torch on the host (`moe.scheme_conversion`): it adds no torch_npu call, so the
    emulation's op schemas are unchanged."""
    fallbacks = {"nvfp4": SchemeFallback(None, f"Atlas {generation} has no fp4 support")}
    fallbacks.update(_fp4_weight_only(generation, fp8))
    done = "the weights are dequantized and quantized again to int8 per output channel (npu_grouped_matmul int8 x int8)"
    if fp8:  # A5: fp8 per channel is computed, 128x128 blocks are not
        why = (
            f"Atlas {generation}'s npu_grouped_matmul takes fp8 weights with per-channel scales, not 128x128 blocks: "
            f"{done}, which measured more accurate than fp8 per channel"
        )
        fallbacks["w8a8-fp8-block"] = SchemeFallback("w8a8-int8", why, INT8_FROM_FP8_BOUND)
        return fallbacks
    why = f"Atlas {generation} has no fp8 matmul: {done}"
    fallbacks["w8a8-fp8-block"] = SchemeFallback("w8a8-int8", why, INT8_FROM_FP8_BOUND)
    fallbacks["w8a8-fp8"] = SchemeFallback("w8a8-int8", why, INT8_FROM_FP8_BOUND)
    return fallbacks


#: Where torch-npu 2.13.0 documents its MX (e8m0 block-32) formats, all with the activations quantized too.
_A5_MX_SOURCES = (
    "torch-npu 2.13.0 documents MX formats on Ascend 950 (A5) only with MX-quantized activations: "
    "npu_quant_matmul and npu_alltoallv_quant_gmm take float4_e2m1fn_x2 weights with an e8m0 activation scale, "
    "npu_moe_init_routing_v2's quant_mode 2/3 quantize the routed rows to MXFP8, npu_dynamic_mx_quant makes "
    "MXFP4 activations; npu_grouped_matmul's weight-only (antiquant) table lists int8/int4 weights with "
    "fp16/bf16 scales only (torch_npu/_op_plugin_docs.py, op_plugin/meta/_meta_registrations.py)"
)


def _fp4_weight_only(generation: str, fp8: bool) -> dict[str, SchemeFallback]:
    """The weight-only 4-bit float schemes (mxfp4 / nvfp4 weights, bf16 activations): refused on every
    generation, each with its reason; no npu_grouped_matmul form with bf16 x and e2m1 weights is documented."""
    if fp8:  # A5: MX formats exist, but not weight-only
        mx = f"Atlas {generation} has no weight-only mxfp4 grouped matmul: {_A5_MX_SOURCES}"
        nv = f"Atlas {generation} has no nvfp4 (e4m3 block-16 scales) in any torch-npu op; {_A5_MX_SOURCES}"
    else:
        mx = nv = (
            f"Atlas {generation} has no fp4 support: npu_grouped_matmul's weight-only (antiquant) form takes "
            "int8/int4 weights with fp16/bf16 scales (torch-npu 2.8.0-2.13.0 docs)"
        )
    return {"w4a16-mxfp4": SchemeFallback(None, mx), "w4a16-nvfp4": SchemeFallback(None, nv)}


#: The name of the MC2 expert-parallel dispatcher (`DispatchConfig(ep_dispatcher="mc2")`).
MC2 = "mc2"


def fused_limits_text(generation: str) -> str:
    """The documented limits of the port's `fused_deep_moe` (FUSED_DEEP_MOE.md), in words."""
    extra = ", 2I a multiple of 1024" if generation == "A5" else ""
    return (
        "1..256 tokens per rank, hidden 512..7168, gmm1 width 2I 1024..6144 (a multiple of 128"
        f"{extra}), top-k 1..12, at most 512 experts"
    )


#: SoC name prefixes reported by torch_npu.npu.get_device_name, and their generation.
SOC_GENERATIONS: tuple[tuple[str, str], ...] = (("Ascend910_93", "A3"), ("Ascend910B", "A2"), ("Ascend950", "A5"))

#: Declared tables for named device models, usable without the hardware (fused_deep_moe as
#: declared with the Ascend DeepEP port installed).
DECLARED_MODELS: dict[str, Capabilities] = {
    "A3": ascend_capabilities("Ascend A3 (declared, Ascend910_93xx)", "A3"),
    "A2": ascend_capabilities("Ascend A2 (declared, Ascend910B)", "A2"),
    "A5": ascend_capabilities("Ascend A5 (declared, Ascend950)", "A5"),
}


def generation_of(soc_name: str) -> str | None:
    """The generation (A2, A3, A5) of a SoC name, or None when unrecognised."""
    for prefix, generation in SOC_GENERATIONS:
        if soc_name.startswith(prefix):
            return generation
    return None
