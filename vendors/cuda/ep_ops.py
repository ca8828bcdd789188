"""The CUDA ops' expert-parallel dispatcher "deepep" (a mixin of `CudaOps`): the seam between `hal.Vendor`'s
`prepare_ep` / `ep_dispatch` / `ep_combine` and DeepEP's buffers (`vendors.cuda.deepep`)."""

from __future__ import annotations

import torch

from hal import DispatchDtype, QuantizedTensor, ScaleLayout, UnsupportedCapability
from vendors.cuda.deepep import DEEPEP, DeepEp


class DeepEpOps:
    """DeepEP's normal and low-latency modes behind the op seam; the buffers are made on first use."""

    _deepep: DeepEp | None

    def prepare_ep(
        self,
        name: str,
        *,
        process_group: object,
        num_experts: int,
        hidden_size: int,
        dtype: DispatchDtype,
        capacity: int | None,
        layout: ScaleLayout | None = None,
    ) -> None:
        """Make (or grow) the DeepEP buffer a layer needs, refusing what DeepEP cannot serve (`vendors.cuda.deepep`)."""
        self._ep(name).prepare(
            process_group,
            num_experts=num_experts,
            hidden_size=hidden_size,
            dtype=dtype,
            capacity=capacity,
            layout=layout,
        )

    def ep_dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        name: str,
        dtype: DispatchDtype,
        num_experts: int,
        process_group: object,
        topk_weights: torch.Tensor | None = None,
        capacity: int | None = None,
        layout: ScaleLayout | None = None,
    ) -> tuple[QuantizedTensor, torch.Tensor, object]:
        """DeepEP's normal dispatch (no `capacity`) or low-latency dispatch (`vendors.cuda.deepep`)."""
        return self._ep(name).dispatch(
            x,
            topk_ids,
            dtype=dtype,
            num_experts=num_experts,
            process_group=process_group,
            topk_weights=topk_weights,
            capacity=capacity,
            layout=layout,
        )

    def ep_combine(
        self, rows: torch.Tensor, topk_weights: torch.Tensor, handle: object, *, name: str, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """DeepEP's combine for the handle's mode (`vendors.cuda.deepep`)."""
        return self._ep(name).combine(rows, topk_weights, handle, out_dtype=out_dtype)

    def release_ep(self) -> None:
        """Destroy the DeepEP buffers (collective: every rank calls it, e.g. before destroying the process group)."""
        if self._deepep is not None:
            self._deepep.release()

    def _ep(self, name: str) -> DeepEp:
        if name != DEEPEP:
            raise UnsupportedCapability(
                f"no expert-parallel dispatcher {name!r} in the CUDA ops (they have {DEEPEP!r})"
            )
        if self._deepep is None:
            self._deepep = DeepEp(self)  # type: ignore[arg-type]  # self is the CudaOps
        return self._deepep
