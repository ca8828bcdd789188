"""Hand-computed checks of the CPU emulation of the torch_npu ops (vendors.ascend.emulation)."""

from __future__ import annotations

import pytest
import torch

from vendors.ascend.emulation import EmulatedTorchNpu

BF16, F16, F32, I8, I32, I64 = torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.int32, torch.int64


@pytest.fixture
def npu() -> EmulatedTorchNpu:
    return EmulatedTorchNpu("Ascend910B3")


def t(values, dtype=F32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def signed32(word: int) -> int:
    """An unsigned 32-bit pattern as the int32 value holding the same bits."""
    return word - (1 << 32) if word >= 1 << 31 else word


# ---------------------------------------------------------------- SoC


def test_soc_generations() -> None:
    assert EmulatedTorchNpu("Ascend910B3").generation == "A2"
    assert EmulatedTorchNpu("Ascend910_9391").generation == "A3"
    assert EmulatedTorchNpu("Ascend950PR").generation == "A5"
    with pytest.raises(RuntimeError, match="Ascend910B"):
        EmulatedTorchNpu("Ascend310P3")


# ---------------------------------------------------------------- npu_dynamic_quant


def test_dynamic_quant_int8_hand_example(npu) -> None:
    # rowmax 4 -> scale 4/127; x*127/4 = [31.75, -63.5, 15.875, 127] -> round half even [32, -64, 16, 127];
    # the zero row gets scale 0 and data 0.
    y, scale = npu.npu_dynamic_quant(t([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0]], BF16))
    assert y.dtype == I8 and scale.dtype == F32 and scale.shape == (2,)
    assert y.tolist() == [[32, -64, 16, 127], [0, 0, 0, 0]]
    assert scale.tolist() == pytest.approx([4 / 127, 0.0])


def test_dynamic_quant_3d_non_contiguous_and_rows_independent(npu) -> None:
    values = t([[[1.0, 3.0], [-4.0, 2.0], [float("inf"), 1.0]]], F16)
    x = values.transpose(1, 2).contiguous().transpose(1, 2)  # same values, column-major storage
    assert not x.is_contiguous()
    y, scale = npu.npu_dynamic_quant(x)
    assert scale.shape == (1, 3)
    # row 0: scale 3/127, 1*127/3 = 42.33 -> 42; row 1: scale 4/127, 2*127/4 = 63.5 -> 64 (even)
    assert y[0, :2].tolist() == [[42, 127], [-127, 64]]
    assert scale[0, :2].tolist() == pytest.approx([3 / 127, 4 / 127])  # the inf row leaves them alone


def test_dynamic_quant_smooth_scales(npu) -> None:
    # x*smooth = [1*4, 3*1] = [4, 3]: scale 4/127, y = [127, 3*127/4 = 95.25 -> 95]
    y, scale = npu.npu_dynamic_quant(t([[1.0, 3.0]], BF16), smooth_scales=t([4.0, 1.0], BF16))
    assert y.tolist() == [[127, 95]] and scale.tolist() == pytest.approx([4 / 127])
    with pytest.raises(RuntimeError, match="smooth_scales dtype"):
        npu.npu_dynamic_quant(t([[1.0, 3.0]], BF16), smooth_scales=t([4.0, 1.0], F16))


def test_dynamic_quant_group_index(npu) -> None:
    # row 0 uses smooth[0] -> [4, 3] -> [127, 95]; rows 1-2 use smooth[1] -> [1, 3]: scale 3/127, 127/3 = 42.33 -> 42
    x = t([[1.0, 3.0]] * 3, BF16)
    smooth = t([[4.0, 1.0], [1.0, 1.0]], BF16)
    y, scale = npu.npu_dynamic_quant(x, smooth_scales=smooth, group_index=t([1, 3], I32))
    assert y.tolist() == [[127, 95], [42, 127], [42, 127]]
    assert scale.tolist() == pytest.approx([4 / 127, 3 / 127, 3 / 127])
    with pytest.raises(RuntimeError, match="non-decreasing"):
        npu.npu_dynamic_quant(x, smooth_scales=smooth, group_index=t([2, 1], I32))
    with pytest.raises(RuntimeError, match="row count 3"):
        npu.npu_dynamic_quant(x, smooth_scales=smooth, group_index=t([1, 2], I32))


