"""Grouped matmul and swiglu of the CPU reference vendor, against float64 references built here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hal import (
    DispatchDtype,
    GemmKind,
    Groups,
    InvalidInput,
    KernelLimits,
    PackedInt4Tensor,
    QuantizedTensor,
    QuantizedWeight,
    ScaleLayout,
    UnsupportedCapability,
    gemm_kind_of,
)
from vendors.cpu import CpuVendor

# |y - ref| <= OUT_RTOL[out dtype] * |ref| + ACC_RTOL * (|a| @ |b|):
#  OUT_RTOL: one rounding to the output dtype (half an ulp, with a factor 2 of margin);
#  ACC_RTOL: fp32 accumulation over K <= 300 terms (K * 2^-24 ~ 2e-5), relative to sum |a_k b_k|.
OUT_RTOL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10, torch.float32: 2.0**-22}
ACC_RTOL = 3e-5
SWIGLU_RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-6}
SWIGLU_ATOL = {torch.bfloat16: 1e-6, torch.float16: 1e-7, torch.float32: 1e-12}

FORMS = ["counts", "offsets"]


@pytest.fixture(scope="module")
def vendor() -> CpuVendor:
    return CpuVendor()


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
        out[start:start + c] = a[start:start + c].double() @ b[g].double()
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


# -- exact results ---------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_fp32_exact_on_integers(vendor: CpuVendor, form: str) -> None:
    g = gen(1)
    x = torch.randint(-8, 9, (9, 64), generator=g).float()
    w = torch.randint(-8, 9, (6, 64, 24), generator=g).float()
    y = vendor.grouped_matmul(x, QuantizedWeight(w), make_groups(COUNTS, form))
    assert y.dtype == torch.float32 and y.shape == (9, 24)
    assert torch.equal(y.double(), reference(x, w, COUNTS))


@pytest.mark.parametrize("form", FORMS)
def test_int8_exact_with_power_of_two_scales(vendor: CpuVendor, form: str) -> None:
    g = gen(2)
    m, k, n, e = 9, 96, 40, 6
    xd = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    wd = torch.randint(-127, 128, (e, k, n), generator=g, dtype=torch.int8)
    xs = 2.0 ** torch.randint(-6, 3, (m,), generator=g).float()
    ws = 2.0 ** torch.randint(-6, 3, (e, n), generator=g).float()
    x = QuantizedTensor(xd, DispatchDtype.INT8, ScaleLayout.PER_TOKEN, xs)
    w = QuantizedWeight(wd, ScaleLayout.PER_CHANNEL, ws)
    y = vendor.grouped_matmul(x, w, make_groups(COUNTS, form), out_dtype=torch.float32)
    # |integer sums| <= 96 * 127^2 < 2^24 and the scales are powers of two: exact in fp32
    assert torch.equal(y.double(), reference(xd, wd, COUNTS) * xs.double()[:, None] * _row_scale(ws, COUNTS))
    assert vendor.grouped_matmul(x, w, make_groups(COUNTS, form)).dtype == torch.bfloat16


def _row_scale(ws: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The weight scale of each row's group: [M, N]."""
    idx = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return ws.double()[idx]


