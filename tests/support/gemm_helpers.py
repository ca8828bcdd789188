"""Shared by the reference grouped-matmul tests: tolerances, group lists and float64 references built here."""

from __future__ import annotations

import dataclasses

import torch

from hal import GemmKind, Groups, QuantizedTensor, QuantizedWeight, ScaleLayout
from vendors.cpu import CpuVendor

# |y - ref| <= OUT_RTOL[out dtype] * |ref| + ACC_RTOL * (|a| @ |b|):
#  OUT_RTOL: one rounding to the output dtype (half an ulp, with a factor 2 of margin);
#  ACC_RTOL: fp32 accumulation over K <= 300 terms (K * 2^-24 ~ 2e-5), relative to sum |a_k b_k|.
OUT_RTOL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10, torch.float32: 2.0**-22}
ACC_RTOL = 3e-5
SWIGLU_RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-6}
SWIGLU_ATOL = {torch.bfloat16: 1e-6, torch.float16: 1e-7, torch.float32: 1e-12}

FORMS = ["counts", "offsets"]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_groups(counts: list[int], form: str, dtype: torch.dtype = torch.int64) -> Groups:
    t = torch.tensor(counts, dtype=dtype)
    return Groups.from_counts(t) if form == "counts" else Groups.from_offsets(torch.cumsum(t, 0).to(dtype))


def reference(a: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """float64 `a[rows of g] @ b[g]`, group by group."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
    start = 0
    for g, c in enumerate(counts):
        out[start : start + c] = a[start : start + c].double() @ b[g].double()
        start += c
    return out


def assert_within(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, counts: list[int]) -> None:
    ref = reference(a, b, counts)
    magnitude = reference(a.abs(), b.abs(), counts)
    bound = OUT_RTOL[y.dtype] * ref.abs() + ACC_RTOL * magnitude
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


def dequant_x(q: QuantizedTensor) -> torch.Tensor:
    """float64 activations from data and scales, written out independently of the library."""
    d = q.data.double()
    if q.layout is ScaleLayout.PER_TOKEN:
        return d * q.scale.double()[:, None]
    cols = torch.arange(d.shape[1]) // 128
    return d * q.scale.double()[:, cols]


def dequant_w(w: QuantizedWeight) -> torch.Tensor:
    d = w.data.double()
    if w.layout is ScaleLayout.NONE:
        return d
    if w.layout is ScaleLayout.PER_CHANNEL:
        return d * w.scale.double()[:, None, :]
    ki = torch.arange(d.shape[1]) // 128
    ni = torch.arange(d.shape[2]) // 128
    return d * w.scale.double()[:, ki][:, :, ni]


COUNTS = [0, 3, 0, 5, 1, 0]  # empty first, middle and last groups


def row_scale(ws: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The weight scale of each row's group: [M, N]."""
    idx = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return ws.double()[idx]


class Bf16OnlyVendor(CpuVendor):
    def _detect_capabilities(self):  # type: ignore[no-untyped-def]
        return dataclasses.replace(super()._detect_capabilities(), grouped_matmul=frozenset({GemmKind.BF16}))
