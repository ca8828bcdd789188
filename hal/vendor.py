"""`Vendor`: the class every backend plugin subclasses; its op methods are the checked entry points.

A vendor is a `Platform` (probe, device, capabilities, declared tables; see
`hal.platform`) plus the ops below. Each op method validates its arguments once, for
every vendor, against the vendor's device and declared capabilities (`hal.checks`), and
then calls the vendor's op implementations (`self.ops`, a `hal.VendorOps` built once by
`_make_ops`). A vendor writes a platform and, for what its runtime accelerates, a
`hal.reference.ReferenceOps` subclass; it does not restate the checks.

Every op, on every vendor, keeps three contracts beside its numbers (the conformance suite's
`test_op_contracts.py` holds each vendor to them): it never writes into its inputs; the
tensors it returns are contiguous (a caller may `.view` them); and two calls with the same
inputs return bit-identical results, unless the vendor declares `Capabilities.deterministic`
False.
"""

from __future__ import annotations

from typing import Any

import torch

from hal import checks
from hal.activations import Activation, ActivationKind
from hal.dtypes import DispatchDtype, ScaleLayout
from hal.errors import UnsupportedCapability, invalid
from hal.final import redefined_methods
from hal.formats import PackedInt4Tensor, QuantizedTensor, QuantizedWeight
from hal.gemm_kinds import GemmKind
from hal.groups import Groups
from hal.ops import OpSource
from hal.platform import DispatchFallbackWarning, Platform, ProbeResult
from hal.vendor_concurrency import ConcurrencyOps
from hal.vendor_ep import ExpertParallelOps
from hal.vendor_results import float_result, quantized_result, tensor_result, tensors_result
from hal.vendor_statistics import StatisticsOps
from hal.vendor_tuning import TuningOps
from hal.verdict_checks import grouped_matmul_verdict, quantize_verdict
from hal.verdicts import gemm_signature, quantize_signature, verdicts_of

__all__ = ["DispatchFallbackWarning", "ProbeResult", "Vendor"]


