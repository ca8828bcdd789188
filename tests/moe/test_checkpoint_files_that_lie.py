"""Checkpoint files and state dicts that lie about what they hold are refused with `hal.InvalidInput` naming the
tensor (and the file), never loaded as another layer, skipped, or left to a traceback from safetensors or torch."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import moe
from hal import InvalidInput
from moe.checkpoint import ExpertCheckpointLoader, load_safetensors
from tests.support.checkpoint_synthetic import encode_fp8_block, fused_checkpoint, per_expert

P = "model.layers.3.mlp"
H, I = 256, 256  # fp8-block128: whole 128x128 tiles


def _fp8_checkpoint(num_experts: int):
    return per_expert(lambda w, e, p: encode_fp8_block(w), H, I, num_experts, P, seed=3)


def _shards(tmp_path: Path, tensors: dict[str, torch.Tensor], count: int) -> list[Path]:
    """`tensors` split over `count` shard files, as `save_pretrained` does, named as HF names them."""
    names = sorted(tensors)
    paths = []
    for s in range(count):
        path = tmp_path / f"model-{s + 1:05d}-of-{count:05d}.safetensors"
        save_file({n: tensors[n] for n in names[s::count]}, str(path))
        paths.append(path)
    return paths


def _raw(path: Path, name: str, dtype: str, shape: list[int], nbytes: int) -> Path:
    """A safetensors file of one tensor written byte by byte (dtypes torch has no tensor for)."""
    header = json.dumps({name: {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(nbytes))
    return path


@pytest.mark.parametrize("local", [range(4), range(2, 4)])
def test_a_checkpoint_of_more_experts_than_num_experts_is_refused_not_cut_to_fit(tmp_path, local):
    # a 6-expert checkpoint read as 4 experts: experts 4 and 5 were skipped, the layer loaded as if it had 4
    paths = _shards(tmp_path, _fp8_checkpoint(6).tensors, 2)
    loader = ExpertCheckpointLoader("fp8-block128", 4, H, I, local_experts=local)
    with pytest.raises(
        InvalidInput, match=r"experts\.[45]\.\w+\.weight\w*: expected an expert id below num_experts=4, got [45]"
    ):
        load_safetensors(paths, P, loader)
    assert loader.wants(f"{P}.experts.5.up_proj.weight")


@pytest.mark.parametrize("expert", ["-1", "x", "²"])
def test_an_expert_id_that_is_no_whole_number_is_refused_by_name(tmp_path, expert):
    ckpt = _fp8_checkpoint(2)
    odd = f"{P}.experts.{expert}.gate_proj.weight"
    ckpt.tensors[odd] = ckpt.tensors[f"{P}.experts.1.gate_proj.weight"].clone()
    ckpt.tensors[f"model.layers.4.mlp.experts.{expert}.gate_proj.weight"] = ckpt.tensors[odd].clone()
    path = tmp_path / "model.safetensors"
    save_file(ckpt.tensors, str(path))
    message = re.escape(f"{odd}: expected an expert id in [0, 2) (num_experts=2), got {expert!r}")
    with pytest.raises(InvalidInput, match=message):
        load_safetensors(path, P, ExpertCheckpointLoader("fp8-block128", 2, H, I))
    loader = ExpertCheckpointLoader("fp8-block128", 2, H, I, prefix=P)
    assert loader.wants(odd) and not loader.wants(f"model.layers.4.mlp.experts.{expert}.gate_proj.weight")
    with pytest.raises(InvalidInput, match=message):
        loader.add(odd, ckpt.tensors[odd])


def test_a_tensor_in_two_shards_is_refused_naming_both_files_before_anything_is_fed(tmp_path):
    ckpt = _fp8_checkpoint(2)
    first, second = _shards(tmp_path, ckpt.tensors, 2)
    again = tmp_path / "model-extra.safetensors"
    name = f"{P}.experts.1.down_proj.weight_scale_inv"
    save_file({name: ckpt.tensors[name] * 2}, str(again))  # a stale copy, of other values
    loader = ExpertCheckpointLoader("fp8-block128", 2, H, I)
    holder = first if name in sorted(ckpt.tensors)[0::2] else second
    with pytest.raises(
        InvalidInput, match=re.escape(f"{name}: expected in one of the files, got it in {holder} and {again}")
    ):
        load_safetensors([first, second, again], P, loader)
    assert len(loader.missing()) == 2 * 3 * 2  # nothing was fed
    with pytest.raises(InvalidInput, match=re.escape(f"paths: expected each file once, got '{first} twice'")):
        load_safetensors([first, second, Path(str(first).replace(str(tmp_path), f"{tmp_path}/."))], P, loader)
    assert len(load_safetensors([first, second], P, loader)) == 2 * 3 * 2 and not loader.missing()


def _index(tmp_path: Path, weight_map: dict[str, str], name: str = "model.safetensors.index.json") -> Path:
    index = tmp_path / name
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


def test_a_malformed_index_is_refused_naming_it(tmp_path):
    ckpt = _fp8_checkpoint(2)
    shards = _shards(tmp_path, ckpt.tensors, 2)
    name = sorted(ckpt.tensors)[0]
    cases = {
        "{not json": "expected a readable index JSON",
        json.dumps({"metadata": {}}): "expected an index JSON with a 'weight_map' object",
        json.dumps([1, 2]): "expected an index JSON with a 'weight_map' object",
        json.dumps({"weight_map": {name: "../" + shards[0].name}}): f"maps {name} to '../{shards[0].name}'",
        json.dumps({"weight_map": {name: str(shards[0])}}): f"maps {name} to '{shards[0]}'",
        json.dumps({"weight_map": {name: 3}}): f"maps {name} to 3",
        json.dumps({"weight_map": {name: "notes.txt"}}): f"maps {name} to 'notes.txt'",
    }
    index = tmp_path / "model.safetensors.index.json"
    for content, expected in cases.items():
        index.write_text(content)
        loader = ExpertCheckpointLoader("fp8-block128", 2, H, I)
        with pytest.raises(InvalidInput, match=rf"^paths: .*{re.escape(expected)}"):
            load_safetensors(index, P, loader)
        assert len(loader.missing()) == 2 * 3 * 2  # nothing fed


@pytest.mark.parametrize(
    "name, dtype, shape, nbytes, local",
    [
        (f"{P}.experts.0.gate_proj.weight", "F6_E2M3", [64, 64], 64 * 64 * 6 // 8, range(2)),
        (f"{P}.experts.0.gate_proj.weight", "F4", [64, 63], 64 * 63 // 2, range(2)),
        (f"{P}.experts.gate_up_proj", "F4", [2, 128, 63], 2 * 128 * 63 // 2, range(1, 2)),  # read by rows
        (f"{P}.experts.gate_up_proj", "F6_E3M2", [2, 128, 64], 2 * 128 * 64 * 6 // 8, range(1, 2)),
    ],
)
def test_a_tensor_torch_cannot_hold_is_refused_by_name_and_file(tmp_path, name, dtype, shape, nbytes, local):
    path = _raw(tmp_path / "odd.safetensors", name, dtype, shape, nbytes)
    loader = ExpertCheckpointLoader("bf16", 2, 64, 64, local_experts=local)
    with pytest.raises(InvalidInput, match=rf"^{re.escape(name)}: expected a tensor torch can read, got .*\(file: "):
        load_safetensors(path, P, loader)


def test_a_bad_tensor_of_a_sharded_checkpoint_names_its_file(tmp_path):
    _, tensors = fused_checkpoint(4, 64, 32, prefix=P)
    tensors = {**tensors, f"{P}.experts.down_proj": tensors[f"{P}.experts.down_proj"][..., :-1].contiguous()}
    paths = _shards(tmp_path, tensors, 2)
    holder = paths[sorted(tensors).index(f"{P}.experts.down_proj") % 2]
    loader = ExpertCheckpointLoader("bf16", 4, 64, 32, local_experts=range(2, 4))
    with pytest.raises(InvalidInput, match=re.escape(f"in the file) (file: {holder})")):
        load_safetensors(paths, P, loader)


@pytest.mark.parametrize(
    "state, got", [("list", "'list'"), ("int key", "'the key 3'"), ("tuple key", "\"the key ('experts', 1)\"")]
)
def test_a_state_dict_that_is_no_mapping_of_str_keys_is_refused(state, got):
    layer = moe.MoELayer(64, 32, 4, 2, vendor="cpu")
    layer.load_weights(torch.randn(4, 64, 64) * 0.1, torch.randn(4, 32, 64) * 0.1)
    good = layer.state_dict()
    given = {
        "list": list(good.items()),
        "int key": {**good, 3: torch.zeros(1)},
        "tuple key": {**good, ("experts", 1): torch.zeros(1)},
    }[state]
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(
        InvalidInput, match=re.escape(f"state_dict: expected a mapping of str keys to tensors, got {got}")
    ):
        layer.load_state_dict(given)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())


@pytest.mark.parametrize("part", ["gate.weight", "experts.down_proj"])
def test_a_block_with_a_meta_tensor_is_refused_by_key_and_no_block_is_replaced(part):
    pytest.importorskip("transformers")
    import moe.integrations.transformers as moe_hf
    from hal import get_vendor
    from tests.support.transformers_models import build_model

    model = build_model("qwen3_moe")
    _, architecture = moe_hf.architecture_of(model)
    name = next(n for n, m in model.named_modules() if architecture.matches(m))
    owner, leaf = f"{name}.{part}".rsplit(".", 1)
    module = model.get_submodule(owner)
    setattr(module, leaf, torch.nn.Parameter(torch.empty_like(getattr(module, leaf), device="meta")))
    # without data the router's logits were whatever memory held (F.linear of a meta weight on the CPU)
    with pytest.raises(InvalidInput, match=re.escape(f"{name}.{part}: expected a tensor with data")):
        moe_hf.replace_moe_blocks(model, vendor=get_vendor("cpu", environ={}))
    assert not any(isinstance(m, moe_hf.MoEBlock) for m in model.modules())


@pytest.mark.parametrize("extra", ["experts.foo.bar", "experts.w13_weight.x"])
def test_a_strict_state_dict_with_a_dotted_unknown_expert_key_is_refused_by_name(extra):
    layer = moe.MoELayer.from_float(torch.randn(4, 32, 48) / 6, torch.randn(4, 24, 32) / 5, 2)
    state = dict(layer.state_dict())
    before = {k: v.clone() for k, v in state.items()}
    state[extra] = torch.zeros(3)
    with pytest.raises(InvalidInput, match=extra.replace(".", r"\.")):
        layer.load_state_dict(state)
    assert all(torch.equal(layer.state_dict()[k], v) for k, v in before.items())
    layer.load_state_dict(state, strict=False)  # not strict: the extra key is ignored
