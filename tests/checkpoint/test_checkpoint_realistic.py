"""Realistic shapes: 64 experts, H = 1000 (no multiple of 128; nvfp4 1008), I = 768, one rank of 8 x 2
(expert x tensor parallel) reading a sharded checkpoint; and a top-8 layer of 16 experts from a checkpoint."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import moe
from conformance.tolerances import layer_tolerance
from hal import DispatchConfig
from hal.reference import weight_value
from moe.checkpoint import ExpertCheckpointLoader, load_safetensors
from tests.support.checkpoint_synthetic import (
    HF,
    PROJECTIONS,
    Synthetic,
    encode_fp8,
    encode_fp8_block,
    encode_int8,
    encode_nvfp4,
    master,
    per_expert,
)
from tests.support.moe_reference import reference_moe, relative_error, softmax_topk

pytestmark = pytest.mark.slow  # realistic shapes: seconds to tens of seconds each on a CPU

PREFIX = "model.layers.7.mlp"
E, I, LOCAL, TP_RANK, TP = 64, 768, range(40, 48), 1, 2


def input_scale(e: int, p: str) -> float:
    return (1.0 + 0.01 * e + (0.5 if p == "down" else 0.0)) / 448


ENCODERS = {
    "fp8-block128": (1000, lambda w, e, p: encode_fp8_block(w)),
    "fp8": (1000, lambda w, e, p: encode_fp8(w, per_channel=True, scale_shape=(-1, 1), input_scale=input_scale(e, p))),
    "int8": (1000, lambda w, e, p: encode_int8(w)),
    "nvfp4": (1008, lambda w, e, p: encode_nvfp4(w, input_scale(e, p))),
}


def checkpoint(fmt: str) -> Synthetic:
    """64 experts on disk; the float64 values of this rank's 8 (the others hold copies of one of them,
    with their own input scales: every tensor has the right name, shape and dtype)."""
    hidden, encode = ENCODERS[fmt]
    out = Synthetic(hidden, I, E)
    template: dict[str, dict[str, torch.Tensor]] = {}
    for e in LOCAL:
        for i, p in enumerate(PROJECTIONS):
            n, k = (hidden, I) if p == "down" else (I, hidden)
            stored, out.values[(e, p)] = encode(master((n, k), 31 * e + i), e, p)
            template[p] = stored
            out.tensors.update({f"{PREFIX}.experts.{e}.{HF[p]}.{kind}": t for kind, t in stored.items()})
    for e in set(range(E)) - set(LOCAL):
        for p in PROJECTIONS:
            for kind, t in template[p].items():
                value = torch.tensor(input_scale(e, p)) if kind == "input_scale" else t.clone()
                out.tensors[f"{PREFIX}.experts.{e}.{HF[p]}.{kind}"] = value
    out.input_scales = {(e, p): float(torch.tensor(input_scale(e, p))) for e in range(E) for p in PROJECTIONS}
    return out


@pytest.mark.parametrize("fmt", list(ENCODERS))
def test_one_rank_of_a_64_expert_checkpoint(tmp_path, fmt):
    ckpt = checkpoint(fmt)
    names = sorted(ckpt.tensors)
    paths = []
    for s in range(4):
        paths.append(tmp_path / f"model-{s}.safetensors")
        save_file({n: ckpt.tensors[n] for n in names[s::4]}, str(paths[-1]))
    loader = ExpertCheckpointLoader(fmt, E, ckpt.hidden, I, local_experts=LOCAL, tp_rank=TP_RANK, tp_size=TP)
    load_safetensors(paths, PREFIX, loader)
    built = loader.build()
    w13, w2 = ckpt.expected(LOCAL, TP_RANK, TP)
    rtol = 2.0**-23 if fmt == "nvfp4" else 0.0
    torch.testing.assert_close(weight_value(built.w13), w13, rtol=rtol, atol=0)
    torch.testing.assert_close(weight_value(built.w2), w2, rtol=rtol, atol=0)
    scheme = loader.scheme()
    if fmt in ("fp8", "nvfp4"):  # the largest input scale of all 64 experts, on every rank
        largest = max(v for (e, p), v in ckpt.input_scales.items() if p != "down")
        got = scheme.input_scale if fmt == "fp8" else 1 / scheme.input_global_scale
        assert got == pytest.approx(largest, rel=1e-15)  # (1 / (1 / s) in float64)


@pytest.mark.parametrize("fmt", ["fp8-block128", "nvfp4"])
def test_a_top8_layer_of_16_experts_from_a_checkpoint(fmt):
    hidden, encode = ENCODERS[fmt]
    experts, inter, top_k = 16, 384, 8
    ckpt = per_expert(encode, hidden, inter, experts, PREFIX, seed=3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(96, experts, generator=g)
    w13, w2 = ckpt.expected(range(experts))
    gate, up = (x.double() @ w13).chunk(2, dim=-1)
    calibrated = {
        "gate": float(x.abs().max()) / 2688,
        "up": float(x.abs().max()) / 2688,
        "down": float((gate * torch.sigmoid(gate) * up).abs().max()) / 2688,
    }  # ModelOpt: amax / (448 * 6)
    for name in [n for n in ckpt.tensors if n.endswith("input_scale")]:
        ckpt.tensors[name] = torch.tensor(calibrated["down" if ".down_proj." in name else "gate"])
    loader = ExpertCheckpointLoader(fmt, experts, hidden, inter)
    for name, t in ckpt.tensors.items():
        loader.add(name, t)
    scheme = loader.scheme()
    dispatch = DispatchConfig(dtype="bf16") if fmt == "nvfp4" else None
    layer = moe.MoELayer(hidden, inter, experts, top_k, scheme=scheme, dispatch=dispatch, vendor="cpu", environ={})
    layer.load_expert_weights(loader.build())
    ids, weights = softmax_topk(logits, top_k)
    ref = reference_moe(x, ids, weights, w13, w2)
    assert relative_error(layer(x, logits), ref) <= layer_tolerance(scheme.name, str(layer.plan.resolved))