def test_dynamic_quant_int4_packing(npu) -> None:
    # rowmax 7 -> scale 7/7 = 1, y = x. Nibbles (two's complement), low first: 1, F, 2, E, 3, D, 7, 9
    # -> word 0x97D3E2F1 (read from the high nibble down).
    x = t([[1.0, -1.0, 2.0, -2.0, 3.0, -3.0, 7.0, -7.0]], BF16)
    y, scale = npu.npu_dynamic_quant(x, dst_type=torch.quint4x2)
    assert y.dtype == I32 and y.tolist() == [[signed32(0x97D3E2F1)]]
    assert scale.tolist() == [1.0]
    with pytest.raises(RuntimeError, match="divisible by 8"):
        npu.npu_dynamic_quant(t([[1.0] * 12], BF16), dst_type=torch.quint4x2)


def test_dynamic_quant_dtype_rules(npu) -> None:
    x = t([[1.0, -2.0, 0.5, 4.0]], BF16)
    with pytest.raises(RuntimeError, match="Ascend910B3.*int8, quint4x2"):
        npu.npu_dynamic_quant(x, dst_type=torch.float8_e4m3fn)
    y, scale = EmulatedTorchNpu("Ascend950PR").npu_dynamic_quant(x, dst_type=torch.float8_e4m3fn)
    # scale 4/448: x*448/4 = [112, -224, 56, 448], all exact in e4m3
    assert y.dtype == torch.float8_e4m3fn and y.float().tolist() == [[112.0, -224.0, 56.0, 448.0]]
    assert scale.tolist() == pytest.approx([4 / 448])
    with pytest.raises(RuntimeError, match="x dtype"):
        npu.npu_dynamic_quant(t([[1.0, 2.0]], F32))
    with pytest.raises(RuntimeError, match="at least 2 dims"):
        npu.npu_dynamic_quant(t([1.0, 2.0], BF16))
    with pytest.raises(RuntimeError, match="dst_type"):
        npu.npu_dynamic_quant(x, dst_type=torch.uint8)


# ---------------------------------------------------------------- npu_swiglu


def test_swiglu_gate_is_first_half(npu) -> None:
    # A = [1, 2] (gate), B = [3, 4]: silu(1)*3 = 0.7310586*3, silu(2)*4 = 1.7615942*4
    out = npu.npu_swiglu(t([[1.0, 2.0, 3.0, 4.0]]))
    assert out.tolist()[0] == pytest.approx([2.1931758, 7.0463767], rel=1e-6)
    out0 = npu.npu_swiglu(t([[1.0], [2.0], [3.0], [4.0]], BF16), dim=0)
    assert out0.dtype == BF16 and out0.shape == (2, 1)
    with pytest.raises(RuntimeError, match="even"):
        npu.npu_swiglu(t([[1.0, 2.0, 3.0]]))


# ---------------------------------------------------------------- npu_grouped_matmul

X3 = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
W3 = [[[1.0, 1.0], [0.0, 1.0]], [[9.0, 9.0], [9.0, 9.0]], [[2.0, 0.0], [0.0, 2.0]]]
# group 0 = row 0: [1, 2] @ [[1, 1], [0, 1]] = [1, 3]; group 1 empty; group 2 = rows 1-2 doubled
Y3 = [[1.0, 3.0], [6.0, 8.0], [10.0, 12.0]]


@pytest.mark.parametrize(("group_list", "group_list_type"), [([1, 1, 3], 0), ([1, 0, 2], 1)])
def test_gmm_float_single_weight(npu, group_list, group_list_type) -> None:
    for dtype in (F32, BF16):
        (y,) = npu.npu_grouped_matmul(
            [t(X3, dtype)],
            [t(W3, dtype)],
            group_list=t(group_list, I64),
            split_item=3,
            group_type=0,
            group_list_type=group_list_type,
        )
        assert y.dtype == dtype and y.float().tolist() == Y3


