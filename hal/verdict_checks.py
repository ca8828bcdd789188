"""The checks of a grouped matmul's and a quantization's arguments that read no values, and what they conclude.

`hal.Vendor.grouped_matmul` and `hal.Vendor.quantize` run them once per signature of their arguments
(`hal.verdicts`), and the checks that read values (row indices, group counts, where that is free) on
every call. They are functions, not vendor methods, so no plugin can redefine them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hal import checks
from hal.activations import Activation
from hal.dtypes import DispatchDtype, ScaleLayout
from hal.errors import UnsupportedCapability, invalid
from hal.gemm_kinds import GemmKind, gemm_kind_of

if TYPE_CHECKING:
    from hal.vendor import Vendor


def grouped_matmul_verdict(
    vendor: Vendor,
    x: object,
    weight: object,
    groups: object,
    out_dtype: object,
    bias: object,
    activation: object,
    row_index: object,
) -> tuple[Activation | None, GemmKind, torch.dtype, int]:
    """`Vendor.grouped_matmul`'s checks that read no values (types, shapes, dtypes, devices, kinds, limits):
    its verdict `(activation, kind, out dtype, rows M)`, or `InvalidInput` / `UnsupportedCapability`."""
    parsed = None if activation is None else vendor._declared_activation(activation)
    checks.gemm_operands(x, weight, groups)
    caps = vendor.capabilities()
    if row_index is not None:  # its device first: its values are read only where they live
        checks.on_device("row_index", row_index, vendor.device)
        checks.row_index(row_index, x.shape[0])  # its values: per call, in grouped_matmul
    if parsed is not None and parsed.gated and weight.out_features % 2:
        raise invalid("weight", f"an even number of output columns [gate | up] for {parsed}", weight.out_features)
    if out_dtype is not None:
        checks.out_dtype("out_dtype", out_dtype)
    device = vendor.device
    if isinstance(x, torch.Tensor):
        checks.on_device("x", x, device)
    else:
        checks.on_device("x.data", x.data, device)
        checks.on_device("x.scale", x.scale, device)
        checks.on_device("x.global_scale", getattr(x, "global_scale", None), device)
    for field, tensor in weight.tensors().items():
        checks.on_device(f"weight.{field}", tensor, device)
    if groups.tensor.device.type != "cpu":  # group lists may also live on the host
        checks.on_device("groups", groups.tensor, device)
    kind = gemm_kind_of(x, weight)
    if kind not in caps.grouped_matmul:
        raise UnsupportedCapability(
            f"vendor {vendor.name!r} ({caps.device_name}) does not declare the grouped-matmul kind {kind}"
        )
    rows = checks.gemm_shapes(x, weight, groups, caps.limits, rows=None if row_index is None else row_index.numel())[0]
    if bias is not None:
        if not caps.expert_bias:
            raise UnsupportedCapability(
                f"vendor {vendor.name!r} ({caps.device_name}) does not declare "
                "expert_bias (grouped_matmul with a per-expert bias)"
            )
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (groups.num_groups, weight.out_features):
            raise invalid(
                "bias",
                f"a tensor of shape ({groups.num_groups}, {weight.out_features})",
                tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__,
            )
        if bias.dtype not in checks.FLOAT_DTYPES:
            raise invalid("bias", "a bf16, fp16 or fp32 tensor", bias.dtype)
        checks.on_device("bias", bias, device)
    return parsed, kind, checks.gemm_out_dtype(kind, out_dtype), rows


def quantize_verdict(
    vendor: Vendor, x: object, dtype: object, layout: object, global_scale: object
) -> tuple[DispatchDtype, ScaleLayout]:
    """`Vendor.quantize`'s checks (all of them read metadata only): its verdict `(dtype, layout)`, or
    `InvalidInput` / `UnsupportedCapability`."""
    parsed = checks.concrete_dtype(dtype)
    caps = vendor.capabilities()
    if not caps.quantizes_to(parsed):
        fallback = caps.fallback_for(parsed)
        raise UnsupportedCapability(
            f"vendor {vendor.name!r} ({caps.device_name}) does not quantize to {parsed} "
            f"({'it falls back to ' + str(fallback) if fallback else 'rejected'}: "
            f"{caps.fallback_reasons.get(parsed, 'not declared')})"
        )
    chosen = checks.activation_layout(layout, parsed, caps.layout_for(parsed))  # type: ignore[arg-type]
    checks.float_rows("x", x)
    device = vendor.device
    checks.on_device("x", x, device)
    checks.global_scale_for(parsed, global_scale, device)  # type: ignore[arg-type]
    parsed.spec.check_hidden("x", x.shape[-1], chosen)  # type: ignore[attr-defined]
    return parsed, chosen
