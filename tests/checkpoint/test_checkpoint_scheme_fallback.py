"""FP8 checkpoints on vendors without the FP8 GEMMs they need (the emulated Atlas A2 and A3): read from
safetensors under HF names through `moe.checkpoint`, converted once at load to the vendor's declared
fallback scheme (W8A8-INT8), run within the declared bound of the float64 layer of the checkpoint's own
weights, for every modelled torch-npu version; the explanation shows the chain, the state dict its form,
and the same checkpoint runs unconverted on the cpu vendor."""

from __future__ import annotations

import pytest
import torch

import moe
from hal import InvalidInput
from moe.checkpoint import ExpertCheckpointLoader, load_safetensors
from tests.checkpoint.test_checkpoint_formats import ENCODERS
from tests.support.checkpoint_synthetic import per_expert
from tests.support.moe_reference import reference_moe, relative_error, softmax_topk
from vendors.ascend.emulation.vendor import EmulatedAscendVendor

safetensors = pytest.importorskip("safetensors.torch")

A2, A3 = "Ascend910B3", "Ascend910_9392"
PREFIX = "model.layers.3.mlp"


def _saved(tmp_path, fmt: str, experts: int, hidden: int, intermediate: int):
    ckpt = per_expert(ENCODERS[fmt], hidden, intermediate, experts, PREFIX, seed=5)
    path = tmp_path / "model-00001-of-00001.safetensors"
    safetensors.save_file({k: t.contiguous() for k, t in ckpt.tensors.items()}, str(path))
    loader = ExpertCheckpointLoader(fmt, experts, hidden, intermediate)
    load_safetensors([path], PREFIX, loader)
    return ckpt, loader


def _run(vendor, ckpt, loader, experts: int, hidden: int, intermediate: int, top_k: int, tokens: int):
    layer = moe.MoELayer(hidden, intermediate, experts, top_k, scheme=loader.scheme(), vendor=vendor, environ={})
    layer.load_expert_weights(loader.build())
    g = torch.Generator().manual_seed(9)
    x, logits = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16), torch.randn(tokens, experts, generator=g)
    ids, weights = softmax_topk(logits, top_k)
    error = relative_error(layer(x, logits), reference_moe(x, ids, weights, *ckpt.expected(range(experts))))
    return layer, error


@pytest.mark.parametrize("version", ["2.8", "2.10", "2.13"])
@pytest.mark.parametrize("soc", [A2, A3])
@pytest.mark.parametrize("fmt", ["fp8-block128", "fp8"])
def test_fp8_checkpoint_runs_converted_on_an_npu_without_fp8(tmp_path, fmt, soc, version):
    e, h, i, k = 8, 384, 256, 2
    ckpt, loader = _saved(tmp_path, fmt, e, h, i)
    vendor = EmulatedAscendVendor(soc, torch_npu_version=version)
    layer, error = _run(vendor, ckpt, loader, e, h, i, k, 40)
    source = loader.scheme().name
    assert (layer.scheme.name, layer.source_scheme.name) == ("w8a8-int8", source)
    stored = layer.expert_weights
    assert stored.w13.data.dtype == torch.int8 and stored.w2.data.dtype == torch.int8
    bound = vendor.capabilities().scheme_fallbacks[source].max_error
    assert error <= bound, f"{source} converted on {soc}: {error:.4g} > declared {bound}"
    text = layer.explanation.text()
    assert f"scheme fallback: {source} -> w8a8-int8" in text and "fallback fp8 -> int8" in text
    assert layer.state_dict()._metadata["experts"]["weight_format"] == {"scheme": "w8a8-int8", "converted_from": source}


def test_the_same_checkpoint_runs_unconverted_on_the_cpu_vendor(tmp_path):
    e, h, i, k = 8, 384, 256, 2
    ckpt, loader = _saved(tmp_path, "fp8-block128", e, h, i)
    layer, error = _run("cpu", ckpt, loader, e, h, i, k, 40)
    assert layer.source_scheme is None and layer.scheme.name == "w8a8-fp8-block"
    assert error <= 0.10


def test_a_converted_state_dict_reloads_and_another_form_is_refused(tmp_path):
    e, h, i, k = 8, 384, 256, 2
    ckpt, loader = _saved(tmp_path, "fp8-block128", e, h, i)
    vendor = EmulatedAscendVendor(A3)
    layer, _ = _run(vendor, ckpt, loader, e, h, i, k, 8)
    state = layer.state_dict()
    again = moe.MoELayer(h, i, e, k, scheme="w8a8-fp8-block", vendor=vendor, environ={})
    again.load_state_dict(state)
    x, logits = torch.randn(8, h).to(torch.bfloat16), torch.randn(8, e)
    assert torch.equal(again(x, logits), layer(x, logits))
    native = moe.MoELayer(h, i, e, k, scheme="w8a8-fp8-block", vendor="cpu", environ={})
    with pytest.raises(InvalidInput, match=r"holds w8a8-int8 \(converted at load from w8a8-fp8-block\)"):
        native.load_state_dict(state)


def test_weights_of_a_third_format_are_refused_with_both_names(tmp_path):
    e, h, i, k = 8, 384, 256, 2
    _, loader = _saved(tmp_path, "fp8-block128", e, h, i)
    other = ExpertCheckpointLoader("bf16", e, h, i)
    for name, t in per_expert(ENCODERS["bf16"], h, i, e, PREFIX).tensors.items():
        other.add(name, t)
    layer = moe.MoELayer(h, i, e, k, scheme=loader.scheme(), vendor=EmulatedAscendVendor(A3), environ={})
    with pytest.raises(InvalidInput, match="w8a8-fp8-block or w8a8-int8"):
        layer.load_expert_weights(other.build())


@pytest.mark.slow
@pytest.mark.parametrize("vendor", ["cpu", A2, A3])
def test_a_deepseek_v3_shaped_fp8_checkpoint_runs_within_the_declared_bound(tmp_path, vendor):
    e, h, i, k = 8, 7168, 2048, 8  # DeepSeek-V3's hidden and expert sizes, 8 of its experts
    ckpt, loader = _saved(tmp_path, "fp8-block128", e, h, i)
    chosen = vendor if vendor == "cpu" else EmulatedAscendVendor(vendor)
    layer, error = _run(chosen, ckpt, loader, e, h, i, k, 16)
    if vendor == "cpu":
        assert layer.source_scheme is None and error <= 0.10
    else:
        assert layer.scheme.name == "w8a8-int8"
        assert error <= chosen.capabilities().scheme_fallbacks["w8a8-fp8-block"].max_error
