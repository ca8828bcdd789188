"""A quick numeric self-check of a vendor's ops against float64 references (`hal doctor`).

It runs every op the vendor declares once, on small random inputs, and compares with
references computed here in float64. It is a smoke check for operators, seconds long;
the full contract is the conformance suite.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from hal.capabilities import Capabilities, GemmKind
from hal.dtypes import FP8_GROUP_SIZE, DispatchDtype, ScaleLayout
from hal.formats import INT4_MAX, PackedInt4Tensor, QuantizedTensor
from hal.groups import Groups
from hal.reference import activation_value, weight_value
from hal.vendor import Vendor

#: Largest |error| allowed, relative to the largest |reference| value, per output dtype.
GEMM_TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}

@dataclass(frozen=True)
class CheckResult:
    """One self-check: its name, whether it passed, the error found and the bound allowed."""

    name: str
    passed: bool
    max_error: float | None
    bound: float | None
    seconds: float
    detail: str = ""

    def as_dict(self) -> dict[str, object]:
        """Plain-data view for JSON output."""
        return {"name": self.name, "passed": self.passed, "max_error": self.max_error,
                "bound": self.bound, "seconds": round(self.seconds, 4), "detail": self.detail}


def run_selfcheck(vendor: Vendor, seed: int = 0) -> list[CheckResult]:
    """Run every declared op of `vendor` once against float64 references."""
    caps = vendor.capabilities()
    gen = torch.Generator().manual_seed(seed)
    device = vendor.device
    checks: list[tuple[str, Callable[[], tuple[float, float]]]] = []
    for dtype, layout in _dispatch_formats(caps):
        checks.append((f"quantize {dtype} {layout}", lambda d=dtype, lay=layout: _roundtrip(vendor, d, lay, gen, device)))
    if GemmKind.INT4 in caps.grouped_matmul:  # int4 is a compute format, not a dispatch dtype
        checks.append(("quantize int4 per-token", lambda: _int4_roundtrip(vendor, gen, device)))
    for kind in sorted(caps.grouped_matmul, key=lambda k: k.value):
        checks.append((f"grouped_matmul {kind}", lambda k=kind: _gemm(vendor, k, gen, device)))
    checks.append(("swiglu", lambda: _swiglu(vendor, gen, device)))

    results = []
    for name, check in checks:
        start = time.perf_counter()
        try:
            error, bound = check()
        except Exception as exc:  # a crashing op is a failed check, reported, not raised
            results.append(CheckResult(name, False, None, None, time.perf_counter() - start,
                                       f"{type(exc).__name__}: {exc}"))
            continue
        results.append(CheckResult(name, error <= bound, error, bound, time.perf_counter() - start))
    return results


def _dispatch_formats(caps: Capabilities) -> Iterator[tuple[DispatchDtype, ScaleLayout]]:
    for dtype in sorted(caps.dispatch_dtypes, key=lambda d: d.value):
        for layout in dtype.scale_layouts():
            yield dtype, layout


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _roundtrip(vendor: Vendor, dtype: DispatchDtype, layout: ScaleLayout, gen: torch.Generator,
               device: torch.device) -> tuple[float, float]:
    """Max |x - dequantize(quantize(x))| against the format's own rounding bound (max over rows)."""
    x = _randn(gen, 64, 512).to(torch.bfloat16)
    ref = x.double()
    q = vendor.quantize(x.to(device), dtype, layout=layout)
    error = (vendor.dequantize(q, torch.float32).double().cpu() - ref).abs()
    if dtype is DispatchDtype.BF16:
        return float(error.max()), 0.0
    if dtype is DispatchDtype.INT8:
        bound = ref.abs().amax(dim=-1, keepdim=True) / 254  # half an int8 step
    elif dtype is DispatchDtype.FP8:
        span = FP8_GROUP_SIZE if layout is ScaleLayout.GROUP_128 else ref.shape[-1]
        groups = ref.abs().view(ref.shape[0], -1, span).amax(dim=-1, keepdim=True)
        bound = (groups * 2.0**-4).expand(-1, -1, span).reshape(ref.shape)  # e4m3: 3 mantissa bits
    else:
        blocks = ref.abs().view(ref.shape[0], -1, 16).amax(dim=-1, keepdim=True)
        bound = (blocks / 6 * 1.125).expand(-1, -1, 16).reshape(ref.shape)  # half the widest e2m1 step
    bound = bound + ref.abs().amax(dim=-1, keepdim=True) * 2.0**-20  # float32 dequantization rounding
    ratio = error / bound.clamp_min(1e-30)
    worst = int(ratio.argmax())
    return float(error.flatten()[worst]), float(bound.expand_as(error).flatten()[worst])


