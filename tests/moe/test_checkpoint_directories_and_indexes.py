"""`load_safetensors` takes a checkpoint as it is downloaded: a directory, or its `model.safetensors.index.json`,
opening only the shards that hold the layer's tensors this rank wants."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hal import InvalidInput
from moe.checkpoint import ExpertCheckpointLoader, load_safetensors
from tests.support.checkpoint_synthetic import encode_fp8_block, per_expert

H, I, E = 256, 384, 4  # fp8-block128: whole tiles
LAYERS = 3


def _prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp"


def _checkpoint(tmp_path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """A three-layer fp8-block checkpoint saved one shard per layer (plus a shard of non-expert tensors), with
    the index `save_pretrained` writes."""
    tensors: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    for layer in range(LAYERS):
        ckpt = per_expert(lambda w, e, p: encode_fp8_block(w), H, I, E, _prefix(layer), seed=layer)
        shard = f"model-{layer + 1:05d}-of-{LAYERS + 1:05d}.safetensors"
        save_file(ckpt.tensors, str(tmp_path / shard))
        tensors.update(ckpt.tensors)
        weight_map.update({n: shard for n in ckpt.tensors})
    other = f"model-{LAYERS + 1:05d}-of-{LAYERS + 1:05d}.safetensors"
    save_file({"model.embed_tokens.weight": torch.randn(8, H)}, str(tmp_path / other))
    weight_map["model.embed_tokens.weight"] = other
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    return tensors, index


def _loaded(paths: object, layer: int, local: range = range(E)) -> ExpertCheckpointLoader:
    loader = ExpertCheckpointLoader("fp8-block128", E, H, I, local_experts=local)
    load_safetensors(paths, _prefix(layer), loader)
    assert not loader.missing()
    return loader


def _same(a: ExpertCheckpointLoader, b: ExpertCheckpointLoader) -> None:
    wa, wb = a.build(), b.build()
    for x, y in [(wa.w13.data, wb.w13.data), (wa.w13.scale, wb.w13.scale), (wa.w2.data, wb.w2.data)]:
        assert torch.equal(
            x.view(torch.uint8) if x.element_size() == 1 else x, y.view(torch.uint8) if y.element_size() == 1 else y
        )


@pytest.mark.parametrize("layer", range(LAYERS))
def test_an_index_a_directory_and_the_shards_load_the_same_weights(tmp_path, layer):
    _, index = _checkpoint(tmp_path)
    shards = sorted(tmp_path.glob("*.safetensors"))
    by_shards = _loaded(shards, layer)
    _same(_loaded(index, layer), by_shards)
    _same(_loaded(tmp_path, layer), by_shards)
    _same(_loaded(str(tmp_path), layer), by_shards)


def test_an_index_opens_only_the_shards_of_the_layer(tmp_path):
    _, index = _checkpoint(tmp_path)
    for s in (1, 3, 4):  # a rank loading layer 1 needs shard 2 only: the others may be absent
        (tmp_path / f"model-{s:05d}-of-{LAYERS + 1:05d}.safetensors").unlink()
    loaded = _loaded(index, 1, local=range(2, 4))
    assert loaded.build().w13.data.shape[0] == 2
    with pytest.raises(InvalidInput, match=r"^paths: expected the shards .* names, got '.*model-00001-of-00004"):
        load_safetensors(index, _prefix(0), ExpertCheckpointLoader("fp8-block128", E, H, I))


def test_a_plain_directory_reads_every_safetensors_file(tmp_path):
    tensors, index = _checkpoint(tmp_path)
    index.unlink()
    _loaded(tmp_path, 2)
    (tmp_path / "model-00005-of-00004.safetensors").write_bytes(
        b"not a checkpoint"
    )  # a stray file is read, and refused
    with pytest.raises(InvalidInput, match=r"expected readable safetensors files, got '.*model-00005-of-00004"):
        load_safetensors(tmp_path, _prefix(2), ExpertCheckpointLoader("fp8-block128", E, H, I))


def test_an_index_listing_a_tensor_its_shard_lacks_leaves_it_missing_by_name(tmp_path):
    tensors, index = _checkpoint(tmp_path)
    weight_map = json.loads(index.read_text())["weight_map"]
    name = f"{_prefix(0)}.experts.2.down_proj.weight"
    save_file(
        {n: t for n, t in tensors.items() if n.startswith(_prefix(0)) and n != name}, str(tmp_path / weight_map[name])
    )
    loader = ExpertCheckpointLoader("fp8-block128", E, H, I)
    load_safetensors(index, _prefix(0), loader)
    with pytest.raises(InvalidInput, match=re.escape(f"got 1 missing: {name}")):
        loader.build()


def test_a_directory_with_two_indexes_or_a_file_given_twice_is_refused(tmp_path):
    _, index = _checkpoint(tmp_path)
    loader = ExpertCheckpointLoader("fp8-block128", E, H, I)
    with pytest.raises(InvalidInput, match="expected each file once, got '.*model-00001-of-00004.safetensors twice'"):
        load_safetensors([index, tmp_path / "model-00001-of-00004.safetensors"], _prefix(0), loader)
    (tmp_path / "model.fp8.safetensors.index.json").write_text(index.read_text())
    with pytest.raises(InvalidInput, match="expected a checkpoint directory with at most one index JSON"):
        load_safetensors(tmp_path, _prefix(0), loader)
    assert len(loader.missing()) == E * 3 * 2  # nothing fed by the refused calls
