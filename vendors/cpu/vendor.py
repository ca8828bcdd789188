"""The CPU reference vendor: always available, the default that runs anywhere."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hal import Capabilities, DeclaredFallback, DispatchDtype, GemmKind, ProbeResult, Vendor

_CPU_CAPABILITIES = Capabilities(
    device_name="cpu",
    dispatch_dtypes=frozenset(
        {DispatchDtype.BF16, DispatchDtype.FP8, DispatchDtype.INT8, DispatchDtype.FP16, DispatchDtype.FP32}
    ),
    fallbacks={
        DispatchDtype.NVFP4: DeclaredFallback(
            None,
            "the CPU reference dispatcher carries bf16, fp16, fp32, fp8 and int8 only; its nvfp4 grouped matmul "
            "takes rows dispatched as bf16 and quantized to nvfp4 after dispatch",
        )
    },
    default_dispatch_dtype=DispatchDtype.BF16,
    grouped_matmul=frozenset(GemmKind),
    collective_backend="gloo",
    host_synchronous=True,
    notes=("reference implementations in plain torch (hal.reference); correct first, not fast",),
)


class CpuVendor(Vendor):
    """The CPU, computing every op with `hal.reference` (the default `Vendor._make_ops`)."""

    name = "cpu"
    priority = 0
    description = "reference implementations in torch on the CPU (runs anywhere)"

    def _probe_once(self) -> ProbeResult:
        return ProbeResult.ok(f"torch {torch.__version__} on the CPU")

    def devices(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def device_memory_bytes(self) -> int | None:
        """The host's physical memory."""
        return self.host_memory_bytes()

    def _detect_capabilities(self) -> Capabilities:
        return _CPU_CAPABILITIES

    def declared_models(self) -> Mapping[str, Capabilities]:
        return {"cpu": _CPU_CAPABILITIES}