def test_gmm_float_list_forms(npu) -> None:
    (y,) = npu.npu_grouped_matmul(
        [t(X3, BF16)], [t(w, BF16) for w in W3], group_list=t([1, 1, 3], I64), split_item=2, group_type=0
    )
    assert y.dtype == BF16 and y.float().tolist() == Y3
    with pytest.raises(RuntimeError, match="only with one x and one weight"):  # float32 needs single tensors
        npu.npu_grouped_matmul([t(X3)], [t(w) for w in W3], group_list=t([1, 1, 3], I64), split_item=2, group_type=0)
    # group_type -1: independent pairs, [1, 2] @ [[1], [1]] = [3]; [[1, 0, 2]] @ I3 = [[1, 0, 2]]
    outs = npu.npu_grouped_matmul(
        [t([[1.0, 2.0]], F16), t([[1.0, 0.0, 2.0]], F16)],
        [t([[1.0], [1.0]], F16), torch.eye(3, dtype=F16)],
        group_type=-1,
    )
    assert [o.tolist() for o in outs] == [[[3.0]], [[1.0, 0.0, 2.0]]]


def test_gmm_empty_m(npu) -> None:
    (y,) = npu.npu_grouped_matmul(
        [torch.zeros(0, 2)], [t(W3)], group_list=t([0, 0, 0], I64), split_item=3, group_type=0
    )
    assert y.shape == (0, 2)


XI = [[1, 2], [3, -1]]
WI = [[[1, 0], [0, 1]], [[2, 1], [0, 3]]]  # row 0 -> [1, 2] @ I = [1, 2]; row 1 -> [3, -1] @ WI[1] = [6, 0]


def test_gmm_int8_per_token_and_per_channel(npu) -> None:
    scale = t([[0.5, 0.25], [1.0, 2.0]])
    # y = acc * scale[g, n] * pts[m]: row 0 [1*0.5*2, 2*0.25*2] = [1, 1]; row 1 [6*1*0.5, 0] = [3, 0]
    # the dtype table pairs them: bf16 scale -> bf16 output, fp32 scale -> fp16 output
    (y,) = npu.npu_grouped_matmul(
        [t(XI, I8)],
        [t(WI, I8)],
        scale=[scale.to(BF16)],
        per_token_scale=[t([2.0, 0.5])],
        group_list=t([1, 2], I64),
        split_item=3,
        group_type=0,
        output_dtype=BF16,
    )
    assert y.dtype == BF16 and y.float().tolist() == [[1.0, 1.0], [3.0, 0.0]]
    # per-channel only: [1*0.5, 2*0.25] = [0.5, 0.5]; [6*1, 0*2] = [6, 0]
    (y,) = npu.npu_grouped_matmul(
        [t(XI, I8)], [t(WI, I8)], scale=[scale], group_list=t([1, 2], I64), split_item=3, group_type=0, output_dtype=F16
    )
    assert y.dtype == F16 and y.float().tolist() == [[0.5, 0.5], [6.0, 0.0]]


def test_gmm_int8_raw_int32_accumulator(npu) -> None:
    (y,) = npu.npu_grouped_matmul(
        [t(XI, I8)], [t(WI, I8)], group_list=t([1, 2], I64), split_item=3, group_type=0, output_dtype=I32
    )
    assert y.dtype == I32 and y.tolist() == [[1, 2], [6, 0]]
    # 127*127 + 127*127 = 32258, no saturation
    (y,) = npu.npu_grouped_matmul([t([[127, 127]], I8)], [t([[127], [127]], I8)], group_type=-1, output_dtype=I32)
    assert y.tolist() == [[32258]]


# x = [1, 2, 3, 4, 5, 6, 7, -8]: nibbles 1..7 and 8 (= -8) -> word 0x87654321.
X_INT4 = signed32(0x87654321)
# weight [K=8, N=8]: column 0 is all -1 (nibble F), plus a 1 at (k, k) for k >= 1 (nibble k set to 1).
W_INT4 = [[0xF]] + [[0xF | (1 << (4 * k))] for k in range(1, 8)]


def test_gmm_a4w4_is_rejected(npu) -> None:
    # int4 x int4 is not a documented ND pairing (int4 weights: weight-only quantization; A4W4 needs an
    # NZ weight with a uint64 scale, not modelled)
    x, w = t([[X_INT4]], I32), t([W_INT4], I32)
    with pytest.raises(RuntimeError, match="int4 x int4"):
        npu.npu_grouped_matmul([x], [w], group_list=t([1], I64), split_item=3, group_type=0, output_dtype=I32)


