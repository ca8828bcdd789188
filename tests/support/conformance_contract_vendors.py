"""Vendors that break an op contract (not its numbers), installed as a real distribution for the
conformance suite to catch: one writes into its inputs, one returns non-contiguous tensors, one
has a grouped matmul whose results change from call to call (and one declares that, honestly).

Each subclasses the CPU reference vendor and puts its fault in the ops its `_make_ops` returns (a
`hal.reference.ReferenceOps` subclass); every result stays within the numeric tests' bounds, so only
`conformance/suite/test_op_contracts.py` can see the faults.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.plugin_dist import write_distribution

SOURCE = '''
import dataclasses
import os

import torch

from hal import ReferenceOps
from vendors.cpu import CpuVendor


def _round_trip_in_place(t):
    """Scale a bf16/fp16/fp32 tensor by 3 in place and back: values round twice, so some change by an ulp."""
    if isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16, torch.float32) and t.numel():
        t.mul_(3).div_(3)


class InputWritingOps(ReferenceOps):
    """The reference ops, but the grouped matmul, after computing, scales its float operands in place and
    back (the activations, the weights or their scales); the activated and gathered products go through it."""

    def grouped_matmul(self, x, weight, groups, *, kind, out_dtype):
        y = super().grouped_matmul(x, weight, groups, kind=kind, out_dtype=out_dtype)
        for t in (x, weight.data, weight.scale, weight.global_scale):
            _round_trip_in_place(t)
        return y


class WritesIntoInput(CpuVendor):
    """A grouped matmul that, after computing, scales its float operands in place and back (the
    activations, the weights or their scales): each result is right, the caller's tensors drift."""

    name = "writes-into-input"

    def _make_ops(self):
        return InputWritingOps()


def _column_major(y):
    """The same values, laid out column-major (not contiguous when both dimensions exceed 1)."""
    return y.t().contiguous().t()


class NonContiguousOps(ReferenceOps):
    """The reference ops, but every grouped-matmul result (plain, activated, gathered, with a bias) comes
    column-major, and the combine returns a view into a wider buffer."""

    def grouped_matmul(self, x, weight, groups, *, kind, out_dtype):
        return _column_major(super().grouped_matmul(x, weight, groups, kind=kind, out_dtype=out_dtype))

    def grouped_matmul_activated(self, x, weight, groups, *, kind, out_dtype, activation):
        y = super().grouped_matmul_activated(x, weight, groups, kind=kind, out_dtype=out_dtype, activation=activation)
        return _column_major(y)

    def add_expert_bias(self, y, bias, *, groups):
        return _column_major(super().add_expert_bias(y, bias, groups=groups))

    def weighted_combine(self, rows, index, topk_weights, *, out_dtype):
        out = super().weighted_combine(rows, index, topk_weights, out_dtype=out_dtype)
        wide = out.new_zeros(out.shape[0], out.shape[1] + 8)
        wide[:, : out.shape[1]] = out
        return wide[:, : out.shape[1]]


class NonContiguousOutputs(CpuVendor):
    """grouped_matmul returns its result column-major, weighted_combine a view into a wider buffer."""

    name = "non-contiguous-outputs"

    def _make_ops(self):
        return NonContiguousOps()


class NoisyGemmOps(ReferenceOps):
    """The reference ops, but the grouped matmul's fp32 accumulator picks up a few ulps of fresh noise
    on every call (as a kernel that splits K over atomics would); it is rounded to the output dtype
    after, so every result stays within the numeric bounds."""

    def __init__(self):
        self._noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(7), "little"))

    def grouped_matmul(self, x, weight, groups, *, kind, out_dtype):
        y = super().grouped_matmul(x, weight, groups, kind=kind, out_dtype=torch.float32)
        ulps = torch.randint(-4, 5, y.shape, generator=self._noise).to(torch.float32)
        return (y + y * ulps * 2.0 ** -24).to(out_dtype)


class NonDeterministicGemm(CpuVendor):
    """A grouped matmul that is not bit-reproducible, while the vendor declares deterministic=True."""

    name = "non-deterministic-gemm"

    def _make_ops(self):
        return NoisyGemmOps()


class DeclaredNonDeterministic(NonDeterministicGemm):
    """The same grouped matmul, declared: `deterministic=False`."""

    name = "declared-non-deterministic"

    def _detect_capabilities(self):
        return dataclasses.replace(super()._detect_capabilities(), deterministic=False)
'''

#: entry-point name -> class in the module above
VENDORS = {
    "writes-into-input": "WritesIntoInput",
    "non-contiguous-outputs": "NonContiguousOutputs",
    "non-deterministic-gemm": "NonDeterministicGemm",
    "declared-non-deterministic": "DeclaredNonDeterministic",
}


def write_contract_vendors(root: Path) -> Path:
    """A distribution registering every vendor of `VENDORS` in `hal.vendors`."""
    return write_distribution(
        root,
        "hal-contract-faulty-vendors",
        {"hal.vendors": {name: f"contract_faulty_vendors:{cls}" for name, cls in VENDORS.items()}},
        {"contract_faulty_vendors": SOURCE},
    )
