"""gpt-oss with MXFP4 experts through the transformers drop-in: a small gpt-oss from transformers' own config,
its experts saved in gpt-oss's MXFP4 layout (`*_blocks`, `*_scales`, biases), decoded by transformers' own MXFP4
code for transformers' forward, and loaded as stored through `moe.checkpoint` into the drop-in's layers
(`w4a16-mxfp4`: MXFP4 weights, bf16 activations). A bf16 model is held to transformers' own bf16 accuracy
against the fp32 model of the same MXFP4 values, as the other drop-in models are."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow  # builds transformers models

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import hal  # noqa: E402
import moe.integrations.transformers as moe_hf  # noqa: E402
from moe.checkpoint import ExpertCheckpointLoader, load_safetensors  # noqa: E402
from tests.support.gpt_oss_mxfp4 import expert_modules, load_as_transformers_does, mxfp4_checkpoint  # noqa: E402
from tests.support.transformers_models import VOCAB, build_model  # noqa: E402

#: a bf16 model's mean error against the fp32 model, over transformers' own bf16 model's (as the other models)
BF16_MEAN_RATIO = 1.5
#: I a multiple of 32 (mxfp4 blocks along the down projection's K), not of 128
SIZES = dict(intermediate_size=96, num_local_experts=16, num_experts_per_tok=4)


def _prompt() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(11))


@torch.no_grad()
def test_an_mxfp4_gpt_oss_loaded_through_moe_checkpoint_matches_transformers(tmp_path):
    from safetensors.torch import save_file

    tensors = mxfp4_checkpoint(build_model("gpt_oss", **SIZES))
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    ids = _prompt()
    exact = load_as_transformers_does(build_model("gpt_oss", **SIZES), tensors)(ids).logits.double()
    model = load_as_transformers_does(build_model("gpt_oss", dtype=torch.bfloat16, **SIZES), tensors)
    theirs = model(ids).logits.double()

    config = model.config
    names = moe_hf.replace_moe_blocks(model, vendor=hal.get_vendor("cpu"), scheme="w4a16-mxfp4", environ={})
    assert names and set(names) == {n.removesuffix(".experts") for n in expert_modules(build_model("gpt_oss"))}
    for name in names:
        layer = model.get_submodule(name).moe
        loader = ExpertCheckpointLoader(
            "mxfp4",
            config.num_local_experts,
            config.hidden_size,
            config.intermediate_size,
            activation=layer.activation,
            bias=True,
            gate_up_interleaved=True,
        )
        assert load_safetensors([path], name, loader)
        stored = loader.build()
        quantized = layer.experts.weights  # the drop-in's own weights: the block's MXFP4 values quantized again
        for ours, theirs_w in ((quantized.w13, stored.w13), (quantized.w2, stored.w2)):
            assert torch.equal(hal.reference.weight_value(ours), hal.reference.weight_value(theirs_w))
        assert torch.equal(quantized.w13_bias, stored.w13_bias) and torch.equal(quantized.w2_bias, stored.w2_bias)
        layer.load_expert_weights(stored)  # the checkpoint's bytes as stored
        assert str(layer.plan.resolved) == "bf16" and layer.scheme.name == "w4a16-mxfp4"
        assert torch.equal(layer.experts.weights.w13.data, stored.w13.data)
    ours = model(ids).logits
    assert ours.dtype == torch.bfloat16
    # bf16 activations (and bf16 rounding flipping some routing choices) in both; on average alike
    ratio = float((ours.double() - exact).abs().mean() / (theirs - exact).abs().mean())
    assert ratio <= BF16_MEAN_RATIO, f"mean error {ratio:.3g} times transformers' own bf16 model's"


def test_the_mxfp4_blocks_hold_the_experts_at_four_bits():
    model = build_model("gpt_oss", **SIZES)
    tensors = mxfp4_checkpoint(model)
    experts = next(iter(expert_modules(model).values()))
    e, h, two_i = experts.gate_up_proj.shape
    blocks = next(t for n, t in tensors.items() if n.endswith("gate_up_proj_blocks"))
    assert blocks.shape == (e, two_i, h // 32, 16) and blocks.dtype == torch.uint8
    assert blocks.numel() * 2 == experts.gate_up_proj.numel()
