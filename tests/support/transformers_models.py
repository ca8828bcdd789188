"""Small random-weight transformers MoE models, built from their configs (no download).

Every family has 2 MoE layers (DeepSeek-V3 and Qwen3-MoE also a dense one, to show it is
left alone), hidden size 64, 8-16 experts, top-1..top-4 and a 128-token vocabulary. All
weights are drawn nonzero, biases and DeepSeek-V3's correction bias included, so that every
feature the drop-in reads changes the output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

VOCAB = 128
HIDDEN = 64
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def _qwen3_moe(t: Any) -> Any:
    return t.Qwen3MoeConfig(
        **_COMMON,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=40,
        num_hidden_layers=3,
        mlp_only_layers=[0],
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )


def _mixtral(t: Any) -> Any:
    return t.MixtralConfig(
        **_COMMON, head_dim=16, intermediate_size=48, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2
    )


def _olmoe(t: Any) -> Any:
    return t.OlmoeConfig(
        **{**_COMMON, "num_key_value_heads": 4},
        intermediate_size=24,
        num_hidden_layers=2,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=False,
    )


def _qwen2_moe(t: Any) -> Any:
    return t.Qwen2MoeConfig(
        **_COMMON,
        intermediate_size=96,
        moe_intermediate_size=40,
        shared_expert_intermediate_size=72,
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=False,
    )


def _deepseek_v3(t: Any) -> Any:
    return t.DeepseekV3Config(
        **{**_COMMON, "num_key_value_heads": 4},
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=16,
        n_shared_experts=2,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def _gpt_oss(t: Any) -> Any:
    return t.GptOssConfig(
        **_COMMON,
        head_dim=16,
        intermediate_size=40,
        num_hidden_layers=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )


def _llama4_text(t: Any) -> Any:
    return t.Llama4TextConfig(
        **_COMMON,
        head_dim=16,
        intermediate_size=40,
        intermediate_size_mlp=96,
        num_hidden_layers=2,
        num_local_experts=8,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        attention_chunk_size=64,
    )


#: family (its transformers model type) -> its config builder
CONFIGS: dict[str, Callable[[Any], Any]] = {
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "qwen2_moe": _qwen2_moe,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
    "llama4_text": _llama4_text,
}


def build_model(
    family: str, dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu", **overrides: Any
) -> torch.nn.Module:
    """A small causal LM of `family` with random nonzero weights, in eval mode, eager attention;
    `overrides` set config fields (e.g. a real model's MoE sizes)."""
    import transformers

    config = CONFIGS[family](transformers)
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomize(model)
    model = model.to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # always 20 new tokens
    model.generation_config.pad_token_id = 0
    return model


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    generator = torch.Generator().manual_seed(1234)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not torch.is_floating_point(tensor) or "rotary" in name or "inv_freq" in name:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name:  # RMSNorm weights around one
            value = 1.0 + 0.1 * torch.randn(tensor.shape, generator=generator)
        elif leaf == "e_score_correction_bias":  # large enough to change DeepSeek-V3's choices
            value = 0.3 * torch.randn(tensor.shape, generator=generator)
        elif "bias" in leaf or tensor.dim() == 1:
            value = 0.1 * torch.randn(tensor.shape, generator=generator)
        elif "embed" in name:
            value = torch.randn(tensor.shape, generator=generator)
        else:  # matrices: unit-variance outputs whatever way the fan-in lies
            fan_in = min(tensor.shape[-1], tensor.shape[-2])
            value = torch.randn(tensor.shape, generator=generator) / math.sqrt(fan_in)
        tensor.copy_(value.to(tensor.dtype))
