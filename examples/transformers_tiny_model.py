"""The transformers drop-in on a tiny Qwen3-MoE built from a config: no download, a few seconds on a CPU.

    pip install 'moe-hal[transformers]'
    python examples/transformers_tiny_model.py

Builds a 2-layer model with random weights, replaces its MoE blocks with `moe.MoELayer`s on the
vendor `hal` selects, checks the logits against transformers' own, generates a few tokens, and
puts the original blocks back.
"""

from __future__ import annotations

from _requires import require

require("transformers", "transformers", "this example")

import torch  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

import moe.integrations.transformers as moe_hf  # noqa: E402


def main() -> int:
    """Build, replace, compare, generate, restore; exit status 1 if the logits differ."""
    print("building a tiny Qwen3-MoE from its config (hidden 64, 8 experts, top-2, random weights)")
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    model = Qwen3MoeForCausalLM(config).eval()
    input_ids = torch.randint(3, 128, (1, 12))
    with torch.no_grad():
        want = model(input_ids).logits

    replaced = moe_hf.replace_moe_blocks(model)  # vendor: HAL_VENDOR or the best available
    print(f"replaced {len(replaced)} MoE blocks: {', '.join(replaced)}")
    layer = model.get_submodule(replaced[0]).moe
    print(f"vendor {layer.vendor.name}, dispatch dtype {layer.plan.resolved} ({layer.plan.source})")
    device = layer.vendor.device
    model.to(device)
    with torch.no_grad():
        got = model(input_ids.to(device)).logits.cpu()
    diff = float((got - want).abs().max() / want.abs().max())
    print(f"logits vs transformers' own: max |diff| / max |logits| = {diff:.2e}")
    generated = model.generate(input_ids.to(device), max_new_tokens=8, do_sample=False)
    print(f"generated: {generated[0, input_ids.shape[1] :].tolist()}")

    restored = moe_hf.restore_moe_blocks(model)
    print(f"restored {len(restored)} original blocks")
    return 0 if diff <= 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
