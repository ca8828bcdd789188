"""`MoEBlock`: a transformers MoE block's forward, computed by a `moe.MoELayer`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hal import invalid
from moe import MoELayer
from moe.integrations.transformers.architectures import Architecture, Returns


class MoEBlock(torch.nn.Module):
    """Stands in for one HF MoE block: same `forward(hidden_states)`, same return structure.

    The router logits are computed here from the HF router's own weight (and bias), as a
    plain linear in the dtype HF uses (`Architecture.logits_dtype`, else the hidden
    states'); with `record_router_logits` the HF router module itself is called instead, so
    transformers' `output_router_logits` (and its auxiliary loss) sees them. The logits go to
    `layer` (`moe` attribute), which routes with its `moe.Router`, computes the routed and
    shared experts and returns the output in the input's dtype.

    The HF router stays a child module under its HF name (so `.to()` moves it); the original
    block is kept outside the module tree (not in `state_dict()`, not moved by `.to()`) and
    given back by `original` for `restore_moe_blocks`.
    """

    def __init__(
        self,
        layer: MoELayer,
        router: torch.nn.Module,
        architecture: Architecture,
        model_type: str,
        original: torch.nn.Module | None,
        record_router_logits: bool = False,
    ) -> None:
        super().__init__()
        self.moe = layer
        self.router_name = architecture.router
        self.add_module(self.router_name, router)
        self.architecture = architecture
        self.model_type = model_type
        self.record_router_logits = bool(record_router_logits)
        self._original = (original,)  # a tuple, so nn.Module does not register it as a child

    @property
    def original(self) -> torch.nn.Module | None:
        """The HF block this one replaced (None when it was not kept)."""
        return self._original[0]

    @property
    def hf_router(self) -> torch.nn.Module:
        """The HF block's router module (weight `[E, H]`)."""
        return self.get_submodule(self.router_name)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits `[T, E]` of rows `x` `[T, H]`, as the HF router computes them."""
        router = self.hf_router
        if self.record_router_logits:
            out = router(x)
            return out[self.architecture.logits_index] if isinstance(out, tuple) else out
        dtype = self.architecture.logits_dtype or x.dtype
        bias = getattr(router, "bias", None)
        return F.linear(x.to(dtype), router.weight.to(dtype), bias.to(dtype) if bias is not None else None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The block's output for `hidden_states` `[..., H]`, structured as the HF block returns it."""
        width = self.moe.hidden_size
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() == 0 or hidden_states.shape[-1] != width:
            given = (
                tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
            )
            raise invalid("hidden_states", f"a tensor [..., {width}] (the block's hidden size last)", given)
        x = hidden_states.reshape(-1, width)
        logits = self.router_logits(x)
        returns = self.architecture.returns
        if returns is Returns.HIDDEN_AND_SCORES:
            routing = self.moe.router(logits)
            out = self.moe(x, topk_ids=routing.topk_ids, topk_weights=routing.topk_weights)
            return out.view(hidden_states.shape), routing.topk_weights.to(logits.dtype)
        out = self.moe(x, logits)
        if returns is Returns.FLAT_AND_LOGITS:
            return out, logits
        return out.view(hidden_states.shape)

    def extra_repr(self) -> str:
        return f"model_type={self.model_type!r}, returns={self.architecture.returns.value!r}"
