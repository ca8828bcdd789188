"""`hal.Activation`: names, aliases, parameters and refusals; `Vendor.activate` and expert biases refuse
bad operands with one clear error."""

from __future__ import annotations

import pytest
import torch

import hal
from hal import Activation, ActivationKind, Groups, InvalidInput, QuantizedWeight


@pytest.mark.parametrize(
    "name, kind",
    [
        ("silu-glu", ActivationKind.SILU_GLU),
        ("SwiGLU", ActivationKind.SILU_GLU),
        ("silu_and_mul", ActivationKind.SILU_GLU),
        ("geglu", ActivationKind.GELU_GLU),
        ("gelu_and_mul", ActivationKind.GELU_GLU),
        ("gelu_pytorch_tanh_glu", ActivationKind.GELU_TANH_GLU),
        ("gelu_tanh_and_mul", ActivationKind.GELU_TANH_GLU),
        ("swigluoai", ActivationKind.SWIGLU_OAI),
        ("swiglu_oai", ActivationKind.SWIGLU_OAI),
        ("gelu", ActivationKind.GELU),
        ("RELU", ActivationKind.RELU),
        ("gelu_pytorch_tanh", ActivationKind.GELU_TANH),
        (ActivationKind.SILU, ActivationKind.SILU),
    ],
)
def test_names_and_aliases(name, kind):
    assert Activation.parse(name).kind is kind


def test_gated_kinds_and_widths():
    assert {k for k in ActivationKind if k.gated} == {
        ActivationKind.SILU_GLU,
        ActivationKind.GELU_GLU,
        ActivationKind.GELU_TANH_GLU,
        ActivationKind.SWIGLU_OAI,
    }
    assert Activation.parse("gelu-glu").input_width(96) == 192 and Activation.parse("relu").input_width(96) == 96
    assert str(Activation("swiglu-oai", alpha=1.5, limit=3.0)) == "swiglu-oai(alpha=1.5, limit=3)"


@pytest.mark.parametrize("bad", ["tanh", "", None, 3, "gelu glu"])
def test_unknown_names_are_refused_listing_the_kinds(bad):
    with pytest.raises(InvalidInput, match="silu-glu, gelu-glu"):
        Activation.parse(bad)


@pytest.mark.parametrize(
    "field, value", [("alpha", 0), ("alpha", float("inf")), ("limit", -1.0), ("limit", True), ("alpha", "1.7")]
)
def test_parameters_must_be_finite_and_positive(field, value):
    with pytest.raises(InvalidInput, match=field):
        Activation("swiglu-oai", **{field: value})


def test_swiglu_oai_clamps_as_gpt_oss_does():
    gate = torch.tensor([[10.0, -10.0, 0.5]])
    up = torch.tensor([[10.0, -10.0, 0.5]])
    got = hal.reference.activate(torch.cat([gate, up], dim=-1), Activation("swiglu-oai", alpha=1.702, limit=7.0))
    g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    assert torch.allclose(got, (u + 1) * g * torch.sigmoid(1.702 * g))


def test_bad_operands_raise_one_clear_error():
    cpu = hal.get_vendor("cpu")
    with pytest.raises(InvalidInput, match="even size"):
        cpu.activate(torch.randn(3, 7), "silu-glu")
    with pytest.raises(InvalidInput, match="bf16, fp16 or fp32"):
        cpu.activate(torch.randint(0, 3, (3, 8)), "gelu")
    w = QuantizedWeight(torch.randn(2, 8, 6))
    groups = Groups.from_counts(torch.tensor([2, 1]))
    with pytest.raises(InvalidInput, match=r"bias: expected a tensor of shape \(2, 6\)"):
        cpu.grouped_matmul(torch.randn(3, 8), w, groups, bias=torch.randn(3, 6))
