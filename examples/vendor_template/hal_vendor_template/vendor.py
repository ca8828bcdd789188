"""`TemplateVendor`: the platform side of the template vendor (probe, device, capability table)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

import hal
from hal_vendor_template.ops import TemplateOps

#: Everything this vendor can do. Each entry is a promise: hal plans dispatch from it, checks
#: every op call against it, and `hal doctor` and the conformance suite test what it declares.
TEMPLATE_CAPABILITIES = hal.Capabilities(
    device_name="template vendor on the CPU",
    # fp16 and fp32: a cast (the reference), for fp16 / fp32 models that compute in their own dtype.
    dispatch_dtypes=frozenset(
        {hal.DispatchDtype.BF16, hal.DispatchDtype.FP16, hal.DispatchDtype.FP32, hal.DispatchDtype.INT8}
    ),
    fallbacks={
        hal.DispatchDtype.FP8: hal.DeclaredFallback(
            hal.DispatchDtype.INT8,
            "the template has no fp8 quantizer; int8 per-token costs the same one byte per channel, so fp8 "
            "requests are dispatched as int8",
        ),
        hal.DispatchDtype.NVFP4: hal.DeclaredFallback(
            None,  # None: refused, with this reason
            "the template has no nvfp4 quantizer or grouped matmul, and no 4-bit dispatch format to fall back to",
        ),
    },
    default_dispatch_dtype=hal.DispatchDtype.BF16,
    grouped_matmul=frozenset({hal.GemmKind.BF16, hal.GemmKind.FP16, hal.GemmKind.FP32, hal.GemmKind.INT8}),
    fused_deep_moe=frozenset(),
    limits=hal.KernelLimits(max_groups=512),  # hal refuses larger grouped matmuls before they reach the ops
    collective_backend="gloo",
    notes=("a starting point for new vendors: plain torch on the CPU, correct rather than fast",),
)


class TemplateVendor(hal.Vendor):
    """A vendor plugin living outside moe-hal. Rename it (class, `name`, entry point) and replace
    the probe, the table and `TemplateOps` with your device's; the structure stays the same."""

    name = "template"
    # Below the CPU reference vendor (0): installing the template never changes which
    # vendor hal selects by default. A real accelerator vendor sets a positive priority.
    priority = -10
    description = "out-of-tree vendor template: plain torch on the CPU (copy it to start a vendor)"

    def _probe_once(self) -> hal.ProbeResult:
        """Report whether the vendor can run here; never raise for a missing runtime."""
        # A real vendor checks its runtime library and devices here and says what is missing:
        #     try:
        #         import my_accel_runtime
        #     except ImportError as exc:
        #         return hal.ProbeResult.unavailable(f"my_accel_runtime is not installed ({exc})")
        return hal.ProbeResult.ok(f"torch {torch.__version__} on the CPU")

    def devices(self) -> list[torch.device]:
        """The devices this vendor drives: the CPU."""
        return [torch.device("cpu")]

    def _detect_capabilities(self) -> hal.Capabilities:
        """The table of the device found; a real vendor reads the device model and picks its table."""
        return TEMPLATE_CAPABILITIES

    def declared_models(self) -> Mapping[str, hal.Capabilities]:
        """Tables per device model, shown by `hal caps --device-model` without the hardware."""
        return {"template-cpu": TEMPLATE_CAPABILITIES}

    def _make_ops(self) -> hal.VendorOps:
        """The op implementations, chosen once (a real vendor picks kernels by what its probe found)."""
        return TemplateOps()