# -- random inputs within tolerance ----------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_float_kinds(vendor: CpuVendor, form: str, dtype: torch.dtype) -> None:
    g = gen(3)
    x = torch.randn(9, 200, generator=g).to(dtype)
    w = (torch.randn(6, 200, 72, generator=g) * 0.1).to(dtype)
    y = vendor.grouped_matmul(x, QuantizedWeight(w), make_groups(COUNTS, form))
    assert y.dtype == dtype and y.shape == (9, 72)
    assert_within(y, x, w, COUNTS)
    y32 = vendor.grouped_matmul(x, QuantizedWeight(w), make_groups(COUNTS, form), out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    assert_within(y32, x, w, COUNTS)


def test_bf16_quantized_tensor_activations(vendor: CpuVendor) -> None:
    g = gen(4)
    x = torch.randn(9, 64, generator=g)
    w = torch.randn(6, 64, 16, generator=g).to(torch.bfloat16)
    q = vendor.quantize(x, DispatchDtype.BF16)
    y = vendor.grouped_matmul(q, QuantizedWeight(w), make_groups(COUNTS, "counts"))
    assert y.dtype == torch.bfloat16
    assert_within(y, q.data, w, COUNTS)


QUANT_KINDS = [
    (DispatchDtype.INT8, ScaleLayout.PER_TOKEN, ScaleLayout.PER_CHANNEL, torch.int8),
    (DispatchDtype.FP8, ScaleLayout.PER_TOKEN, ScaleLayout.PER_CHANNEL, torch.float8_e4m3fn),
    (DispatchDtype.FP8, ScaleLayout.GROUP_128, ScaleLayout.BLOCK_128X128, torch.float8_e4m3fn),
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("xdtype", "xlayout", "wlayout", "wdtype"), QUANT_KINDS)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_quantized_kinds(
    vendor: CpuVendor, form: str, xdtype: DispatchDtype, xlayout: ScaleLayout,
    wlayout: ScaleLayout, wdtype: torch.dtype, out_dtype: torch.dtype | None,
) -> None:
    g = gen(5)
    k, n = 200, 300  # partial 128-tiles in K and N
    x = torch.randn(9, k, generator=g) * 2
    w = torch.randn(6, k, n, generator=g) * 0.05
    w[3, 128:, :] *= 50  # tiles with very different scales
    qx = vendor.quantize(x, xdtype, layout=xlayout)
    qw = vendor.quantize_weight(w, wlayout, wdtype)
    y = vendor.grouped_matmul(qx, qw, make_groups(COUNTS, form), out_dtype=out_dtype)
    assert y.dtype == (out_dtype or torch.bfloat16) and y.shape == (9, n)
    a, b = dequant_x(qx), dequant_w(qw)
    assert_within(y, a, b, COUNTS)
    # and the quantized product is close to the float product (quantization error only)
    rel = (y.double() - reference(x, w, COUNTS)).norm() / reference(x, w, COUNTS).norm()
    assert rel < (0.02 if xdtype is DispatchDtype.INT8 else 0.08)


# -- shapes and layouts ----------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("xdtype", "xlayout", "wlayout", "wdtype"), QUANT_KINDS)
def test_zero_rows(
    vendor: CpuVendor, form: str, xdtype: DispatchDtype, xlayout: ScaleLayout,
    wlayout: ScaleLayout, wdtype: torch.dtype,
) -> None:
    qx = vendor.quantize(torch.zeros(0, 130), xdtype, layout=xlayout)
    qw = vendor.quantize_weight(torch.randn(3, 130, 20, generator=gen(6)), wlayout, wdtype)
    y = vendor.grouped_matmul(qx, qw, make_groups([0, 0, 0], form))
    assert y.shape == (0, 20) and y.dtype == torch.bfloat16
    yf = vendor.grouped_matmul(torch.zeros(0, 130), QuantizedWeight(torch.randn(3, 130, 20)),
                               make_groups([0, 0, 0], form))
    assert yf.shape == (0, 20) and yf.dtype == torch.float32


@pytest.mark.parametrize("form", FORMS)
def test_single_group(vendor: CpuVendor, form: str) -> None:
    g = gen(7)
    x = torch.randn(7, 32, generator=g)
    w = torch.randn(1, 32, 8, generator=g)
    y = vendor.grouped_matmul(x, QuantizedWeight(w), make_groups([7], form, torch.int32))
    assert_within(y, x, w, [7])


@pytest.mark.parametrize("form", FORMS)
def test_non_contiguous_operands(vendor: CpuVendor, form: str) -> None:
    g = gen(8)
    x = torch.randn(64, 9, generator=g).t()  # [9, 64], transposed
    w = torch.randn(6, 24, 64, generator=g).transpose(1, 2)  # [6, 64, 24], transposed
    assert not x.is_contiguous() and not w.is_contiguous()
    y = vendor.grouped_matmul(x, QuantizedWeight(w), make_groups(COUNTS, form))
    assert_within(y, x, w, COUNTS)
    sliced = torch.randn(9, 128, generator=g)[:, ::2]
    y = vendor.grouped_matmul(sliced, QuantizedWeight(w), make_groups(COUNTS, form))
    assert_within(y, sliced, w, COUNTS)
    # quantized operands with non-contiguous storage
    qx = vendor.quantize(torch.randn(9, 64, generator=g), DispatchDtype.INT8)
    qw = vendor.quantize_weight(torch.randn(6, 64, 24, generator=g), ScaleLayout.PER_CHANNEL)
    qx_nc = QuantizedTensor(qx.data.t().contiguous().t(), qx.dtype, qx.layout, qx.scale)
    qw_nc = QuantizedWeight(qw.data.transpose(1, 2).contiguous().transpose(1, 2), qw.layout, qw.scale)
    assert not qx_nc.data.is_contiguous() and not qw_nc.data.is_contiguous()
    y = vendor.grouped_matmul(qx_nc, qw_nc, make_groups(COUNTS, form), out_dtype=torch.float32)
    assert torch.equal(y, vendor.grouped_matmul(qx, qw, make_groups(COUNTS, form), out_dtype=torch.float32))


# -- errors ----------------------------------------------------------------------------------------


def _valid_call(vendor: CpuVendor) -> None:
    x = torch.randn(9, 16, generator=gen(9))
    w = torch.randn(6, 16, 4, generator=gen(10))
    y = vendor.grouped_matmul(x, QuantizedWeight(w), make_groups(COUNTS, "counts"))
    assert_within(y, x, w, COUNTS)


@pytest.mark.parametrize(
    ("groups", "x_shape", "w_shape", "match"),
    [
        (Groups.from_counts(torch.tensor([2, 3, 3])), (9, 16), (3, 16, 4), r"9 rows"),
        (Groups.from_counts(torch.tensor([5, -1, 5])), (9, 16), (3, 16, 4), r"non-negative"),
        (Groups.from_offsets(torch.tensor([5, 3, 9])), (9, 16), (3, 16, 4), r"non-decreasing"),
        (Groups.from_offsets(torch.tensor([3, 9])), (9, 16), (3, 16, 4), r"groups: expected 3 groups"),
        (Groups.from_counts(torch.tensor([3, 3, 3])), (9, 16), (3, 15, 4),
         r"x \(9, 16\).*weight \(3, 15, 4\)"),
        (Groups.from_counts(torch.tensor([3, 3, 3])), (9, 16, 1), (3, 16, 4), r"x: expected a 2-D"),
    ],
)
def test_bad_groups_and_shapes(
    vendor: CpuVendor, groups: Groups, x_shape: tuple[int, ...], w_shape: tuple[int, ...], match: str
) -> None:
    x = torch.randn(*x_shape)
    w = QuantizedWeight(torch.randn(*w_shape))
    with pytest.raises(InvalidInput, match=match):
        vendor.grouped_matmul(x, w, groups)
    _valid_call(vendor)


def test_bad_operand_types_and_pairings(vendor: CpuVendor) -> None:
    groups = make_groups([2, 2], "counts")
    w = QuantizedWeight(torch.randn(2, 16, 4))
    qx = vendor.quantize(torch.randn(4, 16), DispatchDtype.INT8)
    with pytest.raises(InvalidInput, match="supported pairing"):
        vendor.grouped_matmul(qx, w, groups)  # int8 activations with fp32 weights
    with pytest.raises(InvalidInput, match="supported pairing"):
        vendor.grouped_matmul(torch.randn(4, 16, dtype=torch.bfloat16), w, groups)
    with pytest.raises(InvalidInput, match="weight"):
        vendor.grouped_matmul(torch.randn(4, 16), torch.randn(2, 16, 4), groups)
    with pytest.raises(InvalidInput, match="groups"):
        vendor.grouped_matmul(torch.randn(4, 16), w, torch.tensor([2, 2]))
    with pytest.raises(InvalidInput, match="out_dtype"):
        vendor.grouped_matmul(torch.randn(4, 16), w, groups, out_dtype=torch.int32)
    with pytest.raises(InvalidInput, match=r"x: expected a tensor on device cpu, got 'meta'"):
        vendor.grouped_matmul(torch.empty(4, 16, device="meta"), w, groups)
    _valid_call(vendor)


class _Bf16OnlyVendor(CpuVendor):
    def _detect_capabilities(self):  # type: ignore[no-untyped-def]
        return dataclasses.replace(super()._detect_capabilities(), grouped_matmul=frozenset({GemmKind.BF16}))


class _LimitedVendor(CpuVendor):
    def _detect_capabilities(self):  # type: ignore[no-untyped-def]
        return dataclasses.replace(super()._detect_capabilities(), limits=KernelLimits(max_group_rows=4))


def test_undeclared_kind_rejected() -> None:
    vendor = _Bf16OnlyVendor()
    qx = vendor.quantize(torch.randn(4, 16), DispatchDtype.INT8)
    qw = vendor.quantize_weight(torch.randn(2, 16, 4), ScaleLayout.PER_CHANNEL)
    with pytest.raises(UnsupportedCapability, match=r"'cpu'.*int8"):
        vendor.grouped_matmul(qx, qw, make_groups([1, 3], "counts"))
    x = torch.randn(4, 16).to(torch.bfloat16)
    w = torch.randn(2, 16, 4).to(torch.bfloat16)
    y = vendor.grouped_matmul(x, QuantizedWeight(w), make_groups([1, 3], "counts"))
    assert_within(y, x, w, [1, 3])


def test_declared_limits_enforced() -> None:
    vendor = _LimitedVendor()
    w = torch.randn(2, 16, 4)
    with pytest.raises(InvalidInput, match="max_group_rows"):
        vendor.grouped_matmul(torch.randn(5, 16), QuantizedWeight(w), make_groups([2, 3], "offsets"))
    x = torch.randn(4, 16)
    y = vendor.grouped_matmul(x, QuantizedWeight(w), make_groups([2, 2], "offsets"))
    assert_within(y, x, w, [2, 2])


# -- int4 and nvfp4 kinds --------------------------------------------------------------------------

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def pack_int4_here(values: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7] `[..., 8m]` -> int32 words `[..., m]`, word by word in plain Python."""
    rows = values.reshape(-1, values.shape[-1]).tolist()
    words = []
    for row in rows:
        out = []
        for i in range(0, len(row), 8):
            word = sum((v & 0xF) << (4 * j) for j, v in enumerate(row[i:i + 8]))
            out.append(word - (1 << 32) if word >= 1 << 31 else word)
        words.append(out)
    return torch.tensor(words, dtype=torch.int32).reshape(*values.shape[:-1], values.shape[-1] // 8)


def unpack_int4_here(words: torch.Tensor) -> torch.Tensor:
    """int32 words `[..., m]` -> float64 values `[..., 8m]`: value j is bits 4j..4j+3, two's complement."""
    out = torch.empty(*words.shape[:-1], words.shape[-1] * 8, dtype=torch.float64)
    flat_out = out.reshape(-1, out.shape[-1])
    for r, row in enumerate(words.reshape(-1, words.shape[-1]).tolist()):
        for i, word in enumerate(row):
            for j in range(8):
                nibble = (word >> (4 * j)) & 0xF  # Python's >> on a negative int is arithmetic
                flat_out[r, 8 * i + j] = nibble - 16 if nibble >= 8 else nibble
    return out


def decode_e2m1_here(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8, two e2m1 codes per byte along `dim` (low nibble first) -> float64."""
    p = packed.long().movedim(dim, -1)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1]).movedim(-1, dim)
    mags = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    return torch.where(codes & 8 > 0, -mags, mags)


def dequant_int4_x(q: PackedInt4Tensor) -> torch.Tensor:
    return unpack_int4_here(q.data) * q.scale.double()[:, None]


def dequant_int4_w(w: QuantizedWeight) -> torch.Tensor:
    return unpack_int4_here(w.data) * w.scale.double()[:, None, :]


def dequant_nvfp4_x(q: QuantizedTensor) -> torch.Tensor:
    return decode_e2m1_here(q.data, -1) * q.scale.double().repeat_interleave(16, 1) / q.global_scale.double()


def dequant_nvfp4_w(w: QuantizedWeight) -> torch.Tensor:
    s = w.scale.double().repeat_interleave(16, 1)
    return decode_e2m1_here(w.data, 1) * s / w.global_scale.double()[:, None, None]


def test_helpers_here_agree_with_the_format() -> None:
    """The test's own decoders against hand-written words and bytes."""
    assert pack_int4_here(torch.tensor([[1, -1, 0, 0, 0, 0, 0, 0]])).tolist() == [[0xF1]]
    assert unpack_int4_here(torch.tensor([[0xF1, -0x10000000]], dtype=torch.int32)).tolist() == [
        [1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1]]
    assert decode_e2m1_here(torch.tensor([[0x7F, 0x09]], dtype=torch.uint8), -1).tolist() == [[-6, 6, -0.5, 0]]
    assert decode_e2m1_here(torch.tensor([[[0x7F], [0x09]]], dtype=torch.uint8), 1).tolist() == [
        [[-6], [6], [-0.5], [0]]]


@pytest.mark.parametrize("form", FORMS)
def test_int4_exact_with_power_of_two_scales(vendor: CpuVendor, form: str) -> None:
    g = gen(20)
    m, k, n, e = 9, 64, 40, 6
    xv = torch.randint(-7, 8, (m, k), generator=g)
    wv = torch.randint(-7, 8, (e, k, n), generator=g)
    xv[0, :15] = torch.arange(-7, 8)
    xs = 2.0 ** torch.randint(-6, 3, (m,), generator=g).float()
    ws = 2.0 ** torch.randint(-6, 3, (e, n), generator=g).float()
    x = PackedInt4Tensor(pack_int4_here(xv), xs)
    w = QuantizedWeight(pack_int4_here(wv), ScaleLayout.PER_CHANNEL, ws)
    assert gemm_kind_of(x, w) is GemmKind.INT4 and (w.in_features, w.out_features) == (k, n)
    y = vendor.grouped_matmul(x, w, make_groups(COUNTS, form), out_dtype=torch.float32)
    assert y.shape == (m, n)
    # |integer sums| <= 64 * 49 and the scales are powers of two: exact in fp32
    assert torch.equal(y.double(), reference(xv, wv, COUNTS) * xs.double()[:, None] * _row_scale(ws, COUNTS))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.float16])
