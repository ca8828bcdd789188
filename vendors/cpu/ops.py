"""`TorchReferenceOps`: the hal ops in plain, device-agnostic torch."""

from __future__ import annotations

import torch

from typing import NamedTuple

from hal.capabilities import GemmKind
from hal.dtypes import DispatchDtype, ScaleLayout
from hal.errors import UnsupportedCapability, invalid
from hal.formats import PackedInt4Tensor, QuantizedTensor, QuantizedWeight, gemm_kind_of
from hal.groups import Groups
from vendors.cpu import activation, quantize as quant
from vendors.cpu import grouped_matmul as gmm


class GemmCall(NamedTuple):
    """A validated grouped matmul: its kind, logical M and N, the activation data and the output dtype."""

    kind: GemmKind
    rows: int
    cols: int
    data: torch.Tensor
    out_dtype: torch.dtype


class TorchReferenceOps:
    """Mixin implementing the `Vendor` ops with vectorized torch on the vendor's device.

    It is the CPU reference and a correct (if slow) fallback for other vendors. The host
    class must provide `name`, `device` and `capabilities()` (as `hal.Vendor` does).
    Tensors must live on `self.device`; group lists may also be on the CPU.
    """

    def quantize(
        self,
        x: torch.Tensor,
        dtype: DispatchDtype,
        *,
        layout: ScaleLayout | None = None,
        global_scale: torch.Tensor | None = None,
    ) -> QuantizedTensor:
        """Quantize activations `[..., H]` into a dispatch dtype (see `vendors.cpu.quantize`)."""
        self._check_device("x", x)
        self._check_device("global_scale", global_scale)
        return quant.quantize(x, dtype, layout, global_scale)

    def dequantize(self, q: QuantizedTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Turn quantized activations back into `out_dtype`."""
        if isinstance(q, QuantizedTensor):
            self._check_device("q.data", q.data)
            self._check_device("q.scale", q.scale)
            self._check_device("q.global_scale", q.global_scale)
        return quant.dequantize(q, out_dtype)

    def quantize_weight(
        self, weight: torch.Tensor, layout: ScaleLayout, dtype: torch.dtype | None = None
    ) -> QuantizedWeight:
        """Quantize float expert weights `[E, K, N]` (none, per-channel int8/fp8/int4, block-128x128, block-16)."""
        self._check_device("weight", weight)
        return quant.quantize_weight(weight, layout, dtype)

    def quantize_int4(self, x: torch.Tensor) -> PackedInt4Tensor:
        """Quantize activations `[..., H]` to per-token int4 packed eight per int32 (see `vendors.cpu.quantize`).

        Only where the host vendor declares the int4 grouped matmul, the one consumer of the format.
        """
        caps = self.capabilities()
        if GemmKind.INT4 not in caps.grouped_matmul:
            raise UnsupportedCapability(
                f"vendor {self.name!r} ({caps.device_name}) does not declare the int4 grouped matmul, "
                "so it does not quantize activations to int4"
            )
        self._check_device("x", x)
        return quant.quantize_int4(x)

    def grouped_matmul(
        self,
        x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
        weight: QuantizedWeight,
        groups: Groups,
        *,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """`y[rows of g] = x[rows of g] @ weight[g]` for every group g, if the kind is declared."""
        self.declared_gemm_kind(x, weight, groups)
        return gmm.grouped_matmul(x, weight, groups, out_dtype=out_dtype, limits=self.capabilities().limits)

    def checked_gemm(self, x: torch.Tensor | QuantizedTensor | PackedInt4Tensor, weight: QuantizedWeight,
                     groups: Groups, out_dtype: torch.dtype | None) -> GemmCall:
        """Every check of a grouped matmul (operands, devices, declared kind, shapes, limits, output dtype)."""
        kind = self.declared_gemm_kind(x, weight, groups)
        m, _, n = gmm.check_shapes(x, weight, groups, self.capabilities().limits)
        data = x if isinstance(x, torch.Tensor) else x.data
        return GemmCall(kind, m, n, data, gmm.resolve_out_dtype(kind, data.dtype, out_dtype))

    def declared_gemm_kind(self, x: object, weight: object, groups: object) -> GemmKind:
        """Check a grouped matmul's operand types and devices; return its kind if declared.

        Raises `InvalidInput` for wrong operands and `UnsupportedCapability` for a kind the
        host vendor does not declare.
        """
        gmm.check_operands(x, weight, groups)
        if isinstance(x, (QuantizedTensor, PackedInt4Tensor)):
            self._check_device("x.data", x.data)
            self._check_device("x.scale", x.scale)
            self._check_device("x.global_scale", getattr(x, "global_scale", None))
        else:
            self._check_device("x", x)
        for field, tensor in weight.tensors().items():  # type: ignore[union-attr]
            self._check_device(f"weight.{field}", tensor)
        if groups.tensor.device.type != "cpu":  # type: ignore[union-attr]
            self._check_device("groups", groups.tensor)  # type: ignore[union-attr]
        kind = gemm_kind_of(x, weight)  # type: ignore[arg-type]
        caps = self.capabilities()
        if kind not in caps.grouped_matmul:
            raise UnsupportedCapability(
                f"vendor {self.name!r} ({caps.device_name}) does not declare the grouped-matmul kind {kind}"
            )
        return kind

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(a) * b` where a is the first and b the second half of the last dimension."""
        self._check_device("x", x)
        return activation.swiglu(x)

    def _check_device(self, name: str, t: object) -> None:
        """Raise `InvalidInput` unless `t` (when a tensor) is on this vendor's device."""
        if not isinstance(t, torch.Tensor):
            return
        expected: torch.device = self.device
        given = t.device
        same = given.type == expected.type and (expected.index is None or given.index == expected.index)
        if not same:
            raise invalid(name, f"a tensor on device {expected}", str(given))
