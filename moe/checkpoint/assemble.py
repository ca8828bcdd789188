"""Checkpoint tensors, per expert and projection, assembled into hal's expert-weight formats.

Each projection arrives `[N, K]` (out, in); hal keeps `[E, K, N]`. So every weight is
transposed and stacked over the local experts, gate and up concatenated along N (`w13`
`[E, H, 2I]`, gate first; `[E, H, I]` from the up projection alone for a plain
activation), the down projection giving `w2` `[E, I, H]`. Scales follow, by format:

- fp8 / int8
  - `w13.scale` / `w2.scale`: per-channel fp32 `[E, N]`; a per-tensor scale repeated over its N
    channels
  - global scale: none
- fp8-block128
  - `w13.scale` / `w2.scale`: each `weight_scale_inv` transposed: `[E, ceil(K/128), ceil(N/128)]`
  - global scale: none
- nvfp4
  - `w13.scale` / `w2.scale`: each e4m3 `weight_scale` transposed: `[E, K/16, N]`
  - global scale: `1 / weight_scale_2`: fp32 `[E]`, or `[E, 2I]` where gate and up differ
- mxfp4
  - data: each `blocks` tensor (viewed `[N, K/2]`) transposed: `[E, K/2, N]`
  - `w13.scale` / `w2.scale`: each e8m0 `scales` tensor transposed: `[E, K/32, N]` uint8
  - global scale: none

The nvfp4 and mxfp4 bytes need no change: ModelOpt packs two e2m1 codes per byte along K with the
even k in the low nibble, which is hal's layout once transposed. Only the reciprocal of
`weight_scale_2` is computed (in float64, rounded once to fp32). Biases are widened to fp32;
under tensor parallelism the down projection's bias is rank 0's (zeros on the other ranks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hal import Activation, QuantizedWeight, ScaleLayout
from moe.checkpoint.formats import FormatSpec
from moe.checkpoint.names import Projection, TensorKind
from moe.schemes import ExpertWeights

#: `part(expert, projection, kind)`: one stored tensor of a local expert, `[N, K]` (scalars as stored).
PartGetter = Callable[[int, Projection, TensorKind], torch.Tensor]


def assemble(
    spec: FormatSpec,
    part: PartGetter,
    num_experts: int,
    activation: Activation,
    bias: bool,
    input_global_scale: float | None = None,
    intermediate_global_scale: float | None = None,
    device: torch.device | None = None,
    down_bias_here: bool = True,
) -> ExpertWeights:
    """The `ExpertWeights` of `num_experts` local experts from their checkpoint tensors.

    `down_bias_here`: this rank adds the down projection's bias (tensor-parallel rank 0); the
    other ranks get zeros, so that the sum over ranks adds it once.
    """
    first = (Projection.GATE, Projection.UP) if activation.gated else (Projection.UP,)
    w13 = _weight(spec, part, num_experts, first, device)
    w2 = _weight(spec, part, num_experts, (Projection.DOWN,), device)
    extra: dict[str, object] = {"activation": activation}
    if input_global_scale is not None and intermediate_global_scale is not None:
        extra["input_global_scale"] = _one(input_global_scale, w13.data.device)
        extra["intermediate_global_scale"] = _one(intermediate_global_scale, w13.data.device)
    if bias:
        extra["w13_bias"] = _rows(part, num_experts, first, TensorKind.BIAS, torch.float32, device)
        b2 = _rows(part, num_experts, (Projection.DOWN,), TensorKind.BIAS, torch.float32, device)
        extra["w2_bias"] = b2 if down_bias_here else torch.zeros_like(b2)
    return ExpertWeights(w13, w2, **extra)  # type: ignore[arg-type]


def _one(value: float, device: torch.device) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32, device=device)


def _weight(
    spec: FormatSpec, part: PartGetter, experts: int, projections: tuple[Projection, ...], device: torch.device | None
) -> QuantizedWeight:
    """One hal weight `[E, K, N]` from the projections concatenated along N."""
    data = _transposed(part, experts, projections, spec.data_kind, spec.storage, device)
    if spec.layout is ScaleLayout.BLOCK_32:
        scale = _transposed(part, experts, projections, TensorKind.SCALES, torch.uint8, device)
        return QuantizedWeight(data, ScaleLayout.BLOCK_32, scale)
    if spec.layout is ScaleLayout.NONE:
        return QuantizedWeight(data, ScaleLayout.NONE)
    if spec.layout is ScaleLayout.PER_CHANNEL:
        scale = _rows(
            part,
            experts,
            projections,
            TensorKind.WEIGHT_SCALE,
            torch.float32,
            device,
            widths=[part(0, p, TensorKind.WEIGHT).shape[0] for p in projections],
        )
        return QuantizedWeight(data, ScaleLayout.PER_CHANNEL, scale)
    if spec.layout is ScaleLayout.BLOCK_128X128:
        scale = _transposed(part, experts, projections, TensorKind.WEIGHT_SCALE_INV, torch.float32, device)
        return QuantizedWeight(data, ScaleLayout.BLOCK_128X128, scale)
    scale = _transposed(part, experts, projections, TensorKind.WEIGHT_SCALE, torch.float8_e4m3fn, device)
    return QuantizedWeight(data, ScaleLayout.BLOCK_16, scale, _global_scales(part, experts, projections, data))


def _transposed(
    part: PartGetter,
    experts: int,
    projections: tuple[Projection, ...],
    kind: TensorKind,
    dtype: torch.dtype,
    device: torch.device | None,
) -> torch.Tensor:
    """`[E, K, N]`: each expert's `[N_p, K]` tensors transposed and concatenated along N, in one copy."""
    pieces = [part(0, p, kind) for p in projections]
    k = pieces[0].shape[1]
    n = sum(t.shape[0] for t in pieces)
    out = torch.empty((experts, k, n), dtype=dtype, device=device or pieces[0].device)
    for e in range(experts):
        start = 0
        for p in projections:
            t = part(e, p, kind)
            out[e, :, start : start + t.shape[0]].copy_(t.t())  # widening a scale to fp32 is exact
            start += t.shape[0]
    return out


