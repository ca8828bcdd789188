"""`Vendor.activate` for every declared activation kind, and per-expert biases of the grouped
matmul, against float64 (many groups, empty ones, widths that are not multiples of 128)."""

from __future__ import annotations

import pytest
import torch

from conformance.capability import (
    EXPERT_BIAS,
    activation_label,
    mark,
    require_activation,
    require_expert_bias,
    require_gemm,
)
from conformance.reference import activation, generator, worst
from conformance.tolerances import gemm_bound, swiglu_bound
from hal import ActivationKind, GemmKind, Groups, QuantizedWeight

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [pytest.param(k, marks=mark(activation_label(k))) for k in ActivationKind])
def test_activation_matches_float64(hal_vendor, kind, dtype):
    require_activation(hal_vendor, kind)
    gen = generator("activation", kind, dtype)
    width = 2 * 1000 if kind.gated else 1000
    # spread well past swiglu-oai's limit (7) on both sides, so that the clamps matter
    x = (torch.randn(300, width, generator=gen) * 5).to(DTYPES[dtype]).to(hal_vendor.device)
    y = hal_vendor.activate(x, kind)
    want = (300, width // 2 if kind.gated else width)
    assert tuple(y.shape) == want and y.dtype == x.dtype and y.device == hal_vendor.device, (
        f"{kind}: got {y.dtype} {tuple(y.shape)} on {y.device}, expected {x.dtype} {want} on {hal_vendor.device}"
    )
    ref, magnitude = activation(x, kind.value)
    error = (y.double().cpu() - ref).abs()
    info = torch.finfo(x.dtype)
    # plus one subnormal step: fp16 outputs below its smallest normal are rounded on that absolute grid
    bound = swiglu_bound(ref, magnitude, x.dtype) + info.smallest_normal * info.eps
    assert bool((error <= bound).all()), f"{kind}: " + worst(error, bound)


@pytest.mark.parametrize("kind", [pytest.param(k, marks=mark(activation_label(k))) for k in ActivationKind])
def test_activation_input_is_untouched(hal_vendor, kind):
    require_activation(hal_vendor, kind)
    x = torch.randn(7, 64, generator=generator("untouched", kind)).to(hal_vendor.device)
    before = x.clone()
    hal_vendor.activate(x, kind)
    assert torch.equal(x, before), f"{kind} wrote into its input"


@mark(EXPERT_BIAS)
@pytest.mark.parametrize("counts", [[3] * 40, [0, 300, 0, 1, 299, 0], [1]], ids=["40-groups", "uneven", "one-row"])
def test_grouped_matmul_bias_matches_float64(hal_vendor, counts):
    require_expert_bias(hal_vendor)
    for kind in (GemmKind.FP32, GemmKind.BF16):
        if hal_vendor.capabilities().supports_gemm(kind):
            break
    else:
        require_gemm(hal_vendor, GemmKind.BF16)
    dtype = kind.spec.activation.float_dtype
    gen = generator("bias", counts)
    k, n = 200, 333
    x = torch.randn(sum(counts), k, generator=gen).to(dtype)
    w = (torch.randn(len(counts), k, n, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(len(counts), n, generator=gen) * 4
    device = hal_vendor.device
    groups = Groups.from_counts(torch.tensor(counts).to(device))
    y = hal_vendor.grouped_matmul(x.to(device), QuantizedWeight(w.to(device)), groups, bias=bias.to(device))
    group_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    ref = torch.einsum("mk,mkn->mn", x.double(), w.double()[group_of_row]) + bias.double()[group_of_row]
    magnitude = (
        torch.einsum("mk,mkn->mn", x.double().abs(), w.double().abs()[group_of_row]) + bias.double().abs()[group_of_row]
    )
    error = (y.double().cpu() - ref).abs()
    bound = gemm_bound(ref, magnitude, y.dtype)
    assert bool((error <= bound).all()), f"{kind} with bias: " + worst(error, bound)
