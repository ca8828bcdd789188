"""`VendorOps`: the computations a vendor implements, behind the checked entry points of `hal.Vendor`.

Callers (the MoE layer, the conformance suite, engines) call `vendor.quantize(...)`,
`vendor.grouped_matmul(...)` and the other op methods of `hal.Vendor`. Those validate the
arguments once for every vendor (types, shapes, devices, what the vendor declares, its
kernel limits) and then call the vendor's `VendorOps` object with arguments already
parsed: dtypes and layouts resolved, output dtypes decided, the grouped-matmul kind known.
An implementation only computes.

`hal.reference.ReferenceOps` implements every op in plain, device-agnostic torch. A vendor
subclasses it and overrides the ops its runtime accelerates; whatever it does not
override is the reference. The vendor builds its ops object once (`Vendor._make_ops`),
and `hal caps` shows which ops are native and which are the reference.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from hal.activations import Activation
from hal.dtypes import DispatchDtype, ScaleLayout
from hal.gemm_kinds import GemmKind

if TYPE_CHECKING:
    from hal.formats import PackedInt4Tensor, QuantizedTensor, QuantizedWeight
    from hal.graphs import GraphSet
    from hal.groups import Groups
    from hal.tuning import GemmProblem

#: Every op a vendor provides, in the order reports list them.
OP_NAMES = (
    "quantize",
    "dequantize",
    "quantize_weight",
    "quantize_int4",
    "grouped_matmul",
    "grouped_matmul_activated",
    "grouped_matmul_gathered",
    "grouped_matmul_biased",
    "add_expert_bias",
    "swiglu",
    "activate",
    "softmax_topk",
    "prepare_weight",
    "sort_by_expert",
    "sort_by_expert_tokens",
    "weighted_combine",
    "overlap",
    "fused_deep_moe",
    "prepare_fused",
    "prepare_ep",
    "ep_dispatch",
    "ep_combine",
    "graph_set",
    "launch_plan_set",
    "accumulate_counts",
)


@dataclass(frozen=True)
class OpSource:
    """Where one op of a vendor is computed: natively (the vendor's own code) or by the reference."""

    op: str
    native: bool
    detail: str

    def as_dict(self) -> dict[str, object]:
        """Plain data for JSON."""
        return {"op": self.op, "native": self.native, "detail": self.detail}


class VendorOps(abc.ABC):
    """The op implementations of one vendor instance; arguments arrive validated (see the module)."""

    #: op name -> how this class computes it, in a few words (shown by `hal caps`)
    notes: ClassVar[Mapping[str, str]] = {}
    #: set on a class whose own op methods are the plain-torch reference
    reference_implementation: ClassVar[bool] = False

    @abc.abstractmethod
    def quantize(
        self, x: torch.Tensor, *, dtype: DispatchDtype, layout: ScaleLayout, global_scale: torch.Tensor | None
    ) -> QuantizedTensor:
        """Float activations `[..., H]` in `dtype` and `layout` (see `hal.Vendor.quantize`)."""

    @abc.abstractmethod
    def dequantize(self, q: QuantizedTensor, *, out_dtype: torch.dtype) -> torch.Tensor:
        """Quantized activations back in `out_dtype`."""

    @abc.abstractmethod
    def quantize_weight(
        self, weight: torch.Tensor, *, layout: ScaleLayout, dtype: torch.dtype | None
    ) -> QuantizedWeight:
        """Float expert weights `[E, K, N]` in a weight format (see `hal.Vendor.quantize_weight`)."""

    @abc.abstractmethod
    def quantize_int4(self, x: torch.Tensor) -> PackedInt4Tensor:
        """Per-token int4 activations, packed eight per int32."""

    @abc.abstractmethod
    def grouped_matmul(
        self,
        x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
        weight: QuantizedWeight,
        groups: Groups,
        *,
        kind: GemmKind,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """`y[rows of g] = x[rows of g] @ weight[g]`, scales applied, `[M, N]` in `out_dtype`."""

    @abc.abstractmethod
    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(first half) * second half` of the last dimension."""

    @abc.abstractmethod
    def activate(self, x: torch.Tensor, *, activation: Activation) -> torch.Tensor:
        """The experts' activation of `x` (see `hal.Activation`); SiLU-GLU is `swiglu`."""

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
        """`activate(grouped_matmul(x, weight, groups))` (`[M, N / 2]` for gated kinds). The default makes
        the two calls; a vendor that applies the activation in its GEMM's epilogue overrides this."""
        y = self.grouped_matmul(x, weight, groups, kind=kind, out_dtype=out_dtype)
        return self.activate(y, activation=activation)

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
        """`grouped_matmul(x[row_index], ...)`, activated when `activation` is given: the product over the
        rows `row_index` of x (`[M]` int32/int64, M the groups' rows). The default gathers the rows, then
        makes the plain or activated call; a vendor whose GEMM reads its rows through the index overrides
        this (the dispatch's gather is then never written out)."""
        from hal.formats import take_rows

        rows = take_rows(x, row_index)
        if activation is None:
            return self.grouped_matmul(rows, weight, groups, kind=kind, out_dtype=out_dtype)
        return self.grouped_matmul_activated(
            rows, weight, groups, kind=kind, out_dtype=out_dtype, activation=activation
        )

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
        """`grouped_matmul` plus each row's group's bias row (`bias` `[G, N]`), then `activation` when given,
        over x's rows `row_index` when given. The default gathers the rows, takes the product, adds the
        bias (`add_expert_bias`) and activates (`activate`); a vendor may add the bias and activate in its
        GEMM's epilogue, from the unrounded product."""
        from hal import checks
        from hal.formats import take_rows

        rows = x if row_index is None else take_rows(x, row_index)
        y = self.grouped_matmul(rows, weight, groups, kind=kind, out_dtype=out_dtype)
        checks.expert_bias_operands(y, bias, groups)  # the product as this vendor returned it
        y = self.add_expert_bias(y, bias, groups=groups)
        return y if activation is None else self.activate(y, activation=activation)

    @abc.abstractmethod
    def add_expert_bias(self, y: torch.Tensor, bias: torch.Tensor, *, groups: Groups) -> torch.Tensor:
        """`y` `[M, N]` plus the bias row `[N]` of each row's group."""

    def overlap(self, work: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Start `work` beside what the caller issues next and return the function that waits for its
        result. Where the device has no concurrent queue (the default) the work runs at once."""
        result = work()
        return lambda: result

    def graph_set(self, device: torch.device) -> GraphSet:
        """A new set of captured calls on `device` (see `hal.GraphSet`); only vendors declaring
        `graph_capture` implement it."""
        from hal.errors import UnsupportedCapability

        raise UnsupportedCapability("these ops capture no graphs")

    def launch_plan_set(self, device: torch.device) -> GraphSet | None:
        """A new set of launch plans on `device`, or None (the default): captures that record the ops' kernel
        launches and issue them again from the host with the caller's tensors (`hal.Vendor.launch_plan_set`)."""
        return None

    def accumulate_counts(
        self, values: torch.Tensor, total: torch.Tensor, ring: torch.Tensor, step: torch.Tensor, *, ids: bool
    ) -> None:
        """Load counters updated in place (see `hal.Vendor.accumulate_counts`); in plain torch by default,
        a few small kernels and no host read."""
        bins = total.shape[0]
        if ids:
            values = values.to(torch.int64)
            inside = (values >= 0) & (values < bins)
            counts = torch.zeros_like(total).index_add_(0, values.clamp(0, bins - 1), inside.to(torch.int64))
        else:
            counts = values.to(torch.int64)
        total.add_(counts)
        rows = ring.shape[0]
        ring.index_add_(0, torch.remainder(step, rows), counts.view(1, -1))
        step.add_(1)
        ring.index_fill_(0, torch.remainder(step, rows), 0)

    def prepare_ep(
        self,
        name: str,
        *,
        process_group: object,
        num_experts: int,
        hidden_size: int,
        dtype: DispatchDtype,
        capacity: int | None,
        layout: ScaleLayout | None,
    ) -> None:
        """Allocate what dispatcher `name` needs for a layer of this size (see `hal.Vendor.prepare_ep`),
        refusing what it cannot serve. Nothing by default."""

    def ep_dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        name: str,
        dtype: DispatchDtype,
        num_experts: int,
        process_group: object,
        topk_weights: torch.Tensor | None,
        capacity: int | None,
        layout: ScaleLayout | None,
    ) -> tuple[QuantizedTensor, torch.Tensor, object]:
        """The vendor's own expert-parallel dispatch `name`: rows for this rank's experts, grouped by local
        expert, in `dtype` (rows past the counts' sum are padding), int64 counts per local expert, and
        the handle `ep_combine` needs (optionally a fourth element, the received row of each sorted row:
        the rows are then `payload[row_index]`); with `capacity`, the masked low-latency layout. Only vendors that
        declare `name` in `ep_dispatchers` implement it. `topk_weights` (None: the combine applies the
        weights), `capacity` (None: normal mode) and `layout` (the layer's planned scale layout for
        `dtype`; None: the dtype's default) are always passed."""
        from hal.errors import UnsupportedCapability

        raise UnsupportedCapability(f"no expert-parallel dispatcher {name!r} in these ops")

    def ep_combine(
        self, rows: torch.Tensor, topk_weights: torch.Tensor, handle: object, *, name: str, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """Each token's routing-weighted sum of its experts' output rows, back on its own rank, `[T, H]`."""
        from hal.errors import UnsupportedCapability

        raise UnsupportedCapability(f"no expert-parallel dispatcher {name!r} in these ops")

    def prepare_fused(
        self, w13: QuantizedWeight, w2: QuantizedWeight, *, scheme: str, process_group: object | None
    ) -> None:
        """Make whatever the vendor's `fused_deep_moe` needs from these weights (a storage format, a
        tile permutation), once, when a layer's fused path is built on them. Nothing by default."""

    def tune(
        self,
        problems: Sequence[GemmProblem],
        *,
        device: torch.device,
        device_name: str,
        progress: Callable[[str], None] | None,
    ) -> dict[str, Any]:
        """Search this device's kernel configurations for `problems` (see `hal tune`) and return the
        table the vendor loads (JSON-able). Vendors without tunable kernels keep this refusal."""
        from hal.errors import UnsupportedCapability

        raise UnsupportedCapability("these ops have no kernel configurations to tune")

    def prepare_weight(self, weight: QuantizedWeight) -> QuantizedWeight:
        """A checkpoint's weight in hal's reference format made ready for this vendor's grouped matmul,
        once, at load (a layout change, a tile permutation...). The reference keeps it as it is."""
        return weight

    @abc.abstractmethod
    def softmax_topk(self, logits: torch.Tensor, *, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax top-k routing of logits `[T, E]`: fp32 weights and int64 ids `[T, k]`."""

    @abc.abstractmethod
    def sort_by_expert(
        self, topk_ids: torch.Tensor, *, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(order, inverse, counts)` of the (token, slot) pairs sorted by expert, without a host sync."""

    def sort_by_expert_tokens(
        self, topk_ids: torch.Tensor, *, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`sort_by_expert` and the token of each sorted row (`order // k`, int64): the row index a dispatcher
        hands to the experts' GEMM. By default the sort, then a division; a vendor may write it in the sort."""
        order, inverse, counts = self.sort_by_expert(topk_ids, num_experts=num_experts)
        top_k = topk_ids.shape[-1] if topk_ids.dim() == 2 else 1
        return order, inverse, counts, torch.div(order, top_k, rounding_mode="floor")

    @abc.abstractmethod
    def weighted_combine(
        self, rows: torch.Tensor, index: torch.Tensor | None, topk_weights: torch.Tensor, *, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """Each token's routing-weighted sum of its experts' rows, `[T, H]` in `out_dtype`."""

    @abc.abstractmethod
    def fused_deep_moe(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: QuantizedWeight,
        w2: QuantizedWeight,
        *,
        scheme: str,
        process_group: object | None,
        dispatch_dtype: DispatchDtype,
        max_tokens_per_rank: int | None,
    ) -> torch.Tensor:
        """Dispatch, both grouped GEMMs with swiglu, and combine as one op (declared schemes only)."""

    def sources(self) -> list[OpSource]:
        """For every op: computed natively by this object's classes, or by the reference."""
        found = []
        for op in OP_NAMES:
            owner = next(c for c in type(self).__mro__ if op in vars(c))
            native = owner is not VendorOps and not vars(owner).get("reference_implementation", False)
            detail = vars(owner).get("notes", {}).get(op) or (self.notes.get(op) if native else None)
            found.append(OpSource(op, native, detail or ("the vendor's own" if native else "hal.reference")))
        return found