def test_int4_kind(vendor: CpuVendor, form: str, out_dtype: torch.dtype | None) -> None:
    g = gen(21)
    k, n = 96, 48
    x = torch.randn(9, k, generator=g) * 2
    x[4] = 0  # an all-zero row (scale 0)
    w = torch.randn(6, k, n, generator=g) * 0.05
    w[3, :, 8:16] *= 50  # channels with very different scales
    qx = vendor.quantize_int4(x)
    qw = vendor.quantize_weight(w, ScaleLayout.PER_CHANNEL, torch.quint4x2)
    y = vendor.grouped_matmul(qx, qw, make_groups(COUNTS, form), out_dtype=out_dtype)
    assert y.dtype == (out_dtype or torch.bfloat16) and y.shape == (9, n)
    assert_within(y, dequant_int4_x(qx), dequant_int4_w(qw), COUNTS)
    assert (y[4] == 0).all()
    # and the quantized product is close to the float product (int4 quantization error only)
    rel = (y.double() - reference(x, w, COUNTS)).norm() / reference(x, w, COUNTS).norm()
    assert rel < 0.25


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_nvfp4_kind(vendor: CpuVendor, form: str, out_dtype: torch.dtype | None) -> None:
    g = gen(22)
    k, n = 96, 40
    x = torch.randn(9, k, generator=g) * 2
    x[4] = 0  # an all-zero row
    x[5, 16:32] *= 100  # blocks with very different scales
    w = torch.randn(6, k, n, generator=g) * 0.05
    w[3, 32:48, :] *= 50
    w[4] = 0  # an all-zero expert (global scale 1); its only row is row 8
    qx = vendor.quantize(x, DispatchDtype.NVFP4)
    qw = vendor.quantize_weight(w, ScaleLayout.BLOCK_16)
    assert gemm_kind_of(qx, qw) is GemmKind.NVFP4 and (qw.in_features, qw.out_features) == (k, n)
    y = vendor.grouped_matmul(qx, qw, make_groups(COUNTS, form), out_dtype=out_dtype)
    assert y.dtype == (out_dtype or torch.bfloat16) and y.shape == (9, n)
    assert_within(y, dequant_nvfp4_x(qx), dequant_nvfp4_w(qw), COUNTS)
    assert (y[4] == 0).all() and (y[8] == 0).all() and qw.global_scale[4] == 1
    rel = (y.double() - reference(x, w, COUNTS)).norm() / reference(x, w, COUNTS).norm()
    assert rel < 0.2


