"""Helpers of the loading tests: a layer's state and output before a load, and the check that nothing changed."""

from __future__ import annotations

import torch

import moe


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality of two tensors of any dtype (float8 codes compared as bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a, b) or bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


class Before:
    """A layer's `state_dict()` and its output for fixed inputs, taken before a load is tried."""

    def __init__(self, layer: moe.MoELayer, tokens: int = 9, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(tokens, layer.hidden_size, generator=g).to(torch.bfloat16)
        self.logits = torch.randn(tokens, layer.num_experts, generator=g)
        self.state = {k: v.clone() for k, v in layer.state_dict().items()}
        self.out = layer(self.x, self.logits)

    def unchanged(self, layer: moe.MoELayer) -> None:
        """Assert that the layer's state dict and forward are still the ones taken."""
        state = layer.state_dict()
        assert state.keys() == self.state.keys()
        for key, t in state.items():
            assert same(t, self.state[key]), key
        assert torch.equal(layer(self.x, self.logits), self.out)
