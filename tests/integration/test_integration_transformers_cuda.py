"""The transformers drop-in on the CUDA vendor (GPU only): every family's small model equal to
transformers' own in fp32 with identical greedy generations, and Qwen3-MoE / DeepSeek-V3 at
their real MoE sizes in bf16, as accurate as transformers' own bf16 model."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("transformers")

import moe.integrations.transformers as moe_hf  # noqa: E402
from tests.support.transformers_models import CONFIGS, VOCAB, build_model  # noqa: E402

#: A real model's MoE sizes (DeepSeek-V3: 32 of its 256 experts, one expert-parallel rank's share of 8).
REAL_SIZES = {
    "qwen3_moe": dict(
        hidden_size=2048,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=2,
        mlp_only_layers=[],
    ),
    "deepseek_v3": dict(
        hidden_size=7168,
        moe_intermediate_size=2048,
        n_routed_experts=32,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        n_shared_experts=1,
        num_hidden_layers=2,
        first_k_dense_replace=1,
    ),
}


def _prompt(batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(7)).cuda()


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


@pytest.mark.parametrize("family", list(CONFIGS))
def test_fp32_logits_and_generation_equal_transformers_on_cuda(family):
    model = build_model(family, device="cuda")
    ids = _prompt()
    want = _logits(model, ids)
    with torch.no_grad():
        want_tokens = model.generate(ids, do_sample=False, max_new_tokens=20)
    moe_hf.replace_moe_blocks(model, vendor="cuda")
    got = _logits(model, ids)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    with torch.no_grad():
        assert torch.equal(model.generate(ids, do_sample=False, max_new_tokens=20), want_tokens)


@pytest.mark.parametrize("family", list(REAL_SIZES))
def test_real_moe_sizes_in_bf16_are_as_accurate_as_transformers(family):
    ids = _prompt(2, 33)
    exact = _logits(build_model(family, device="cuda", **REAL_SIZES[family]), ids).double()
    model = build_model(family, dtype=torch.bfloat16, device="cuda", **REAL_SIZES[family])
    theirs = _logits(model, ids).double()
    names = moe_hf.replace_moe_blocks(model, vendor="cuda")
    assert names and all(model.get_submodule(n).moe.vendor.name == "cuda" for n in names)
    ours = _logits(model, ids).double()
    ratio = float((ours - exact).abs().mean() / (theirs - exact).abs().mean())
    print(f"\nHF-CUDA {family}: mean |ours - fp32| / mean |transformers bf16 - fp32| = {ratio:.3f}")
    assert ratio <= 1.5
