"""The CUDA vendor's weight-only 4-bit grouped GEMMs: bf16 activations times MXFP4 or NVFP4 expert weights.

`GemmKind.BF16_MXFP4` (e8m0 scales per 32 values along K) and `GemmKind.BF16_NVFP4` (e4m3 scales per 16
values, an fp32 global scale per expert or per column) run the Triton kernel of
`kernels/grouped_gemm_fp4.py`, which decodes the packed weights tile by tile in registers: the weights stay
4-bit in memory and no full-precision copy is ever made. The experts' biases and SiLU-GLU or gpt-oss's
swiglu-oai run in the kernel's epilogue (other activations after it); a dispatch's row index is read by
the kernel's loads (no gathered copy).
"""

from __future__ import annotations

import torch

from hal import Activation, ActivationKind, GemmKind, Groups, PackedInt4Tensor, QuantizedTensor, QuantizedWeight
from vendors.cuda.kernels.grouped_gemm_fp4 import grouped_gemm_fp4
from vendors.cuda.kernels.split_scratch import SplitScratch

#: The weight-only kinds, and whether each one's scales are e8m0 (MXFP4).
WEIGHT_ONLY_KINDS = {GemmKind.BF16_MXFP4: True, GemmKind.BF16_NVFP4: False}
#: The activations the kernel's epilogue applies.
IN_EPILOGUE = frozenset({ActivationKind.SILU_GLU, ActivationKind.SWIGLU_OAI})


class WeightOnlyOps:
    """The weight-only kinds of the grouped-matmul ops (a mixin of the CUDA vendor's ops: the other kinds go
    on to the next class)."""

    pdl: bool
    #: K split at decode (`grouped_gemm_fp4.decode_split_k`); its scratch is kept per stream (`split_scratch`).
    split_fp4_decode: bool = True
    split_scratch: SplitScratch | None = None
    notes = {
        "grouped_matmul_biased": "bf16 x fp4: the bias, then SiLU-GLU or swiglu-oai, in the Triton GEMM's "
        "epilogue, rows read through the index; other kinds: the product, the reference's bias, the activation"
    }

    def grouped_matmul(
        self,
        x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
        weight: QuantizedWeight,
        groups: Groups,
        *,
        kind: GemmKind,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """`y[rows of g] = x[rows of g] @ dequant(weight[g])` for the weight-only kinds."""
        if kind not in WEIGHT_ONLY_KINDS:
            return super().grouped_matmul(x, weight, groups, kind=kind, out_dtype=out_dtype)  # type: ignore[misc]
        return self._weight_only(x, weight, groups, kind, out_dtype, activation=None, row_index=None)

    def grouped_matmul_activated(
        self,
        x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
        weight: QuantizedWeight,
        groups: Groups,
        *,
        kind: GemmKind,
        out_dtype: torch.dtype,
        activation: Activation,
    ) -> torch.Tensor:
        """SiLU-GLU or swiglu-oai in the kernel's epilogue; other activations after the product."""
        if kind not in WEIGHT_ONLY_KINDS or activation.kind not in IN_EPILOGUE:
            return super().grouped_matmul_activated(  # type: ignore[misc]
                x, weight, groups, kind=kind, out_dtype=out_dtype, activation=activation
            )
        return self._weight_only(x, weight, groups, kind, out_dtype, activation=activation, row_index=None)

    def grouped_matmul_gathered(
        self,
        x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
        row_index: torch.Tensor,
        weight: QuantizedWeight,
        groups: Groups,
        *,
        kind: GemmKind,
        out_dtype: torch.dtype,
        activation: Activation | None,
    ) -> torch.Tensor:
        """The kernel reads x's rows through `row_index`; SiLU-GLU or swiglu-oai in its epilogue, other
        activations after."""
        if kind not in WEIGHT_ONLY_KINDS:
            return super().grouped_matmul_gathered(  # type: ignore[misc]
                x, row_index, weight, groups, kind=kind, out_dtype=out_dtype, activation=activation
            )
        return self._then_activated(x, weight, groups, kind, out_dtype, activation, row_index=row_index)

    def grouped_matmul_biased(
        self,
        x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
        weight: QuantizedWeight,
        groups: Groups,
        bias: torch.Tensor,
        *,
        kind: GemmKind,
        out_dtype: torch.dtype,
        activation: Activation | None,
        row_index: torch.Tensor | None,
    ) -> torch.Tensor:
        """The bias added in the kernel's epilogue, before SiLU-GLU or swiglu-oai there (other activations
        after); x's rows read through `row_index`."""
        if kind not in WEIGHT_ONLY_KINDS:
            return super().grouped_matmul_biased(  # type: ignore[misc]
                x, weight, groups, bias, kind=kind, out_dtype=out_dtype, activation=activation, row_index=row_index
            )
        return self._then_activated(x, weight, groups, kind, out_dtype, activation, row_index=row_index, bias=bias)

    def _then_activated(
        self,
        x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
        weight: QuantizedWeight,
        groups: Groups,
        kind: GemmKind,
        out_dtype: torch.dtype,
        activation: Activation | None,
        *,
        row_index: torch.Tensor | None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The kernel with the activation in its epilogue where it can be, else after it."""
        fused = activation if activation is not None and activation.kind in IN_EPILOGUE else None
        y = self._weight_only(x, weight, groups, kind, out_dtype, activation=fused, row_index=row_index, bias=bias)
        if activation is None or fused is not None:
            return y
        return self.activate(y, activation=activation)  # type: ignore[attr-defined]

    def _weight_only(
        self,
        x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
        weight: QuantizedWeight,
        groups: Groups,
        kind: GemmKind,
        out_dtype: torch.dtype,
        *,
        activation: Activation | None,
        row_index: torch.Tensor | None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One kernel call; `activation` (SiLU-GLU, swiglu-oai or None) in its epilogue."""
        data = x if isinstance(x, torch.Tensor) else x.data  # bf16 rows, or rows carried as bf16
        oai = activation is not None and activation.kind is ActivationKind.SWIGLU_OAI
        return grouped_gemm_fp4(
            data,
            weight.data,
            weight.scale,  # type: ignore[arg-type]
            groups.counts().to(data.device),
            out_dtype,
            mx=WEIGHT_ONLY_KINDS[kind],
            global_scale=weight.global_scale,
            gated=activation is not None,
            row_index=row_index,
            pdl=self.pdl,
            split_k=None if self.split_fp4_decode else 1,
            scratch=self.split_scratch,
            bias=bias,
            swiglu_oai=(activation.alpha, activation.limit) if oai else None,  # type: ignore[union-attr]
        )
