"""The int4 and nvfp4 grouped-matmul kinds and swiglu of the reference ops (through the CPU vendor),
against float64 references built here."""

from __future__ import annotations

import itertools

import pytest
import torch

from hal import (
    GEMM_KINDS,
    DispatchDtype,
    GemmKind,
    InvalidInput,
    PackedInt4Tensor,
    QuantizedTensor,
    QuantizedWeight,
    ScaleLayout,
    UnsupportedCapability,
    gemm_kind_of,
)
from hal.gemm_kinds import ActivationFormat
from tests.support.gemm_helpers import (
    Bf16OnlyVendor,
    row_scale,
    gen,
    make_groups,
    reference,
    assert_within,
    SWIGLU_RTOL,
    SWIGLU_ATOL,
    FORMS,
    COUNTS,
)
from vendors.cpu import CpuVendor


@pytest.fixture(scope="module")
def vendor() -> CpuVendor:
    return CpuVendor()


# -- int4 and nvfp4 kinds --------------------------------------------------------------------------

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def pack_int4_here(values: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7] `[..., 8m]` -> int32 words `[..., m]`, word by word in plain Python."""
    rows = values.reshape(-1, values.shape[-1]).tolist()
    words = []
    for row in rows:
        out = []
        for i in range(0, len(row), 8):
            word = sum((v & 0xF) << (4 * j) for j, v in enumerate(row[i : i + 8]))
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
        [1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1]
    ]
    assert decode_e2m1_here(torch.tensor([[0x7F, 0x09]], dtype=torch.uint8), -1).tolist() == [[-6, 6, -0.5, 0]]
    assert decode_e2m1_here(torch.tensor([[[0x7F], [0x09]]], dtype=torch.uint8), 1).tolist() == [
        [[-6], [6], [-0.5], [0]]
    ]


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
    assert torch.equal(y.double(), reference(xv, wv, COUNTS) * xs.double()[:, None] * row_scale(ws, COUNTS))


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
    y = vendor.grouped_matmul(
        qx4, vendor.quantize_weight(w, ScaleLayout.PER_CHANNEL, torch.quint4x2), make_groups([0, 0, 0], form)
    )
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
    meta4 = PackedInt4Tensor(torch.empty(2, 2, dtype=torch.int32, device="meta"), torch.empty(2, device="meta"))
    w4 = vendor.quantize_weight(torch.randn(2, 16, 8, generator=gen(31)), ScaleLayout.PER_CHANNEL, torch.quint4x2)
    with pytest.raises(InvalidInput, match=r"x.data: expected a tensor on device cpu, got 'meta'"):
        vendor.grouped_matmul(meta4, w4, groups)
    metaf = QuantizedTensor(
        torch.empty(2, 8, dtype=torch.uint8, device="meta"),
        DispatchDtype.NVFP4,
        ScaleLayout.BLOCK_16,
        torch.empty(2, 1, dtype=torch.float8_e4m3fn, device="meta"),
        torch.empty(1, device="meta"),
    )
    wf = vendor.quantize_weight(torch.randn(2, 16, 8, generator=gen(32)), ScaleLayout.BLOCK_16)
    with pytest.raises(InvalidInput, match=r"x.data: expected a tensor on device cpu, got 'meta'"):
        vendor.grouped_matmul(metaf, wf, groups)
    meta_w = QuantizedWeight(
        torch.empty(2, 8, 8, dtype=torch.uint8, device="meta"),
        ScaleLayout.BLOCK_16,
        torch.empty(2, 1, 8, dtype=torch.float8_e4m3fn, device="meta"),
        torch.empty(2, device="meta"),
    )
    qxf = vendor.quantize(torch.randn(2, 16, generator=gen(33)), DispatchDtype.NVFP4)
    with pytest.raises(InvalidInput, match=r"weight.data: expected a tensor on device cpu, got 'meta'"):
        vendor.grouped_matmul(qxf, meta_w, groups)


def test_int4_and_nvfp4_undeclared_kinds_rejected(cuda) -> None:  # type: ignore[no-untyped-def]
    vendor = Bf16OnlyVendor()
    x = torch.randn(4, 32, generator=gen(34))
    w = torch.randn(2, 32, 16, generator=gen(35))
    with pytest.raises(UnsupportedCapability, match=r"'cpu'.*int4"):
        vendor.grouped_matmul(
            vendor.quantize_int4(x),
            vendor.quantize_weight(w, ScaleLayout.PER_CHANNEL, torch.quint4x2),
            make_groups([1, 3], "counts"),
        )
    with pytest.raises(UnsupportedCapability, match=r"'cpu'.*nvfp4"):
        vendor.grouped_matmul(
            vendor.quantize(x, DispatchDtype.NVFP4),
            vendor.quantize_weight(w, ScaleLayout.BLOCK_16),
            make_groups([1, 3], "counts"),
        )
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


def test_the_kind_of_every_operand_and_weight_format_pairing_follows_the_table(vendor: CpuVendor) -> None:
    """`gemm_kind_of` (looked up once per pair of formats) names the table's kind for every pairing of an
    operand format and a weight format, and refuses every pairing the table has no kind for."""
    x = torch.randn(4, 256, generator=gen(31))
    operands = [x.to(dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64)]
    operands.append(vendor.quantize_int4(x))
    for dtype in DispatchDtype.concrete():
        operands += [vendor.quantize(x.bfloat16(), dtype, layout=layout) for layout in dtype.scale_layouts()]
    w = torch.randn(2, 256, 64, generator=gen(32))
    weights = [QuantizedWeight(w.to(dtype)) for dtype in (torch.bfloat16, torch.float16, torch.float32)]
    weights += [vendor.quantize_weight(w, s.weight_layout, s.weight_dtype) for s in GEMM_KINDS.values()]
    for operand, weight in itertools.product(operands, weights):
        fmt = ActivationFormat.of(operand)
        expected = [s.kind for s in GEMM_KINDS.values() if s.accepts(fmt) and s.pairs_with(weight)]
        for _ in range(2):  # the second call is answered from the lookup
            if expected:
                assert gemm_kind_of(operand, weight) is expected[0], (fmt, weight.layout, weight.data.dtype)
            else:
                with pytest.raises(InvalidInput, match="supported pairing"):
                    gemm_kind_of(operand, weight)
