"""swiglu: `silu(gate) * up` over the two halves of the last dimension, against float64."""

from __future__ import annotations

import pytest
import torch

from conformance.capability import SWIGLU, mark
from conformance.reference import generator, swiglu, worst
from conformance.tolerances import swiglu_bound

pytestmark = mark(SWIGLU)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHAPES = {"2d": (33, 192), "3d": (2, 3, 128), "no-tokens": (0, 128), "strided": None}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_matches_float64(hal_vendor, dtype, shape):
    gen = generator("swiglu", dtype, shape)
    if SHAPES[shape] is None:
        x = (torch.randn(192, 17, generator=gen) * 3).to(DTYPES[dtype]).to(hal_vendor.device).t()
    else:
        x = (torch.randn(*SHAPES[shape], generator=gen) * 3).to(DTYPES[dtype]).to(hal_vendor.device)
    y = hal_vendor.swiglu(x)
    want = (*x.shape[:-1], x.shape[-1] // 2)
    assert tuple(y.shape) == want, f"shape {tuple(y.shape)}, expected {want}"
    assert y.dtype == x.dtype and y.device == hal_vendor.device
    ref, gate_times_up = swiglu(x)
    error = (y.double().cpu() - ref).abs()
    bound = swiglu_bound(ref, gate_times_up, x.dtype)
    assert bool((error <= bound).all()), worst(error, bound)


def test_the_gate_is_the_first_half(hal_vendor):
    x = torch.tensor([[2.0, -1.0, 3.0, 0.5]], dtype=torch.float32, device=hal_vendor.device)
    y = hal_vendor.swiglu(x).double().cpu()
    expected = torch.tensor(
        [[2.0 / (1 + torch.exp(torch.tensor(-2.0))) * 3.0, -1.0 / (1 + torch.exp(torch.tensor(1.0))) * 0.5]],
        dtype=torch.float64,
    )
    assert torch.allclose(y, expected, rtol=1e-5), (
        f"swiglu([2, -1 | 3, 0.5]) = {y.tolist()}, expected {expected.tolist()}"
    )
