"""Every mistake is one `InvalidInput` naming the tensor (or the argument), what was expected and what came."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file

from hal import InvalidInput
from moe.checkpoint import ExpertCheckpointLoader, load_safetensors
from tests.support.checkpoint_synthetic import MIXTRAL, encode_fp8_block, encode_nvfp4, fused_checkpoint, per_expert

P = "model.layers.1.mlp"


def fp8_block(e: int = 2, h: int = 256, i: int = 256, **kwargs):
    return per_expert(lambda w, x, p: encode_fp8_block(w), h, i, e, P, **kwargs)


def test_a_wrong_shape_names_the_tensor_and_both_shapes():
    loader = ExpertCheckpointLoader("bf16", 2, 64, 32)
    with pytest.raises(
        InvalidInput,
        match=re.escape(
            f"{P}.experts.1.up_proj.weight: expected bfloat16 of shape [32, 64], got bfloat16 of shape [64, 32]"
        ),
    ):
        loader.add(f"{P}.experts.1.up_proj.weight", torch.zeros(64, 32, dtype=torch.bfloat16))


def test_a_wrong_dtype_names_the_tensor():
    loader = ExpertCheckpointLoader("fp8-block128", 2, 256, 256)
    with pytest.raises(InvalidInput, match=re.escape(f"{P}.experts.0.down_proj.weight: expected float8_e4m3fn")):
        loader.add(f"{P}.experts.0.down_proj.weight", torch.zeros(256, 256, dtype=torch.bfloat16))
    with pytest.raises(InvalidInput, match=r"weight_scale_inv: expected .* of shape \[2, 2\], got float32 of shape"):
        loader.add(f"{P}.experts.0.down_proj.weight_scale_inv", torch.ones(2, 3))


def test_a_missing_scale_is_named_by_build():
    ckpt = fp8_block()
    del ckpt.tensors[f"{P}.experts.1.up_proj.weight_scale_inv"]
    loader = ExpertCheckpointLoader("fp8-block128", 2, 256, 256)
    for name, t in ckpt.tensors.items():
        loader.add(name, t)
    assert loader.missing() == [f"{P}.experts.1.up_proj.weight_scale_inv"]
    with pytest.raises(InvalidInput, match=re.escape(f"1 missing: {P}.experts.1.up_proj.weight_scale_inv")):
        loader.build()


def test_missing_tensors_are_named_in_the_checkpoints_own_naming():
    mixtral = per_expert(lambda w, e, p: encode_fp8_block(w), 128, 128, 2, "m.block_sparse_moe", names=MIXTRAL)
    loader = ExpertCheckpointLoader("fp8-block128", 2, 128, 128, local_experts=range(1, 2))
    loader.add("m.block_sparse_moe.experts.1.w1.weight", mixtral.tensors["m.block_sparse_moe.experts.1.w1.weight"])
    assert loader.missing() == [
        "m.block_sparse_moe.experts.1.w1.weight_scale_inv",
        *(f"m.block_sparse_moe.experts.1.{p}.{k}" for p in ("w3", "w2") for k in ("weight", "weight_scale_inv")),
    ]
    _, fused = fused_checkpoint(2, 16, 8)
    loader = ExpertCheckpointLoader("bf16", 2, 16, 8)
    loader.add("model.layers.0.mlp.experts.down_proj", fused["model.layers.0.mlp.experts.down_proj"])
    assert loader.missing() == ["model.layers.0.mlp.experts.gate_up_proj"]


def test_every_experts_input_scale_is_needed_on_every_rank():
    ckpt = per_expert(lambda w, e, p: encode_nvfp4(w, 0.01 * (e + 1)), 32, 32, 4, P)
    loader = ExpertCheckpointLoader("nvfp4", 4, 32, 32, local_experts=range(0, 2))
    for name, t in ckpt.tensors.items():
        if ".experts.3.up_proj.input_scale" not in name:
            loader.add(name, t)
    assert loader.missing() == [f"{P}.experts.3.up_proj.input_scale"]
    with pytest.raises(InvalidInput, match=re.escape(f"{P}.experts.3.up_proj.input_scale")):
        loader.scheme()


def test_tensor_parallel_shards_must_fall_on_block_boundaries():
    ckpt = fp8_block(i=256)
    loader = ExpertCheckpointLoader("fp8-block128", 2, 256, 256, activation_gated=False, tp_rank=1, tp_size=4)
    with pytest.raises(
        InvalidInput,
        match=re.escape(
            f"{P}.experts.0.down_proj.weight_scale_inv: the tensor-parallel "
            "shard [64, 128) of the intermediate dimension (I=256) must "
            "start and end on a 128-channel block"
        ),
    ):
        loader.add(
            f"{P}.experts.0.down_proj.weight_scale_inv", ckpt.tensors[f"{P}.experts.0.down_proj.weight_scale_inv"]
        )


def test_fp8_blocks_must_not_straddle_gate_and_up():
    ckpt = fp8_block(h=128, i=192)
    loader = ExpertCheckpointLoader("fp8-block128", 2, 128, 192)
    with pytest.raises(
        InvalidInput,
        match=re.escape(f"{P}.experts.0.gate_proj.weight_scale_inv: gate and up concatenated along N")
        + ".*multiple of 128, got 192",
    ):
        loader.add(
            f"{P}.experts.0.gate_proj.weight_scale_inv", ckpt.tensors[f"{P}.experts.0.gate_proj.weight_scale_inv"]
        )
    loader.add(f"{P}.experts.0.down_proj.weight_scale_inv", ckpt.tensors[f"{P}.experts.0.down_proj.weight_scale_inv"])


@pytest.mark.parametrize(
    "name, tensor, loader_args, message",
    [
        (
            f"{P}.experts.0.gate_proj.weight_scale_inv",
            torch.ones(1, 1),
            ("bf16", 2, 64, 32),
            "expected one of the bf16 tensors (weight, bias), got 'weight_scale_inv'",
        ),
        (f"{P}.experts.0.gate_proj.bias", torch.ones(32), ("bf16", 2, 64, 32), "no bias tensors"),
        (
            f"{P}.experts.2.gate_proj.weight",
            torch.ones(32, 64),
            ("bf16", 2, 64, 32),
            "an expert id below num_experts=2",
        ),
        (
            f"{P}.experts.0.gate_proj.weight",
            torch.ones(32, 64),
            ("fp32", 2, 64, 32, {"activation_gated": False}),
            "up and down projections only",
        ),
        (
            f"{P}.experts.0.gate_proj.weight_scale_2",
            torch.tensor(0.0),
            ("nvfp4", 2, 64, 32),
            "a finite positive scale, got 0.0",
        ),
        (f"{P}.experts.0.gate_proj.input_scale", torch.tensor(1.0), ("int8", 2, 64, 32), "got 'input_scale'"),
        (
            f"{P}.experts.gate_up_proj",
            torch.zeros(2, 64, 64, dtype=torch.int8),
            ("int8", 2, 64, 32, {"fused_layout": "in-out"}),
            "fused int8 weights in the out-in layout",
        ),
    ],
)
def test_each_wrong_tensor_is_refused_by_name(name, tensor, loader_args, message):
    *args, kwargs = loader_args if isinstance(loader_args[-1], dict) else (*loader_args, {})
    with pytest.raises(InvalidInput, match=re.escape(name) + ".*" + re.escape(message)):
        ExpertCheckpointLoader(*args, **kwargs).add(name, tensor)


def test_a_tensor_loaded_twice_and_two_layers_without_a_prefix_are_refused():
    loader = ExpertCheckpointLoader("fp32", 2, 64, 32)
    loader.add(f"{P}.experts.0.gate_proj.weight", torch.ones(32, 64))
    with pytest.raises(InvalidInput, match="already loaded from"):
        loader.add(f"{P}.experts.0.gate_proj.weight", torch.ones(32, 64))
    with pytest.raises(InvalidInput, match="a tensor of another layer .* pass prefix="):
        loader.add("model.layers.2.mlp.experts.0.up_proj.weight", torch.ones(32, 64))
    assert not loader.add("model.layers.2.mlp.gate.weight", torch.ones(2, 64))  # not an expert tensor: ignored


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(local_experts=range(3, 5)), "local_experts"),
        (dict(local_experts=range(0, 2, 2)), "local_experts"),
        (dict(tp_size=3), "tp_size"),
        (dict(tp_rank=2, tp_size=2), "tp_rank"),
        (dict(static_input_scale=True), "static_input_scale"),
        (dict(activation="silu", activation_gated=True), "activation_gated"),
    ],
)
def test_bad_arguments_are_named(kwargs, argument):
    with pytest.raises(InvalidInput, match=argument):
        ExpertCheckpointLoader("bf16", 4, 64, 32, **kwargs)


def test_nvfp4_dimensions_must_be_whole_blocks_and_formats_are_named():
    with pytest.raises(InvalidInput, match="hidden_size: expected a multiple of 16"):
        ExpertCheckpointLoader("nvfp4", 2, 40, 32)
    with pytest.raises(InvalidInput, match=r"intermediate_size / tp_size: expected a multiple of 16"):
        ExpertCheckpointLoader("nvfp4", 2, 32, 32, tp_size=4)
    with pytest.raises(InvalidInput, match="format: expected one of bf16, fp16, fp32, fp8-block128"):
        ExpertCheckpointLoader("gptq-int4", 2, 32, 32)


def test_load_safetensors_reports_a_bad_tensor_by_name(tmp_path):
    ckpt = fp8_block()
    ckpt.tensors[f"{P}.experts.1.gate_proj.weight_scale_inv"] = torch.ones(3, 2)
    path = tmp_path / "bad.safetensors"
    save_file(ckpt.tensors, str(path))
    with pytest.raises(InvalidInput, match=re.escape(f"{P}.experts.1.gate_proj.weight_scale_inv: expected")):
        load_safetensors(path, P, ExpertCheckpointLoader("fp8-block128", 2, 256, 256))


@pytest.mark.parametrize("what", ["empty directory", "missing", "empty", "not safetensors", "truncated"])
def test_load_safetensors_refuses_paths_that_are_not_readable_safetensors_files(tmp_path, what):
    good = tmp_path / "good.safetensors"
    save_file(fp8_block().tensors, str(good))
    (tmp_path / "junk.safetensors").write_bytes(b"plain text, not a checkpoint")
    (tmp_path / "cut.safetensors").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    (tmp_path / "empty").mkdir()
    paths = {
        "empty directory": tmp_path / "empty",
        "missing": tmp_path / "absent.safetensors",
        "empty": [],
        "not safetensors": [good, tmp_path / "junk.safetensors"],
        "truncated": tmp_path / "cut.safetensors",
    }[what]
    expected = {
        "empty directory": "a directory holding safetensors files or an index JSON",
        "missing": "existing safetensors files",
        "empty": "at least one safetensors file",
        "not safetensors": "readable safetensors files",
        "truncated": "readable safetensors files",
    }[what]
    loader = ExpertCheckpointLoader("fp8-block128", 2, 256, 256)
    with pytest.raises(InvalidInput, match=rf"^paths: expected {re.escape(expected)}"):
        load_safetensors(paths, P, loader)
    assert load_safetensors(good, P, loader)  # the refused call fed the loader nothing


def test_the_scheme_needs_only_the_input_scales():
    ckpt = per_expert(lambda w, e, p: encode_nvfp4(w, 0.01 * (e + 1)), 32, 32, 2, P)
    loader = ExpertCheckpointLoader("nvfp4", 2, 32, 32, local_experts=range(1, 2))
    for name in [n for n in ckpt.tensors if n.endswith("input_scale")]:
        assert loader.wants(name) and loader.add(name, ckpt.tensors[name])
    assert loader.scheme().input_global_scale == pytest.approx(1 / 0.02)
    assert len(loader.missing()) == 3 * 3  # weight, weight_scale, weight_scale_2 of 3 projections: still to come


@pytest.mark.parametrize("file_experts", [3, 8])
@pytest.mark.parametrize("local", [range(0, 2), range(2, 4)])
def test_a_fused_file_of_another_expert_count_is_refused_not_cut_to_fit(tmp_path, file_experts, local):
    h, i = 64, 32
    path = tmp_path / "experts.safetensors"
    save_file(
        {
            f"{P}.experts.gate_up_proj": torch.randn(file_experts, 2 * i, h).bfloat16(),
            f"{P}.experts.down_proj": torch.randn(file_experts, h, i).bfloat16(),
        },
        str(path),
    )
    loader = ExpertCheckpointLoader("bf16", 4, h, i, local_experts=local)
    before = loader.missing()
    with pytest.raises(InvalidInput, match=rf"leading dimension of num_experts=4.*got shape \[{file_experts}, "):
        load_safetensors(path, P, loader)
    assert loader.missing() == before  # nothing was kept


def test_a_fused_file_row_mismatch_names_the_files_shape(tmp_path):
    h, i = 64, 32
    path = tmp_path / "experts.safetensors"
    save_file({f"{P}.experts.down_proj": torch.randn(4, h, i + 1).bfloat16()}, str(path))
    loader = ExpertCheckpointLoader("bf16", 4, h, i, local_experts=range(2, 4))
    with pytest.raises(InvalidInput, match=re.escape("(rows 2:4 of shape [4, 64, 33] in the file)")):
        load_safetensors(path, P, loader)


def test_a_fused_file_of_all_experts_loads_only_this_ranks_rows(tmp_path):
    h, i = 64, 32
    gate_up, down = torch.randn(4, 2 * i, h).bfloat16(), torch.randn(4, h, i).bfloat16()
    path = tmp_path / "experts.safetensors"
    save_file({f"{P}.experts.gate_up_proj": gate_up, f"{P}.experts.down_proj": down}, str(path))
    loader = ExpertCheckpointLoader("bf16", 4, h, i, local_experts=range(2, 4))
    assert len(load_safetensors(path, P, loader)) == 2 and not loader.missing()
