"""torch's own grouped GEMMs on Hopper: `torch._grouped_mm` (bf16) and `torch._scaled_grouped_mm` (fp8 row-wise).

Both take the rows sorted by group and the groups' end offsets on the device (no host read), and run
CUTLASS kernels that torch ships: at many rows per group they beat the Triton grouped GEMM. The
row-wise fp8 product scales row i of x by `x.scale[i]` and column n of expert e by `weight.scale[e, n]`,
the layout `hal.formats` gives the `fp8-rowwise` kind; it reads the weights K-major, as
`CudaOps.prepare_weight` stores one-byte weights. It runs with fast accumulation (the tensor cores'
own accumulator between promotions): on an H200 its products differed from the exactly accumulated
ones by 1.3-3.7e-3 (relative norm, K 768-14336), within one bf16 rounding of the output.
"""

from __future__ import annotations

import logging

import torch

from hal import GemmKind, PackedInt4Tensor, QuantizedTensor, QuantizedWeight
from vendors.cuda.tuning import Choice

_LOG = logging.getLogger(__name__)

#: torch's row-wise fp8 grouped GEMM runs on sm90 only (its CUTLASS kernel is built for that arch).
SCALED_GROUPED_MM_CAPABILITY = (9, 0)
#: Rows per group from which torch._grouped_mm beats the Triton kernel for bf16, measured on an H100:
#: at 256 rows per group (qwen3, 4096 tokens) 463 us against 642 us for the gate/up projection; at
#: 128 (mixtral, 512 tokens) 1120 us against 756 us; at 32 (qwen3, 512 tokens) even.
GROUPED_MM_MIN_ROWS_PER_GROUP = 192
#: The same for torch._scaled_grouped_mm against the Triton kernel's row-wise fp8, measured on an H200 (graph
#: replays of the vendor's call, first projections gathered with their activation; three runs): at 128 rows per
#: group 1.13-1.35x faster on both projections of qwen3-30b-a3b, mixtral-8x7b and deepseek-v3-ep8 (mixtral's down
#: projection 1.03-1.16x); at 64 0.84-1.08x; at 16-32 0.58-0.79x.
SCALED_GROUPED_MM_MIN_ROWS_PER_GROUP = 128


def scaled_grouped_mm_available(capability: tuple[int, int]) -> bool:
    """Whether `torch._scaled_grouped_mm` serves row-wise fp8 on a device of this compute capability."""
    return tuple(capability) == SCALED_GROUPED_MM_CAPABILITY and hasattr(torch, "_scaled_grouped_mm")


def grouped_mm_aligned(k: int, n: int) -> bool:
    """torch._grouped_mm needs 16-byte aligned strides: K and N multiples of 8 bf16 values."""
    return k % 8 == 0 and n % 8 == 0


def grouped_mm_fits(w: torch.Tensor) -> bool:
    """Whether bf16 weights `[E, K, N]` suit torch._grouped_mm: contiguous, K and N aligned."""
    return grouped_mm_aligned(w.shape[1], w.shape[2]) and w.is_contiguous()


def grouped_mm_by_default(rows: int, groups: int, kind: GemmKind = GemmKind.BF16) -> bool:
    """The built-in rule where the table has no entry: torch's grouped GEMM (where it fits) from
    `GROUPED_MM_MIN_ROWS_PER_GROUP` rows per group (`SCALED_GROUPED_MM_MIN_ROWS_PER_GROUP` for fp8
    row-wise), the Triton kernel below."""
    least = SCALED_GROUPED_MM_MIN_ROWS_PER_GROUP if kind is GemmKind.FP8_ROWWISE else GROUPED_MM_MIN_ROWS_PER_GROUP
    return rows >= least * groups


def scaled_grouped_mm_aligned(k: int, n: int) -> bool:
    """torch._scaled_grouped_mm needs 16-byte aligned strides of its one-byte operands: K and N multiples of 16."""
    return k % 16 == 0 and n % 16 == 0


def scaled_grouped_mm_fits(
    x: torch.Tensor | QuantizedTensor, weight: QuantizedWeight, kind: GemmKind, out_dtype: torch.dtype
) -> bool:
    """Whether a call of kind fp8-rowwise can run as `torch._scaled_grouped_mm`: fp8 rows with one fp32
    scale each, K-major fp8 weights with `[E, N]` fp32 scales, aligned K and N, a bf16 output."""
    if kind is not GemmKind.FP8_ROWWISE or out_dtype != torch.bfloat16 or not isinstance(x, QuantizedTensor):
        return False
    w = weight.data
    return (
        x.data.dtype == torch.float8_e4m3fn
        and x.scale is not None
        and x.scale.dtype == torch.float32
        and x.scale.numel() == x.data.shape[0]
        and w.dtype == torch.float8_e4m3fn
        and w.stride(1) == 1
        and w.stride(0) % 16 == 0
        and w.stride(2) % 16 == 0
        and weight.scale is not None
        and weight.scale.dtype == torch.float32
        and tuple(weight.scale.shape) == (w.shape[0], w.shape[2])
        and scaled_grouped_mm_aligned(w.shape[1], w.shape[2])
    )


