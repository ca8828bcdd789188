"""Ascend capability tables per SoC generation (Atlas A2 and A3)."""

from __future__ import annotations

from hal import Capabilities, DispatchDtype, GemmKind, Int8QuantMode, KernelLimits

#: npu_grouped_matmul's documented limit on the inner dimension on A2/A3.
MAX_INNER_DIM = 65536


def ascend_capabilities(device_name: str, generation: str, notes: tuple[str, ...] = ()) -> Capabilities:
    """The A2/A3 table: bf16 and int8 dispatch, fp8 falls back to int8, nvfp4 is rejected."""
    return Capabilities(
        device_name=device_name,
        dispatch_dtypes=frozenset({DispatchDtype.BF16, DispatchDtype.INT8}),
        dispatch_fallbacks={DispatchDtype.FP8: DispatchDtype.INT8, DispatchDtype.NVFP4: None},
        fallback_reasons={
            DispatchDtype.FP8: f"Atlas {generation} has no fp8 matmul; activations are carried as "
            "int8 with per-token dynamic scales (npu_dynamic_quant)",
            DispatchDtype.NVFP4: f"Atlas {generation} has no fp4 support",
        },
        default_dispatch_dtype=DispatchDtype.BF16,
        int8_quant_mode=Int8QuantMode.PER_TOKEN_DYNAMIC,
        grouped_matmul=frozenset({GemmKind.BF16, GemmKind.FP16, GemmKind.INT8}),
        limits=KernelLimits(max_inner_dim=MAX_INNER_DIM),
        collective_backend="hccl",
        notes=(f"SoC generation {generation}", *notes),
    )


#: SoC name prefixes reported by torch_npu.npu.get_device_name, and their generation.
SOC_GENERATIONS: tuple[tuple[str, str], ...] = (
    ("Ascend910_93", "A3"),
    ("Ascend910B", "A2"),
)

#: Declared tables for named device models, usable without the hardware.
DECLARED_MODELS: dict[str, Capabilities] = {
    "A3": ascend_capabilities("Ascend A3 (declared, Ascend910_93xx)", "A3"),
    "A2": ascend_capabilities("Ascend A2 (declared, Ascend910B)", "A2"),
}


def generation_of(soc_name: str) -> str | None:
    """The generation (A2, A3) of a SoC name, or None when unrecognised."""
    for prefix, generation in SOC_GENERATIONS:
        if soc_name.startswith(prefix):
            return generation
    return None
