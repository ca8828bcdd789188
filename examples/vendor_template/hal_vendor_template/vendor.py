"""`TemplateVendor`: the probe, the capability table and the op methods of the template vendor."""

from __future__ import annotations

from collections.abc import Mapping

import torch

import hal
from hal_vendor_template import ops

#: Everything this vendor can do. Each entry is a promise: hal plans dispatch from it,
#: `hal doctor` and the conformance suite test what it declares (and skip the rest).
TEMPLATE_CAPABILITIES = hal.Capabilities(
    device_name="template vendor on the CPU",
    dispatch_dtypes=frozenset({hal.DispatchDtype.BF16, hal.DispatchDtype.INT8}),
    dispatch_fallbacks={
        hal.DispatchDtype.FP8: hal.DispatchDtype.INT8,
        hal.DispatchDtype.NVFP4: None,  # None: rejected, with the reason below
    },
    fallback_reasons={
        hal.DispatchDtype.FP8: "the template has no fp8 quantizer; int8 per-token costs the same "
        "one byte per channel, so fp8 requests are dispatched as int8",
        hal.DispatchDtype.NVFP4: "the template has no nvfp4 quantizer or grouped matmul, and no "
        "4-bit dispatch format to fall back to",
    },
    default_dispatch_dtype=hal.DispatchDtype.BF16,
    int8_quant_mode=hal.Int8QuantMode.PER_TOKEN_DYNAMIC,
    grouped_matmul=frozenset({hal.GemmKind.BF16, hal.GemmKind.FP16, hal.GemmKind.FP32, hal.GemmKind.INT8}),
    fused_deep_moe=frozenset(),
    # A limit declared here is also enforced by ops.grouped_matmul (InvalidInput beyond it).
    limits=hal.KernelLimits(max_groups=512),
    collective_backend="gloo",
    notes=("a starting point for new vendors: plain torch on the CPU, correct rather than fast",),
)


class TemplateVendor(hal.Vendor):
    """A vendor plugin living outside moe-hal, computing with its own torch code on the CPU.

    Rename it (class, `name`, entry point) and replace the probe, the table and the ops
    with your device's; the structure stays the same.
    """

    name = "template"
    # Below the CPU reference vendor (0): installing the template never changes which
    # vendor hal selects by default. A real accelerator vendor sets a positive priority.
    priority = -10
    description = "out-of-tree vendor template: plain torch on the CPU (copy it to start a vendor)"

    def _probe_once(self) -> hal.ProbeResult:
        """Report whether the vendor can run here; never raise for a missing runtime."""
        # A real vendor checks its runtime library and devices here, and says what is
        # missing instead of raising, for example:
        #     try:
        #         import my_accel_runtime
        #     except ImportError as exc:
        #         return hal.ProbeResult.unavailable(f"my_accel_runtime is not installed ({exc})")
        #     if my_accel_runtime.device_count() == 0:
        #         return hal.ProbeResult.unavailable("no MyAccel device found (is the driver loaded?)")
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

    # -- ops: thin wrappers; the work is in ops.py ---------------------------------------------

    def quantize(
        self,
        x: torch.Tensor,
        dtype: hal.DispatchDtype,
        *,
        layout: hal.ScaleLayout | None = None,
        global_scale: torch.Tensor | None = None,
    ) -> hal.QuantizedTensor:
        """Quantize activations `[..., H]` to bf16 (a cast) or int8 per-token."""
        return ops.quantize(x, dtype, layout=layout, global_scale=global_scale,
                            vendor=self.name, capabilities=self.capabilities())

    def dequantize(self, q: hal.QuantizedTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Turn bf16 or int8 activations back into `out_dtype`."""
        return ops.dequantize(q, out_dtype, vendor=self.name)

    def quantize_weight(
        self, weight: torch.Tensor, layout: hal.ScaleLayout, dtype: torch.dtype | None = None
    ) -> hal.QuantizedWeight:
        """Expert weights `[E, K, N]`: unscaled float, or int8 per-channel."""
        return ops.quantize_weight(weight, layout, dtype, vendor=self.name)

    def grouped_matmul(
        self,
        x: torch.Tensor | hal.QuantizedTensor | hal.PackedInt4Tensor,
        weight: hal.QuantizedWeight,
        groups: hal.Groups,
        *,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """`y[rows of g] = x[rows of g] @ weight[g]` for the declared kinds (bf16, fp16, fp32, int8)."""
        return ops.grouped_matmul(x, weight, groups, out_dtype=out_dtype,
                                  vendor=self.name, capabilities=self.capabilities())

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(first half) * second half` of the last dimension."""
        return ops.swiglu(x)
