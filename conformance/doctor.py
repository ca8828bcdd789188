"""`hal doctor`: a vendor's declared ops, each run once against float64, with the suite's own bounds.

A smoke check for operators, seconds long, without pytest: the operands
(`conformance.operands`), the float64 references (`conformance.reference`, `hal.reference`'s
value decoders) and the error bounds (`conformance.tolerances`) are the conformance
suite's, so a vendor that passes the suite passes the doctor and the other way round for
the cases both run. The full contract is the suite (`hal conformance`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from conformance.operands import random_codes_activation, random_codes_weight, to_device
from conformance.reference import activation, grouped_matmul, swiglu
from conformance.tolerances import gemm_bound, quantize_bound, swiglu_bound
from hal import ActivationKind, GemmKind, Groups, Vendor
from hal.reference import activation_value


@dataclass(frozen=True)
class CheckResult:
    """One check: its name, whether it passed, the error found and the bound allowed (at the worst element)."""

    name: str
    passed: bool
    max_error: float | None
    bound: float | None
    seconds: float
    detail: str = ""

    def as_dict(self) -> dict[str, object]:
        """Plain-data view for JSON output."""
        return {
            "name": self.name,
            "passed": self.passed,
            "max_error": self.max_error,
            "bound": self.bound,
            "seconds": round(self.seconds, 4),
            "detail": self.detail,
        }


def run_doctor(vendor: Vendor, seed: int = 0) -> list[CheckResult]:
    """Run every declared op of `vendor` once against float64 references."""
    caps = vendor.capabilities()
    gen = torch.Generator().manual_seed(seed)
    checks: list[tuple[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]] = []
    for dtype in sorted(caps.dispatch_dtypes, key=lambda d: d.value):
        for layout in dtype.scale_layouts():
            checks.append((f"quantize {dtype} {layout}", lambda d=dtype, lay=layout: _quantize(vendor, d, lay, gen)))
    if caps.supports_gemm(GemmKind.INT4):  # int4 is a compute format, not a dispatch dtype
        checks.append(("quantize int4 per-token", lambda: _int4(vendor, gen)))
    for kind in sorted(caps.grouped_matmul, key=lambda k: k.value):
        checks.append((f"grouped_matmul {kind}", lambda k=kind: _gemm(vendor, k, gen)))
    checks.append(("swiglu", lambda: _swiglu(vendor, gen)))
    for act in (k for k in ActivationKind if k in caps.activations and k is not ActivationKind.SILU_GLU):
        checks.append((f"activate {act}", lambda a=act: _activate(vendor, a, gen)))
    return [_run(name, check) for name, check in checks]


def _run(name: str, check: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> CheckResult:
    start = time.perf_counter()
    try:
        error, bound = check()
    except Exception as exc:  # a crashing op is a failed check, reported, not raised
        return CheckResult(name, False, None, None, time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - start
    if error.numel() == 0:
        return CheckResult(name, True, 0.0, 0.0, seconds)
    worst = int((error / bound.clamp_min(1e-300)).argmax())
    passed = bool((error <= bound).all())
    return CheckResult(name, passed, float(error.flatten()[worst]), float(bound.flatten()[worst]), seconds)


def _activations(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(64, 512, generator=gen, dtype=torch.float64).to(torch.bfloat16)


def _quantize(  # type: ignore[no-untyped-def]
    vendor: Vendor, dtype, layout, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The round trip through the format, against one rounding of each value."""
    x = _activations(gen)
    ref = x.double()
    q = vendor.quantize(x.to(vendor.device), dtype, layout=layout)
    error = torch.maximum(
        (activation_value(q) - ref).abs(), (vendor.dequantize(q, torch.float32).double().cpu() - ref).abs()
    )
    return error, quantize_bound(dtype.value, layout.value, ref)


def _int4(vendor: Vendor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = _activations(gen)
    ref = x.double()
    error = (activation_value(vendor.quantize_int4(x.to(vendor.device))) - ref).abs()
    return error, quantize_bound("int4", "per-token", ref)


def _gemm(vendor: Vendor, kind: GemmKind, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One grouped matmul with an empty group, on operands made from random codes."""
    counts, k, n = [13, 0, 20, 7], 256, 192
    x = random_codes_activation(kind.value, sum(counts), k, gen)
    w = random_codes_weight(kind.value, len(counts), k, n, gen)
    ref, magnitude = grouped_matmul(x, w, counts)
    out = vendor.grouped_matmul(
        to_device(x, vendor.device),
        to_device(w, vendor.device),
        Groups.from_counts(torch.tensor(counts, device=vendor.device)),
    )
    return (out.double().cpu() - ref).abs(), gemm_bound(ref, magnitude, out.dtype)


def _activate(vendor: Vendor, kind: ActivationKind, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = (torch.randn(32, 2 * 96, generator=gen, dtype=torch.float64) * 4).to(torch.bfloat16)
    expected, magnitude = activation(x, kind.value)
    out = vendor.activate(x.to(vendor.device), kind).double().cpu()
    return (out - expected).abs(), swiglu_bound(expected, magnitude, torch.bfloat16)


def _swiglu(vendor: Vendor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 2 * 96, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    expected, gate_times_up = swiglu(x)
    out = vendor.swiglu(x.to(vendor.device)).double().cpu()
    return (out - expected).abs(), swiglu_bound(expected, gate_times_up, torch.bfloat16)
