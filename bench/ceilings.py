"""The device's measured ceilings: copy bandwidth and dense matmul throughput (bf16, fp8)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.timing import DeviceTimer


@dataclass(frozen=True)
class Ceilings:
    """Measured peaks: bytes/s of a large device copy (read + write), FLOP/s of dense matmuls."""

    copy_bytes_per_s: float
    matmul_flops_per_s: dict[str, float]

    def as_dict(self) -> dict[str, float]:
        """Plain data (GB/s and TFLOP/s) for JSON."""
        return {
            "copy_GBps": self.copy_bytes_per_s / 1e9,
            **{f"matmul_{k}_TFLOPs": v / 1e12 for k, v in self.matmul_flops_per_s.items()},
        }


def measure(timer: DeviceTimer, *, copy_bytes: int = 1 << 30, n: int = 8192) -> Ceilings:
    """Time a `copy_bytes` device copy and `n`x`n`x`n` matmuls in bf16 and (where supported) fp8."""
    device = timer.device
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_us = timer.median_us(lambda i: dst.copy_(src), warmup=3, repeats=20)
    del src, dst
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    flops = 2.0 * n**3
    peaks = {"bf16": flops / (timer.median_us(lambda i: a @ b, warmup=3, repeats=20) * 1e-6)}
    fp8 = _fp8_matmul(a, b)
    if fp8 is not None:
        peaks["fp8"] = flops / (timer.median_us(lambda i: fp8(), warmup=3, repeats=20) * 1e-6)
    return Ceilings(2.0 * copy_bytes / (copy_us * 1e-6), peaks)


def _fp8_matmul(a: torch.Tensor, b: torch.Tensor):
    """A dense fp8 matmul of a and b (torch._scaled_mm), or None where the device has none."""
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device=a.device)
        torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except Exception:  # no fp8 matmul on this device or torch build: no fp8 ceiling
        return None
    return lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
