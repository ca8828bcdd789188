"""Weight quantization, int4 packing and int4 activations of the reference ops (through the CPU vendor),
against float64 math done here."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from hal import DispatchDtype, InvalidInput, PackedInt4Tensor, QuantizedWeight, ScaleLayout
from hal import reference as quant
from tests.support.quantize_helpers import fp8_bound, TOL, E2M1, e2m1_error_bound, randn
from vendors.cpu import CpuVendor


@pytest.fixture(scope="module")
def vendor() -> CpuVendor:
    return CpuVendor()


# -- weights ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("wdtype", "qmax"), [(torch.int8, 127.0), (torch.float8_e4m3fn, 448.0)])
def test_weight_per_channel(vendor: CpuVendor, wdtype: torch.dtype, qmax: float) -> None:
    w = randn(3, 200, 72, seed=11, scale=0.05)
    w[1, :, 5] = 0  # a zero output channel
    qw = vendor.quantize_weight(w, ScaleLayout.PER_CHANNEL, wdtype)
    assert qw.data.dtype == wdtype and qw.scale.shape == (3, 72) and qw.scale.dtype == torch.float32
    wd = w.double()
    amax = wd.abs().amax(dim=1)
    torch.testing.assert_close(qw.scale.double(), amax / qmax, rtol=1e-6, atol=0)
    assert qw.scale[1, 5] == 0 and (qw.data[1, :, 5].float() == 0).all()
    step = qw.scale.double().unsqueeze(1).expand_as(wd)
    deq = qw.data.double() * step
    if wdtype == torch.int8:
        bound = 0.5 * step * (1 + TOL["int8_half_step_slack"])
        assert (deq.abs() <= amax.unsqueeze(1) * (1 + 1e-6)).all()
    else:
        bound = fp8_bound(wd, step)
    assert ((wd - deq).abs() <= bound).all()


def test_weight_per_channel_defaults_to_int8(vendor: CpuVendor) -> None:
    qw = vendor.quantize_weight(randn(1, 8, 4, seed=12), "per-channel")
    assert qw.data.dtype == torch.int8


@pytest.mark.parametrize(("k", "n"), [(200, 72), (128, 256), (200, 300)])
def test_weight_block128(vendor: CpuVendor, k: int, n: int) -> None:
    w = randn(2, k, n, seed=13)
    w[0, :128, : min(n, 128)] *= 100  # tiles must not share scales
    w[1, 128:, :] = 0 if k > 128 else w[1, 128:, :]  # zero partial tiles when K is partial
    qw = vendor.quantize_weight(w, ScaleLayout.BLOCK_128X128)
    kb, nb = math.ceil(k / 128), math.ceil(n / 128)
    assert qw.data.dtype == torch.float8_e4m3fn and qw.scale.shape == (2, kb, nb)
    wd = w.double()
    step = torch.empty_like(wd)
    for e in range(2):
        for i in range(kb):
            for j in range(nb):
                tile = wd[e, i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
                want = tile.abs().max() / 448
                assert math.isclose(qw.scale[e, i, j].item(), want.item(), rel_tol=1e-6, abs_tol=0)
                step[e, i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = qw.scale[e, i, j].double()
    if k > 128:
        assert (qw.scale[1, 1] == 0).all() and (qw.data[1, 128:].float() == 0).all()
    deq = qw.data.double() * step
    assert ((wd - deq).abs() <= fp8_bound(wd, step)).all()


def test_weight_none_casts(vendor: CpuVendor) -> None:
    w = randn(2, 8, 4, seed=14)
    assert vendor.quantize_weight(w, ScaleLayout.NONE).data.dtype == torch.float32
    qw = vendor.quantize_weight(w, ScaleLayout.NONE, torch.bfloat16)
    assert isinstance(qw, QuantizedWeight) and torch.equal(qw.data, w.to(torch.bfloat16))
    nc = vendor.quantize_weight(w.transpose(1, 2).contiguous().transpose(1, 2), ScaleLayout.PER_CHANNEL)
    assert torch.equal(nc.data, vendor.quantize_weight(w, ScaleLayout.PER_CHANNEL).data)


@pytest.mark.parametrize(
    ("w", "layout", "dtype", "match"),
    [
        (torch.ones(2, 8, 4), ScaleLayout.NONE, torch.int8, "dtype"),
        (torch.ones(2, 8, 4), ScaleLayout.PER_CHANNEL, torch.bfloat16, "dtype"),
        (torch.ones(2, 8, 4), ScaleLayout.BLOCK_128X128, torch.int8, "dtype"),
        (torch.ones(2, 8, 4), ScaleLayout.PER_TOKEN, None, "layout"),
        (torch.ones(2, 8, 4), "bogus", None, "layout"),
        (torch.ones(8, 4), ScaleLayout.NONE, None, "weight: expected 3 dimensions"),
        (torch.ones(2, 0, 4), ScaleLayout.NONE, None, "weight: expected 3 dimensions"),
        (torch.ones(2, 8, 4, dtype=torch.int8), ScaleLayout.PER_CHANNEL, None, "weight: expected a bf16"),
        (torch.full((2, 8, 4), float("nan")), ScaleLayout.PER_CHANNEL, None, "weight: .*64 non-finite"),
    ],
)
def test_bad_weights_rejected(vendor: CpuVendor, w: torch.Tensor, layout: object, dtype: object, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        vendor.quantize_weight(w, layout, dtype)


# -- int4 packing ----------------------------------------------------------------------------------


def pack_word_here(values: list[int]) -> int:
    """One int32 word from eight int4 values, in plain Python: value j in bits 4j..4j+3."""
    assert len(values) == 8
    word = 0
    for j, v in enumerate(values):
        word |= (v & 0xF) << (4 * j)
    return word - (1 << 32) if word >= 1 << 31 else word  # as a signed int32


def unpack_int4_here(words: torch.Tensor) -> torch.Tensor:
    """Independent int4 decode through the little-endian bytes: byte b holds values 2b (low) and 2b+1."""
    assert sys.byteorder == "little"
    raw = words.contiguous().view(torch.uint8).to(torch.int64)  # [..., 4m]
    nibbles = torch.stack([raw & 0xF, raw >> 4], dim=-1).reshape(*words.shape[:-1], words.shape[-1] * 8)
    return nibbles - 16 * (nibbles >= 8).to(torch.int64)


@pytest.mark.parametrize(
    ("values", "word"),
    [
        ([1, -1, 0, 0, 0, 0, 0, 0], 0xF1),
        ([0, 0, 0, 0, 0, 0, 0, 1], 0x10000000),
        ([0, 0, 0, 0, 0, 0, 0, -1], -0x10000000),  # top nibble 0xF: the sign bit of the word
        ([0, 0, 0, 0, 0, 0, 0, -7], -0x70000000),  # 0x9 << 28
        ([-1] * 8, -1),
        ([7, -7, 0, 3, -3, 1, -8, 7], 0x781D3097),  # nibbles j7..j0: 7 8 1 D 3 0 9 7
        ([0] * 8, 0),
    ],
)
def test_pack_int4_hand_computed_words(values: list[int], word: int) -> None:
    assert pack_word_here(values) == word
    packed = quant.pack_int4(torch.tensor([values]))
    assert packed.dtype == torch.int32 and packed.tolist() == [[word]]
    unpacked = quant.unpack_int4(packed)
    assert unpacked.shape == (1, 8) and unpacked.tolist() == [values]


def test_pack_unpack_int4_round_trip() -> None:
    g = torch.Generator().manual_seed(20)
    values = torch.randint(-8, 8, (3, 5, 32), generator=g)
    values[0, 0, :16] = torch.arange(-8, 8)  # every value, at every nibble position of two words
    values[0, 1, :16] = torch.arange(7, -9, -1)
    for dtype in (torch.int8, torch.int32, torch.int64):
        packed = quant.pack_int4(values.to(dtype))
        assert packed.dtype == torch.int32 and packed.shape == (3, 5, 4)
        want = [
            [[pack_word_here(row[8 * i : 8 * i + 8]) for i in range(4)] for row in plane] for plane in values.tolist()
        ]
        assert packed.tolist() == want
        assert torch.equal(unpack_int4_here(packed), values)
        assert torch.equal(quant.unpack_int4(packed).to(torch.int64), values)
    nc = values.transpose(0, 1)  # non-contiguous input
    assert torch.equal(quant.pack_int4(nc), quant.pack_int4(nc.contiguous()))
    assert quant.pack_int4(torch.zeros(0, 8, dtype=torch.int8)).shape == (0, 1)


@pytest.mark.parametrize(
    ("values", "match"),
    [
        (torch.zeros(2, 12, dtype=torch.int8), "multiple of 8"),
        (torch.tensor([[8, 0, 0, 0, 0, 0, 0, 0]]), r"\[-8, 7\]"),
        (torch.tensor([[-9, 0, 0, 0, 0, 0, 0, 0]]), r"\[-8, 7\]"),
        (torch.zeros(2, 8), "integer"),
    ],
)
def test_pack_int4_rejects(values: torch.Tensor, match: str) -> None:
    with pytest.raises(InvalidInput, match=f"values: expected .*{match}"):
        quant.pack_int4(values)


def test_unpack_int4_rejects_non_int32() -> None:
    with pytest.raises(InvalidInput, match="words: expected an int32 tensor"):
        quant.unpack_int4(torch.zeros(2, 1, dtype=torch.int64))


# -- int4 activations ------------------------------------------------------------------------------


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int4_per_token_round_trip(vendor: CpuVendor, in_dtype: torch.dtype) -> None:
    x = randn(3, 17, 64, seed=21, dtype=in_dtype, scale=3.0)
    q = vendor.quantize_int4(x)
    assert isinstance(q, PackedInt4Tensor)
    assert q.data.dtype == torch.int32 and q.data.shape == (3, 17, 8) and q.shape == (3, 17, 64)
    assert q.scale.dtype == torch.float32 and q.scale.shape == (3, 17)
    xd = x.to(torch.float64)
    rowmax = xd.abs().amax(dim=-1)
    torch.testing.assert_close(q.scale.double(), rowmax / 7, rtol=1e-6, atol=0)
    values = unpack_int4_here(q.data)
    assert values.abs().max() <= 7
    assert torch.equal(values.abs().amax(dim=-1), torch.full((3, 17), 7))  # each row's max maps to +-7
    deq_here = values.double() * q.scale.double().unsqueeze(-1)
    err = (xd - deq_here).abs()
    assert (err <= 0.5 * q.scale.double().unsqueeze(-1) * (1 + TOL["int8_half_step_slack"])).all()
    deq = quant.dequantize_int4(q)
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    torch.testing.assert_close(deq.double(), deq_here, rtol=TOL["FLOAT_SLACK"], atol=0)
    assert quant.dequantize_int4(q, torch.bfloat16).dtype == torch.bfloat16


def test_int4_rounds_half_to_even_and_clamps(vendor: CpuVendor) -> None:
    # scale = 7/7 = 1, so the values themselves are rounded
    x = torch.tensor([[7.0, 0.5, 1.5, 2.5, -2.5, -0.5, 3.4, -3.6, 6.5, -6.5, 5.5, 0, 0, 0, 0, -7.0]])
    q = vendor.quantize_int4(x)
    assert q.scale.tolist() == [1.0]
    assert unpack_int4_here(q.data).tolist() == [[7, 0, 2, 2, -2, 0, 3, -4, 6, -6, 6, 0, 0, 0, 0, -7]]


def test_int4_all_zero_rows_and_zero_rows(vendor: CpuVendor) -> None:
    x = randn(4, 32, seed=22)
    x[1] = 0
    x[3] = 0
    q = vendor.quantize_int4(x)
    assert q.scale[1] == 0 and q.scale[3] == 0 and (q.scale[[0, 2]] > 0).all()
    assert (q.data[1] == 0).all() and (q.data[3] == 0).all()
    assert torch.equal(quant.dequantize_int4(q)[1], torch.zeros(32))
    empty = vendor.quantize_int4(torch.zeros(0, 16))
    assert empty.data.shape == (0, 2) and empty.scale.shape == (0,)
    assert quant.dequantize_int4(empty).shape == (0, 16)


def test_int4_non_contiguous_input(vendor: CpuVendor) -> None:
    x = randn(48, 5, seed=23).t()
    a, b = vendor.quantize_int4(x), vendor.quantize_int4(x.contiguous())
    assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (torch.ones(2, 12), "x: expected a last dimension that is a multiple of 8 for int4, got 12"),
        (torch.ones(2, 16, dtype=torch.int32), "x: expected a bf16"),
        (torch.ones(2, 16, dtype=torch.float64), "x: expected a bf16"),
        (torch.ones(()), "x: expected at least one dimension"),
        (torch.tensor([[1.0] * 7 + [float("nan")]]), "x: expected finite values, got 1 non-finite"),
        (torch.tensor([[1.0] * 7 + [float("-inf")]]), "x: expected finite values, got 1 non-finite"),
    ],
)
def test_int4_bad_input_rejected(vendor: CpuVendor, x: torch.Tensor, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        vendor.quantize_int4(x)


def test_int4_wrong_device_rejected(vendor: CpuVendor) -> None:
    with pytest.raises(InvalidInput, match=r"x: expected a tensor on device cpu, got 'meta'"):
        vendor.quantize_int4(torch.empty(2, 16, device="meta"))
    with pytest.raises(InvalidInput, match="q: expected a PackedInt4Tensor"):
        quant.dequantize_int4(vendor.quantize(torch.ones(1, 8), DispatchDtype.INT8))


# -- int4 and nvfp4 weights ------------------------------------------------------------------------


def test_weight_int4_per_channel(vendor: CpuVendor) -> None:
    w = randn(3, 40, 24, seed=24, scale=0.05)
    w[1, :, 5] = 0  # a zero output channel
    w[2, :, 23] *= 100  # channels must not share scales
    qw = vendor.quantize_weight(w, ScaleLayout.PER_CHANNEL, torch.quint4x2)
    assert qw.is_int4 and qw.layout is ScaleLayout.PER_CHANNEL
    assert qw.data.dtype == torch.int32 and qw.data.shape == (3, 40, 3)
    assert (qw.num_experts, qw.in_features, qw.out_features) == (3, 40, 24)
    assert qw.scale.dtype == torch.float32 and qw.scale.shape == (3, 24)
    wd = w.double()
    amax = wd.abs().amax(dim=1)
    torch.testing.assert_close(qw.scale.double(), amax / 7, rtol=1e-6, atol=0)
    values = unpack_int4_here(qw.data)  # packed along N
    assert values.shape == (3, 40, 24) and values.abs().max() <= 7
    assert qw.scale[1, 5] == 0 and (values[1, :, 5] == 0).all()
    nonzero = amax > 0
    assert (values.abs().amax(dim=1)[nonzero] == 7).all()
    step = qw.scale.double().unsqueeze(1)
    deq_here = values.double() * step
    assert ((wd - deq_here).abs() <= 0.5 * step * (1 + TOL["int8_half_step_slack"])).all()
    deq = quant.dequantize_weight(qw)
    assert deq.dtype == torch.float32 and deq.shape == (3, 40, 24)
    torch.testing.assert_close(deq.double(), deq_here, rtol=TOL["FLOAT_SLACK"], atol=0)


def decode_nvfp4_weight_here(qw: QuantizedWeight) -> torch.Tensor:
    """Independent float64 decode of nvfp4 weights: codes packed along K, scales per 16 k."""
    e, half_k, n = qw.data.shape
    out = torch.empty(e, 2 * half_k, n, dtype=torch.float64)
    data = qw.data.tolist()
    for ei in range(e):
        for i in range(half_k):
            for ni in range(n):
                byte = data[ei][i][ni]
                for j, code in enumerate((byte & 0xF, byte >> 4)):
                    mag = E2M1[code & 7]
                    out[ei, 2 * i + j, ni] = -mag if code & 8 else mag
    s = qw.scale.to(torch.float64).repeat_interleave(16, dim=1)
    return out * s / qw.global_scale.double()[:, None, None]


def test_weight_nvfp4_exact_codes_and_packing(vendor: CpuVendor) -> None:
    # amax 6 gives a global scale of 448 and a block scale of 448: step 1, every e2m1 value exact.
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, -0.0]
    col = torch.tensor(values)
    w = torch.stack([col, -col, col / 64], dim=1).unsqueeze(0)  # [1, K=16, N=3]
    qw = vendor.quantize_weight(w, ScaleLayout.BLOCK_16)
    assert qw.data.dtype == torch.uint8 and qw.data.shape == (1, 8, 3)
    assert qw.scale.dtype == torch.float8_e4m3fn and qw.scale.shape == (1, 1, 3)
    assert qw.global_scale.dtype == torch.float32 and qw.global_scale.tolist() == [448.0]
    assert qw.scale.float().tolist() == [[[448.0, 448.0, 7.0]]]
    assert (qw.in_features, qw.out_features) == (16, 3)
    codes = [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 0]
    neg = [c ^ 8 if c & 7 else 0 for c in codes]
    packed = [
        [
            codes[2 * i] | (codes[2 * i + 1] << 4),
            neg[2 * i] | (neg[2 * i + 1] << 4),
            codes[2 * i] | (codes[2 * i + 1] << 4),
        ]
        for i in range(8)
    ]
    assert qw.data[0].tolist() == packed
    assert torch.equal(decode_nvfp4_weight_here(qw).float(), w)
    assert torch.equal(quant.dequantize_weight(qw), w)


def test_weight_nvfp4_random(vendor: CpuVendor) -> None:
    w = randn(3, 64, 20, seed=25, scale=0.05)
    w[0, 16:32, 3] = 0  # a zero block
    w[1] = 0  # an all-zero expert: global scale 1
    w[2, :, 7] *= 300  # a large channel
    qw = vendor.quantize_weight(w, ScaleLayout.BLOCK_16, torch.uint8)
    assert qw.data.shape == (3, 32, 20) and qw.scale.shape == (3, 4, 20) and qw.global_scale.shape == (3,)
    wd = w.double()
    amax = wd.abs().amax(dim=(1, 2))
    gs = torch.where(amax > 0, 448 * 6 / torch.where(amax > 0, amax, 1), 1.0)
    torch.testing.assert_close(qw.global_scale.double(), gs, rtol=1e-6, atol=0)
    assert qw.global_scale[1] == 1 and (qw.data[1] == 0).all() and (qw.scale[1].float() == 0).all()
    blocks = wd.reshape(3, 4, 16, 20)
    ideal = blocks.abs().amax(dim=2) / 6 * gs[:, None, None]
    s = qw.scale.double()
    scale_bound = torch.maximum(ideal * TOL["e4m3_scale_rel"], torch.full_like(ideal, 2.0**-10))
    assert ((s - ideal).abs() <= scale_bound).all()
    assert s[0, 1, 3] == 0 and (qw.data[0, 8:16, 3] == 0).all()
    step = (s / qw.global_scale.double()[:, None, None]).repeat_interleave(16, dim=1)
    bound = e2m1_error_bound(wd, step)
    deq = decode_nvfp4_weight_here(qw)
    assert ((wd - deq).abs() <= bound).all()
    torch.testing.assert_close(quant.dequantize_weight(qw).double(), deq, rtol=TOL["FLOAT_SLACK"], atol=0)


def test_weight_nvfp4_matches_the_activation_path(vendor: CpuVendor) -> None:
    """Each expert's `[K, N]` quantizes like the activations `[N, K]` under the same global scale."""
    w = randn(2, 48, 10, seed=26)
    qw = vendor.quantize_weight(w, ScaleLayout.BLOCK_16)
    for e in range(2):
        qx = vendor.quantize(w[e].t(), DispatchDtype.NVFP4, global_scale=qw.global_scale[e : e + 1])
        assert torch.equal(qx.data, qw.data[e].t())
        assert torch.equal(qx.scale.view(torch.uint8), qw.scale[e].t().view(torch.uint8))
        assert torch.equal(vendor.dequantize(qx), quant.dequantize_weight(qw)[e].t())