def _rows(
    part: PartGetter,
    experts: int,
    projections: tuple[Projection, ...],
    kind: TensorKind,
    dtype: torch.dtype,
    device: torch.device | None,
    widths: list[int] | None = None,
) -> torch.Tensor:
    """`[E, N]` from per-channel vectors (`[N]` or `[N, 1]`) concatenated; a one-value scale fills
    its projection's `widths[p]` channels."""
    first = part(0, projections[0], kind)
    sizes = widths or [part(0, p, kind).reshape(-1).shape[0] for p in projections]
    out = torch.empty((experts, sum(sizes)), dtype=dtype, device=device or first.device)
    for e in range(experts):
        start = 0
        for p, width in zip(projections, sizes):
            out[e, start : start + width].copy_(part(e, p, kind).reshape(-1).expand(width))
            start += width
    return out


def _global_scales(
    part: PartGetter, experts: int, projections: tuple[Projection, ...], data: torch.Tensor
) -> torch.Tensor:
    """nvfp4 global scales `1 / weight_scale_2`: `[E]` where every projection of an expert agrees,
    else per output channel `[E, N]`."""
    ws2 = torch.tensor(
        [[float(part(e, p, TensorKind.WEIGHT_SCALE_2).reshape(())) for p in projections] for e in range(experts)],
        dtype=torch.float64,
    )
    gs = (1.0 / ws2).to(torch.float32)  # [E, P]
    if bool((gs == gs[:, :1]).all()):
        return gs[:, 0].contiguous().to(data.device)
    widths = [part(0, p, TensorKind.WEIGHT).shape[0] for p in projections]
    return gs.repeat_interleave(torch.tensor(widths), dim=1).to(data.device)
