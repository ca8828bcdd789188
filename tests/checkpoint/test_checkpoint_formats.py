"""Each checkpoint format, written to safetensors in its own on-disk layout, loaded through
`moe.checkpoint` with expert and tensor parallelism, equals its float64 dequantized value."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from hal import ScaleLayout
from hal.reference import dequantize_weight, weight_value
from moe import NvFp4, Unquantized, W8A8Fp8, W8A8Fp8Block, W8A8Int8
from moe.checkpoint import ExpertCheckpointLoader, load_safetensors
from tests.support.checkpoint_synthetic import (
    MIXTRAL,
    decode_nvfp4,
    encode_float,
    encode_fp8,
    encode_fp8_block,
    encode_int8,
    encode_nvfp4,
    per_expert,
)

PREFIX = "model.layers.3.mlp"
E, H, I = 6, 320, 256  # H is no multiple of 128
LOCAL = range(2, 5)  # expert parallelism: this rank holds experts 2, 3, 4


def input_scale(e: int, p: str) -> float:
    """A different static activation scale per expert and projection."""
    return (2.0 + e + (3 if p == "down" else 0.5 * (p == "up"))) / 448


ENCODERS = {
    "bf16": lambda w, e, p: encode_float(w, torch.bfloat16),
    "fp16": lambda w, e, p: encode_float(w, torch.float16),
    "fp32": lambda w, e, p: encode_float(w, torch.float32),
    "fp8-block128": lambda w, e, p: encode_fp8_block(w),
    "fp8": lambda w, e, p: encode_fp8(w, per_channel=False, input_scale=input_scale(e, p)),
    "int8": lambda w, e, p: encode_int8(w),
    "nvfp4": lambda w, e, p: encode_nvfp4(w, input_scale(e, p)),
}
LAYOUTS = {
    "bf16": ScaleLayout.NONE,
    "fp16": ScaleLayout.NONE,
    "fp32": ScaleLayout.NONE,
    "fp8-block128": ScaleLayout.BLOCK_128X128,
    "fp8": ScaleLayout.PER_CHANNEL,
    "int8": ScaleLayout.PER_CHANNEL,
    "nvfp4": ScaleLayout.BLOCK_16,
}
SCHEMES = {
    "bf16": Unquantized,
    "fp16": Unquantized,
    "fp32": Unquantized,
    "fp8-block128": W8A8Fp8Block,
    "fp8": W8A8Fp8,
    "int8": W8A8Int8,
    "nvfp4": NvFp4,
}


def write(tmp_path, tensors: dict[str, torch.Tensor], shards: int = 2) -> list:
    """The tensors in `shards` safetensors files, as checkpoints are split."""
    names = sorted(tensors)
    paths = []
    for s in range(shards):
        path = tmp_path / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in names[s::shards]}, str(path))
        paths.append(path)
    return paths


def assert_weights(built, expected13: torch.Tensor, expected2: torch.Tensor, fmt: str) -> None:
    """The built weights' float64 value equals the reference (nvfp4: up to 1 / weight_scale_2 in fp32)."""
    for w, ref in ((built.w13, expected13), (built.w2, expected2)):
        assert w.layout is LAYOUTS[fmt]
        value = weight_value(w)
        if fmt == "nvfp4":
            torch.testing.assert_close(value, ref, rtol=2.0**-23, atol=0)
        else:
            assert torch.equal(value, ref)
        torch.testing.assert_close(dequantize_weight(w).double(), ref, rtol=2.0**-22, atol=1e-30)