def test_gmm_w4a16(npu) -> None:
    # weight row 0 = [1..7, -8], row 1 = all 1 (0x11111111); dequant (w + 1) * 0.5:
    # row 0 -> [1, 1.5, 2, 2.5, 3, 3.5, 4, -3.5], row 1 -> 1. y = 1*row0 + 2*row1.
    w = t([[[X_INT4], [0x11111111]]], I32)
    (y,) = npu.npu_grouped_matmul(
        [t([[1.0, 2.0]], BF16)],
        [w],
        antiquant_scale=[torch.full((1, 8), 0.5, dtype=BF16)],
        antiquant_offset=[torch.ones(1, 8, dtype=BF16)],
        group_list=t([1], I64),
        split_item=3,
        group_type=0,
    )
    assert y.dtype == BF16 and y.float().tolist() == [[3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, -1.5]]


def test_gmm_fp8_needs_a5() -> None:
    x, w = t([[1.0, 2.0]]).to(torch.float8_e4m3fn), t([[[1.0], [0.5]]]).to(torch.float8_e4m3fn)
    kwargs = dict(
        scale=[t([[2.0]])],
        per_token_scale=[t([0.5])],
        group_list=t([1], I64),
        split_item=3,
        group_type=0,
        output_dtype=BF16,
    )
    with pytest.raises(RuntimeError, match="Ascend910B3"):
        EmulatedTorchNpu().npu_grouped_matmul([x], [w], **kwargs)
    (y,) = EmulatedTorchNpu("Ascend950PR").npu_grouped_matmul([x], [w], **kwargs)
    assert y.float().tolist() == [[2.0]]  # (1*1 + 2*0.5) * 2 * 0.5


def gmm_error(npu, match, x=None, w=None, exc=RuntimeError, **kwargs) -> None:
    kwargs = {"group_list": t([1, 1, 3], I64), "split_item": 3, "group_type": 0, **kwargs}
    with pytest.raises(exc, match=match):
        npu.npu_grouped_matmul(x if x is not None else [t(X3)], w if w is not None else [t(W3)], **kwargs)


def test_gmm_group_list_validation(npu) -> None:
    gmm_error(npu, r"non-decreasing when group_list_type is 0, got \[3, 1, 3\]", group_list=t([3, 1, 3], I64))
    gmm_error(npu, "non-negative", group_list=t([2, -1, 2], I64), group_list_type=1)
    gmm_error(npu, "sum to at most x's rows 3", group_list=t([2, 1, 2], I64), group_list_type=1)
    gmm_error(npu, "must not exceed x's rows 3", group_list=t([1, 1, 4], I64))
    gmm_error(npu, "length 1", w=[t(W3[:1])], group_list=t([3], I64), group_list_type=1)
    gmm_error(npu, "int64", group_list=t([1, 1, 3], I32))
    gmm_error(npu, "group_list_type", group_list_type=2)
    gmm_error(npu, "split_item", split_item=0)
    gmm_error(npu, "group_type", group_type=1)


def test_gmm_shape_and_dtype_validation(npu) -> None:
    gmm_error(npu, "65536", x=[torch.zeros(1, 65536)], w=[torch.zeros(1, 65536, 2)], group_list=t([1], I64))
    gmm_error(
        npu,
        "1 to 128 tensors, got 129",
        x=[torch.zeros(1, 2)] * 129,
        w=[torch.zeros(2, 2)] * 129,
        group_type=-1,
        group_list=None,
        split_item=0,
    )
    gmm_error(npu, "supported pairings", w=[t(W3, BF16)])
    gmm_error(
        npu,
        "output_dtype",
        x=[t(XI, I8)],
        w=[t(WI, I8)],
        scale=[torch.ones(2, 2)],
        per_token_scale=[torch.ones(2)],
        group_list=t([1, 2], I64),
        output_dtype=F32,
    )
    gmm_error(npu, "not emulated", x=[t(XI, I8)], w=[t(WI, I8)], group_list=t([1, 2], I64), exc=NotImplementedError)
    gmm_error(npu, "not emulated", bias=[torch.zeros(3, 2)], exc=NotImplementedError)
    gmm_error(npu, "offset only supports None", offset=[torch.zeros(3, 2)])


