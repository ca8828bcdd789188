"""Checkpoint tensors are checked as they arrive: inf / NaN in a weight or any scale, and tensors of an
expert no format understands (int8 zero points, GPTQ zeros), are refused by name; a refused tensor
leaves the loader as it was, so the checkpoint can be fixed and fed again."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file

import moe
from hal import InvalidInput
from moe.checkpoint import ExpertCheckpointLoader, load_safetensors
from tests.checkpoint.test_checkpoint_formats import ENCODERS
from tests.support.checkpoint_synthetic import fused_checkpoint, per_expert
from tests.support.load_checks import Before, same

P = "model.layers.2.mlp"
E, H, I = 4, 128, 128  # fp8-block128 splits gate and up on 128-row tiles
#: every floating tensor kind of each format (integer and packed weights hold no inf or NaN)
KINDS = {
    "bf16": ["weight"],
    "fp16": ["weight"],
    "fp32": ["weight"],
    "fp8-block128": ["weight", "weight_scale_inv"],
    "fp8": ["weight", "weight_scale", "input_scale"],
    "int8": ["weight_scale"],
    "nvfp4": ["weight_scale", "weight_scale_2", "input_scale"],
}
CASES = [(fmt, kind) for fmt, kinds in KINDS.items() for kind in kinds]


def _bad(t: torch.Tensor, value: float) -> torch.Tensor:
    out = t.clone()
    if out.dtype == torch.float8_e4m3fn:  # e4m3 has no inf: its one non-finite code is NaN
        out.view(torch.uint8).reshape(-1)[-1] = 0x7F
    else:
        out.reshape(-1)[-1] = value
    return out


def _built(loader: ExpertCheckpointLoader) -> dict[str, torch.Tensor]:
    weights = loader.build()
    found = {f"{p}.{k}": t for p in ("w13", "w2") for k, t in getattr(weights, p).tensors().items()}
    return {**found, **{k: getattr(weights, k) for k in ("input_global_scale", "intermediate_global_scale")}}


@pytest.mark.parametrize(("fmt", "kind"), CASES, ids=[f"{f}-{k}" for f, k in CASES])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_tensor_of_any_format_is_refused_by_name_and_the_loader_is_unchanged(fmt, kind, value):
    ckpt = per_expert(ENCODERS[fmt], H, I, E, P, seed=5)
    name = f"{P}.experts.2.down_proj.{kind}"
    loader = ExpertCheckpointLoader(fmt, E, H, I)
    for key, t in ckpt.tensors.items():
        if key != name:
            loader.add(key, t)
    missing = loader.missing()
    expected = "a finite positive scale" if kind in ("weight_scale_2", "input_scale") else "finite values"
    with pytest.raises(InvalidInput, match=re.escape(f"{name}: expected {expected}")):
        loader.add(name, _bad(ckpt.tensors[name], value))
    assert loader.missing() == missing
    loader.add(name, ckpt.tensors[name])  # the good tensor is taken after the refused one
    clean = ExpertCheckpointLoader(fmt, E, H, I)
    for key, t in ckpt.tensors.items():
        clean.add(key, t)
    got, want = _built(loader), _built(clean)
    assert all((got[k] is None and want[k] is None) or same(got[k], want[k]) for k in want)


def test_a_fused_tensor_with_one_bad_expert_keeps_none_of_its_experts():
    _, tensors = fused_checkpoint(E, 64, 32, prefix=P)
    loader = ExpertCheckpointLoader("bf16", E, 64, 32, prefix=P)
    bad = tensors[f"{P}.experts.gate_up_proj"].clone()
    bad[3, 40, 7] = float("nan")  # expert 3's up projection
    with pytest.raises(InvalidInput, match=re.escape(f"{P}.experts.gate_up_proj: expected finite values")):
        loader.add(f"{P}.experts.gate_up_proj", bad)
    assert loader.missing() == [f"{P}.experts.gate_up_proj", f"{P}.experts.down_proj"]
    assert loader.add(f"{P}.experts.gate_up_proj", tensors[f"{P}.experts.gate_up_proj"])  # none "already loaded"


def test_a_per_expert_gate_up_with_a_bad_up_half_keeps_neither_half():
    loader = ExpertCheckpointLoader("bf16", 2, 64, 32, prefix=P)
    gate_up = torch.randn(64, 64).to(torch.bfloat16)
    gate_up[40, 3] = float("-inf")
    with pytest.raises(InvalidInput, match=re.escape(f"{P}.experts.1.gate_up_proj.weight: expected finite values")):
        loader.add(f"{P}.experts.1.gate_up_proj.weight", gate_up)
    assert f"{P}.experts.1.gate_proj.weight" in loader.missing()
    gate_up[40, 3] = 0.0
    assert loader.add(f"{P}.experts.1.gate_up_proj.weight", gate_up)  # not "already loaded"


@pytest.mark.parametrize(
    ("fmt", "name"),
    [
        ("int8", f"{P}.experts.1.up_proj.weight_zero_point"),
        ("bf16", f"{P}.experts.gate_up_proj_qzeros"),
        ("fp8", f"{P}.experts.0.w1.qweight"),
    ],
)
def test_a_tensor_of_an_expert_that_no_format_understands_is_refused_by_name(tmp_path, fmt, name):
    ckpt = per_expert(ENCODERS[fmt], 64, 32, 2, P)
    loader = ExpertCheckpointLoader(fmt, 2, 64, 32)
    for key, t in ckpt.tensors.items():
        loader.add(key, t)
    stray = torch.zeros(32, dtype=torch.int8)
    with pytest.raises(InvalidInput, match=re.escape(name) + r": expected one of the .* tensors of an expert"):
        loader.add(name, stray)
    assert loader.wants(name)
    save_file({**ckpt.tensors, name: stray}, str(tmp_path / "m.safetensors"))
    with pytest.raises(InvalidInput, match=re.escape(name)):
        load_safetensors(tmp_path / "m.safetensors", P, ExpertCheckpointLoader(fmt, 2, 64, 32))
    other_layer = name.replace("layers.2", "layers.3")
    assert not ExpertCheckpointLoader(fmt, 2, 64, 32, prefix=P).wants(other_layer)


def test_zero_points_are_named_as_asymmetric_weights():
    loader = ExpertCheckpointLoader("int8", 2, 64, 32)
    with pytest.raises(InvalidInput, match=r"asymmetric \(zero-point\) weights"):
        loader.add(f"{P}.experts.0.gate_proj.weight_zero_point", torch.zeros(32, dtype=torch.int8))


@pytest.mark.parametrize("vendor", ["cpu", "ascend-emulated"])
def test_a_checkpoint_refused_at_load_never_reaches_the_layer(vendor):
    ckpt = per_expert(ENCODERS["fp8-block128"], H, I, E, P, seed=2)
    loader = ExpertCheckpointLoader("fp8-block128", E, H, I)
    for key, t in ckpt.tensors.items():
        loader.add(key, t)
    layer = moe.MoELayer(H, I, E, 2, scheme=loader.scheme(), vendor=vendor, environ={})
    layer.load_expert_weights(loader.build())
    before = Before(layer)
    fresh = ExpertCheckpointLoader("fp8-block128", E, H, I)
    name = f"{P}.experts.0.gate_proj.weight_scale_inv"
    for key, t in ckpt.tensors.items():
        if key != name:
            fresh.add(key, t)
            continue
        with pytest.raises(InvalidInput, match=re.escape(f"{name}: expected finite values")):
            fresh.add(key, _bad(t, float("inf")))
    with pytest.raises(InvalidInput, match=re.escape(f"1 missing: {name}")):
        layer.load_expert_weights(fresh.build())
    before.unchanged(layer)


def _mxfp4(seed: int = 0) -> dict[str, torch.Tensor]:
    """A gpt-oss MXFP4 layer: fused `*_blocks` [E, N, K/32, 16] and e8m0 `*_scales` [E, N, K/32] bytes."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for proj, (n, k) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
        tensors[f"{P}.experts.{proj}_blocks"] = torch.randint(0, 256, (E, n, k // 32, 16), generator=gen).byte()
        tensors[f"{P}.experts.{proj}_scales"] = torch.randint(118, 130, (E, n, k // 32), generator=gen).byte()
    return tensors


def _mxfp4_loader(**kwargs) -> ExpertCheckpointLoader:
    return ExpertCheckpointLoader("mxfp4", E, H, I, activation="swiglu-oai", gate_up_interleaved=True, **kwargs)


@pytest.mark.parametrize("proj", ["gate_up_proj", "down_proj"])
def test_an_mxfp4_scale_byte_255_is_refused_by_name_and_the_checkpoint_can_be_fed_again(proj):
    tensors = _mxfp4()
    name = f"{P}.experts.{proj}_scales"
    bad = tensors[name].clone()
    bad[E - 1, 5, 1] = 255  # e8m0's NaN
    loader = _mxfp4_loader()
    for key, t in tensors.items():
        if key != name:
            assert loader.add(key, t)
    with pytest.raises(InvalidInput, match=re.escape(name) + r": expected finite values, got 1 non-finite"):
        loader.add(name, bad)
    assert loader.missing()  # nothing of the refused tensor was kept, for any expert
    assert loader.add(name, tensors[name])
    whole = _mxfp4_loader()
    for key, t in tensors.items():
        whole.add(key, t)
    assert all(same(getattr(a, f), getattr(b, f)) for a, b in _weights(loader, whole) for f in ("data", "scale"))


def _weights(*loaders: ExpertCheckpointLoader):
    built = [loader.build() for loader in loaders]
    return [(built[0].w13, built[1].w13), (built[0].w2, built[1].w2)]


def test_mxfp4_tensors_of_a_wrong_shape_or_dtype_are_refused_by_name(tmp_path):
    tensors = _mxfp4()
    name = f"{P}.experts.down_proj_blocks"
    for bad in (tensors[name][..., :8], tensors[name].reshape(E, H, -1), tensors[name].to(torch.int8)):
        with pytest.raises(InvalidInput, match=re.escape(name) + r": expected uint8 of shape \[4, 128, 4, 16\]"):
            _mxfp4_loader().add(name, bad)
    save_file({**tensors, name: tensors[name][..., :8].contiguous()}, str(tmp_path / "m.safetensors"))
    with pytest.raises(InvalidInput, match=re.escape(name)):
        load_safetensors(tmp_path / "m.safetensors", P, _mxfp4_loader())


def test_mxfp4_tensors_are_understood_and_refused_by_other_formats_as_not_theirs():
    assert _mxfp4_loader().wants(f"{P}.experts.gate_up_proj_blocks")
    with pytest.raises(InvalidInput, match=r"gate_up_proj_blocks: expected one of the bf16 tensors .*got 'blocks'"):
        ExpertCheckpointLoader("bf16", E, H, I).add(
            f"{P}.experts.gate_up_proj_blocks", _mxfp4()[f"{P}.experts.gate_up_proj_blocks"]
        )