@pytest.mark.parametrize("form", FORMS)
def test_int4_and_nvfp4_zero_rows(vendor: CpuVendor, form: str) -> None:
    w = torch.randn(3, 32, 16, generator=gen(23))
    qx4 = vendor.quantize_int4(torch.zeros(0, 32))
    y = vendor.grouped_matmul(qx4, vendor.quantize_weight(w, ScaleLayout.PER_CHANNEL, torch.quint4x2),
                              make_groups([0, 0, 0], form))
    assert y.shape == (0, 16) and y.dtype == torch.bfloat16
    qxf = vendor.quantize(torch.zeros(0, 32), DispatchDtype.NVFP4)
    y = vendor.grouped_matmul(qxf, vendor.quantize_weight(w, ScaleLayout.BLOCK_16), make_groups([0, 0, 0], form))
    assert y.shape == (0, 16) and y.dtype == torch.bfloat16


def test_int4_and_nvfp4_shape_errors_use_logical_sizes(vendor: CpuVendor) -> None:
    groups = make_groups([4, 5], "counts")
    qx4 = vendor.quantize_int4(torch.randn(9, 64, generator=gen(24)))
    qw4 = vendor.quantize_weight(torch.randn(2, 32, 40, generator=gen(25)), ScaleLayout.PER_CHANNEL, torch.quint4x2)
    with pytest.raises(InvalidInput, match=r"x \(9, 64\) and weight \(2, 32, 40\)"):
        vendor.grouped_matmul(qx4, qw4, groups)
    qxf = vendor.quantize(torch.randn(9, 64, generator=gen(26)), DispatchDtype.NVFP4)
    qwf = vendor.quantize_weight(torch.randn(2, 32, 40, generator=gen(27)), ScaleLayout.BLOCK_16)
    with pytest.raises(InvalidInput, match=r"x \(9, 64\) and weight \(2, 32, 40\)"):
        vendor.grouped_matmul(qxf, qwf, groups)
    with pytest.raises(InvalidInput, match=r"x: expected 2-D data"):
        vendor.grouped_matmul(PackedInt4Tensor(qx4.data.reshape(3, 3, 8), qx4.scale.reshape(3, 3)), qw4, groups)
    with pytest.raises(InvalidInput, match=r"groups: expected 2 groups"):
        qw = vendor.quantize_weight(torch.randn(2, 64, 8, generator=gen(28)), ScaleLayout.PER_CHANNEL, torch.quint4x2)
        vendor.grouped_matmul(qx4, qw, make_groups([4, 2, 3], "counts"))