# ---------------------------------------------------------------- npu_moe_init_routing_v2

# tokens 0, 1, 2 with top-2 experts; pairs p = 2*i + k: p0 e2, p1 e0, p2 e1, p3 e2, p4 e0, p5 e2.
# stable sort by expert -> pairs [1, 4, 2, 0, 3, 5], i.e. tokens [0, 2, 1, 0, 1, 2].
X_TOK = [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
IDX = [[2, 0], [1, 2], [0, 2]]


def route(npu, x=None, idx=None, **kwargs):
    kwargs = {"expert_num": 3, "expert_tokens_num_type": 1, "expert_tokens_num_flag": True, **kwargs}
    return npu.npu_moe_init_routing_v2(
        x if x is not None else t(X_TOK), idx if idx is not None else t(IDX, I32), **kwargs
    )


def test_init_routing_gather_and_scatter(npu) -> None:
    ex, row_idx, counts, ex_scale = route(npu, scale=t([10.0, 20.0, 30.0]))
    assert ex.tolist() == [[1.0, 1.0], [3.0, 3.0], [2.0, 2.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    assert row_idx.dtype == I32 and row_idx.tolist() == [3, 0, 2, 4, 1, 5]  # pair p -> row d
    assert counts.dtype == I64 and counts.tolist() == [2, 1, 3]
    assert ex_scale.tolist() == [10.0, 30.0, 20.0, 10.0, 20.0, 30.0]  # scale of each row's token
    _, scatter, _, _ = route(npu, row_idx_type=1)
    assert scatter.tolist() == [1, 4, 2, 0, 3, 5]  # row d -> pair p


def test_init_routing_active_range_and_key_value(npu) -> None:
    # experts [1, 3) of 4: active pairs p2 (e1), p0, p3, p5 (e2) -> rows tokens 1, 0, 1, 2, then zeros
    ex, row_idx, counts, _ = route(npu, expert_num=4, active_expert_range=[1, 3])
    assert ex.tolist() == [[2.0, 2.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [0.0, 0.0], [0.0, 0.0]]
    assert row_idx.tolist() == [1, -1, 0, 2, -1, 3]
    assert counts.tolist() == [1, 3]
    _, scatter, kv, _ = route(npu, expert_num=4, active_expert_range=[1, 3], expert_tokens_num_type=2, row_idx_type=1)
    assert scatter.tolist() == [2, 0, 3, 5, -1, -1]
    assert kv.shape == (4, 2) and kv.tolist() == [[1, 1], [2, 3], [0, 0], [0, 0]]  # (0, 0) ends the pairs
    # active_num caps the rows kept
    ex, row_idx, counts, _ = route(npu, active_num=4)
    assert ex.shape == (4, 2) and row_idx.tolist() == [3, 0, 2, -1, 1, -1] and counts.tolist() == [2, 1, 1]


def test_init_routing_dynamic_int8(npu) -> None:
    # rows in order (token, expert): (0, e0), (2, e0), (1, e1), (0, e2), (1, e2), (2, e2); expert 2 smooths by [2, 0.5].
    # [1, -4]: scale 4/127 -> [31.75 -> 32, -127]; [2, 8]: 8/127 -> [32, 127]; (0, e2) [2, -2] -> [127, -127];
    # (1, e2) [4, 4] -> [127, 127]; token 2 is all zero -> scale 0, data 0.
    x = t([[1.0, -4.0], [2.0, 8.0], [0.0, 0.0]], BF16)
    smooth = t([[1.0, 1.0], [1.0, 1.0], [2.0, 0.5]])
    ex, _, _, ex_scale = route(npu, x=x, scale=smooth, quant_mode=1)
    assert ex.dtype == I8 and ex.tolist() == [[32, -127], [0, 0], [32, 127], [127, -127], [127, 127], [0, 0]]
    assert ex_scale.tolist() == pytest.approx([4 / 127, 0.0, 8 / 127, 2 / 127, 4 / 127, 0.0])
    # experts [1, 3): the smooth scale has one row per local expert, indexed by expert - 1
    ex, _, _, ex_scale = route(npu, x=x, scale=smooth[1:], quant_mode=1, active_expert_range=[1, 3])
    assert ex.tolist() == [[32, 127], [127, -127], [127, 127], [0, 0], [0, 0], [0, 0]]
    assert ex_scale.tolist() == pytest.approx([8 / 127, 2 / 127, 4 / 127, 0.0, 0.0, 0.0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"expert_tokens_num_type": 0}, "only 1 and 2"),
        ({"expert_tokens_num_flag": False}, "expert_tokens_num_flag"),
        ({"quant_mode": 0}, "quant_mode"),
        ({"drop_pad_mode": 1}, "drop_pad_mode"),
        ({"row_idx_type": 2}, "row_idx_type"),
        ({"expert_num": 10241}, "expert_num"),
        ({"expert_num": 5121, "expert_tokens_num_type": 2}, r"\(0, 5120\]"),
        ({"active_expert_range": [2, 1]}, "active_expert_range"),
        ({"active_expert_range": [0, 4]}, "active_expert_range"),
        ({"expert_num": 2}, r"expert ids must be in \[0, 2\)"),
        ({"idx": t(IDX, I64)}, "expert_idx dtype"),
        ({"idx": t(IDX[:2], I32)}, "equal rows"),
        ({"x": t(X_TOK, I8), "quant_mode": 1}, "int8"),
        ({"scale": t([1.0, 2.0])}, "NUM_ROWS"),
    ],
)
def test_init_routing_validation(npu, kwargs, match) -> None:
    with pytest.raises(RuntimeError, match=match):
        route(npu, **kwargs)


# ---------------------------------------------------------------- npu_moe_finalize_routing


def test_finalize_routing_hand_example(npu) -> None:
    rows = t([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    src_to_dst = t([2, 0, 3, 1], I32)  # k-major: (i0,k0)->2, (i1,k0)->0, (i0,k1)->3, (i1,k1)->1
    scales, experts = t([[0.5, 0.25], [1.0, 2.0]]), t([[0, 1], [1, 0]], I32)
    bias, skip1, skip2 = t([[10.0, 10.0], [100.0, 100.0]]), t([[1.0, 1.0]] * 2), t([[0.0, 1.0], [2.0, 0.0]])
    out = npu.npu_moe_finalize_routing(rows, skip1, skip2, bias, scales, src_to_dst, experts)
    # token 0: [1, 2] + 0.5*([5, 6] + 10) + 0.25*([7, 8] + 100) = [35.25, 37]
    # token 1: [3, 1] + 1.0*([1, 2] + 100) + 2.0*([3, 4] + 10) = [130, 131]
    assert out.tolist() == [[35.25, 37.0], [130.0, 131.0]]
    # no scales: weights 1, K from k
    out = npu.npu_moe_finalize_routing(rows, None, None, None, None, src_to_dst, None, k=2)
    assert out.tolist() == [[12.0, 14.0], [4.0, 6.0]]  # [5+7, 6+8], [1+3, 2+4]
    with pytest.raises(RuntimeError, match="skip1 must be None"):
        npu.npu_moe_finalize_routing(rows, skip1, None, None, scales, src_to_dst, None)
    with pytest.raises(RuntimeError, match="export_for_source_row is required"):
        npu.npu_moe_finalize_routing(rows, None, None, bias, scales, src_to_dst, None)
    with pytest.raises(RuntimeError, match=r"\[0, 3\]"):
        npu.npu_moe_finalize_routing(rows, None, None, None, scales, t([2, 0, 3, -1], I32), None)


def test_init_then_finalize_round_trip(npu) -> None:
    gen = torch.Generator().manual_seed(0)
    n, k, num_experts = 5, 2, 4
    x = torch.randn(n, 3, generator=gen)
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(n)]).to(I32)
    w = torch.rand(n, k, generator=gen)
    expanded, row_idx, counts, _ = route(npu, x=x, idx=idx, expert_num=num_experts)
    assert counts.sum().item() == n * k
    src_to_dst = row_idx.view(n, k).t().reshape(-1)  # gather index (p = i*K + k) -> k-major order
    out = npu.npu_moe_finalize_routing(expanded, None, None, None, w, src_to_dst, idx)
    torch.testing.assert_close(out, w.sum(dim=1, keepdim=True) * x)
