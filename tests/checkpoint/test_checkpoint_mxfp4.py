"""gpt-oss's MXFP4 experts (`*_blocks`, `*_scales`, biases, gate/up interleaved) loaded as stored: the bytes
become hal's block-32 weights unchanged, worth what transformers' own MXFP4 decoding makes of them, for all
experts, a range of them (expert parallelism) and a shard of the intermediate dimension (tensor parallelism)."""

from __future__ import annotations

import pytest
import torch

from hal import InvalidInput, ScaleLayout
from hal.reference import weight_value
from moe.checkpoint import ExpertCheckpointLoader

E, H, I = 6, 96, 64  # H, I multiples of 32, not of 128
PREFIX = "model.layers.0.mlp"


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for proj, (n, k) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
        tensors[f"{PREFIX}.experts.{proj}_blocks"] = torch.randint(0, 256, (E, n, k // 32, 16), generator=gen).byte()
        tensors[f"{PREFIX}.experts.{proj}_scales"] = torch.randint(118, 130, (E, n, k // 32), generator=gen).byte()
        tensors[f"{PREFIX}.experts.{proj}_bias"] = torch.randn(E, n, generator=gen).to(torch.bfloat16)
    return tensors


def _loader(**kwargs) -> ExpertCheckpointLoader:
    return ExpertCheckpointLoader(
        "mxfp4", E, H, I, activation="swiglu-oai", bias=True, gate_up_interleaved=True, prefix=PREFIX, **kwargs
    )


def _load(tensors: dict[str, torch.Tensor], **kwargs):
    loader = _loader(**kwargs)
    assert all(loader.add(name, t) for name, t in tensors.items())
    return loader.build(), loader


def _transformers_values(tensors: dict[str, torch.Tensor], proj: str) -> torch.Tensor:
    """`[E, K, N]` float64 as transformers decodes gpt-oss's MXFP4 (then de-interleaved into [gate | up])."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    w = mxfp4.convert_moe_packed_tensors(
        tensors[f"{PREFIX}.experts.{proj}_blocks"], tensors[f"{PREFIX}.experts.{proj}_scales"], dtype=torch.float32
    ).double()
    return torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1) if proj == "gate_up_proj" else w


def test_mxfp4_bytes_load_unchanged_and_decode_as_transformers_does():
    tensors = _checkpoint()
    weights, loader = _load(tensors)
    assert loader.scheme().name == "w4a16-mxfp4"
    assert weights.w13.layout is ScaleLayout.BLOCK_32 and weights.w13.scale.dtype == torch.uint8
    assert (weights.w13.data.shape, weights.w2.data.shape) == ((E, H // 2, 2 * I), (E, I // 2, H))
    assert torch.equal(weight_value(weights.w13), _transformers_values(tensors, "gate_up_proj"))
    assert torch.equal(weight_value(weights.w2), _transformers_values(tensors, "down_proj"))
    bias = tensors[f"{PREFIX}.experts.gate_up_proj_bias"].float()
    assert torch.equal(weights.w13_bias, torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1))
    assert torch.equal(weights.w2_bias, tensors[f"{PREFIX}.experts.down_proj_bias"].float())


def test_expert_and_tensor_parallel_shards_are_slices_of_the_whole():
    tensors = _checkpoint(1)
    whole, _ = _load(tensors)
    w13, w2 = weight_value(whole.w13), weight_value(whole.w2)
    for rank in range(2):
        part, _ = _load(tensors, local_experts=range(2, 5), tp_rank=rank, tp_size=2)
        cols = torch.arange(rank * I // 2, (rank + 1) * I // 2)
        assert torch.equal(weight_value(part.w13), w13[2:5][..., torch.cat([cols, I + cols])])
        assert torch.equal(weight_value(part.w2), w2[2:5, rank * I // 2 : (rank + 1) * I // 2])


def test_mxfp4_shapes_and_block_multiples_are_checked_by_name():
    with pytest.raises(InvalidInput, match="multiple of 32 for mxfp4"):
        ExpertCheckpointLoader("mxfp4", E, H, 48, activation="swiglu-oai")
    with pytest.raises(InvalidInput, match="multiple of 32 for mxfp4"):
        ExpertCheckpointLoader("mxfp4", E, H, I, activation="swiglu-oai", tp_size=4)  # 16 channels per rank
    loader = _loader()
    bad = torch.zeros(E, 2 * I, H // 32, 8, dtype=torch.uint8)
    with pytest.raises(InvalidInput, match=r"gate_up_proj_blocks: expected uint8 of shape \[6, 128, 3, 16\]"):
        loader.add(f"{PREFIX}.experts.gate_up_proj_blocks", bad)
    with pytest.raises(InvalidInput, match="missing"):
        loader.build()