def _int4_roundtrip(vendor: Vendor, gen: torch.Generator, device: torch.device) -> tuple[float, float]:
    """Max |x - decode(quantize_int4(x))| against half an int4 step (rowmax / 14)."""
    x = _randn(gen, 64, 512).to(torch.bfloat16)
    ref = x.double()
    error = (activation_value(vendor.quantize_int4(x.to(device))) - ref).abs()
    bound = ref.abs().amax(dim=-1, keepdim=True) * (1 / (2 * INT4_MAX) + 2.0**-20)
    ratio = error / bound.clamp_min(1e-30)
    worst = int(ratio.argmax())
    return float(error.flatten()[worst]), float(bound.expand_as(error).flatten()[worst])


def _gemm(vendor: Vendor, kind: GemmKind, gen: torch.Generator, device: torch.device) -> tuple[float, float]:
    """One grouped matmul with an empty group against a float64 per-group reference."""
    experts, k, n = 4, 256, 192
    counts = torch.tensor([13, 0, 20, 7])
    x = _randn(gen, int(counts.sum()), k)
    w = _randn(gen, experts, k, n, scale=0.05)
    float_dtype = {GemmKind.FP16: torch.float16, GemmKind.FP32: torch.float32}.get(kind, torch.bfloat16)
    xq: torch.Tensor | QuantizedTensor | PackedInt4Tensor
    if kind in (GemmKind.BF16, GemmKind.FP16, GemmKind.FP32):
        xq = x.to(float_dtype).to(device)
        weight = vendor.quantize_weight(w.to(torch.float32).to(device), ScaleLayout.NONE, float_dtype)
        x_ref = xq.double().cpu()
    elif kind is GemmKind.INT4:
        xq = vendor.quantize_int4(x.to(torch.bfloat16).to(device))
        weight = vendor.quantize_weight(w.to(torch.float32).to(device), ScaleLayout.PER_CHANNEL, torch.quint4x2)
        x_ref = activation_value(xq)
    elif kind is GemmKind.NVFP4:
        xq = vendor.quantize(x.to(torch.bfloat16).to(device), DispatchDtype.NVFP4, layout=ScaleLayout.BLOCK_16)
        weight = vendor.quantize_weight(w.to(torch.float32).to(device), ScaleLayout.BLOCK_16)
        x_ref = activation_value(xq)
    else:
        a_dtype, a_layout, w_layout, w_dtype = {
            GemmKind.INT8: (DispatchDtype.INT8, ScaleLayout.PER_TOKEN, ScaleLayout.PER_CHANNEL, torch.int8),
            GemmKind.FP8_ROWWISE: (DispatchDtype.FP8, ScaleLayout.PER_TOKEN, ScaleLayout.PER_CHANNEL,
                                   torch.float8_e4m3fn),
            GemmKind.FP8_BLOCK128: (DispatchDtype.FP8, ScaleLayout.GROUP_128, ScaleLayout.BLOCK_128X128,
                                    torch.float8_e4m3fn),
        }[kind]
        xq = vendor.quantize(x.to(torch.bfloat16).to(device), a_dtype, layout=a_layout)
        weight = vendor.quantize_weight(w.to(torch.float32).to(device), w_layout, w_dtype)
        x_ref = vendor.dequantize(xq, torch.float32).double().cpu()
    w_ref = weight_value(weight)
    out = vendor.grouped_matmul(xq, weight, Groups.from_counts(counts.to(device)))
    ref = torch.cat([x_ref[int(a):int(b)] @ w_ref[e] for e, (a, b) in
                     enumerate(zip([0, *counts.cumsum(0).tolist()], counts.cumsum(0).tolist()))])
    error = float((out.double().cpu() - ref).abs().max())
    return error, GEMM_TOLERANCE[out.dtype] * float(ref.abs().max())


def _swiglu(vendor: Vendor, gen: torch.Generator, device: torch.device) -> tuple[float, float]:
    x = _randn(gen, 32, 2 * 96).to(torch.bfloat16)
    ref = x.double()
    gate, up = ref.chunk(2, dim=-1)
    expected = gate * torch.sigmoid(gate) * up
    out = vendor.swiglu(x.to(device)).double().cpu()
    return float((out - expected).abs().max()), GEMM_TOLERANCE[torch.bfloat16] * float(expected.abs().max())
