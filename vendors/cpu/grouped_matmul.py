"""Reference grouped matmul: a plain loop over groups, each a dense matmul with scales applied.

Float kinds compute in fp32; int8 and int4 compute the integer product exactly (fp64
holds any int8 or int4 dot product of realistic K exactly) before applying the scales;
fp8 and nvfp4 kinds dequantize both operands to fp32 first.
"""

from __future__ import annotations

import torch

from hal.capabilities import GemmKind, KernelLimits
from hal.dtypes import FP8_GROUP_SIZE
from hal.errors import invalid
from hal.formats import FLOAT_DTYPES, PackedInt4Tensor, QuantizedTensor, QuantizedWeight, gemm_kind_of
from hal.groups import Groups
from vendors.cpu import quantize as quant

_FLOAT_KINDS = (GemmKind.BF16, GemmKind.FP16, GemmKind.FP32)


def grouped_matmul(
    x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
    weight: QuantizedWeight,
    groups: Groups,
    out_dtype: torch.dtype | None = None,
    limits: KernelLimits | None = None,
) -> torch.Tensor:
    """`y[rows of g] = x[rows of g] @ weight[g]` for every group g, scales applied: `[M, N]`.

    `out_dtype` defaults to the activation dtype for float kinds and bf16 for quantized
    kinds. `limits`, when given, are enforced (exceeding one raises `InvalidInput`).
    """
    check_operands(x, weight, groups)
    kind = gemm_kind_of(x, weight)
    data = x if isinstance(x, torch.Tensor) else x.data
    m, _, n = check_shapes(x, weight, groups, limits)
    out_dtype = resolve_out_dtype(kind, data.dtype, out_dtype)
    counts = groups.check_values(m)

    out = torch.zeros((m, n), dtype=out_dtype, device=data.device)
    start = 0
    for g, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        out[rows] = _group_product(kind, x, weight, g, rows).to(out_dtype)
        start += count
    return out


def _group_product(
    kind: GemmKind,
    x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
    weight: QuantizedWeight,
    g: int,
    rows: slice,
) -> torch.Tensor:
    """One group's product, before the cast to the output dtype."""
    if kind in _FLOAT_KINDS:
        a = x if isinstance(x, torch.Tensor) else x.data
        return a[rows].to(torch.float32) @ weight.data[g].to(torch.float32)
    if kind is GemmKind.INT8:
        acc = x.data[rows].to(torch.float64) @ weight.data[g].to(torch.float64)
        return acc * x.scale[rows].to(torch.float64).unsqueeze(1) * weight.scale[g].to(torch.float64)
    if kind is GemmKind.INT4:
        a = quant.unpack_int4(x.data[rows]).to(torch.float64)
        b = quant.unpack_int4(weight.data[g]).to(torch.float64)
        return (a @ b) * x.scale[rows].to(torch.float64).unsqueeze(1) * weight.scale[g].to(torch.float64)
    if kind is GemmKind.NVFP4:
        a = quant.dequantize(QuantizedTensor(x.data[rows], x.dtype, x.layout, x.scale[rows], x.global_scale))
        return a @ quant.dequantize_weight(weight.select(slice(g, g + 1)))[0]
    if kind is GemmKind.FP8_ROWWISE:
        a = x.data[rows].to(torch.float32) * x.scale[rows].unsqueeze(1)
        b = weight.data[g].to(torch.float32) * weight.scale[g].unsqueeze(0)
        return a @ b
    # FP8_BLOCK128: activation scales per 128 channels, weight scales per 128x128 tile.
    k, n = weight.data.shape[1:]
    a_scale = x.scale[rows].repeat_interleave(FP8_GROUP_SIZE, dim=1)[:, :k]
    b_scale = (
        weight.scale[g].repeat_interleave(FP8_GROUP_SIZE, dim=0)
        .repeat_interleave(FP8_GROUP_SIZE, dim=1)[:k, :n]
    )
    a = x.data[rows].to(torch.float32) * a_scale
    b = weight.data[g].to(torch.float32) * b_scale
    return a @ b


def check_shapes(
    x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
    weight: QuantizedWeight,
    groups: Groups,
    limits: KernelLimits | None = None,
) -> tuple[int, int, int]:
    """Check K, the group count and `limits` (when given); return the logical `(M, K, N)`."""
    m, k = x.shape  # logical (unpacked) shapes throughout
    e, wk, n = weight.num_experts, weight.in_features, weight.out_features
    if k != wk:
        raise invalid(
            "x, weight", "x [M, K] and weight [E, K, N] with the same K",
            f"x {tuple(x.shape)} and weight {(e, wk, n)}",
        )
    if groups.num_groups != e:
        raise invalid("groups", f"{e} groups (one per expert of weight)", groups.num_groups)
    if limits is not None:
        _check_limits(limits, m, k, n, e)
    return m, k, n


def resolve_out_dtype(kind: GemmKind, activation_dtype: torch.dtype, out_dtype: torch.dtype | None) -> torch.dtype:
    """The output dtype: as asked, else the activation dtype (float kinds) or bf16 (quantized kinds)."""
    if out_dtype is None:
        out_dtype = activation_dtype if kind in _FLOAT_KINDS else torch.bfloat16
    if out_dtype not in FLOAT_DTYPES:
        raise invalid("out_dtype", "torch.bfloat16, torch.float16 or torch.float32", out_dtype)
    return out_dtype


def check_operands(x: object, weight: object, groups: object) -> None:
    """Check the operand types and ranks (no values, no devices); raise `InvalidInput` if wrong."""
    if isinstance(x, (QuantizedTensor, PackedInt4Tensor)):
        if x.data.dim() != 2:
            raise invalid("x", "2-D data [M, K]", tuple(x.data.shape))
    elif isinstance(x, torch.Tensor):
        if x.dim() != 2:
            raise invalid("x", "a 2-D tensor [M, K]", tuple(x.shape))
    else:
        raise invalid("x", "a torch.Tensor, a QuantizedTensor or a PackedInt4Tensor", type(x).__name__)
    if not isinstance(weight, QuantizedWeight):
        raise invalid("weight", "a QuantizedWeight", type(weight).__name__)
    if not isinstance(groups, Groups):
        raise invalid("groups", "a hal Groups", type(groups).__name__)


def _check_limits(limits: KernelLimits, m: int, k: int, n: int, e: int) -> None:
    checks = (
        ("max_group_rows", limits.max_group_rows, "rows M", m),
        ("max_inner_dim", limits.max_inner_dim, "K", k),
        ("max_inner_dim", limits.max_inner_dim, "N", n),
        ("max_groups", limits.max_groups, "groups E", e),
    )
    for name, limit, what, value in checks:
        if limit is not None and value > limit:
            raise invalid(f"grouped_matmul {what}", f"at most {limit} (kernel limit {name})", value)
