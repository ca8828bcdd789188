"""Grouped-matmul operands of every kind, built from random codes and scales.

The suite builds GEMM operands itself (never through the vendor's quantizers), so that a
wrong quantizer fails the quantize tests and nothing else. Helpers move operands to a
device and make non-contiguous copies of them.
"""

from __future__ import annotations

import torch

import math

from hal import FP8_GROUP_SIZE, NVFP4_BLOCK_SIZE, DispatchDtype, PackedInt4Tensor, QuantizedTensor, QuantizedWeight
from hal import ScaleLayout

#: Values along K under one e8m0 scale in mxfp4 weights (restated: the suite keeps its own facts).
MXFP4_BLOCK = 32

Activation = torch.Tensor | QuantizedTensor | PackedInt4Tensor


def random_codes_activation(
    kind: str, rows: int, k: int, gen: torch.Generator
) -> torch.Tensor | QuantizedTensor | PackedInt4Tensor:
    """Activations `[rows, k]` of a grouped-matmul kind, from random codes and scales (CPU)."""
    if kind in ("bf16", "fp16", "fp32", "bf16-mxfp4", "bf16-nvfp4"):
        dtype = {"fp16": torch.float16, "fp32": torch.float32}.get(kind, torch.bfloat16)
        return torch.randn(rows, k, generator=gen).to(dtype)
    scale = torch.rand(rows, generator=gen) * 0.02 + 0.005
    if kind == "int8":
        data = torch.randint(-127, 128, (rows, k), generator=gen, dtype=torch.int8)
        return QuantizedTensor(data, DispatchDtype.INT8, ScaleLayout.PER_TOKEN, scale)
    if kind == "fp8-rowwise":
        data = (torch.randn(rows, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        return QuantizedTensor(data, DispatchDtype.FP8, ScaleLayout.PER_TOKEN, scale * 0.01)
    if kind == "fp8-block128":
        data = (torch.randn(rows, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        groups = -(-k // FP8_GROUP_SIZE)
        return QuantizedTensor(
            data, DispatchDtype.FP8, ScaleLayout.GROUP_128, torch.rand(rows, groups, generator=gen) * 2e-4 + 5e-5
        )
    if kind == "int4":
        words = torch.randint(-(2**31), 2**31, (rows, k // 8), generator=gen, dtype=torch.int64)
        return PackedInt4Tensor(_no_minus_eight(words).to(torch.int32), scale * 10)
    if kind == "nvfp4":
        data = torch.randint(0, 256, (rows, k // 2), generator=gen, dtype=torch.uint8)
        block_scale = (torch.rand(rows, k // NVFP4_BLOCK_SIZE, generator=gen) * 300 + 8).to(torch.float8_e4m3fn)
        return QuantizedTensor(
            data, DispatchDtype.NVFP4, ScaleLayout.BLOCK_16, block_scale, torch.tensor([448.0 * 6 / 4.0])
        )
    raise ValueError(f"kind: expected a grouped-matmul kind, got {kind!r}")


def random_codes_weight(kind: str, experts: int, k: int, n: int, gen: torch.Generator) -> QuantizedWeight:
    """Expert weights `[experts, k, n]` of a grouped-matmul kind, from random codes and scales (CPU)."""
    if kind in ("bf16", "fp16", "fp32"):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[kind]
        return QuantizedWeight((torch.randn(experts, k, n, generator=gen) / k**0.5).to(dtype))
    scale = torch.rand(experts, n, generator=gen) * 0.02 + 0.005
    if kind == "int8":
        data = torch.randint(-127, 128, (experts, k, n), generator=gen, dtype=torch.int8)
        return QuantizedWeight(data, ScaleLayout.PER_CHANNEL, scale)
    if kind == "fp8-rowwise":
        data = (torch.randn(experts, k, n, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        return QuantizedWeight(data, ScaleLayout.PER_CHANNEL, scale * 0.01)
    if kind == "fp8-block128":
        data = (torch.randn(experts, k, n, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        tiles = (experts, -(-k // FP8_GROUP_SIZE), -(-n // FP8_GROUP_SIZE))
        return QuantizedWeight(data, ScaleLayout.BLOCK_128X128, torch.rand(*tiles, generator=gen) * 2e-4 + 5e-5)
    if kind == "int4":
        words = torch.randint(-(2**31), 2**31, (experts, k, n // 8), generator=gen, dtype=torch.int64)
        return QuantizedWeight(_no_minus_eight(words).to(torch.int32), ScaleLayout.PER_CHANNEL, scale)
    if kind == "bf16-mxfp4":
        data = torch.randint(0, 256, (experts, k // 2, n), generator=gen, dtype=torch.uint8)
        exponents = torch.randint(-9, -3, (experts, k // MXFP4_BLOCK, n), generator=gen) + 127  # 2^-9 .. 2^-4
        return QuantizedWeight(data, ScaleLayout.BLOCK_32, exponents.to(torch.uint8))
    if kind in ("nvfp4", "bf16-nvfp4"):
        data = torch.randint(0, 256, (experts, k // 2, n), generator=gen, dtype=torch.uint8)
        block_scale = (torch.rand(experts, k // NVFP4_BLOCK_SIZE, n, generator=gen) * 300 + 8).to(torch.float8_e4m3fn)
        return QuantizedWeight(
            data, ScaleLayout.BLOCK_16, block_scale, global_scale=torch.full((experts,), 448.0 * 6 / 2.0)
        )
    raise ValueError(f"kind: expected a grouped-matmul kind, got {kind!r}")


def _no_minus_eight(words: torch.Tensor) -> torch.Tensor:
    """Random int4 words with every nibble in [-7, 7] (the symmetric range the format uses)."""
    nibbles = [(words >> (4 * j)) & 0xF for j in range(8)]
    fixed = [torch.where(n == 8, torch.zeros_like(n), n) for n in nibbles]
    packed = sum(n << (4 * j) for j, n in enumerate(fixed))
    return torch.where(packed >= 2**31, packed - 2**32, packed)


def to_device(x: Activation | QuantizedWeight, device: torch.device) -> Activation | QuantizedWeight:
    """The same operand with every tensor on `device`."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, PackedInt4Tensor):
        return PackedInt4Tensor(x.data.to(device), x.scale.to(device))
    if isinstance(x, QuantizedWeight):
        return QuantizedWeight(x.data.to(device), x.layout, _to(x.scale, device), _to(x.global_scale, device))
    return QuantizedTensor(x.data.to(device), x.dtype, x.layout, _to(x.scale, device), _to(x.global_scale, device))


def strided(x: Activation | QuantizedWeight) -> Activation | QuantizedWeight:
    """The same values with non-contiguous data (column-major within each matrix)."""
    if isinstance(x, torch.Tensor):
        return _transposed(x)
    if isinstance(x, PackedInt4Tensor):
        return PackedInt4Tensor(_transposed(x.data), x.scale)
    if isinstance(x, QuantizedWeight):
        return QuantizedWeight(_transposed(x.data), x.layout, x.scale, x.global_scale)
    return QuantizedTensor(_transposed(x.data), x.dtype, x.layout, x.scale, x.global_scale)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """Column-major storage of the last two dimensions: same shape and values, other strides."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


# -- shapes and magnitudes of real models (the shape sweeps and property tests) ---------------------


def magnitudes(shape: tuple[int, ...], low: float, high: float, gen: torch.Generator) -> torch.Tensor:
    """Float64 factors `10^u`, u uniform in [low, high]: magnitudes that differ by orders of magnitude."""
    return 10.0 ** (low + torch.rand(*shape, generator=gen, dtype=torch.float64) * (high - low))


def tiles_to_elements(factors: torch.Tensor, k: int, n: int, tile: int = FP8_GROUP_SIZE) -> torch.Tensor:
    """Per-tile factors `[E, ceil(K/tile), ceil(N/tile)]` spread over the elements `[E, K, N]`."""
    return factors.repeat_interleave(tile, dim=-2).repeat_interleave(tile, dim=-1)[..., :k, :n]


def spread_rows(rows: int, hidden: int, gen: torch.Generator, spread: float = 1.5) -> torch.Tensor:
    """fp32 activations `[rows, hidden]` whose rows and 128-channel groups are each scaled by
    `10^[-spread, spread]` (default: values from 1e-3 to 1e3 times normal), so a scale read from
    the wrong row or group shows at once."""
    groups = -(-hidden // FP8_GROUP_SIZE)
    per_group = magnitudes((rows, groups), -spread, spread, gen).repeat_interleave(FP8_GROUP_SIZE, dim=1)
    factor = magnitudes((rows, 1), -spread, spread, gen) * per_group[:, :hidden]
    return (torch.randn(rows, hidden, generator=gen, dtype=torch.float64) * factor).to(torch.float32)


def spread_weights(experts: int, k: int, n: int, gen: torch.Generator, spread: float = 3.0) -> torch.Tensor:
    """fp32 expert weights `[E, K, N]` whose 128x128 tiles (and so their blocks and channels)
    differ by up to `10^spread` either way, as the tiles of real checkpoints do."""
    tiles = magnitudes((experts, -(-k // FP8_GROUP_SIZE), -(-n // FP8_GROUP_SIZE)), -spread, spread, gen)
    return torch.randn(experts, k, n, generator=gen) / k**0.5 * tiles_to_elements(tiles.float(), k, n)


def layer_tile_factors(experts: int, k: int, n: int, spread: float = 3.0) -> torch.Tensor:
    """Tile magnitudes `[E, Kb, Nb]` for a layer's weights: in every 128-column block the tiles of
    one row block (`e mod Kb`, the same for all columns) have magnitude 1 and the others
    `10^-spread/3 .. 10^-spread`.

    Every output channel keeps a tile of magnitude one, so no channel is negligible in the
    layer's error; and tile (i, j) differs from tile (j, i), so block scales read transposed
    or from the wrong tile change the result, at any token count.
    """
    kb, nb = -(-k // FP8_GROUP_SIZE), -(-n // FP8_GROUP_SIZE)
    e = torch.arange(experts).view(-1, 1, 1)
    i = torch.arange(kb).view(1, -1, 1)
    j = torch.arange(nb).view(1, 1, -1)
    exponent = -spread * ((i + j + e) % 3 + 1).to(torch.float64) / 3
    dominant = (i == e % kb).expand(experts, kb, nb)
    return 10.0 ** torch.where(dominant, torch.zeros_like(exponent), exponent)


def layer_weights(
    experts: int, hidden: int, intermediate: int, gen: torch.Generator, *, spread: float = 3.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 `w13` `[E, H, 2I]` and `w2` `[E, I, H]` with tile magnitudes of `layer_tile_factors`,
    scaled to keep the layer's activations of order one."""
    w13 = torch.randn(experts, hidden, 2 * intermediate, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, intermediate, hidden, generator=gen) / intermediate**0.5
    w13 *= tiles_to_elements(
        layer_tile_factors(experts, hidden, 2 * intermediate, spread).float(), hidden, 2 * intermediate
    )
    w2 *= tiles_to_elements(layer_tile_factors(experts, intermediate, hidden, spread).float(), intermediate, hidden)
    return w13, w2


def uneven_counts(groups: int, rows: int, gen: torch.Generator, empty: float = 0.25) -> list[int]:
    """Rows per group summing to `rows`: uneven, about a fraction `empty` of the groups (at random
    positions, first and last included sometimes) with none."""
    if rows == 0:
        return [0] * groups
    weights = torch.rand(groups, generator=gen, dtype=torch.float64) ** 2
    weights = weights * (torch.rand(groups, generator=gen) >= empty)
    if not bool(weights.any()):
        weights[int(torch.randint(groups, (1,), generator=gen))] = 1.0
    counts = (weights / weights.sum() * rows).floor().long()
    counts[int(weights.argmax())] += rows - int(counts.sum())
    return counts.tolist()


def routing(
    tokens: int, top_k: int, experts: int, gen: torch.Generator, empty: float = 0.25
) -> tuple[torch.Tensor, torch.Tensor]:
    """Precomputed routing `(ids int64 [T, k], weights fp32 [T, k])`: k distinct experts per token with
    uneven popularity, about a fraction `empty` of the experts never chosen, and weights in
    [0.1, 1] that do not sum to one (sigmoid scores and scaling factors do not), so a combine that
    drops a weight is seen even at top-1."""
    popularity = torch.rand(experts, generator=gen, dtype=torch.float64) ** 2 + 1e-3
    popularity = popularity * (torch.rand(experts, generator=gen) >= empty)
    chosen = popularity.nonzero().flatten()
    if chosen.numel() < top_k:  # keep at least k experts to choose from
        popularity[torch.randperm(experts, generator=gen)[:top_k]] = 1.0
    if tokens == 0:
        ids = torch.zeros((0, top_k), dtype=torch.int64)
    else:
        ids = torch.multinomial(popularity.expand(tokens, experts), top_k, replacement=False, generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen) * 0.9 + 0.1
    return ids, weights


def spread_scales(
    x: Activation | QuantizedWeight, gen: torch.Generator, low: float, high: float
) -> Activation | QuantizedWeight:
    """The same kind of operand with its scales (float kinds: its rows or 128x128 tiles) multiplied by
    factors `10^[low, high]`: tokens, channels, groups and tiles of very different magnitude. nvfp4's
    e4m3 block scales are kept (their range is small); its per-expert global scale is spread."""
    if isinstance(x, torch.Tensor):
        return (x.double() * magnitudes((x.shape[0], 1), low, high, gen)).to(x.dtype)
    if isinstance(x, PackedInt4Tensor):
        return PackedInt4Tensor(x.data, _spread(x.scale, gen, low, high))
    if isinstance(x, QuantizedTensor):
        if x.dtype is DispatchDtype.NVFP4:
            return x
        return QuantizedTensor(x.data, x.dtype, x.layout, _spread(x.scale, gen, low, high), x.global_scale)
    if x.layout is ScaleLayout.NONE:
        e, k, n = x.data.shape
        tiles = magnitudes((e, -(-k // FP8_GROUP_SIZE), -(-n // FP8_GROUP_SIZE)), low, high, gen)
        return QuantizedWeight((x.data.double() * tiles_to_elements(tiles, k, n)).to(x.data.dtype), x.layout)
    if x.layout is ScaleLayout.BLOCK_16:  # a larger global scale is a smaller weight
        return QuantizedWeight(x.data, x.layout, x.scale, _spread(x.global_scale, gen, -high, -low))
    if x.layout is ScaleLayout.BLOCK_32:  # e8m0 bytes are exponents: spread them by whole powers of two
        u = low + torch.rand(*x.scale.shape, generator=gen, dtype=torch.float64) * (high - low)
        shifted = x.scale.to(torch.int64) + torch.round(u * math.log2(10)).to(torch.int64)
        return QuantizedWeight(x.data, x.layout, shifted.clamp(0, 254).to(torch.uint8))
    return QuantizedWeight(x.data, x.layout, _spread(x.scale, gen, low, high), x.global_scale)


def _spread(t: torch.Tensor | None, gen: torch.Generator, low: float, high: float) -> torch.Tensor | None:
    return None if t is None else (t.double() * magnitudes(tuple(t.shape), low, high, gen)).to(t.dtype)
