"""Grouped-matmul operands of every kind, built from random codes and scales.

The suite builds GEMM operands itself (never through the vendor's quantizers), so that a
wrong quantizer fails the quantize tests and nothing else. Helpers move operands to a
device and make non-contiguous copies of them.
"""

from __future__ import annotations

import torch

from hal import FP8_GROUP_SIZE, NVFP4_BLOCK_SIZE, DispatchDtype, PackedInt4Tensor, QuantizedTensor, QuantizedWeight
from hal import ScaleLayout

Activation = torch.Tensor | QuantizedTensor | PackedInt4Tensor


def random_codes_activation(kind: str, rows: int, k: int, gen: torch.Generator
                            ) -> torch.Tensor | QuantizedTensor | PackedInt4Tensor:
    """Activations `[rows, k]` of a grouped-matmul kind, from random codes and scales (CPU)."""
    if kind in ("bf16", "fp16", "fp32"):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[kind]
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
        return QuantizedTensor(data, DispatchDtype.FP8, ScaleLayout.GROUP_128,
                               torch.rand(rows, groups, generator=gen) * 2e-4 + 5e-5)
    if kind == "int4":
        words = torch.randint(-2**31, 2**31, (rows, k // 8), generator=gen, dtype=torch.int64)
        return PackedInt4Tensor(_no_minus_eight(words).to(torch.int32), scale * 10)
    if kind == "nvfp4":
        data = torch.randint(0, 256, (rows, k // 2), generator=gen, dtype=torch.uint8)
        block_scale = (torch.rand(rows, k // NVFP4_BLOCK_SIZE, generator=gen) * 300 + 8).to(torch.float8_e4m3fn)
        return QuantizedTensor(data, DispatchDtype.NVFP4, ScaleLayout.BLOCK_16, block_scale,
                               torch.tensor([448.0 * 6 / 4.0]))
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
        words = torch.randint(-2**31, 2**31, (experts, k, n // 8), generator=gen, dtype=torch.int64)
        return QuantizedWeight(_no_minus_eight(words).to(torch.int32), ScaleLayout.PER_CHANNEL, scale)
    if kind == "nvfp4":
        data = torch.randint(0, 256, (experts, k // 2, n), generator=gen, dtype=torch.uint8)
        block_scale = (torch.rand(experts, k // NVFP4_BLOCK_SIZE, n, generator=gen) * 300 + 8).to(torch.float8_e4m3fn)
        return QuantizedWeight(data, ScaleLayout.BLOCK_16, block_scale,
                               global_scale=torch.full((experts,), 448.0 * 6 / 2.0))
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