@pytest.mark.parametrize(
    ("wdtype", "layout"),
    [
        (None, ScaleLayout.NONE),
        (torch.int8, ScaleLayout.PER_CHANNEL),
        (torch.float8_e4m3fn, ScaleLayout.PER_CHANNEL),
        (None, ScaleLayout.BLOCK_128X128),
    ],
)
def test_dequantize_weight_other_layouts(vendor: CpuVendor, wdtype: torch.dtype | None, layout: ScaleLayout) -> None:
    w = randn(2, 200, 136, seed=27)
    qw = vendor.quantize_weight(w, layout, wdtype)
    d = qw.data.double()
    if layout is ScaleLayout.PER_CHANNEL:
        d = d * qw.scale.double()[:, None, :]
    elif layout is ScaleLayout.BLOCK_128X128:
        d = d * qw.scale.double()[:, torch.arange(200) // 128][:, :, torch.arange(136) // 128]
    deq = quant.dequantize_weight(qw)
    assert deq.dtype == torch.float32 and deq.shape == (2, 200, 136)
    torch.testing.assert_close(deq.double(), d, rtol=TOL["FLOAT_SLACK"], atol=0)


@pytest.mark.parametrize(
    ("w", "layout", "dtype", "match"),
    [
        (torch.ones(2, 8, 12), ScaleLayout.PER_CHANNEL, torch.quint4x2, r"weight: expected N a multiple of 8"),
        (torch.ones(2, 24, 8), ScaleLayout.BLOCK_16, None, r"weight: expected K a multiple of 16"),
        (torch.ones(2, 16, 8), ScaleLayout.BLOCK_16, torch.int8, r"dtype: expected None or torch.uint8"),
        (torch.ones(2, 16, 8), ScaleLayout.BLOCK_16, torch.float8_e4m3fn, "dtype"),
        (torch.ones(2, 16, 8), ScaleLayout.PER_CHANNEL, torch.int32, r"torch.quint4x2"),
        (torch.ones(2, 16, 8), ScaleLayout.BLOCK_128X128, torch.quint4x2, "dtype"),
        (torch.full((2, 16, 8), float("inf")), ScaleLayout.BLOCK_16, None, "weight: .*256 non-finite"),
        (torch.full((2, 16, 8), float("nan")), ScaleLayout.PER_CHANNEL, torch.quint4x2, "weight: .*non-finite"),
    ],
)
def test_bad_int4_and_nvfp4_weights_rejected(
    vendor: CpuVendor, w: torch.Tensor, layout: ScaleLayout, dtype: torch.dtype | None, match: str
) -> None:
    with pytest.raises(InvalidInput, match=match):
        vendor.quantize_weight(w, layout, dtype)


def test_dequantize_weight_rejects_other_types() -> None:
    with pytest.raises(InvalidInput, match="weight: expected a QuantizedWeight"):
        quant.dequantize_weight(torch.ones(1, 2, 2))