def scaled_grouped_mm(
    data: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """`y[rows of g] = (data * scale) @ (weight[g] * weight_scale[g])` in bf16: fp8 rows sorted by group with
    one scale each, K-major fp8 weights `[E, K, N]` with `[E, N]` scales, `offsets` the groups' int32 end rows."""
    return torch._scaled_grouped_mm(
        data,
        weight,
        scale.reshape(-1).contiguous(),
        weight_scale if weight_scale.is_contiguous() else weight_scale.contiguous(),
        offs=offsets,
        out_dtype=torch.bfloat16,
        use_fast_accum=True,
    )


def torch_grouped_fits(
    x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
    weight: QuantizedWeight,
    kind: GemmKind,
    out_dtype: torch.dtype,
    *,
    bf16: bool,
    fp8_rowwise: bool,
) -> bool:
    """Whether torch's grouped GEMM serves a call: `torch._grouped_mm` for bf16 where `bf16` (it runs here),
    `torch._scaled_grouped_mm` for fp8 row-wise where `fp8_rowwise`."""
    if kind is GemmKind.BF16:
        return bf16 and out_dtype == torch.bfloat16 and grouped_mm_fits(weight.data)
    return fp8_rowwise and not isinstance(x, PackedInt4Tensor) and scaled_grouped_mm_fits(x, weight, kind, out_dtype)


def torch_grouped(
    data: torch.Tensor,
    scale: torch.Tensor | None,
    weight: QuantizedWeight,
    counts: torch.Tensor,
    row_index: torch.Tensor | None,
) -> torch.Tensor:
    """torch's grouped GEMM of a call that `torch_grouped_fits`, in bf16: x's rows `data` (and their scales, for
    fp8 row-wise) gathered through `row_index` first where there is one, the groups' sizes `counts`."""
    if row_index is not None:
        data = data.index_select(0, row_index)
        scale = None if scale is None else scale.reshape(-1).index_select(0, row_index)
    if (data.stride(0) * data.element_size()) % 16:  # torch's GEMMs read rows at 16-byte aligned strides
        data = data.contiguous()
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    if scale is None:
        return torch._grouped_mm(data, weight.data, offs=offsets, out_dtype=torch.bfloat16)
    return scaled_grouped_mm(data, scale, weight.data, weight.scale, offsets)  # type: ignore[arg-type]


def log_unserved_choice(
    logged: set[tuple[object, ...]],
    kind: GemmKind,
    weight: QuantizedWeight,
    out_dtype: torch.dtype,
    backend: str = "torch-grouped-mm",
    *,
    fallback: Choice | None = None,
    level: int = logging.WARNING,
) -> None:
    """Log at `level`, once per problem and backend in `logged` (the caller's own set), that a tuned table chose
    `backend` (torch's grouped GEMM, DeepGEMM or quack) for a call it cannot serve here (not installed, not in this torch
    or on this device, or operands it does not take): the call runs on the entry's `fallback`, else the next runner."""
    key = (kind, tuple(weight.data.shape), out_dtype, backend)
    if key in logged:
        return
    logged.add(key)
    instead = (
        f"running its fallback entry ({fallback.backend})"
        if fallback is not None
        else "running the next runner (torch's grouped GEMM or the Triton kernel at its built-in tiles)"
    )
    _LOG.log(
        level,
        "the tuned table chooses %s for %s experts %s (output %s), which cannot run here (%s); %s",
        backend,
        kind,
        "x".join(map(str, weight.data.shape)),
        out_dtype,
        _UNSERVED_WHY.get(backend, backend),
        instead,
    )


_UNSERVED_WHY = {
    "torch-grouped-mm": "torch._grouped_mm: bf16 on sm90+; torch._scaled_grouped_mm: fp8 row-wise, K-major, on sm90",
    "deep-gemm": "DeepGEMM: installed, sm90, fp8 block-128 with K and N multiples of 128",
    "quack": "quack-kernels: installed and importable, sm90, bf16 with K and N multiples of 8",
}
