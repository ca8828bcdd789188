"""Programmatic dependent launch on the CUDA vendor: when it is used, that it is refused in a bad
argument, and (GPU) that it changes no result: the layer's forward, eager and replayed from a CUDA
graph, is bit-equal with and without it."""

from __future__ import annotations

import warnings

import pytest
import torch

import moe
from conformance.reference import random_weights, seed_of
from hal import InvalidInput
from tests.support.cuda_graph import capture
from vendors.cuda import CudaVendor
from vendors.cuda.vendor import MIN_TRITON_DEPENDENT_LAUNCH, dependent_launch_supported

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    "version, capability, expected",
    [
        ("3.6.0", (9, 0), True),
        ("3.4.0", (10, 0), True),
        ("3.10.1", (12, 0), True),
        ("3.3.1", (9, 0), False),  # no launch_pdl in this Triton
        ("3.6.0", (8, 9), False),
        ("3.6.0", (8, 0), False),  # griddepcontrol is sm90+
        ("2.3.1", (9, 0), False),
        ("4.0.0", (9, 0), True),
        ("3.6.0+git1a2b3c", (9, 0), True),
        ("main", (9, 0), False),
        ("", (9, 0), False),
    ],
)
def test_dependent_launch_needs_sm90_and_a_recent_triton(version, capability, expected):
    assert dependent_launch_supported(version, capability) is expected
    assert MIN_TRITON_DEPENDENT_LAUNCH == (3, 4)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_the_vendor_refuses_a_dependent_launch_argument_that_is_not_a_bool(value):
    with pytest.raises(InvalidInput, match="dependent_launch"):
        CudaVendor(dependent_launch=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", [True, False])
def test_the_vendor_builds_with_either_setting(flag):
    assert isinstance(CudaVendor(dependent_launch=flag), CudaVendor)  # no device is touched before it is used


def _layers(scheme: str, e: int, h: int, i: int, k: int) -> tuple[moe.MoELayer, moe.MoELayer]:
    w13, w2 = random_weights(e, h, i, seed_of("pdl", scheme, e, h))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the declared int8 -> fp8 fallback warns once
        return tuple(
            moe.MoELayer.from_float(w13, w2, k, scheme=scheme, vendor=CudaVendor(dependent_launch=flag))
            for flag in (True, False)
        )  # type: ignore[return-value]


def _replayed(layer: moe.MoELayer, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    graph, y = capture(lambda: layer(x, logits))
    graph.replay()
    torch.cuda.synchronize()
    return y.clone()


@pytest.mark.parametrize("scheme", ["unquantized", "w8a8-fp8-block", "w8a8-int8"])
@pytest.mark.parametrize(
    "e, h, i, k, tokens",
    [
        (128, 2048, 768, 8, 1),  # qwen3-30b-a3b decode: one-program sort, gathered GEMM reads
        (128, 2048, 768, 8, 64),
        (60, 1000, 360, 4, 2049),  # spread sort, unaligned H and I, many rows per group
        (8, 1536, 1408, 2, 4100),  # few experts: torch._grouped_mm and the swiglu pass for bf16
    ],
)
@pytest.mark.gpu
@needs_gpu
def test_dependent_launch_changes_no_result(scheme, e, h, i, k, tokens):
    import triton

    with_pdl, plain = _layers(scheme, e, h, i, k)
    used = dependent_launch_supported(triton.__version__, torch.cuda.get_device_capability())
    assert (with_pdl.vendor.ops.pdl, plain.vendor.ops.pdl) == (used, False)  # sm90+: both paths run here
    notes = " ".join(with_pdl.vendor.capabilities().notes)
    assert ("programmatic dependent launch" if used else "kernel launches: plain") in notes
    assert "dependent_launch=False" in " ".join(plain.vendor.capabilities().notes)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, h, device="cuda", generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, e, device="cuda", generator=g)
    eager = plain(x, logits)
    assert torch.equal(with_pdl(x, logits), eager)
    assert torch.equal(_replayed(with_pdl, x, logits), eager)
    assert torch.equal(_replayed(plain, x, logits), eager)
