"""A transformers drop-in: compute a loaded model's MoE blocks with `moe.MoELayer`.

    import moe.integrations.transformers as moe_hf
    model = AutoModelForCausalLM.from_pretrained(...)
    replaced = moe_hf.replace_moe_blocks(model, vendor="cuda")   # ["model.layers.0.mlp", ...]
    model.generate(...)                                           # the experts now run through hal
    moe_hf.restore_moe_blocks(model)                              # the original blocks are back

Each replaced block becomes a `MoEBlock` with the HF block's forward signature and return
structure, its router logits computed from the block's own router weight and its experts
in a `MoELayer` built from the block's own tensors. Which blocks and how to read them is
one `Architecture` entry per model type (`ARCHITECTURES`: Qwen3-MoE, Qwen2-MoE, OLMoE,
Mixtral, DeepSeek-V3, gpt-oss, Llama-4). Needs the `[transformers]` extra; `moe` never
imports this package.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("transformers") is None:  # pragma: no cover - only without the extra
    raise ImportError("moe.integrations.transformers needs transformers: pip install 'moe-hal[transformers]'")

from moe.integrations.transformers.architectures import (
    ARCHITECTURES,
    Architecture,
    ExpertLayout,
    ExpertTensors,
    Returns,
    SharedTensors,
    deepseek_v3_router,
    glu_of,
    gpt_oss_activation,
    llama4_router,
    read_experts,
    softmax_topk,
)
from moe.integrations.transformers.block import MoEBlock
from moe.integrations.transformers.replace import architecture_of, build_layer, replace_moe_blocks, restore_moe_blocks

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "ExpertLayout",
    "ExpertTensors",
    "Returns",
    "SharedTensors",
    "deepseek_v3_router",
    "glu_of",
    "gpt_oss_activation",
    "llama4_router",
    "read_experts",
    "softmax_topk",
    "MoEBlock",
    "architecture_of",
    "build_layer",
    "replace_moe_blocks",
    "restore_moe_blocks",
]
