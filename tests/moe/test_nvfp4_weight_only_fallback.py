"""NVFP4 layers on a GPU without fp4 tensor cores: the CUDA vendor's declared H100 table (on the reference
ops, so no GPU is needed) converts the nvfp4 scheme to w4a16-nvfp4. Weights that arrive in nvfp4's format
(checkpoints) are kept bit for bit; float weights are stored as nvfp4 stores them first; the activations
stay bf16, and the layer stays within the declared bound of the float64 layer of the stored weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import conformance.suite.test_scheme_fallbacks as fallback_checks
import moe
from conformance import reference
from conformance.capability import build_scheme
from conformance.reference import relative_error
from hal import DispatchDtype, KernelLimits, LayerSpec
from hal.reference import dequantize_weight
from vendors.cpu import CpuVendor
from vendors.cuda.capabilities import DECLARED_MODELS, cuda_capabilities

E, H, I = 16, 256, 96


class DeclaredH100(CpuVendor):
    """The H100's declared capability table, computed by the reference ops."""

    name = "declared-h100"

    def _detect_capabilities(self):  # type: ignore[no-untyped-def]
        declared = cuda_capabilities(*DECLARED_MODELS["H100"])
        return dataclasses.replace(
            declared,
            limits=KernelLimits(),
            ep_dispatchers=frozenset(),
            ep_low_latency=frozenset(),
            ep_dispatchers_absent={},
            graph_capture=False,
        )


def _float_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, H, 2 * I, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / I**0.5


@pytest.mark.parametrize("top_k", [1, 8])
def test_the_conformance_check_of_the_declared_nvfp4_fallback_holds(top_k):
    fallback_checks.test_declared_scheme_fallback_stays_within_its_bound(DeclaredH100(), "quick", "nvfp4", top_k)


def test_nvfp4_checkpoint_weights_run_weight_only_as_they_are_stored():
    vendor = DeclaredH100()
    scheme = build_scheme("nvfp4", input_amax=4.0, intermediate_amax=4.0)
    w13, w2 = _float_weights()
    stored = scheme.quantize_weights(CpuVendor(), w13, w2)  # as an nvfp4 checkpoint holds them
    layer = moe.MoELayer(H, I, E, 4, scheme=scheme, vendor=vendor, environ={})
    assert (layer.scheme.name, layer.source_scheme.name) == ("w4a16-nvfp4", "nvfp4")
    assert layer.plan.resolved is DispatchDtype.BF16
    layer.load_expert_weights(stored)
    held = layer.expert_weights
    for name in ("w13", "w2"):
        for part in ("data", "scale", "global_scale"):
            assert torch.equal(getattr(getattr(held, name), part), getattr(getattr(stored, name), part)), (name, part)
    g = torch.Generator().manual_seed(1)
    x, logits = torch.randn(64, H, generator=g).to(torch.bfloat16), torch.randn(64, E, generator=g)
    ids, weights = reference.softmax_topk(logits, 4)
    want = reference.moe_by_expert(x, ids, weights, dequantize_weight(stored.w13), dequantize_weight(stored.w2))
    bound = vendor.capabilities().scheme_fallbacks["nvfp4"].max_error
    assert relative_error(layer(x, logits), want) <= bound
    assert "scheme fallback: nvfp4 -> w4a16-nvfp4" in layer.explanation.text()


def test_an_nvfp4_layer_before_sm89_is_refused_with_the_reason():
    caps = cuda_capabilities(*DECLARED_MODELS["A100"])
    problems = [p.message for p in LayerSpec(H, I, E, 2, scheme="nvfp4").problems(caps)]
    assert any("bf16 x nvfp4 weight-only GEMM needs sm89+" in p for p in problems), problems