class Vendor(ExpertParallelOps, TuningOps, ConcurrencyOps, StatisticsOps, Platform):
    """A hardware backend: a `Platform` and the hal ops, checked here and computed by `self.ops`.

    The op methods are final: a vendor implements ops in the `hal.VendorOps` its `_make_ops` returns
    (a `hal.reference.ReferenceOps` subclass), never by redefining them here, so every vendor's ops
    get the same checked arguments and one signature. A subclass that redefines one is refused when
    it is defined (`TypeError`, naming the methods), so a plugin doing so fails to load with that reason.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        bases = (Vendor, ExpertParallelOps, TuningOps, ConcurrencyOps, StatisticsOps)
        redefined = redefined_methods(cls, Vendor, bases)
        if redefined:
            raise TypeError(
                f"{cls.__module__}.{cls.__qualname__} redefines hal.Vendor's op method(s) {', '.join(redefined)}: "
                "those methods check arguments for every vendor and are final; implement the op in a "
                "hal.reference.ReferenceOps subclass and return an instance of it from _make_ops()"
            )

    # -- activations -----------------------------------------------------------------------------

    def quantize(
        self,
        x: torch.Tensor,
        dtype: DispatchDtype | str,
        *,
        layout: ScaleLayout | str | None = None,
        global_scale: torch.Tensor | None = None,
    ) -> QuantizedTensor:
        """Quantize activations `[..., H]` into a dispatch dtype (bf16 is a plain cast).

        `layout` defaults to the vendor's declared layout for the dtype; `global_scale` is
        nvfp4's per-tensor scale (computed from the input when not given). The dtype must be
        one the vendor carries or one of its declared grouped-matmul kinds consumes. Input
        with inf or NaN is either refused with `InvalidInput` or quantized row by row, every
        finite row exactly as if the others were absent (nvfp4: when `global_scale` is given);
        what a non-finite row becomes is unspecified. A kernel that must not synchronise takes
        the second way.
        """
        caps = self.capabilities()
        signature = quantize_signature(x, dtype, layout, global_scale)
        verdicts = verdicts_of(self)
        verdict = None if signature is None else verdicts.get(signature, caps)
        if verdict is None:
            verdict = quantize_verdict(self, x, dtype, layout, global_scale)
            if signature is not None:
                verdicts.put(signature, caps, verdict)
        parsed, chosen = verdict
        q = self.ops.quantize(x, dtype=parsed, layout=chosen, global_scale=global_scale)
        return quantized_result(self, x, q, parsed, chosen)

    def dequantize(self, q: QuantizedTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Turn quantized activations back into `out_dtype`."""
        if not isinstance(q, QuantizedTensor):
            raise invalid("q", "a QuantizedTensor", type(q).__name__)
        checks.out_dtype("out_dtype", out_dtype)
        for name, tensor in (("q.data", q.data), ("q.scale", q.scale), ("q.global_scale", q.global_scale)):
            checks.on_device(name, tensor, self.device)
        return self.ops.dequantize(q, out_dtype=out_dtype)

    def quantize_int4(self, x: torch.Tensor) -> PackedInt4Tensor:
        """Quantize activations `[..., H]` to per-token int4 (`scale = rowmax|x| / 7`), packed eight
        per int32 (H a multiple of 8). A compute format for the int4 grouped-matmul kind, never
        a dispatch dtype: only vendors declaring that kind quantize to it."""
        caps = self.capabilities()
        if GemmKind.INT4 not in caps.grouped_matmul:
            raise UnsupportedCapability(
                f"vendor {self.name!r} ({caps.device_name}) does not declare the int4 grouped matmul, "
                "so it does not quantize activations to int4"
            )
        checks.float_rows("x", x)
        if x.shape[-1] % 8:
            raise invalid("x", "a last dimension that is a multiple of 8 for int4", x.shape[-1])
        checks.on_device("x", x, self.device)
        return self.ops.quantize_int4(x)

    # -- weights ---------------------------------------------------------------------------------

    def quantize_weight(
        self, weight: torch.Tensor, layout: ScaleLayout | str, dtype: torch.dtype | None = None
    ) -> QuantizedWeight:
        """Quantize float expert weights `[E, K, N]` into the formats `hal.formats` documents.

        `layout` is none (cast to `dtype`), per-channel (`dtype` int8, float8_e4m3fn, or
        `torch.quint4x2` for int4 packed eight per int32), block-128x128 (fp8) or block-16
        (nvfp4, with a per-expert global scale). Weights are quantized once, at load.
        """
        parsed = checks.weight_layout(layout)
        checks.float_weights(weight, parsed, dtype)
        checks.on_device("weight", weight, self.device)
        return self.ops.quantize_weight(weight, layout=parsed, dtype=dtype)

    # -- experts ---------------------------------------------------------------------------------

    def grouped_matmul(
        self,
        x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
        weight: QuantizedWeight,
        groups: Groups,
        *,
        out_dtype: torch.dtype | None = None,
        bias: torch.Tensor | None = None,
        activation: Activation | ActivationKind | str | None = None,
        row_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`y[rows of g] = x[rows of g] @ weight[g] (+ bias[g])` for every group g, scales applied.

        x is `[M, K]` with rows sorted by group; the result is `[M, N]` in `out_dtype`
        (default: the activation dtype for float kinds, bf16 for quantized kinds). The kind
        must be declared and the vendor's kernel limits hold; `bias` (`[groups, N]`, float)
        needs `capabilities().expert_bias`. `activation` (declared, see `activate`) is applied
        to the product (after the bias): `[M, N / 2]` for gated kinds. Vendors may apply it in
        the GEMM's epilogue, from the unrounded product.

        `row_index` (int32/int64 `[M]`): the product's row i is x's row `row_index[i]` (x is then
        `[T, K]`, any T), the same as passing `x[row_index]`; vendors may read the rows through the
        index inside the GEMM, so a dispatch's gather is never written out. Indices outside `[0, T)`
        are refused where reading them is free (host-synchronous vendors), else undefined.

        The group list's numbers (non-negative counts, non-decreasing offsets, covering at most M rows;
        rows beyond the groups are unspecified) raise `InvalidInput` where reading
        them is free: a host-synchronous vendor, or a group list in host memory. A list on the device of
        another vendor is not read: inconsistent numbers there give unspecified rows (or a device-side
        error), never a write outside the output.
        """
        caps = self.capabilities()
        signature = gemm_signature(x, weight, groups, out_dtype, bias, activation, row_index)
        verdicts = verdicts_of(self)
        verdict = None if signature is None else verdicts.get(signature, caps)
        if verdict is None:
            verdict = grouped_matmul_verdict(self, x, weight, groups, out_dtype, bias, activation, row_index)
            if signature is not None:
                verdicts.put(signature, caps, verdict)
        parsed, kind, resolved_dtype, rows = verdict
        # the checks that read values, on every call (where reading them is free)
        if row_index is not None and checks.values_are_free(caps.host_synchronous, row_index):
            checks.index_range("row_index", row_index, x.shape[0], "rows of x")
        if checks.values_are_free(caps.host_synchronous, groups.tensor):
            checks.group_values(groups, rows, padding=caps.grouped_matmul_padding)
        if bias is not None:
            y = self.ops.grouped_matmul_biased(
                x, weight, groups, bias, kind=kind, out_dtype=resolved_dtype, activation=parsed, row_index=row_index
            )
        elif row_index is not None:
            y = self.ops.grouped_matmul_gathered(
                x, row_index, weight, groups, kind=kind, out_dtype=resolved_dtype, activation=parsed
            )
        elif parsed is not None:
            y = self.ops.grouped_matmul_activated(
                x, weight, groups, kind=kind, out_dtype=resolved_dtype, activation=parsed
            )
        else:
            y = self.ops.grouped_matmul(x, weight, groups, kind=kind, out_dtype=resolved_dtype)
        columns = weight.out_features // 2 if parsed is not None and parsed.gated else weight.out_features
        return tensor_result(self, "grouped_matmul", y, (rows, columns), resolved_dtype)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(a) * b` where a is the first and b the second half of the last dimension."""
        checks.swiglu_input(x)
        checks.on_device("x", x, self.device)
        return self.ops.swiglu(x)

    def activate(self, x: torch.Tensor, activation: Activation | ActivationKind | str) -> torch.Tensor:
        """The experts' activation (see `hal.ActivationKind`): `[..., 2I]` as `[gate | up]` to `[..., I]`
        for gated kinds, elementwise for plain ones; the kind must be declared."""
        parsed = self._declared_activation(activation)
        checks.activation_input(x, parsed)
        checks.on_device("x", x, self.device)
        return self.ops.activate(x, activation=parsed)

    def _declared_activation(self, activation: Activation | ActivationKind | str) -> Activation:
        """`activation` parsed, refused unless the vendor declares its kind."""
        parsed = Activation.parse(activation)
        caps = self.capabilities()
        if parsed.kind not in caps.activations:
            raise UnsupportedCapability(
                f"vendor {self.name!r} ({caps.device_name}) does not declare the activation {parsed.kind} "
                f"(declared: {', '.join(sorted(a.value for a in caps.activations)) or 'none'})"
            )
        return parsed

    def prepare_fused(
        self, w13: QuantizedWeight, w2: QuantizedWeight, *, scheme: str, process_group: object | None = None
    ) -> None:
        """Prepare the fused op's form of a layer's weights once, at load (before its first forward)."""
        checks.name_string("scheme", scheme, "a scheme name (str)")
        checks.process_group(process_group, optional=True)
        if scheme not in self.capabilities().fused_deep_moe:
            raise UnsupportedCapability(f"vendor {self.name!r} does not declare fused_deep_moe for scheme {scheme!r}")
        for name, w in (("w13", w13), ("w2", w2)):
            if not isinstance(w, QuantizedWeight):
                raise invalid(name, "a hal.QuantizedWeight", type(w).__name__)
            for field, tensor in w.tensors().items():
                checks.on_device(f"{name}.{field}", tensor, self.device)
        self.ops.prepare_fused(w13, w2, scheme=scheme, process_group=process_group)

    def prepare_weight(self, weight: QuantizedWeight) -> QuantizedWeight:
        """A weight in hal's reference format (as a checkpoint loader builds it) in the form this
        vendor's grouped matmul reads, prepared once at load; the result is what the layer stores."""
        if not isinstance(weight, QuantizedWeight):
            raise invalid("weight", "a hal.QuantizedWeight", type(weight).__name__)
        for field, tensor in weight.tensors().items():
            checks.on_device(f"weight.{field}", tensor, self.device)
        prepared = self.ops.prepare_weight(weight)
        if not isinstance(prepared, QuantizedWeight):
            raise invalid(f"{self.name} prepare_weight result", "a hal.QuantizedWeight", type(prepared).__name__)
        return prepared

    # -- routing, permutation and combine --------------------------------------------------------

    def softmax_topk(
        self, logits: torch.Tensor, top_k: int, *, renormalize: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax top-k routing: `(weights, ids)` `[T, k]`, fp32 and int64, for float logits `[T, E]`
        (bf16, fp16, fp32, or float64 read as fp32).

        The k experts of largest `softmax(logits)` (computed in fp32) and their probabilities,
        divided by their sum when `renormalize`. Equal probabilities may be picked in any order
        (which of them is kept at the k-th place is the vendor's); weights are within fp32
        rounding of the reference `hal.reference.softmax_topk`. Without a host synchronisation.
        """
        checks.router_logits(logits, top_k)
        checks.on_device("logits", logits, self.device)
        if not isinstance(renormalize, bool):
            raise invalid("renormalize", "True or False", renormalize)
        if logits.shape[0] == 0:
            empty = torch.empty((0, top_k), device=logits.device)
            return empty.to(torch.float32), empty.to(torch.int64)
        if logits.dtype == torch.float64:  # computed in fp32 anyway: vendors' kernels never see float64
            logits = logits.to(torch.float32)
        shape = (logits.shape[0], top_k)
        result = self.ops.softmax_topk(logits, top_k=top_k, renormalize=renormalize)
        return tensors_result(self, "softmax_topk", result, ((shape, torch.float32), (shape, torch.int64)))

    def sort_by_expert(
        self, topk_ids: torch.Tensor, num_experts: int, *, tokens: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """The (token, slot) pairs of `topk_ids` `[T, k]` sorted by expert, token order kept within one:
        `order` (the flat pair of each sorted row) and `inverse` (the sorted row of each flat pair),
        int64 `[T*k]`, and `counts` int64 `[num_experts]`. With `tokens`, a fourth output: the token of
        each sorted row (`order // k`, int64 `[T*k]`), the row index a dispatcher hands to the experts'
        GEMM (a vendor may write it in the sort's own pass).

        `topk_ids` is int32 or int64 (the results are the same), `num_experts` a positive int.
        Ids outside `[0, num_experts)` raise `InvalidInput` where reading them costs no device
        synchronisation: on a vendor declaring `host_synchronous` (the CPU) or for ids in host
        memory. Elsewhere the op never synchronises, so it does not look: an out-of-range id
        gives unspecified `order`, `inverse` and `counts` (its pair may be counted nowhere, or
        land among another expert's rows), or a device-side error; no implementation writes
        outside the outputs.
        """
        checks.on_device("topk_ids", topk_ids, self.device)
        checks.expert_ids(topk_ids, num_experts, host_synchronous=self.capabilities().host_synchronous)
        if not isinstance(tokens, bool):
            raise invalid("tokens", "True or False", tokens)
        pairs = ((topk_ids.numel(),), torch.int64)
        specs = (pairs, pairs, ((num_experts,), torch.int64)) + ((pairs,) if tokens else ())
        if tokens:
            result = self.ops.sort_by_expert_tokens(topk_ids, num_experts=num_experts)
        else:
            result = self.ops.sort_by_expert(topk_ids, num_experts=num_experts)
        return tensors_result(self, "sort_by_expert", result, specs)

    def weighted_combine(
        self, rows: torch.Tensor, index: torch.Tensor | None, topk_weights: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """Each token's routing-weighted sum of its experts' rows: `[T, H]` in `out_dtype`.

        `out[t] = sum_j topk_weights[t, j] * rows[index[t*k + j]]` accumulated in fp32 (`index`
        None: rows already in (token, slot) order). `rows` is bf16, fp16 or fp32 `[R, H]`,
        `topk_weights` floating-point `[T, k]`, `index` int32 or int64 `[T*k]` (the results are
        the same), `out_dtype` a float `torch.dtype` (bf16, fp16, fp32; never an integer dtype).
        Indices outside `[0, R)` raise `InvalidInput` where reading them is free (a
        `host_synchronous` vendor, or an index in host memory); elsewhere the op does not look,
        and such an index makes its token's output unspecified (or raises a device-side error).
        """
        checks.out_dtype("out_dtype", out_dtype)
        device = self.device
        for name, tensor in (("rows", rows), ("index", index), ("topk_weights", topk_weights)):
            checks.on_device(name, tensor, device)
        checks.combine_operands(rows, index, topk_weights, host_synchronous=self.capabilities().host_synchronous)
        out = self.ops.weighted_combine(rows, index, topk_weights, out_dtype=out_dtype)
        return tensor_result(self, "weighted_combine", out, (topk_weights.shape[0], rows.shape[-1]), out_dtype)

    def fused_deep_moe(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: QuantizedWeight,
        w2: QuantizedWeight,
        *,
        scheme: str,
        process_group: object | None = None,
        dispatch_dtype: DispatchDtype | None = None,
        max_tokens_per_rank: int | None = None,
    ) -> torch.Tensor:
        """Dispatch, both grouped GEMMs with swiglu, and combine as one op: `[T, H]`.

        `w13` / `w2` are this rank's experts (gate and up projections concatenated, gate
        first; then the down projection); `topk_ids` are global expert ids; `process_group`
        is the expert-parallel group (None on one rank). `dispatch_dtype` is the calling
        layer's resolved dispatch dtype (None: int8 as the fused schemes carry) and
        `max_tokens_per_rank` its low-latency capacity (None: normal mode); a vendor may use
        or ignore them, but never takes them from process-wide state. Only for schemes listed
        in `capabilities().fused_deep_moe`; others raise `UnsupportedCapability`. With one rank
        (`process_group` None) ids outside `[0, E)` raise `InvalidInput` where reading them is
        free, as for `sort_by_expert`.
        """
        checks.name_string("scheme", scheme, "a scheme name (str)")
        checks.process_group(process_group, optional=True)
        caps = self.capabilities()
        if scheme not in caps.fused_deep_moe:
            raise UnsupportedCapability(
                f"vendor {self.name!r} does not declare fused_deep_moe for scheme {scheme!r} "
                f"(declared for: {', '.join(sorted(caps.fused_deep_moe)) or 'no scheme'})"
            )
        checks.fused_operands(hidden_states, topk_ids, topk_weights, w13, w2)
        parsed = checks.concrete_dtype(dispatch_dtype or DispatchDtype.INT8, "dispatch_dtype")
        capacity = checks.optional_positive_int("max_tokens_per_rank", max_tokens_per_rank)
        device = self.device
        for name, tensor in (
            ("hidden_states", hidden_states),
            ("topk_ids", topk_ids),
            ("topk_weights", topk_weights),
            *((f"w13.{f}", t) for f, t in w13.tensors().items()),
            *((f"w2.{f}", t) for f, t in w2.tensors().items()),
        ):
            checks.on_device(name, tensor, device)
        if process_group is None:  # global ids = this rank's experts
            checks.expert_ids(topk_ids, w13.num_experts, host_synchronous=caps.host_synchronous)
        out = self.ops.fused_deep_moe(
            hidden_states,
            topk_ids,
            topk_weights,
            w13,
            w2,
            scheme=scheme,
            process_group=process_group,
            dispatch_dtype=parsed,
            max_tokens_per_rank=capacity,
        )
        return float_result(self, "fused_deep_moe", out, tuple(hidden_states.shape))

    # -- provenance ------------------------------------------------------------------------------

    def op_sources(self) -> list[OpSource]:
        """Which ops run on the vendor's own code and which on the reference (`hal caps` shows it)."""
        return self.ops.sources()
