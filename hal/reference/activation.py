"""Reference activations of the experts' intermediate result (the kinds of `hal.ActivationKind`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hal import checks
from hal.activations import Activation, ActivationKind


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :I]) * x[..., I:]` for `x` of shape `[..., 2I]`, computed in fp32, returned in x.dtype."""
    return silu_glu(checks.swiglu_input(x))


def activate(x: torch.Tensor, activation: Activation | ActivationKind | str) -> torch.Tensor:
    """`activation` applied to `x` (`[..., 2I]` as `[gate | up]` for gated kinds, `[..., I]` for plain
    ones), computed in fp32, returned in x.dtype."""
    parsed = Activation.parse(activation)
    return apply_activation(checks.activation_input(x, parsed), parsed)


def silu_glu(x: torch.Tensor) -> torch.Tensor:
    """`swiglu` of a checked input."""
    half = x.shape[-1] // 2
    xf = x.to(torch.float32)
    return (F.silu(xf[..., :half]) * xf[..., half:]).to(x.dtype)


def apply_activation(x: torch.Tensor, activation: Activation) -> torch.Tensor:
    """`activate` of a checked input."""
    kind = activation.kind
    xf = x.to(torch.float32)
    if not kind.gated:
        return _plain(kind, xf).to(x.dtype)
    half = x.shape[-1] // 2
    gate, up = xf[..., :half], xf[..., half:]
    if kind is ActivationKind.SWIGLU_OAI:
        gate = gate.clamp(max=activation.limit)
        up = up.clamp(min=-activation.limit, max=activation.limit)
        return ((up + 1) * gate * torch.sigmoid(activation.alpha * gate)).to(x.dtype)
    plain = {
        ActivationKind.SILU_GLU: ActivationKind.SILU,
        ActivationKind.GELU_GLU: ActivationKind.GELU,
        ActivationKind.GELU_TANH_GLU: ActivationKind.GELU_TANH,
    }[kind]
    return (_plain(plain, gate) * up).to(x.dtype)


def _plain(kind: ActivationKind, x: torch.Tensor) -> torch.Tensor:
    if kind is ActivationKind.SILU:
        return F.silu(x)
    if kind is ActivationKind.GELU:
        return F.gelu(x)
    if kind is ActivationKind.GELU_TANH:
        return F.gelu(x, approximate="tanh")
    return F.relu(x)
