"""The checked entry points run their metadata checks once per signature of arguments and keep the verdict:
a repeat with new tensors of the same shapes, dtypes and devices reuses it, anything that changes the
metadata (or is not a plain tensor) is checked again, and the verdicts kept are bounded."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hal
import hal.vendor
from hal import InvalidInput, ScaleLayout, UnsupportedCapability
from hal.groups import Groups
from hal.verdicts import Verdicts

E, K, N, T = 4, 32, 24, 6


class _Marked(torch.Tensor):
    """A tensor subclass: never part of a kept signature."""


def _counting(monkeypatch, name: str) -> list[int]:
    calls = [0]
    original = getattr(hal.vendor, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(hal.vendor, name, counted)
    return calls


def _operands():
    vendor = type(hal.get_vendor("cpu"))()  # a fresh vendor: no verdicts kept yet
    gen = torch.Generator().manual_seed(0)
    weight = vendor.quantize_weight(torch.randn(E, K, N, generator=gen), ScaleLayout.NONE, torch.bfloat16)
    return vendor, weight, Groups.from_counts(torch.tensor([2, 0, 3, 1]))


def test_grouped_matmul_checks_metadata_once_per_signature(monkeypatch):
    calls = _counting(monkeypatch, "grouped_matmul_verdict")
    vendor, weight, groups = _operands()
    outs = [vendor.grouped_matmul(torch.randn(T, K).to(torch.bfloat16), weight, groups) for _ in range(3)]
    assert calls[0] == 1 and all(o.shape == (T, N) for o in outs)
    vendor.grouped_matmul(torch.randn(T, K).to(torch.bfloat16), weight, groups, activation="silu-glu")
    vendor.grouped_matmul(torch.randn(T, K).to(torch.bfloat16), weight, groups, out_dtype=torch.float32)
    vendor.grouped_matmul(torch.randn(T, K).to(torch.bfloat16), weight, groups, row_index=torch.arange(T))
    assert calls[0] == 4


def test_a_kept_verdict_never_lets_a_bad_call_through():
    vendor, weight, groups = _operands()
    x = torch.randn(T, K).to(torch.bfloat16)
    vendor.grouped_matmul(x, weight, groups, row_index=torch.arange(T))
    with pytest.raises(InvalidInput, match="row_index"):  # values: read on every call where that is free
        vendor.grouped_matmul(x, weight, groups, row_index=torch.tensor([0, 1, 2, 3, 4, 99]))
    with pytest.raises(InvalidInput, match="groups"):
        vendor.grouped_matmul(x, weight, Groups.from_counts(torch.tensor([2, -1, 3, 1])))
    with pytest.raises(InvalidInput):  # the same shapes in another dtype
        vendor.grouped_matmul(x.to(torch.int32), weight, groups)
    other = vendor.quantize_weight(torch.randn(E, K, N), ScaleLayout.NONE, torch.float16)
    with pytest.raises(InvalidInput):  # a weight of the same shape in a dtype x does not pair with
        vendor.grouped_matmul(x, other, groups)
    with pytest.raises(InvalidInput, match="x"):
        vendor.grouped_matmul(x.to("meta"), weight, groups)


def test_tensor_subclasses_are_checked_on_every_call(monkeypatch):
    calls = _counting(monkeypatch, "grouped_matmul_verdict")
    vendor, weight, groups = _operands()
    x = torch.randn(T, K).to(torch.bfloat16).as_subclass(_Marked)
    for _ in range(3):
        vendor.grouped_matmul(x, weight, groups)
    assert calls[0] == 3


def test_quantize_checks_once_per_signature_and_still_refuses_bad_calls():
    vendor = type(hal.get_vendor("cpu"))()
    x = torch.randn(T, 256)
    first = vendor.quantize(x, "int8")
    again = vendor.quantize(x.clone(), "int8")
    assert torch.equal(first.data, again.data) and torch.equal(first.scale, again.scale)
    with pytest.raises(InvalidInput, match="x"):
        vendor.quantize(x.to("meta"), "int8")
    with pytest.raises(InvalidInput):
        vendor.quantize(x.to(torch.int32), "int8")
    with pytest.raises(InvalidInput):
        vendor.quantize(torch.randn(T, 100), "fp8", layout="block-128")  # 100 channels: not whole blocks
    with pytest.raises((InvalidInput, UnsupportedCapability)):
        vendor.quantize(x, "no-such-dtype")


def test_verdicts_are_bounded_and_bound_to_the_capabilities_they_were_reached_under():
    kept, caps = Verdicts(capacity=3), object()
    for i in range(10):
        kept.put((i,), caps, i)
        assert kept.get((i,), caps) == i
        assert kept.get((i,), object()) is None
        assert len(kept) <= 3


def test_a_vendor_whose_capabilities_change_meets_the_full_checks_again():
    vendor, weight, groups = _operands()
    x = torch.randn(T, K).to(torch.bfloat16)
    vendor.grouped_matmul(x, weight, groups)
    vendor.quantize(torch.randn(T, 256), "int8")
    narrowed = dataclasses.replace(vendor.capabilities(), grouped_matmul=frozenset(), dispatch_dtypes=frozenset())
    vendor.capabilities = lambda: narrowed
    with pytest.raises(UnsupportedCapability):
        vendor.grouped_matmul(x, weight, groups)
    with pytest.raises(UnsupportedCapability):
        vendor.quantize(torch.randn(T, 256), "int8")


@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_kept_verdicts_compute_realistic_shapes_like_the_float64_reference(monkeypatch, top_k):
    """128 experts, 1,500 tokens, K and N not multiples of 128, rows read through the dispatch's index: the
    first call meets the full checks, repeats (new tensors, the same signature) reuse the verdict, and every
    result is within bf16 rounding of the float64 product; an out-of-range index after them is still refused."""
    calls = _counting(monkeypatch, "grouped_matmul_verdict")
    experts, tokens, k, n = 128, 1500, 200, 136
    vendor = type(hal.get_vendor("cpu"))()
    gen = torch.Generator().manual_seed(top_k)
    weight = vendor.quantize_weight(torch.randn(experts, k, n, generator=gen) / 8, ScaleLayout.NONE, torch.bfloat16)
    for _ in range(3):
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
        order = torch.argsort(ids.flatten(), stable=True)
        counts = torch.bincount(ids.flatten(), minlength=experts)
        index = order // top_k
        x = torch.randn(tokens, k, generator=gen).to(torch.bfloat16)
        y = vendor.grouped_matmul(x, weight, Groups.from_counts(counts), row_index=index)
        rows, expected = 0, []
        for e, c in enumerate(counts.tolist()):
            expected.append(x[index[rows : rows + c]].double() @ weight.data[e].double())
            rows += c
        expected = torch.cat(expected)
        err = (y.double() - expected).abs().max().item()
        assert err <= 2**-7 * expected.abs().max().item(), err
    assert calls[0] == 1
    bad = index.clone()
    bad[-1] = tokens
    with pytest.raises(InvalidInput, match="row_index"):
        vendor.grouped_matmul(x, weight, Groups.from_counts(counts), row_index=bad)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_kept_quantize_verdicts_quantize_realistic_shapes_within_a_step(monkeypatch, dtype):
    """2,000 tokens of 2,880 channels (not a multiple of 128), quantized three times with new data: one full
    check, and every result dequantizes to within half a step of the input (int8) or fp8's relative rounding."""
    from hal.reference.quantize import dequantize

    calls = _counting(monkeypatch, "quantize_verdict")
    vendor = type(hal.get_vendor("cpu"))()
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        x = (torch.randn(2000, 2880, generator=gen) * torch.rand(2000, 1, generator=gen) * 4).to(torch.bfloat16)
        q = vendor.quantize(x, dtype)
        back, exact = dequantize(q, torch.float32).double(), x.double()
        amax = exact.abs().amax(dim=-1, keepdim=True)
        bound = amax / 127 / 2 * 1.001 if dtype == "int8" else exact.abs() / 16 + amax / 448 * 2**-9
        assert ((back - exact).abs() <= bound).all()
    assert calls[0] == 1
