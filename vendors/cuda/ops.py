"""`CudaOps`: the hal ops on CUDA devices, through Triton kernels and torch's grouped GEMMs.

Each op and its kernel:

- quantize and dequantize, symmetric one-byte dtypes (fp8, int8) per token or per 128 channels: Triton, one pass
  (`kernels/quantize.py`, `quantize_ops.py`); cast dtypes (bf16): a cast
- grouped matmul bf16 / fp8 row-wise: `torch._grouped_mm` (sm90+) / `torch._scaled_grouped_mm` (sm90) for
  many rows per group (`torch_grouped.py`), else the Triton grouped GEMM
- grouped matmul fp16, fp32, int8, fp8 row-wise, fp8 128x128-block: the Triton grouped GEMM
  (`kernels/grouped_gemm.py`); fp8 128x128-block at prefill: DeepGEMM where installed (sm90, `deep_gemm_runner.py`),
  else the Triton kernel's TMA-fed form (`kernels/grouped_gemm_tma.py`) where the tiles say so
- grouped matmul bf16 where the tuned table names `quack`: quack-kernels' CuTe DSL variable-length GEMM (sm90,
  `quack_runner.py`; a first projection's rows read through the index, SiLU-GLU a separate pass after)
- grouped matmul + SiLU-GLU (the experts' first projection): the Triton grouped GEMM with the activation in
  its epilogue; torch's GEMMs and DeepGEMM take the swiglu pass after (DeepGEMM's reads its aligned rows)
- grouped matmul through a row index (the dispatch's gather): the Triton grouped GEMM reads its rows
  through the index or gathers them first (Triton, one pass per tensor: `kernels/gather.py`), as the tuned
  table says (without an entry, one-byte rows through the index up to 32 rows per group); torch's GEMMs: a
  gather first
- swiglu: Triton, one pass
- softmax top-k routing and the sort by expert (`routing_ops.py`): Triton, one launch of softmax, k rounds of
  argmax, renormalization (<= 1024 experts), which at decode also sorts the pairs; counting sorts otherwise (one
  program, two launches above; torch's radix sort past 2**24 pairs x padded experts), writing each sorted
  row's token (the row index) in the same pass
- weighted combine: Triton, one pass: gather the k rows, weigh in fp32, write once
- weight quantization: the reference, then one-byte weights stored K-major (each expert's `[K, N]` as
  a transposed `[N, K]`), the operand layout Hopper's 8-bit tensor-core instructions read
- bf16 x mxfp4 / nvfp4 weights: `weight_only.py`; the rest (int4, nvfp4): `hal.reference.ReferenceOps`
- expert-parallel dispatch "deepep" (prepare_ep, ep_dispatch, ep_combine): DeepEP v1.2.1's buffers,
  normal and low-latency modes (`vendors/cuda/deepep.py`; declared where `deep_ep` imports)
- every Triton launch (sm90+, Triton 3.4+): programmatic dependent launch: each kernel's launch
  overlaps the tail of the one before; it waits for that kernel before reading
  (`kernels/dependent.py`; `CudaVendor(dependent_launch=False)` turns it off)

This module imports Triton: the vendor builds `CudaOps` only where Triton imports, once,
when its ops are first needed. No op reads a value back on the host: group sizes stay on
the device and scheduling is done inside the kernels, so the MoE layer's forward can be
captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import ModuleType

import torch

from hal import (
    FLOAT_DTYPES,
    Activation,
    ActivationKind,
    GemmKind,
    Groups,
    PackedInt4Tensor,
    QuantizedTensor,
    QuantizedWeight,
    ReferenceOps,
    ScaleLayout,
    take_rows,
)
from vendors.cuda.counting import CountingOps
from vendors.cuda.deep_gemm_runner import deep_gemm_grouped, deep_gemm_or_fallback, take
from vendors.cuda.deepep import DeepEp
from vendors.cuda.ep_ops import DeepEpOps
from vendors.cuda.graphs import CapturingOps
from vendors.cuda.kernels import activation, combine, grouped_gemm
from vendors.cuda.kernels.gather import gather_rows
from vendors.cuda.kernels.split_scratch import SplitScratch
from vendors.cuda.quack_runner import GemmFn, Quack, quack_or_fallback, quack_or_none
from vendors.cuda.quantize_ops import QuantizeOps
from vendors.cuda.routing_ops import RoutingOps
from vendors.cuda.row_reading import ONE_BYTE_GATHER_MAX_ROWS_PER_GROUP, reads_through_index
from vendors.cuda.streams import SideStreams
from vendors.cuda.torch_grouped import GROUPED_MM_MIN_ROWS_PER_GROUP as GROUPED_MM_MIN_ROWS
from vendors.cuda.torch_grouped import SCALED_GROUPED_MM_MIN_ROWS_PER_GROUP as SCALED_MIN_ROWS
from vendors.cuda.torch_grouped import grouped_mm_by_default, log_unserved_choice, torch_grouped, torch_grouped_fits
from vendors.cuda.tuning import GROUPED_MM, TRITON, Choice, TuningTable, forced_choice
from vendors.cuda.weight_only import WeightOnlyOps

_TRITON_KINDS = {
    GemmKind.BF16,
    GemmKind.FP16,
    GemmKind.FP32,
    GemmKind.INT8,
    GemmKind.FP8_ROWWISE,
    GemmKind.FP8_BLOCK128,
}
_SCALE_MODE = {
    GemmKind.INT8: grouped_gemm.SCALE_ROWWISE,
    GemmKind.FP8_ROWWISE: grouped_gemm.SCALE_ROWWISE,
    GemmKind.FP8_BLOCK128: grouped_gemm.SCALE_BLOCK128,
}


class CudaOps(RoutingOps, CountingOps, DeepEpOps, WeightOnlyOps, QuantizeOps, CapturingOps, ReferenceOps):
    """The CUDA vendor's op implementations; `torch_grouped_mm` / `torch_scaled_grouped_mm`: use
    `torch._grouped_mm` for bf16 (sm90+) / `torch._scaled_grouped_mm` for fp8 row-wise (sm90); `dependent_launch`:
    launch the Triton kernels with programmatic dependent launch (sm90+, `kernels/dependent.py`)."""

    notes = {
        "quantize_weight": "the reference, then prepare_weight",
        "prepare_weight": "one-byte weights stored K-major (checkpoint weights too)",
        "grouped_matmul": "Triton grouped GEMM scheduled on the device; torch._grouped_mm for bf16 (sm90+), "
        "torch._scaled_grouped_mm (fast accumulation) for fp8 row-wise (sm90); fp8 128x128-block tiles fed by TMA "
        "(sm90+) where the table or built-in rule says so; tiles from the device's tuned table where it has the "
        f"problem, else built-in (torch's GEMMs from {GROUPED_MM_MIN_ROWS} rows per group for bf16, "
        f"{SCALED_MIN_ROWS} for fp8 row-wise); bf16 x fp4: weight_only.py",
        "grouped_matmul_activated": "SiLU-GLU in the Triton grouped GEMM's epilogue; a separate pass after torch's "
        "GEMMs, DeepGEMM (reading its aligned product back in row order) and for other activations",
        "grouped_matmul_gathered": "the Triton grouped GEMM reads x's rows through the index (no gathered copy) "
        "or gathers them first (Triton), as the tuned table says; without an entry, one-byte "
        f"rows through the index up to {ONE_BYTE_GATHER_MAX_ROWS_PER_GROUP} per group",
        "swiglu": "Triton, one pass",
        "weighted_combine": "Triton, one pass",
        "overlap": "a second CUDA stream per device (shared experts beside the routed ones)",
        "prepare_ep": "deepep: one DeepEP buffer per (process group, mode), sized from the layers' plans (the "
        "largest prepared), refused past the device's free memory",
        "ep_dispatch": "deepep: DeepEP normal dispatch (bf16, or fp8 with the Triton quantizer's per-128 scales; "
        "sorted by local expert on the experts' side) or low-latency dispatch (masked layout)",
        "ep_combine": "deepep: the experts' side weighs each received token's rows (Triton combine), DeepEP "
        "combine sums the ranks' partials; low-latency: DeepEP's weighted low_latency_combine",
    }

    def __init__(
        self,
        *,
        torch_grouped_mm: bool,
        tuning: TuningTable | None = None,
        dependent_launch: bool = False,
        torch_scaled_grouped_mm: bool = False,
        deep_gemm: ModuleType | None = None,
        quack: Quack | None = None,
        force_runner: str | None = None,
    ) -> None:
        super().__init__()
        self.torch_grouped_mm = torch_grouped_mm
        self.deep_gemm = deep_gemm  # DeepGEMM's module where found (`vendors.cuda.deep_gemm_runner`)
        self.quack = quack  # quack-kernels where found (`vendors.cuda.quack_runner`)
        self.force_runner = force_runner  # an optional backend put before the table (`tuning.forced_choice`)
        self.torch_scaled_grouped_mm = torch_scaled_grouped_mm
        self.pdl = dependent_launch
        self.tuning = tuning
        self._tiles: dict[tuple[int, ...], grouped_gemm.TileConfig] = {}  # parsed table entries
        self._choices: dict[tuple[object, ...], Choice | None] = {}  # the table's answer per call shape
        self._unserved: set[tuple[object, ...]] = set()  # table problems whose torch-grouped-mm entry ran Triton
        self._side = SideStreams()
        self.split_scratch = SplitScratch()  # the FP4 split's shares and counts, kept per stream (weight_only.py)
        self._deepep: DeepEp | None = None  # DeepEP's buffers, made at the first prepare_ep

    def tune(self, problems, *, device, device_name, progress=None) -> dict:  # type: ignore[no-untyped-def]
        """Time candidate grouped-GEMM configurations for `problems` here (see `vendors.cuda.tuner`)."""
        from vendors.cuda.tuner import tune

        return tune(
            problems,
            device,
            device_name,
            grouped_mm=self.torch_grouped_mm,
            scaled_grouped_mm=self.torch_scaled_grouped_mm,
            deep_gemm=self.deep_gemm,
            quack=self.quack,
            progress=progress,
        ).as_dict()

    def overlap(self, work: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """`work` on a second stream of the device, joined when its result is asked for."""
        return self._side.run(work)

    def grouped_matmul(
        self,
        x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
        weight: QuantizedWeight,
        groups: Groups,
        *,
        kind: GemmKind,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """`y[rows of g] = x[rows of g] @ weight[g]` on the device, without a host synchronisation."""
        if kind not in _TRITON_KINDS:
            return super().grouped_matmul(x, weight, groups, kind=kind, out_dtype=out_dtype)
        return self._grouped(
            x, weight, groups, kind, out_dtype, gated=False, choice=self._choice(kind, weight, _rows(x), gated=False)
        )

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
        """SiLU-GLU in the Triton GEMM's epilogue (from the fp32 accumulators); otherwise the GEMM, then
        the activation (torch._grouped_mm's calls, other activations, the reference's kinds)."""
        if kind not in _TRITON_KINDS or activation.kind is not ActivationKind.SILU_GLU:
            return super().grouped_matmul_activated(
                x, weight, groups, kind=kind, out_dtype=out_dtype, activation=activation
            )
        return self._grouped(
            x, weight, groups, kind, out_dtype, gated=True, choice=self._choice(kind, weight, _rows(x), gated=True)
        )

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
        """The Triton kinds read x's rows through `row_index` inside the GEMM (SiLU-GLU in its epilogue), or
        gather them first, as the table's choice says (`Choice.gather`; without one, the built-in rule
        `gather_in_gemm`: one-byte rows in groups of many rows are gathered); DeepGEMM's placement reads them
        through the index; the other kinds and activations gather first."""
        gated = activation is not None
        if kind not in _TRITON_KINDS or (
            gated and activation.kind is not ActivationKind.SILU_GLU  # type: ignore[union-attr]
        ):
            return super().grouped_matmul_gathered(
                x, row_index, weight, groups, kind=kind, out_dtype=out_dtype, activation=activation
            )
        choice, rows = self._choice(kind, weight, row_index.numel(), gated), row_index.numel()  # both ways: one entry
        element_bytes = (x if isinstance(x, torch.Tensor) else x.data).element_size()
        deep, choice = deep_gemm_or_fallback(
            self.deep_gemm, choice, x, weight, kind, out_dtype, rows, groups.num_groups, self._unserved
        )
        quack, choice = quack_or_fallback(self.quack, choice, x, weight, kind, out_dtype, self._unserved)
        if deep or quack is not None or reads_through_index(choice, rows, groups.num_groups, element_bytes):
            # DeepGEMM and quack read the rows through the index themselves
            return self._grouped(
                x,
                weight,
                groups,
                kind,
                out_dtype,
                gated=gated,
                row_index=row_index,
                choice=choice,
                deep=deep,
                quack=quack,
            )
        return self._grouped(
            self._take_rows(x, row_index),
            weight,
            groups,
            kind,
            out_dtype,
            gated=gated,
            choice=choice,
            deep=deep,
            quack=quack,
        )

    def _take_rows(
        self, x: torch.Tensor | QuantizedTensor | PackedInt4Tensor, index: torch.Tensor
    ) -> torch.Tensor | QuantizedTensor | PackedInt4Tensor:
        """`hal.take_rows` through the Triton gather (one launch per tensor, so a launch plan can hold it)."""
        return take_rows(x, index, partial(gather_rows, pdl=self.pdl))

    def _grouped(
        self,
        x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
        weight: QuantizedWeight,
        groups: Groups,
        kind: GemmKind,
        out_dtype: torch.dtype,
        *,
        gated: bool,
        choice: Choice | None,
        row_index: torch.Tensor | None = None,
        deep: bool | None = None,
        quack: GemmFn | None = None,
    ) -> torch.Tensor:
        """The grouped GEMM of a Triton kind, `gated`: with SiLU-GLU. `choice`, the table's entry for the call
        (`_choice`; for a gated call its `+silu-glu` entry, else the plain product's with the activation after),
        picks the backend and tiles (`quack` only from a table); without one, the built-in rules: DeepGEMM (fp8
        block-128) or torch's grouped GEMM (bf16, fp8 row-wise) from many rows per group, else the Triton kernel
        (gated: in its epilogue). A backend that cannot run here passes the call on, logged once per problem (a
        `deep-gemm` or `quack` entry to its fallback). `row_index`: the rows are x's rows through it (read by the
        Triton kernel, quack and DeepGEMM's placement; gathered first for torch's GEMMs). `deep`: whether DeepGEMM
        takes the call, where the caller has decided it (`deep_gemm_or_fallback`, then also `quack_or_fallback`:
        `quack` its GEMM or None, and `choice` already their outcome)."""
        data = x if isinstance(x, torch.Tensor) else x.data
        if data.stride(-1) != 1:
            data = data.contiguous()
        counts = groups.counts()
        if counts.device != data.device:  # group lists may live on the host
            counts = counts.to(data.device)
        rows = data.shape[0] if row_index is None else row_index.numel()
        decided = deep is not None
        if not decided:
            deep, choice = deep_gemm_or_fallback(
                self.deep_gemm, choice, x, weight, kind, out_dtype, rows, groups.num_groups, self._unserved
            )
        if deep:
            finish = partial(activation.swiglu, pdl=self.pdl) if gated else take  # reads rows through `place`
            return deep_gemm_grouped(self.deep_gemm, x, weight, counts, row_index, finish=finish)  # type: ignore[arg-type]
        if not decided:
            quack, choice = quack_or_fallback(self.quack, choice, x, weight, kind, out_dtype, self._unserved)
        if quack is not None:
            y = quack_or_none(self.quack, quack, data, weight, counts, row_index)  # type: ignore[arg-type]
            if y is not None:
                return self.swiglu(y) if gated else y
            choice = choice.fallback  # type: ignore[union-attr]
        wants_grouped_mm = (
            choice.backend == GROUPED_MM if choice is not None else grouped_mm_by_default(rows, groups.num_groups, kind)
        )
        if wants_grouped_mm and rows > 0:
            if torch_grouped_fits(
                x, weight, kind, out_dtype, bf16=self.torch_grouped_mm, fp8_rowwise=self.torch_scaled_grouped_mm
            ):
                y = torch_grouped(data, x.scale if isinstance(x, QuantizedTensor) else None, weight, counts, row_index)
                return self.swiglu(y) if gated else y
            if choice is not None:
                log_unserved_choice(self._unserved, kind, weight, out_dtype)
        tiles = None
        if choice is not None and choice.tiles is not None:
            tiles = self._tiles.get(choice.tiles)
            if tiles is None:
                tiles = self._tiles[choice.tiles] = grouped_gemm.TileConfig.from_list(list(choice.tiles))
        fused = gated and (choice is None or choice.backend == TRITON)
        mode = _SCALE_MODE.get(kind)
        if mode is None:
            y = grouped_gemm.grouped_gemm(
                data, weight.data, counts, out_dtype, config=tiles, gated=fused, row_index=row_index, pdl=self.pdl
            )
        else:
            y = grouped_gemm.grouped_gemm(
                data,
                weight.data,
                counts,
                out_dtype,
                x_scale=x.scale,  # type: ignore[union-attr]
                w_scale=weight.scale,
                scale_mode=mode,
                config=tiles,
                gated=fused,
                row_index=row_index,
                pdl=self.pdl,
            )
        return self.swiglu(y) if gated and not fused else y

    def _choice(self, kind: GemmKind, weight: QuantizedWeight, rows: int, gated: bool) -> Choice | None:
        """The table's choice for a call (None: no table, or no entry within reach), behind the forced runner
        where there is one (`forced_choice`)."""
        if self.tuning is None and self.force_runner is None:
            return None
        e, k, n = weight.data.shape
        key = (kind, e, k, n, rows, gated)
        if key not in self._choices:
            activation = ActivationKind.SILU_GLU.value if gated else None
            table = None if self.tuning is None else self.tuning.lookup_activated(kind.value, e, k, n, rows, activation)
            self._choices[key] = forced_choice(self.force_runner, kind.value, table)
        return self._choices[key]

    def quantize_weight(
        self, weight: torch.Tensor, *, layout: ScaleLayout, dtype: torch.dtype | None
    ) -> QuantizedWeight:
        """The reference quantization, then `prepare_weight` (one-byte weights stored K-major)."""
        return self.prepare_weight(super().quantize_weight(weight, layout=layout, dtype=dtype))

    def prepare_weight(self, weight: QuantizedWeight) -> QuantizedWeight:
        """One-byte weights stored K-major (same values, same shape), as the Triton GEMMs read them best."""
        if weight.data.dtype not in (torch.int8, torch.float8_e4m3fn) or weight.data.stride(1) == 1:
            return weight
        k_major = weight.data.transpose(1, 2).contiguous().transpose(1, 2)
        return QuantizedWeight(k_major, weight.layout, weight.scale, weight.global_scale)

    def weighted_combine(
        self, rows: torch.Tensor, index: torch.Tensor | None, topk_weights: torch.Tensor, *, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """Each token's weighted sum of its k rows, in one Triton pass."""
        if rows.dtype not in FLOAT_DTYPES or rows.stride(-1) != 1:
            return super().weighted_combine(rows, index, topk_weights, out_dtype=out_dtype)
        return combine.weighted_combine(rows, index, topk_weights, out_dtype, pdl=self.pdl)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(a) * b` in one Triton pass (a, the gate, is the first half)."""
        if x.numel() == 0:
            return super().swiglu(x)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return activation.swiglu(rows, pdl=self.pdl).view(*x.shape[:-1], x.shape[-1] // 2)


def _rows(x: torch.Tensor | QuantizedTensor | PackedInt4Tensor) -> int:
    return (x if isinstance(x, torch.Tensor) else x.data).shape[0]