def test_int4_and_nvfp4_pairing_errors(vendor: CpuVendor) -> None:
    x = torch.randn(4, 32, generator=gen(29))
    w = torch.randn(2, 32, 16, generator=gen(30))
    qx4 = vendor.quantize_int4(x)
    qxf = vendor.quantize(x, DispatchDtype.NVFP4)
    qx8 = vendor.quantize(x, DispatchDtype.INT8)
    qx_fp8 = vendor.quantize(x, DispatchDtype.FP8, layout=ScaleLayout.PER_TOKEN)
    w8 = vendor.quantize_weight(w, ScaleLayout.PER_CHANNEL, torch.int8)
    w4 = vendor.quantize_weight(w, ScaleLayout.PER_CHANNEL, torch.quint4x2)
    wf = vendor.quantize_weight(w, ScaleLayout.BLOCK_16)
    w_fp8 = vendor.quantize_weight(w, ScaleLayout.PER_CHANNEL, torch.float8_e4m3fn)
    groups = make_groups([2, 2], "counts")
    bad = [
        (qx4, w8, "int4 per-token activations with torch.int8 per-channel"),
        (qx4, w_fp8, "int4 per-token activations with torch.float8_e4m3fn per-channel"),
        (qx4, wf, "int4 per-token activations with torch.uint8 block-16"),
        (qx4, QuantizedWeight(w), "int4 per-token activations with torch.float32 none"),
        (qx8, w4, "int8 per-token activations with torch.int32 per-channel"),
        (qx_fp8, w4, "fp8 per-token activations with torch.int32 per-channel"),
        (qx_fp8, wf, "fp8 per-token activations with torch.uint8 block-16"),
        (qxf, w8, "nvfp4 block-16 activations with torch.int8 per-channel"),
        (qxf, w4, "nvfp4 block-16 activations with torch.int32 per-channel"),
        (x, wf, "torch.float32 activations with torch.uint8 block-16"),
    ]
    for a, b, got in bad:
        with pytest.raises(InvalidInput, match=f"supported pairing.*got {got} weights"):
            gemm_kind_of(a, b)
        with pytest.raises(InvalidInput, match="supported pairing"):
            vendor.grouped_matmul(a, b, groups)
    assert gemm_kind_of(qx4, w4) is GemmKind.INT4 and gemm_kind_of(qxf, wf) is GemmKind.NVFP4


