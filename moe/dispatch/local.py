"""The single-rank dispatcher: rows sorted by expert, counts, and the inverse permutation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.dispatch.base import DispatchFormat, DispatchOutput, Dispatcher
from moe.routing import Routing
from moe.schemes.base import Quantizer


@dataclass(frozen=True)
class _LocalHandle:
    routing: Routing
    inverse: torch.Tensor  #: sorted row of each flat (token, slot) pair


class LocalDispatcher(Dispatcher):
    """One rank holds every expert: quantize each token once, then gather its k rows sorted
    by expert. No communication and no host synchronisation."""

    format = DispatchFormat.STANDARD

    def dispatch(self, hidden_states: torch.Tensor, routing: Routing, quantize: Quantizer) -> DispatchOutput:
        """Rows `[T * k, H]` in the planned dtype, sorted by expert (token order within one), handed over
        as the quantized tokens and the token of each sorted row: the gather is left to the experts' GEMM."""
        _, inverse, counts, token_of_row = self.sort_pairs(routing.topk_ids, tokens=True)
        return DispatchOutput(
            self.format, quantize(hidden_states), counts, _LocalHandle(routing, inverse), row_index=token_of_row
        )

    def combine(self, expert_output: torch.Tensor, dispatched: DispatchOutput, out_dtype: torch.dtype) -> torch.Tensor:
        """Un-sort the expert rows and take each token's weighted sum."""
        handle: _LocalHandle = dispatched.handle
        return self.combine_rows(expert_output, handle.inverse, handle.routing, out_dtype)
