"""Activation quantize / dequantize of the reference ops (through the CPU vendor), against float64 math done here."""

from __future__ import annotations

import math

import pytest
import torch

from hal import DispatchDtype, InvalidInput, ScaleLayout
from tests.support.quantize_helpers import fp8_bound, TOL, e2m1_error_bound, randn, decode_nvfp4_here
from vendors.cpu import CpuVendor


@pytest.fixture(scope="module")
def vendor() -> CpuVendor:
    return CpuVendor()


# -- int8 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_per_token_round_trip(vendor: CpuVendor, in_dtype: torch.dtype) -> None:
    x = randn(3, 17, 200, seed=1, dtype=in_dtype, scale=3.0)
    q = vendor.quantize(x, DispatchDtype.INT8)
    assert q.data.dtype == torch.int8 and q.layout is ScaleLayout.PER_TOKEN
    assert q.scale.dtype == torch.float32 and q.scale.shape == (3, 17)
    xd = x.to(torch.float64)
    rowmax = xd.abs().amax(dim=-1)
    torch.testing.assert_close(q.scale.double(), rowmax / 127, rtol=1e-6, atol=0)
    # the largest element of every row maps to +-127
    assert torch.equal(q.data.abs().amax(dim=-1), torch.full((3, 17), 127, dtype=torch.int8))
    deq_here = q.data.double() * q.scale.double().unsqueeze(-1)
    err = (xd - deq_here).abs()
    assert (err <= (rowmax / 127).unsqueeze(-1)).all()
    assert (err <= 0.5 * q.scale.double().unsqueeze(-1) * (1 + TOL["int8_half_step_slack"])).all()
    deq = vendor.dequantize(q)
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    torch.testing.assert_close(deq.double(), deq_here, rtol=TOL["FLOAT_SLACK"], atol=0)


def test_int8_rounds_half_to_even(vendor: CpuVendor) -> None:
    # scale = 127/127 = 1, so the values themselves are rounded
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 3.4, -3.6]])
    q = vendor.quantize(x, DispatchDtype.INT8)
    assert q.scale.tolist() == [1.0]
    assert q.data.tolist() == [[127, 0, 2, 2, -2, 0, 3, -4]]


# -- fp8 -------------------------------------------------------------------------------------------


def test_fp8_per_token_round_trip(vendor: CpuVendor) -> None:
    x = randn(33, 256, seed=2, scale=5.0)
    x[4, 7] = 1e-6  # a value far below the row's scale: subnormal in e4m3
    q = vendor.quantize(x, DispatchDtype.FP8, layout=ScaleLayout.PER_TOKEN)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.shape == (33,) and q.scale.dtype == torch.float32
    xd = x.double()
    amax = xd.abs().amax(dim=-1)
    torch.testing.assert_close(q.scale.double(), amax / 448, rtol=1e-6, atol=0)
    step = q.scale.double().unsqueeze(-1).expand_as(xd)
    deq = vendor.dequantize(q).double()
    assert ((xd - deq).abs() <= fp8_bound(xd, step)).all()
    assert (q.data.float().abs().amax(dim=-1) == 448).all()


