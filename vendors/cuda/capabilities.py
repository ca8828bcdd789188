"""CUDA capability tables, chosen from the compute capability (sm)."""

from __future__ import annotations

from typing import Any

from hal import SchemeFallback, Capabilities, DeclaredFallback, DispatchDtype, GemmKind, KernelLimits
from vendors.cuda.deepep import DEEPEP, DeepEpProbe
from vendors.cuda.deepep_limits import LOW_LATENCY_HIDDEN, LOW_LATENCY_MAX_TOP_K

#: Groups the Triton grouped GEMM schedules in one call.
MAX_GROUPS = 1024

_FLOAT_KINDS = frozenset({GemmKind.BF16, GemmKind.FP16, GemmKind.FP32})
#: Weight-only 4-bit kinds (bf16 activations, e2m1 weights decoded inside the Triton grouped GEMM): mxfp4
#: wherever bf16 runs, nvfp4 from sm89 (its e4m3 block scales are converted by the fp8 hardware).
_WEIGHT_ONLY_KINDS = frozenset({GemmKind.BF16_MXFP4})
_WEIGHT_ONLY_KINDS_SM89 = frozenset({GemmKind.BF16_MXFP4, GemmKind.BF16_NVFP4})
#: Float dispatch dtypes every sm carries: a cast, then the Triton grouped GEMM of the same dtype
#: (fp32 with IEEE products, no TF32), swiglu and combine in any float dtype.
_FLOAT_DISPATCH = frozenset({DispatchDtype.BF16, DispatchDtype.FP16, DispatchDtype.FP32})
_INT8_REASON = "int8 is not a CUDA dispatch dtype: fp8 also takes one byte per channel and feeds the tensor cores"


def cuda_capabilities(
    device_name: str,
    compute_capability: tuple[int, int],
    *,
    kernels: bool = True,
    extra_notes: tuple[str, ...] = (),
    deepep: DeepEpProbe | None = None,
) -> Capabilities:
    """The capabilities of a CUDA device: bf16, fp16 and fp32 everywhere, fp8 from sm89, nvfp4 from
    sm100; int8 falls back; bf16 x mxfp4 weights everywhere, bf16 x nvfp4 weights from sm89.

    `kernels`: Triton is installed (the grouped GEMM then limits a call to `MAX_GROUPS` groups).
    `deepep`: what the probe found of DeepEP (`vendors.cuda.deepep.probe_deep_ep`): the expert-parallel
    dispatcher "deepep" is declared where it serves, else named absent with the reason; None: not probed.
    """
    major, minor = compute_capability
    sm = major * 10 + minor
    path = (
        (
            "Triton kernels (quantize, grouped GEMM with a SiLU-GLU epilogue, swiglu, softmax-top-k, sort, combine)"
            + (" and torch._grouped_mm for bf16" if sm >= 90 else "")
            + (", torch._scaled_grouped_mm for fp8 row-wise" if sm == 90 else "")
        )
        if kernels
        else ("Triton is not installed: ops take the torch reference path (slow, and it synchronises)")
    )
    notes = [f"compute capability sm{sm}", path, *extra_notes]
    if sm >= 89:
        dispatch = {*_FLOAT_DISPATCH, DispatchDtype.FP8}
        fallbacks = {DispatchDtype.INT8: DeclaredFallback(DispatchDtype.FP8, _INT8_REASON)}
        kinds = _FLOAT_KINDS | _WEIGHT_ONLY_KINDS_SM89 | {GemmKind.INT8, GemmKind.FP8_ROWWISE, GemmKind.FP8_BLOCK128}
    else:
        dispatch = set(_FLOAT_DISPATCH)
        fallbacks = {
            DispatchDtype.INT8: DeclaredFallback(
                DispatchDtype.BF16, f"sm{sm} has no fp8; int8 dispatch is carried as bf16"
            ),
            DispatchDtype.FP8: DeclaredFallback(
                DispatchDtype.BF16, f"sm{sm} has no fp8 tensor cores (fp8 needs sm89+); carried as bf16"
            ),
        }
        kinds = _FLOAT_KINDS | _WEIGHT_ONLY_KINDS | {GemmKind.INT8}
    schemes = {} if sm >= 89 else _fp8_as_int8(sm)
    if sm >= 100:
        dispatch.add(DispatchDtype.NVFP4)
    else:
        fallbacks[DispatchDtype.NVFP4] = DeclaredFallback(
            None, f"nvfp4 needs sm100+ (Blackwell); this device is sm{sm}"
        )
        schemes["nvfp4"] = _nvfp4_as_weight_only(sm)
    ep = deepep_declaration(deepep, sm, kernels)
    return Capabilities(
        device_name=device_name,
        dispatch_dtypes=frozenset(dispatch),
        fallbacks=fallbacks,
        default_dispatch_dtype=DispatchDtype.BF16,
        grouped_matmul=kinds,
        scheme_fallbacks=schemes,
        limits=KernelLimits(max_groups=MAX_GROUPS) if kernels else KernelLimits(),
        collective_backend="nccl",
        grouped_matmul_padding=kernels,  # the Triton grouped GEMM schedules the groups' rows only
        graph_capture=True,
        ep_dispatchers=ep["ep_dispatchers"],
        ep_low_latency=ep["ep_low_latency"],
        ep_dispatchers_absent=ep["ep_dispatchers_absent"],
        notes=(*notes, *ep["notes"]),
    )


