"""`hal.refuse_non_finite`: every dtype a weight, scale or activation is held in, by bit pattern where the
format has no inf, in slices for large tensors, and refusals that name the tensor."""

from __future__ import annotations

import pytest
import torch

import hal
from hal import InvalidInput, refuse_non_finite

FLOATS = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2, torch.complex64]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_an_inf_or_nan_of_any_float_dtype_is_refused_by_name(dtype, bad):
    x = torch.linspace(-2, 2, 300).reshape(3, 100)
    x[2, 57] = bad
    with pytest.raises(InvalidInput, match=r"^experts\.w13: expected finite values, got 1 non-finite"):
        refuse_non_finite("experts.w13", x.to(dtype))
    assert refuse_non_finite("experts.w13", torch.linspace(-2, 2, 300).to(dtype)) is not None


def test_e4m3_nan_codes_are_found_by_their_bits():
    """e4m3fn has no inf: 0x7F and 0xFF are its NaNs; 448 (0x7E) is its largest finite value."""
    codes = torch.tensor([0x00, 0x7E, 0xFE, 0x38, 0x7F, 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(InvalidInput, match="got 2 non-finite"):
        refuse_non_finite("w.scale", codes)
    refuse_non_finite("w", codes[:4])


def test_e8m0_scale_byte_255_is_nan_and_every_other_byte_a_power_of_two():
    scales = torch.arange(256, dtype=torch.uint8)
    with pytest.raises(InvalidInput, match="got 1 non-finite"):
        refuse_non_finite("mlp.experts.gate_up_proj_scales", scales, e8m0=True)
    refuse_non_finite("mlp.experts.gate_up_proj_scales", scales[:255], e8m0=True)
    refuse_non_finite("packed e2m1 values", scales)  # packed bytes hold no inf or NaN


def test_integer_and_meta_tensors_hold_no_values_to_refuse():
    refuse_non_finite("ids", torch.arange(10))
    refuse_non_finite("mask", torch.ones(3, dtype=torch.bool))
    refuse_non_finite("w", torch.empty(4, 4, device="meta"))


def test_a_large_tensor_is_read_in_slices_and_its_last_value_counts():
    x = torch.zeros(5, (1 << 22) + 7, dtype=torch.bfloat16)  # over one slice of 2^24 values
    x[-1, -1] = float("nan")
    x[0, 0] = float("inf")
    with pytest.raises(InvalidInput, match="got 2 non-finite"):
        refuse_non_finite("big", x)


@pytest.mark.parametrize("value", [[1.0, float("nan")], 3.0, None, "w"])
def test_something_other_than_a_tensor_is_refused(value):
    with pytest.raises(InvalidInput, match=r"^w: expected a torch.Tensor, got "):
        hal.refuse_non_finite("w", value)
