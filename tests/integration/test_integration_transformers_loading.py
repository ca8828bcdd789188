"""The transformers drop-in checks every tensor of every MoE block before it replaces any: a block's tensor
holding inf or NaN (routed or shared experts, their biases, the shared-expert gate, the router) is refused
by its key, and the model is left with all its own blocks."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")

import hal  # noqa: E402
import moe.integrations.transformers as moe_hf  # noqa: E402
from tests.support.transformers_models import build_model  # noqa: E402


@pytest.mark.parametrize("vendor", ["cpu", "ascend-emulated"])
@pytest.mark.parametrize("part", ["experts", "shared_expert.", "shared_expert_gate", "gate"])
def test_a_non_finite_tensor_of_any_block_is_refused_by_key_and_no_block_is_replaced(vendor, part):
    model = build_model("qwen2_moe")
    _, architecture = moe_hf.architecture_of(model)
    blocks = [name for name, m in model.named_modules() if architecture.matches(m)]
    last = model.get_submodule(blocks[-1])
    key, tensor = next((k, t) for k, t in last.named_parameters() if k.startswith(part))
    with torch.no_grad():
        tensor.view(-1)[1] = float("nan")
    with pytest.raises(hal.InvalidInput, match=re.escape(f"{blocks[-1]}.{key}: expected finite values")):
        moe_hf.replace_moe_blocks(model, vendor=hal.get_vendor(vendor, environ={}))
    assert not any(isinstance(m, moe_hf.MoEBlock) for m in model.modules())