#: The declared error of nvfp4 layers run weight-only, against the float64 layer of the weights as nvfp4 stores
#: them: the weights are the checkpoint's own, so only the bf16 activations differ (0.004 measured, 2026-11-28).
WEIGHT_ONLY_NVFP4_BOUND = 0.02


def _nvfp4_as_weight_only(sm: int) -> SchemeFallback:
    """Without fp4 tensor cores an nvfp4 layer keeps its weights as stored and runs them weight-only (the
    bf16 x nvfp4 GEMM decodes the e4m3 block scales with sm89's fp8 conversions); before sm89, refused."""
    lacking = f"nvfp4 GEMMs need sm100+ (Blackwell); this device is sm{sm}"
    if sm < 89:
        return SchemeFallback(None, f"{lacking}, and its bf16 x nvfp4 weight-only GEMM needs sm89+")
    return SchemeFallback(
        "w4a16-nvfp4",
        f"{lacking}: the weights run as stored, weight-only (bf16 activations, no activation quantization)",
        WEIGHT_ONLY_NVFP4_BOUND,
    )


def _fp8_as_int8(sm: int) -> dict[str, SchemeFallback]:
    """FP8 checkpoints before sm89 (no fp8 tensor cores): weights converted once at load to int8 per channel,
    computed by the int8 tensor cores every sm80+ device has (the same conversion as Atlas A2/A3 declare)."""
    why = (
        f"sm{sm} has no fp8 tensor cores (fp8 needs sm89+): the fp8 weights are dequantized and quantized again "
        "to int8 per output channel (int8 tensor cores)"
    )
    return {name: SchemeFallback("w8a8-int8", why, 0.08) for name in ("w8a8-fp8-block", "w8a8-fp8")}


def deepep_declaration(probe: DeepEpProbe | None, sm: int, kernels: bool) -> dict[str, Any]:
    """The `Capabilities` fields of the "deepep" dispatcher on an `sm` device, from what the probe found."""
    fields: dict[str, Any] = {
        "ep_dispatchers": frozenset(),
        "ep_low_latency": frozenset(),
        "ep_dispatchers_absent": {},
        "notes": (),
    }
    if probe is None:
        return fields
    why = probe.reason
    if why is None and not kernels:
        why = "the CUDA vendor runs deepep on its Triton ops, and Triton is not installed"
    elif why is None and sm < 80:
        why = f"DeepEP needs sm80 or newer; this device is sm{sm}"
    elif why is None and probe.fp8 and sm < 90:
        why = (
            f"{probe.describe()} is built with its sm90 features (TORCH_CUDA_ARCH_LIST=9.0); this device is "
            f"sm{sm}: build it with DISABLE_SM90_FEATURES=1 (bf16 normal mode only)"
        )
    if why is not None:
        return {**fields, "ep_dispatchers_absent": {DEEPEP: why}}
    dtypes = "bf16 and fp8 (e4m3, fp32 scale per 128 channels)" if probe.fp8 else "bf16"
    low_latency = (
        f"low-latency mode carries {dtypes} for hidden sizes {', '.join(map(str, LOW_LATENCY_HIDDEN))} "
        f"and top-k up to {LOW_LATENCY_MAX_TOP_K}"
        if probe.low_latency
        else "no low-latency mode (deep_ep built without NVSHMEM)"
    )
    note = f"ep dispatcher deepep: {probe.describe()}; normal mode carries {dtypes}; {low_latency}"
    return {
        **fields,
        "ep_dispatchers": frozenset({DEEPEP}),
        "ep_low_latency": frozenset({DEEPEP}) if probe.low_latency else frozenset(),
        "notes": (note,),
    }


#: Declared tables for named device models, usable without the hardware.
DECLARED_MODELS: dict[str, tuple[str, tuple[int, int]]] = {
    "H100": ("NVIDIA H100 (declared, sm90)", (9, 0)),
    "H200": ("NVIDIA H200 (declared, sm90)", (9, 0)),
    "B200": ("NVIDIA B200 (declared, sm100)", (10, 0)),
    "L40S": ("NVIDIA L40S (declared, sm89)", (8, 9)),
    "A100": ("NVIDIA A100 (declared, sm80)", (8, 0)),
}
