"""Shared by the reference-quantizer tests: error bounds in quantization steps, and an nvfp4 decoder
written here (float64, one nibble at a time), independent of hal's."""

from __future__ import annotations

import torch

from hal import QuantizedTensor


# Error bounds, in units of the quantization step `scale` (or of |x| where relative):
#  int8:  round to nearest integer -> half a step; the fp32 division x/scale adds a relative
#         error of at most 127 * 2^-24 to the half step, so we allow a 2^-14 relative slack.
#  fp8:   e4m3 has 3 mantissa bits: a normal value is off by <= 2^-4 of itself; below the
#         smallest normal (2^-6) the spacing is 2^-9, i.e. an error <= 2^-10 steps.
#  nvfp4: half the e2m1 spacing at the value (0.25 / 0.5 / 1 step), and the block scale is an
#         e4m3 rounding of blockamax/6 (<= 2^-4 relative, or 2^-10 absolute when subnormal).
#  FLOAT_SLACK: relative fp32 rounding slack on products computed in fp32.
TOL = {
    "int8_half_step_slack": 2.0**-14,
    "fp8_rel": 2.0**-4,
    "fp8_subnormal_steps": 2.0**-10,
    "e4m3_scale_rel": 2.0**-4,
    "FLOAT_SLACK": 1e-6,
}

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_error_bound(x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Largest |x - nvfp4(x)| for values scaled by `step`: half the e2m1 spacing around
    |x| / step (0.25 up to 2, 0.5 up to 4, 1 beyond), or the saturation excess past 6."""
    ratio = torch.where(step > 0, x.abs() / torch.where(step > 0, step, 1), 0)
    half_spacing = torch.where(ratio <= 2, 0.25, torch.where(ratio <= 4, 0.5, 1.0))
    return step * torch.maximum(half_spacing, ratio - 6) * (1 + 1e-5)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def decode_nvfp4_here(q: QuantizedTensor) -> torch.Tensor:
    """Independent float64 nvfp4 decode: unpack nibbles one by one, look up e2m1, apply scales."""
    flat = q.data.reshape(-1, q.data.shape[-1]).tolist()
    values = []
    for row in flat:
        out = []
        for byte in row:
            for code in (byte & 0xF, byte >> 4):
                mag = E2M1[code & 7]
                out.append(-mag if code & 8 else mag)
        values.append(out)
    v = torch.tensor(values, dtype=torch.float64).reshape(q.shape)
    s = q.scale.to(torch.float64).repeat_interleave(16, dim=-1)
    return v * s / float(q.global_scale.reshape(()).double())


def fp8_bound(xd: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Per-element |error| bound for e4m3 with per-element step (scale broadcast)."""
    bound = torch.maximum(xd.abs() * TOL["fp8_rel"], step * TOL["fp8_subnormal_steps"])
    return bound * (1 + 1e-5) + xd.abs() * TOL["FLOAT_SLACK"]