@pytest.mark.parametrize("hidden", [128, 300, 5])
def test_fp8_group128_round_trip(vendor: CpuVendor, hidden: int) -> None:
    x = randn(2, 9, hidden, seed=3, scale=0.1)
    if hidden > 128:
        x[0, 0, 128:256] *= 1000  # groups must not share scales
    q = vendor.quantize(x, DispatchDtype.FP8)  # group-128 is fp8's default
    groups = math.ceil(hidden / 128)
    assert q.layout is ScaleLayout.GROUP_128 and q.scale.shape == (2, 9, groups)
    xd = x.double()
    for gi in range(groups):
        chunk = xd[..., gi * 128 : (gi + 1) * 128]
        want = chunk.abs().amax(dim=-1) / 448
        torch.testing.assert_close(q.scale[..., gi].double(), want, rtol=1e-6, atol=0)
    step = torch.stack([q.scale[..., c // 128].double() for c in range(hidden)], dim=-1)
    deq = vendor.dequantize(q, torch.float32).double()
    assert deq.shape == x.shape
    assert ((xd - deq).abs() <= fp8_bound(xd, step)).all()


# -- nvfp4 -----------------------------------------------------------------------------------------


def test_nvfp4_exact_codes_and_packing(vendor: CpuVendor) -> None:
    # global scale 1 and block amax 6 give block scale 1: every e2m1 value is exact.
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, -0.0]
    x = torch.tensor([values, [v / 64 for v in values]])  # row 2: block scale 1/64 (exact in e4m3)
    q = vendor.quantize(x, DispatchDtype.NVFP4, global_scale=torch.tensor([1.0]))
    assert q.data.dtype == torch.uint8 and q.data.shape == (2, 8)
    assert q.scale.dtype == torch.float8_e4m3fn and q.scale.shape == (2, 1)
    assert q.scale.float().tolist() == [[1.0], [1 / 64]]
    codes = [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 0]
    packed = [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(8)]
    assert q.data.tolist() == [packed, packed]
    assert torch.equal(vendor.dequantize(q), x)
    assert torch.equal(decode_nvfp4_here(q).float(), x)


def test_nvfp4_ties_go_to_the_even_code(vendor: CpuVendor) -> None:
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    row = [6.0, *ties, *(-t for t in ties), 0.0]
    want = [6.0, *expected, *(-e for e in expected), 0.0]
    q = vendor.quantize(torch.tensor([row]), DispatchDtype.NVFP4, global_scale=torch.tensor([1.0]))
    assert q.scale.float().tolist() == [[1.0]]
    assert vendor.dequantize(q).tolist() == [want]
    # a negative value that rounds to zero is stored as code 0 (no negative zero)
    assert q.data[0, 4].item() & 0xF == 0  # element 8 is -0.25


def test_nvfp4_saturates_and_clamps_block_scale(vendor: CpuVendor) -> None:
    one = torch.tensor([1.0])
    # blockamax/6 = 1.06 rounds down to e4m3 1.0, so 6.36 exceeds 6 steps and saturates
    q = vendor.quantize(torch.tensor([[6.36] + [0.0] * 15]), DispatchDtype.NVFP4, global_scale=one)
    assert q.scale.float().tolist() == [[1.0]]
    assert vendor.dequantize(q)[0, 0].item() == 6.0
    # a global scale so large that the block scale exceeds e4m3's max: clamped to 448
    q = vendor.quantize(torch.tensor([[6.0] * 16]), DispatchDtype.NVFP4, global_scale=torch.tensor([1000.0]))
    assert q.scale.float().tolist() == [[448.0]]
    torch.testing.assert_close(vendor.dequantize(q), torch.full((1, 16), 6 * 448 / 1000.0))


def test_nvfp4_random_round_trip(vendor: CpuVendor) -> None:
    x = randn(5, 4, 96, seed=4, scale=2.0)
    x[1, 2, 16:32] = 0  # a zero block
    q = vendor.quantize(x, DispatchDtype.NVFP4)
    xd = x.double()
    gs = 448 * 6 / xd.abs().max()
    torch.testing.assert_close(q.global_scale.double(), gs.reshape(1), rtol=1e-6, atol=0)
    assert q.global_scale.dtype == torch.float32
    assert q.data.shape == (5, 4, 48) and q.scale.shape == (5, 4, 6)
    blocks = xd.reshape(5, 4, 6, 16)
    ideal = blocks.abs().amax(dim=-1) / 6 * gs
    s = q.scale.double()
    scale_bound = torch.maximum(ideal * TOL["e4m3_scale_rel"], torch.full_like(ideal, 2.0**-10))
    assert ((s - ideal).abs() <= scale_bound).all()
    assert s[1, 2, 1] == 0 and (q.data[1, 2, 8:16] == 0).all()
    step = (s / float(q.global_scale)).repeat_interleave(16, dim=-1)
    bound = e2m1_error_bound(xd, step)
    deq = decode_nvfp4_here(q)
    assert ((xd - deq).abs() <= bound).all()
    torch.testing.assert_close(vendor.dequantize(q).double(), deq, rtol=TOL["FLOAT_SLACK"], atol=0)


# -- shapes, special inputs -------------------------------------------------------------------------

CASES = [
    (DispatchDtype.BF16, ScaleLayout.NONE),
    (DispatchDtype.INT8, ScaleLayout.PER_TOKEN),
    (DispatchDtype.FP8, ScaleLayout.PER_TOKEN),
    (DispatchDtype.FP8, ScaleLayout.GROUP_128),
    (DispatchDtype.NVFP4, ScaleLayout.BLOCK_16),
]


@pytest.mark.parametrize(("dtype", "layout"), CASES)
def test_all_zero_rows(vendor: CpuVendor, dtype: DispatchDtype, layout: ScaleLayout) -> None:
    x = randn(4, 160, seed=5)
    x[1] = 0
    x[3] = 0
    q = vendor.quantize(x, dtype, layout=layout)
    deq = vendor.dequantize(q)
    assert torch.equal(deq[1], torch.zeros(160)) and torch.equal(deq[3], torch.zeros(160))
    assert (q.data[1].view(torch.uint8) == 0).all() and (q.data[3].view(torch.uint8) == 0).all()
    if q.scale is not None:
        assert (q.scale[1].float() == 0).all() and (q.scale[3].float() == 0).all()
        assert (q.scale[0].float() > 0).all()


def test_all_zero_tensor_nvfp4(vendor: CpuVendor) -> None:
    q = vendor.quantize(torch.zeros(2, 32), DispatchDtype.NVFP4)
    assert q.global_scale.tolist() == [1.0]
    assert (q.data == 0).all() and (q.scale.float() == 0).all()


def test_zero_group_inside_a_row(vendor: CpuVendor) -> None:
    x = randn(2, 300, seed=6)
    x[0, 128:256] = 0
    q = vendor.quantize(x, DispatchDtype.FP8, layout=ScaleLayout.GROUP_128)
    assert q.scale[0, 1].item() == 0 and (q.scale[1] > 0).all()
    assert (q.data[0, 128:256].float() == 0).all()


@pytest.mark.parametrize(("dtype", "layout"), CASES)
def test_zero_rows(vendor: CpuVendor, dtype: DispatchDtype, layout: ScaleLayout) -> None:
    x = torch.zeros(0, 160)
    q = vendor.quantize(x, dtype, layout=layout)
    assert q.shape == (0, 160)
    if q.scale is not None:
        assert q.scale.shape == tuple(q.expected_scale_shape()) and q.scale.shape[0] == 0
    assert vendor.dequantize(q, torch.bfloat16).shape == (0, 160)


@pytest.mark.parametrize(("dtype", "layout"), CASES)
def test_non_contiguous_input(vendor: CpuVendor, dtype: DispatchDtype, layout: ScaleLayout) -> None:
    base = randn(160, 6, seed=7)
    x = base.t()
    assert not x.is_contiguous()
    a = vendor.quantize(x, dtype, layout=layout)
    b = vendor.quantize(x.contiguous(), dtype, layout=layout)
    assert torch.equal(
        a.data.view(torch.uint8) if a.data.dtype != torch.bfloat16 else a.data,
        b.data.view(torch.uint8) if b.data.dtype != torch.bfloat16 else b.data,
    )
    if a.scale is not None:
        assert torch.equal(a.scale.float(), b.scale.float())
    sliced = randn(6, 320, seed=8)[:, ::2]
    c = vendor.quantize(sliced, dtype, layout=layout)
    d = vendor.quantize(sliced.contiguous(), dtype, layout=layout)
    torch.testing.assert_close(vendor.dequantize(c), vendor.dequantize(d))


def test_bf16_is_a_plain_cast(vendor: CpuVendor) -> None:
    x = randn(3, 20, seed=9)
    q = vendor.quantize(x, "bf16")
    assert q.scale is None and torch.equal(q.data, x.to(torch.bfloat16))
    assert torch.equal(vendor.dequantize(q, torch.float16), x.to(torch.bfloat16).to(torch.float16))


# -- rejected input --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", list(DispatchDtype.concrete()))
def test_non_finite_rejected(vendor: CpuVendor, bad: float, dtype: DispatchDtype) -> None:
    x = randn(3, 32, seed=10)
    x[1, 3] = bad
    x[2, 0] = bad
    with pytest.raises(InvalidInput, match=r"x: .*2 non-finite"):
        vendor.quantize(x, dtype)


@pytest.mark.parametrize(
    ("x", "dtype", "layout", "match"),
    [
        (torch.ones(2, 32, dtype=torch.int32), "int8", None, "x"),
        (torch.ones(2, 32, dtype=torch.float64), "fp8", None, "x"),
        (torch.ones(2, 32), "auto", None, "dtype"),
        (torch.ones(2, 32), "fp12", None, "dispatch dtype"),
        (torch.ones(2, 32), "int8", ScaleLayout.GROUP_128, "layout"),
        (torch.ones(2, 32), "fp8", ScaleLayout.BLOCK_16, "layout"),
        (torch.ones(2, 32), "bf16", ScaleLayout.PER_TOKEN, "layout"),
        (torch.ones(2, 32), "nvfp4", ScaleLayout.PER_TOKEN, "layout"),
        (torch.ones(2, 32), "fp8", "bogus", "layout"),
        (torch.ones(2, 40), "nvfp4", None, "multiple of 16"),
        (torch.ones(()), "int8", None, "x"),
        (torch.ones(2, 0), "int8", None, "x"),
    ],
)
def test_bad_arguments_rejected(vendor: CpuVendor, x: torch.Tensor, dtype: str, layout: object, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        vendor.quantize(x, dtype, layout=layout)


@pytest.mark.parametrize(
    "global_scale",
    [
        torch.tensor([0.0]),
        torch.tensor([-1.0]),
        torch.tensor([float("inf")]),
        torch.tensor([1.0, 2.0]),
        torch.tensor([1.0], dtype=torch.float64),
    ],
)
def test_bad_global_scale_rejected(vendor: CpuVendor, global_scale: torch.Tensor) -> None:
    with pytest.raises(InvalidInput, match="global_scale"):
        vendor.quantize(torch.ones(1, 16), DispatchDtype.NVFP4, global_scale=global_scale)


def test_global_scale_only_for_nvfp4(vendor: CpuVendor) -> None:
    with pytest.raises(InvalidInput, match="global_scale: expected None for int8"):
        vendor.quantize(torch.ones(1, 16), DispatchDtype.INT8, global_scale=torch.tensor([1.0]))


def test_wrong_device_rejected(vendor: CpuVendor) -> None:
    x = torch.empty(2, 32, device="meta")
    with pytest.raises(InvalidInput, match=r"x: expected a tensor on device cpu, got 'meta'"):
        vendor.quantize(x, DispatchDtype.INT8)
    with pytest.raises(InvalidInput, match="weight"):
        vendor.quantize_weight(torch.empty(1, 4, 4, device="meta"), ScaleLayout.NONE)
    q = vendor.quantize(torch.ones(2, 32), DispatchDtype.INT8)  # still usable
    assert q.data.shape == (2, 32)
