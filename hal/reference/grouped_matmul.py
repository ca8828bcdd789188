"""Reference grouped matmul: a plain loop over groups, each a dense matmul with scales applied.

What a kind computes is read from its row of `hal.GEMM_KINDS`: integer kinds (int8, int4)
compute the integer product exactly (float64 holds any int8 or int4 dot product of
realistic K exactly) and then apply the per-token and per-channel scales; every other kind
decodes both operands to fp32 (float kinds are a cast; fp8 and nvfp4 apply their scales)
and multiplies in fp32.
"""

from __future__ import annotations

import torch

from hal import checks
from hal.capabilities import KernelLimits
from hal.formats import PackedInt4Tensor, QuantizedTensor, QuantizedWeight
from hal.gemm_kinds import GemmSpec, gemm_kind_of
from hal.groups import Groups
from hal.reference.int4 import unpack_int4
from hal.reference.quantize import dequantize
from hal.reference.weights import dequantize_weight

Activation = torch.Tensor | QuantizedTensor | PackedInt4Tensor


def grouped_matmul(
    x: Activation,
    weight: QuantizedWeight,
    groups: Groups,
    out_dtype: torch.dtype | None = None,
    limits: KernelLimits | None = None,
) -> torch.Tensor:
    """`y[rows of g] = x[rows of g] @ weight[g]` for every group g, scales applied: `[M, N]`.

    `out_dtype` defaults to the activation dtype for float kinds and bf16 for quantized
    kinds. `limits`, when given, are enforced (exceeding one raises `InvalidInput`). Reads
    the group sizes on the host, and checks that they cover every row.
    """
    checks.gemm_operands(x, weight, groups)
    kind = gemm_kind_of(x, weight)
    m, _, n = checks.gemm_shapes(x, weight, groups, limits)
    return compute(x, weight, groups, kind.spec, checks.gemm_out_dtype(kind, out_dtype), m, n)


def compute(
    x: Activation,
    weight: QuantizedWeight,
    groups: Groups,
    spec: GemmSpec,
    out_dtype: torch.dtype,
    m: int | None = None,
    n: int | None = None,
) -> torch.Tensor:
    """The product of validated operands of kind `spec`."""
    m = x.shape[0] if m is None else m
    n = weight.out_features if n is None else n
    counts = groups.check_values(m)
    data = x if isinstance(x, torch.Tensor) else x.data
    out = torch.zeros((m, n), dtype=out_dtype, device=data.device)
    start = 0
    for g, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        out[rows] = _group_product(spec, x, weight, g, rows).to(out_dtype)
        start += count
    return out


def _group_product(spec: GemmSpec, x: Activation, weight: QuantizedWeight, g: int, rows: slice) -> torch.Tensor:
    """One group's product, before the cast to the output dtype."""
    if spec.exact_integer:
        a = _integers(x.data[rows]).to(torch.float64)
        b = _integers(weight.data[g]).to(torch.float64)
        return (a @ b) * x.scale[rows].to(torch.float64).unsqueeze(1) * weight.scale[g].to(torch.float64)
    if isinstance(x, torch.Tensor):
        a = x[rows].to(torch.float32)
    else:
        a = dequantize(x.rows(rows))  # type: ignore[union-attr]
    return a @ dequantize_weight(weight.select(slice(g, g + 1)))[0]


def _integers(t: torch.Tensor) -> torch.Tensor:
    """Integer operand values: int8 as they are, int4 unpacked from its int32 words."""
    return unpack_int4(t) if t.dtype == torch.int32 else t