def test_int4_and_nvfp4_wrong_device_rejected(vendor: CpuVendor) -> None:
    groups = make_groups([1, 1], "counts")
    meta4 = PackedInt4Tensor(torch.empty(2, 2, dtype=torch.int32, device="meta"),
                             torch.empty(2, device="meta"))
    w4 = vendor.quantize_weight(torch.randn(2, 16, 8, generator=gen(31)), ScaleLayout.PER_CHANNEL, torch.quint4x2)
    with pytest.raises(InvalidInput, match=r"x.data: expected a tensor on device cpu, got 'meta'"):
        vendor.grouped_matmul(meta4, w4, groups)
    metaf = QuantizedTensor(torch.empty(2, 8, dtype=torch.uint8, device="meta"), DispatchDtype.NVFP4,
                            ScaleLayout.BLOCK_16, torch.empty(2, 1, dtype=torch.float8_e4m3fn, device="meta"),
                            torch.empty(1, device="meta"))
    wf = vendor.quantize_weight(torch.randn(2, 16, 8, generator=gen(32)), ScaleLayout.BLOCK_16)
    with pytest.raises(InvalidInput, match=r"x.data: expected a tensor on device cpu, got 'meta'"):
        vendor.grouped_matmul(metaf, wf, groups)
    meta_w = QuantizedWeight(torch.empty(2, 8, 8, dtype=torch.uint8, device="meta"), ScaleLayout.BLOCK_16,
                             torch.empty(2, 1, 8, dtype=torch.float8_e4m3fn, device="meta"),
                             torch.empty(2, device="meta"))
    qxf = vendor.quantize(torch.randn(2, 16, generator=gen(33)), DispatchDtype.NVFP4)
    with pytest.raises(InvalidInput, match=r"weight.data: expected a tensor on device cpu, got 'meta'"):
        vendor.grouped_matmul(qxf, meta_w, groups)


