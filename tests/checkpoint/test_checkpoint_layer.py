"""A layer loaded from each checkpoint format (`MoELayer.load_expert_weights`) against the float64 MoE of
the checkpoint's dequantized weights; and the static-scale fp8 scheme `W8A8Fp8`."""

from __future__ import annotations

import pytest
import torch

import moe
from conformance.tolerances import layer_tolerance
from hal import DispatchConfig, DispatchDtype, InvalidInput, QuantizedTensor, ScaleLayout, get_vendor
from moe.checkpoint import ExpertCheckpointLoader
from tests.support.checkpoint_synthetic import fused_checkpoint, per_expert
from tests.support.moe_reference import reference_moe, relative_error, softmax_topk
from tests.checkpoint.test_checkpoint_formats import ENCODERS

E, H, I, TOP_K, TOKENS = 8, 160, 128, 3, 40


def load(fmt: str, ckpt, **kwargs) -> ExpertCheckpointLoader:
    loader = ExpertCheckpointLoader(fmt, ckpt.num_experts, ckpt.hidden, ckpt.intermediate, **kwargs)
    for name, t in ckpt.tensors.items():
        loader.add(name, t)
    return loader


def inputs(seed: int, hidden: int = H, experts: int = E, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(TOKENS, hidden, generator=g).to(dtype), torch.randn(TOKENS, experts, generator=g)


@pytest.mark.parametrize("fmt", list(ENCODERS))
def test_a_layer_of_each_format_matches_the_float64_moe_of_its_checkpoint(fmt):
    ckpt = per_expert(ENCODERS[fmt], H, I, E, "model.layers.0.mlp", seed=11)
    loader = load(fmt, ckpt)
    dispatch = DispatchConfig(dtype="bf16") if fmt == "nvfp4" else None  # the CPU vendor carries no nvfp4
    scheme = loader.scheme()
    layer = moe.MoELayer(H, I, E, TOP_K, scheme=scheme, dispatch=dispatch, vendor="cpu", environ={})
    layer.load_expert_weights(loader.build())
    dtype = {"fp16": torch.float16, "fp32": torch.float32}.get(fmt, torch.bfloat16)
    x, logits = inputs(3, dtype=dtype)
    y = layer(x, logits)
    ids, weights = softmax_topk(logits, TOP_K)
    ref = reference_moe(x, ids, weights, *ckpt.expected(range(E)))
    bound = layer_tolerance(scheme.name, str(layer.plan.resolved))
    assert relative_error(y, ref) <= bound


def gated_oai_moe(x, ids, weights, w13, w2, b13, b2, alpha=1.702, limit=7.0):
    """float64 gpt-oss experts: `(clamp(up) + 1) * g * sigmoid(alpha * g)`, g = gate clamped above, biases."""
    inter = w2.shape[1]
    out = torch.zeros(x.shape[0], w2.shape[2], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = x[t].double() @ w13[e] + b13[e]
            gate, up = h[:inter].clamp(max=limit), h[inter:].clamp(-limit, limit)
            out[t] += float(weights[t, j]) * (((up + 1) * gate * torch.sigmoid(alpha * gate)) @ w2[e] + b2[e])
    return out


def test_a_gpt_oss_layer_from_its_fused_interleaved_tensors():
    ckpt, tensors = fused_checkpoint(E, 96, 64, layout="gpt-oss", bias=True)
    loader = ExpertCheckpointLoader(
        "bf16", E, 96, 64, activation="swiglu-oai", bias=True, fused_layout="in-out", gate_up_interleaved=True
    )
    for name, t in tensors.items():
        loader.add(name, t)
    layer = moe.MoELayer(96, 64, E, TOP_K, activation="swiglu-oai", bias=True, vendor="cpu", environ={})
    layer.load_expert_weights(loader.build())
    x, logits = inputs(5, hidden=96)
    ids, weights = softmax_topk(logits, TOP_K)
    ref = gated_oai_moe(x, ids, weights, *ckpt.expected(range(E)), *ckpt.expected_biases(range(E)))
    assert relative_error(layer(x, logits), ref) <= layer_tolerance("unquantized", "bf16")


def test_w8a8_fp8_static_input_scales_quantize_with_the_fixed_scale():
    x = torch.tensor([[1.0, -2.0, 900.0, 0.0]])
    q = moe.schemes.w8a8_fp8.static_fp8(x, 0.5)
    assert q.dtype is DispatchDtype.FP8 and q.layout is ScaleLayout.PER_TOKEN
    assert q.scale.tolist() == [0.5]
    assert q.data.to(torch.float32).tolist() == [[2.0, -4.0, 448.0, 0.0]]  # x / s, clamped to +-448


def test_w8a8_fp8_layers_static_and_dynamic_match_the_float64_moe():
    ckpt = per_expert(ENCODERS["fp8"], H, I, E, "model.layers.0.mlp", seed=2)
    x, logits = inputs(9)
    ids, weights = softmax_topk(logits, TOP_K)
    w13, w2 = ckpt.expected(range(E))
    ref = reference_moe(x, ids, weights, w13, w2)
    gate, up = (x.double() @ w13).chunk(2, dim=-1)  # every expert's intermediate, for its calibrated amax
    intermediate_amax = float((gate * torch.sigmoid(gate) * up).abs().max())
    for static in (True, False):
        loader = load("fp8", ckpt, static_input_scale=static)
        scheme = loader.scheme()
        assert (scheme.input_scale is not None) is static
        if static:  # calibrated scales: the input's and the intermediate's amax over 448
            scheme = moe.W8A8Fp8(float(x.abs().max()) / 448, intermediate_amax / 448)
        layer = moe.MoELayer(H, I, E, TOP_K, scheme=scheme, vendor="cpu", environ={})
        layer.load_expert_weights(loader.build())
        assert layer.plan.resolved is DispatchDtype.FP8 and layer.plan.scale_layout is ScaleLayout.PER_TOKEN
        assert relative_error(layer(x, logits), ref) <= layer_tolerance("w8a8-fp8", "fp8")


def test_w8a8_fp8_static_scale_reaches_both_gemms():
    scheme = moe.W8A8Fp8(input_scale=0.25, intermediate_scale=0.125)
    vendor = get_vendor("cpu")
    rows = torch.randn(5, 32)
    first = scheme.first_operand(vendor, vendor.quantize(rows, DispatchDtype.BF16), None)
    second = scheme.second_operand(vendor, rows, None)
    assert isinstance(first, QuantizedTensor) and first.scale.unique().tolist() == [0.25]
    assert isinstance(second, QuantizedTensor) and second.scale.unique().tolist() == [0.125]
    dynamic = moe.W8A8Fp8().gemm_operand(vendor, rows)  # no static scale: per token
    assert torch.allclose(dynamic.scale, rows.abs().amax(dim=1) / 448)


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), True, "1"])
def test_w8a8_fp8_refuses_a_bad_scale(value):
    with pytest.raises(InvalidInput, match="input_scale"):
        moe.W8A8Fp8(input_scale=value)


def test_w8a8_fp8_is_a_known_scheme():
    assert moe.make_scheme("w8a8-fp8").gemm_kind().value == "fp8-rowwise"
    assert isinstance(moe.make_scheme("fp8-rowwise"), moe.W8A8Fp8)
