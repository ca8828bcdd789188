"""Random 4-bit float expert weights (MXFP4, NVFP4) in their packed layouts and their float64 values.

Packed weights are `[E, K/2, N]` uint8, two e2m1 codes along K (even k in the low nibble); MXFP4
scales are `[E, K/32, N]` uint8 e8m0 (`2 ** (s - 127)`), NVFP4 scales `[E, K/16, N]` e4m3 with a
global scale `[E]` or `[E, N]` fp32 that the value is divided by. The codes are uniform over all 16
(both zeros, every magnitude, both signs); the scales are drawn near 1 so products stay in range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hal import E2M1_VALUES

MX_BLOCK, NV_BLOCK = 32, 16


@dataclass(frozen=True)
class Fp4Weights:
    """Packed codes, block scales and (NVFP4) the global scale of `[E, K, N]` expert weights."""

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None
    mx: bool

    def values(self) -> torch.Tensor:
        """The dequantized `[E, K, N]` weights in float64."""
        return dequantize(self)


def random_fp4(
    experts: int, k: int, n: int, *, mx: bool, per_column_global: bool = False, device: str = "cpu", seed: int = 0
) -> Fp4Weights:
    """Random weights of `experts` x `[k, n]` (k a multiple of the format's block)."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (experts, k // 2, n), generator=gen, dtype=torch.int32).to(torch.uint8)
    if mx:
        scale = torch.randint(120, 131, (experts, k // MX_BLOCK, n), generator=gen, dtype=torch.int32).to(torch.uint8)
        return Fp4Weights(data.to(device), scale.to(device), None, True)
    raw = torch.rand((experts, k // NV_BLOCK, n), generator=gen) * 3 + 0.25
    scale = raw.to(torch.float8_e4m3fn)
    shape = (experts, n) if per_column_global else (experts,)
    gs = (torch.rand(shape, generator=gen) * 4 + 0.5).to(torch.float32)
    return Fp4Weights(data.to(device), scale.to(device), gs.to(device), False)


def decode_codes(packed: torch.Tensor) -> torch.Tensor:
    """float64 `[E, K, N]` e2m1 values of packed `[E, K/2, N]` codes (low nibble: even k)."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=packed.device)
    table = torch.cat([magnitudes, -magnitudes])
    codes = packed.to(torch.int64)
    lo, hi = table[codes & 15], table[codes >> 4]
    e, half, n = packed.shape
    return torch.stack([lo, hi], dim=2).reshape(e, 2 * half, n)


def dequantize(w: Fp4Weights) -> torch.Tensor:
    """float64 values of packed weights: `e2m1 * 2**(s-127)` (MXFP4), `e2m1 * scale / global` (NVFP4)."""
    values = decode_codes(w.data)
    if w.mx:
        scale = torch.exp2(w.scale.to(torch.float64) - 127).repeat_interleave(MX_BLOCK, dim=1)
        return values * scale
    scale = w.scale.to(torch.float64).repeat_interleave(NV_BLOCK, dim=1)
    gs = w.global_scale.to(torch.float64)  # type: ignore[union-attr]
    gs = gs[:, None, :] if gs.dim() == 2 else gs[:, None, None]
    return values * scale / gs


def grouped_reference(
    x: torch.Tensor, w: torch.Tensor, counts: list[int], *, gated: bool = False, row_index: torch.Tensor | None = None
) -> torch.Tensor:
    """float64 `x[rows of g] @ w[g]` (x's rows through `row_index` where given); `gated`: `silu(gate) * up`."""
    rows = x.to(torch.float64) if row_index is None else x.to(torch.float64)[row_index.long()]
    w = w.to(rows.device)
    outs, start = [], 0
    for g, c in enumerate(counts):
        y = rows[start : start + c] @ w[g]
        if gated:
            gate, up = y.chunk(2, dim=-1)
            y = gate * torch.sigmoid(gate) * up
        outs.append(y)
        start += c
    return torch.cat(outs)