def test_int4_and_nvfp4_undeclared_kinds_rejected(cuda) -> None:  # type: ignore[no-untyped-def]
    vendor = _Bf16OnlyVendor()
    x = torch.randn(4, 32, generator=gen(34))
    w = torch.randn(2, 32, 16, generator=gen(35))
    with pytest.raises(UnsupportedCapability, match=r"'cpu'.*int4"):
        vendor.grouped_matmul(vendor.quantize_int4(x), vendor.quantize_weight(w, ScaleLayout.PER_CHANNEL,
                              torch.quint4x2), make_groups([1, 3], "counts"))
    with pytest.raises(UnsupportedCapability, match=r"'cpu'.*nvfp4"):
        vendor.grouped_matmul(vendor.quantize(x, DispatchDtype.NVFP4),
                              vendor.quantize_weight(w, ScaleLayout.BLOCK_16), make_groups([1, 3], "counts"))
    assert GemmKind.INT4 in CpuVendor().capabilities().grouped_matmul
    for model in cuda.declared_models():  # the CUDA tables do not claim the new kinds (yet)
        caps = cuda.declared_capabilities(model)
        assert not caps.supports_gemm(GemmKind.INT4) and not caps.supports_gemm(GemmKind.NVFP4)


# -- swiglu ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_swiglu(vendor: CpuVendor, dtype: torch.dtype) -> None:
    x = (torch.randn(3, 5, 2 * 48, generator=gen(11)) * 4).to(dtype)
    y = vendor.swiglu(x)
    assert y.dtype == dtype and y.shape == (3, 5, 48)
    a, b = x.double()[..., :48], x.double()[..., 48:]
    ref = a / (1 + torch.exp(-a)) * b
    err = (y.double() - ref).abs()
    assert (err <= SWIGLU_RTOL[dtype] * ref.abs() + SWIGLU_ATOL[dtype]).all()
    nc = x.transpose(0, 1)
    assert torch.equal(vendor.swiglu(nc), y.transpose(0, 1))


def test_swiglu_rejects_odd_last_dim(vendor: CpuVendor) -> None:
    with pytest.raises(InvalidInput, match="even"):
        vendor.swiglu(torch.randn(4, 7))
    with pytest.raises(InvalidInput, match="x"):
        vendor.swiglu(torch.ones(4, 8, dtype=torch.int32))
    assert vendor.swiglu(torch.zeros(2, 0)).shape == (2, 0)