@pytest.mark.parametrize("fmt", list(ENCODERS))
def test_each_format_loads_this_ranks_experts_and_shard(tmp_path, fmt):
    ckpt = per_expert(ENCODERS[fmt], H, I, E, PREFIX, seed=len(fmt))
    paths = write(tmp_path, ckpt.tensors)
    for tp_rank in range(2):
        loader = ExpertCheckpointLoader(fmt, E, H, I, local_experts=LOCAL, tp_rank=tp_rank, tp_size=2)
        fed = load_safetensors(paths, PREFIX, loader)
        assert {int(n.split(".experts.")[1].split(".")[0]) for n in fed if not n.endswith("input_scale")} == set(LOCAL)
        assert loader.missing() == []
        built = loader.build()
        assert (built.num_experts, built.hidden_size, built.intermediate_size) == (len(LOCAL), H, I // 2)
        assert_weights(built, *ckpt.expected(LOCAL, tp_rank, 2), fmt)
        scheme = loader.scheme()
        assert isinstance(scheme, SCHEMES[fmt])
    if fmt == "nvfp4":
        gate_up = max(v for (e, p), v in ckpt.input_scales.items() if p != "down")  # every expert's, not only 2-4
        down = max(v for (e, p), v in ckpt.input_scales.items() if p == "down")
        assert scheme.input_global_scale == 1 / gate_up and scheme.intermediate_global_scale == 1 / down
        assert float(built.input_global_scale) == pytest.approx(1 / gate_up, rel=2**-23)
        assert built.w13.global_scale.shape == (len(LOCAL), I)  # gate and up have their own weight_scale_2
        assert built.w2.global_scale.shape == (len(LOCAL),)
    if fmt == "fp8":
        assert scheme.input_scale == max(v for (e, p), v in ckpt.input_scales.items() if p != "down")
        assert scheme.intermediate_scale == max(v for (e, p), v in ckpt.input_scales.items() if p == "down")


def test_the_nvfp4_encoder_here_agrees_with_its_decoder():
    stored, value = encode_nvfp4(torch.randn(8, 64, dtype=torch.float64), 0.01)
    assert torch.equal(decode_nvfp4(stored), value)
    assert stored["weight"].dtype == torch.uint8 and stored["weight"].shape == (8, 32)
    assert stored["weight_scale"].dtype == torch.float8_e4m3fn and stored["weight_scale"].shape == (8, 4)


def test_nvfp4_gate_and_up_with_one_weight_scale_2_keep_a_global_scale_per_expert(tmp_path):
    def encode(w, e, p):
        return encode_nvfp4(w, 0.01, weight_scale_2=0.5 / 2688 * (1 + e))

    ckpt = per_expert(encode, 64, 32, 2, PREFIX)
    loader = ExpertCheckpointLoader("nvfp4", 2, 64, 32)
    load_safetensors(write(tmp_path, ckpt.tensors, 1), PREFIX, loader)
    built = loader.build()
    assert built.w13.global_scale.shape == (2,)
    assert_weights(built, *ckpt.expected(range(2)), "nvfp4")


@pytest.mark.parametrize("scale_shape", [(), (1,), None, "column"])
def test_fp8_per_tensor_and_per_channel_scales_become_per_channel(tmp_path, scale_shape):
    per_channel = scale_shape in (None, "column")
    shape = {None: None, "column": (-1, 1)}.get(scale_shape, scale_shape)  # type: ignore[arg-type]

    def encode(w, e, p):
        return encode_fp8(w, per_channel=per_channel, scale_shape=shape)

    ckpt = per_expert(encode, 96, 64, 3, PREFIX, seed=5)
    loader = ExpertCheckpointLoader("fp8", 3, 96, 64, tp_rank=1, tp_size=2)
    load_safetensors(write(tmp_path, ckpt.tensors, 1), PREFIX, loader)
    built = loader.build()
    assert built.w13.scale.shape == (3, 64) and built.w2.scale.shape == (3, 96)
    assert_weights(built, *ckpt.expected(range(3), 1, 2), "fp8")
    assert isinstance(loader.scheme(), W8A8Fp8) and loader.scheme().input_scale is None  # dynamic


def test_int8_bf16_scales_widen_exactly_and_mixtral_names_map(tmp_path):
    ckpt = per_expert(
        lambda w, e, p: encode_int8(w, torch.bfloat16), 48, 40, 4, "model.layers.0.block_sparse_moe", names=MIXTRAL
    )
    loader = ExpertCheckpointLoader("w8a8-int8", 4, 48, 40, local_experts=range(2, 4))
    fed = load_safetensors(write(tmp_path, ckpt.tensors, 1), "model.layers.0.block_sparse_moe", loader)
    assert all(".w1." in n or ".w2." in n or ".w3." in n for n in fed) and len(fed) == 2 * 3 * 2
    assert_weights(loader.build(), *ckpt.expected(range(2, 4)), "int8")


def test_biases_are_fp32_and_the_down_bias_is_tensor_parallel_rank_zeros(tmp_path):
    ckpt = per_expert(ENCODERS["bf16"], 32, 24, 3, PREFIX, bias=True)
    paths = write(tmp_path, ckpt.tensors, 1)
    for rank in range(2):
        loader = ExpertCheckpointLoader("bf16", 3, 32, 24, bias=True, tp_rank=rank, tp_size=2)
        load_safetensors(paths, PREFIX, loader)
        built = loader.build()
        b13, b2 = ckpt.expected_biases(range(3), rank, 2)
        assert built.w13_bias.dtype == torch.float32 and torch.equal(built.w13_bias.double(), b13)
        assert torch.equal(built.w2_bias.double(), b2)


def test_the_built_weights_never_alias_the_tensors_given():
    gate, up, down = torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 8)
    loader = ExpertCheckpointLoader("fp32", 1, 16, 8)
    for name, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
        assert loader.add(f"experts.0.{name}.weight", t)
    built = loader.build()
    before = (built.w13.data.clone(), built.w2.data.clone())
    for t in (gate, up, down):
        t.zero_()
    assert torch.equal(built.w13.data, before[0]) and torch.equal(built.w2.data, before[1])
