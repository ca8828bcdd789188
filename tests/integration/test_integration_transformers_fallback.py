"""The transformers drop-in with an FP8 scheme on an NPU without FP8 GEMMs (the emulated Atlas A2 and A3):
every DeepSeek-V3 MoE block (routed and shared experts) converted once at load to W8A8-INT8, the model's
logits within the vendor's declared bound of the same model whose expert weights are their FP8 values (the
original FP8 model, computed by transformers in fp32); on the cpu vendor the same blocks run as FP8, within
the scheme's own layer bound."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import moe  # noqa: E402
from conformance.tolerances import layer_tolerance  # noqa: E402
from hal import get_vendor  # noqa: E402
import moe.integrations.transformers as moe_hf  # noqa: E402
from moe.scheme_conversion import as_stored  # noqa: E402
from tests.support.transformers_models import build_model  # noqa: E402
from vendors.ascend.emulation.vendor import EmulatedAscendVendor  # noqa: E402

SIZES = dict(hidden_size=256, moe_intermediate_size=128)  # hidden a multiple of 128 (fp8 blocks)


@torch.no_grad()
def _as_fp8_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every MoE block's expert weights replaced by their value as FP8 blocks store them."""
    source = moe.make_scheme("w8a8-fp8-block")
    for module in model.modules():
        if type(module).__name__ != "DeepseekV3MoE":
            continue
        experts = module.experts  # fused, out-in: gate_up_proj [E, 2I, H], down_proj [E, H, I]
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(experts, name)
            w.copy_(as_stored(source, w.transpose(1, 2)).transpose(1, 2))
        shared = module.shared_experts
        gate_up = torch.cat([shared.gate_proj.weight.T, shared.up_proj.weight.T], dim=1)[None]  # [1, H, 2Is]
        gate, up = as_stored(source, gate_up)[0].chunk(2, dim=1)
        shared.gate_proj.weight.copy_(gate.T)
        shared.up_proj.weight.copy_(up.T)
        shared.down_proj.weight.copy_(as_stored(source, shared.down_proj.weight.T[None])[0].T)
    return model


@pytest.mark.parametrize("soc", ["Ascend910B3", "Ascend910_9392", "cpu"])
def test_fp8_deepseek_runs_converted_through_the_drop_in(soc):
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = _as_fp8_model(build_model("deepseek_v3", **SIZES))(input_ids=ids).logits.double()
    model = build_model("deepseek_v3", **SIZES)
    vendor = get_vendor("cpu") if soc == "cpu" else EmulatedAscendVendor(soc)
    names = moe_hf.replace_moe_blocks(model, vendor=vendor, scheme="w8a8-fp8-block", environ={})
    layers = [model.get_submodule(n).moe for n in names]
    runs = ("w8a8-fp8-block", None) if soc == "cpu" else ("w8a8-int8", "w8a8-fp8-block")
    assert layers and all((m.scheme.name, getattr(m.source_scheme, "name", None)) == runs for m in layers)
    with torch.no_grad():
        got = model(input_ids=ids).logits.double()
    error = float((got - want).norm() / want.norm())
    if soc == "cpu":  # computed as FP8: the layer bound of the scheme itself
        bound = layer_tolerance("w8a8-fp8-block", "fp8")
    else:
        bound = vendor.capabilities().scheme_fallbacks["w8a8-fp8-block"].max_error
    assert error <= bound, f"logits {error:.4g} from the FP8 model's, declared bound {bound}"


@pytest.mark.slow
def test_a_deepseek_v3_shaped_fp8_model_runs_converted_through_the_drop_in():
    real = dict(
        hidden_size=7168,
        moe_intermediate_size=2048,
        intermediate_size=2048,
        n_routed_experts=8,
        num_experts_per_tok=8,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        num_hidden_layers=2,
    )
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = _as_fp8_model(build_model("deepseek_v3", **real))(input_ids=ids).logits.double()
    model = build_model("deepseek_v3", **real)
    vendor = EmulatedAscendVendor("Ascend910_9392")
    names = moe_hf.replace_moe_blocks(model, vendor=vendor, scheme="w8a8-fp8-block", environ={})
    assert [model.get_submodule(n).moe.scheme.name for n in names] == ["w8a8-int8"]
    with torch.no_grad():
        got = model(input_ids=ids).logits.double()
    error = float((got - want).norm() / want.norm())
    assert error <= vendor.capabilities().scheme_fallbacks["w8a8-fp8-block"].max_error
