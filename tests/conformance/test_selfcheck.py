"""`hal doctor`'s self-check passes on the reference vendor and catches a broken one."""

from __future__ import annotations

import torch

from conformance.doctor import run_doctor
from hal.reference import ReferenceOps
from vendors.cpu import CpuVendor


class DropsLastGroupOps(ReferenceOps):
    """Broken ops: the grouped matmul leaves the last group's rows at zero."""

    def grouped_matmul(self, x, weight, groups, *, kind, out_dtype):
        out = super().grouped_matmul(x, weight, groups, kind=kind, out_dtype=out_dtype)
        last = int(groups.counts()[-1])
        if last:
            out[-last:] = 0
        return out


class SwappedSwigluOps(ReferenceOps):
    """Broken ops: swiglu with the gate and up halves swapped."""

    def swiglu(self, x):
        half = x.shape[-1] // 2
        return super().swiglu(torch.cat([x[..., half:], x[..., :half]], dim=-1))


class DropsLastGroup(CpuVendor):
    def _make_ops(self):
        return DropsLastGroupOps()


class SwappedSwiglu(CpuVendor):
    def _make_ops(self):
        return SwappedSwigluOps()


def test_reference_vendor_passes_every_check(cpu):
    results = run_doctor(cpu)
    assert results and all(r.passed for r in results), [r for r in results if not r.passed]
    assert {"quantize int8 per-token", "grouped_matmul fp8-block128", "swiglu"} <= {r.name for r in results}


def test_broken_grouped_matmul_fails_exactly_the_gemm_checks():
    failed = {r.name for r in run_doctor(DropsLastGroup()) if not r.passed}
    assert failed == {
        f"grouped_matmul {k}"
        for k in (
            "bf16",
            "fp16",
            "fp32",
            "int8",
            "fp8-rowwise",
            "fp8-block128",
            "int4",
            "nvfp4",
            "bf16-mxfp4",
            "bf16-nvfp4",
        )
    }


def test_broken_swiglu_is_caught():
    failed = {r.name for r in run_doctor(SwappedSwiglu()) if not r.passed}
    assert failed == {"swiglu"}
