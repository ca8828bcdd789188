"""Shared experts: always-on dense MLPs computed beside the routed experts (DeepSeek, Qwen2-MoE, Llama-4).

A model's shared experts are one MLP of their own intermediate size (DeepSeek's n shared
experts of size I are one MLP of size n*I: their outputs add up exactly like the halves of
one wider MLP). It runs with the routed experts' scheme and activation, as a grouped
matmul of one group through `hal`, and its output is added to the routed output, scaled
per token by `sigmoid(x @ gate)` when the model gates it (Qwen2-MoE's `shared_expert_gate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hal import Activation, Groups, InvalidInput, ScaleLayout, Vendor, invalid, positive_int, refuse_non_finite
from moe.schemes import ExpertWeights, QuantScheme
from moe.runners import first_projection
from moe.weight_store import WeightStore


@dataclass(frozen=True)
class SharedExperts:
    """The shape of a layer's shared experts: their intermediate size and whether a gate scales them."""

    intermediate_size: int
    gated: bool = False

    def __post_init__(self) -> None:
        positive_int("shared_experts.intermediate_size", self.intermediate_size)
        if not isinstance(self.gated, bool):
            raise invalid("shared_experts.gated", "True or False", self.gated)


class SharedExpertsBlock(torch.nn.Module):
    """The shared experts' weights (a one-expert `WeightStore`, `store`) and gate (`gate`, `[H]`)."""

    def __init__(
        self,
        config: SharedExperts,
        layouts: tuple[ScaleLayout, ScaleLayout],
        activation: Activation,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.config = config
        self._device = device
        self.store = WeightStore(layouts, activation, device)
        self.register_buffer("gate", None)

    def load(self, weights: ExpertWeights, gate: torch.Tensor | None, hidden_size: int) -> None:
        """Store one-expert weights and the gate (copied)."""
        if weights.num_experts != 1:
            raise invalid("shared expert weights", "one expert (E == 1)", weights.num_experts)
        if self.config.gated:
            if not isinstance(gate, torch.Tensor) or gate.numel() != hidden_size or not torch.is_floating_point(gate):
                got = f"{gate.dtype} {tuple(gate.shape)}" if isinstance(gate, torch.Tensor) else gate
                raise invalid("shared expert gate", f"a float tensor of {hidden_size} elements ([H] or [1, H])", got)
            refuse_non_finite("shared expert gate", gate)
            self.gate = gate.detach().reshape(hidden_size).to(device=weights.w13.data.device).clone()
        elif gate is not None:
            raise InvalidInput(
                "shared expert gate: expected None (built with SharedExperts(gated=False)), got a tensor"
            )
        self.store.store(weights)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        saved = state_dict.get(prefix + "gate")
        if isinstance(saved, torch.Tensor) and self.gate is None:  # a fresh block: take the saved gate's shape
            self.gate = torch.empty(saved.shape, dtype=saved.dtype, device=self._device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, vendor: Vendor, scheme: QuantScheme, x: torch.Tensor) -> torch.Tensor:
        """The shared experts' output for rows `x` `[T, H]`, fp32 `[T, H]`."""
        weights = self.store.weights
        if weights is None:
            raise InvalidInput("MoELayer: expected shared expert weights; call load_shared_experts()")
        groups = Groups.from_counts(torch.full((1,), x.shape[0], dtype=torch.int64, device=x.device))
        out_dtype = scheme.output_dtype()
        h = first_projection(
            vendor, scheme.gemm_operand(vendor, x, weights.input_global_scale), weights, groups, out_dtype
        )
        out = vendor.grouped_matmul(
            scheme.gemm_operand(vendor, h, weights.intermediate_global_scale),
            weights.w2,
            groups,
            out_dtype=out_dtype,
            bias=weights.w2_bias,
        ).to(torch.float32)
        if self.gate is not None:
            out = out * torch.sigmoid(x.to(torch.float32) @ self.gate.to(device=x.device, dtype=torch.float32))[:, None]
        return out
