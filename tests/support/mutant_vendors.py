"""Mutant vendors: one deliberate fault each, across every op family, that `hal conformance` must fail.

They extend the faulty vendors of `tests.support.conformance_vendors` (which prove particular tests on
particular faults) into a measure of the whole suite: `scripts/mutation_report.py` runs the suite against
each mutant and writes which tests catch it (`docs/conformance-mutants.md`); a mutant that no test
catches is a missing test. Each subclasses the CPU reference vendor and breaks one thing in the ops its
`_make_ops` returns, so hal's checks still run before the fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.support.plugin_dist import write_distribution


@dataclass(frozen=True)
class Mutant:
    """A mutant vendor: its op family, its fault, and the suite subset (`-k`) it runs on (none with `ep_ranks`:
    the expert-parallel section runs all its cases)."""

    name: str
    cls: str
    family: str
    fault: str
    keyword: str
    ep_ranks: int = 0  #: run the expert-parallel section with this many ranks (slow)


MUTANTS = [
    Mutant(
        "mutant-int8-per-tensor-scale",
        "Int8PerTensorScale",
        "quantize",
        "int8 activations quantized with one scale for the whole tensor, not one per token",
        "test_quantize",
    ),
    Mutant(
        "mutant-int8-gemm-no-weight-scale",
        "Int8GemmNoWeightScale",
        "grouped matmul (int8)",
        "the int8 grouped matmul forgets the per-channel weight scale",
        "test_grouped_matmul_matches_float64",
    ),
    Mutant(
        "mutant-int4-gemm-no-weight-scale",
        "Int4GemmNoWeightScale",
        "grouped matmul (int4)",
        "the int4 grouped matmul forgets the per-channel weight scale",
        "test_grouped_matmul_matches_float64",
    ),
    Mutant(
        "mutant-nvfp4-gemm-no-global-scale",
        "Nvfp4GemmNoGlobalScale",
        "grouped matmul (nvfp4)",
        "the nvfp4 grouped matmul forgets the weights' per-expert global scale",
        "test_grouped_matmul_matches_float64",
    ),
    Mutant(
        "mutant-fp8-gemm-shifted-scales",
        "Fp8GemmSwapsExperts",
        "grouped matmul (fp8)",
        "the fp8 row-wise grouped matmul reads expert g's scales for expert g + 1 (wrapping)",
        "test_grouped_matmul_matches_float64",
    ),
    Mutant(
        "mutant-gelu-tanh-exact",
        "GeluTanhExact",
        "activations",
        "the tanh-approximated GELU kinds compute the exact GELU",
        "test_activation_matches_float64",
    ),
    Mutant("mutant-bias-dropped", "BiasDropped", "expert biases", "the per-expert bias is never added", "bias"),
    Mutant(
        "mutant-sort-unstable",
        "SortUnstable",
        "sort and permute",
        "sort_by_expert keeps each expert's pairs in reverse token order (not a stable sort)",
        "test_sort_by_expert",
    ),
    Mutant(
        "mutant-combine-drops-last-slot",
        "CombineDropsLastSlot",
        "combine",
        "the weighted combine sums k - 1 slots per token (an off-by-one at top-k > 1)",
        "test_weighted_combine",
    ),
    Mutant(
        "mutant-softmax-ignores-renormalize",
        "SoftmaxIgnoresRenormalize",
        "routing",
        "softmax_topk never renormalizes the kept probabilities",
        "test_softmax_topk",
    ),
    Mutant(
        "mutant-shared-experts-dropped",
        "SharedExpertsDropped",
        "shared experts",
        "work run beside the routed experts (`overlap`: the shared experts) returns zeros",
        "test_layer_features",
    ),
    Mutant(
        "mutant-counts-ring-not-cleared",
        "CountsRingNotCleared",
        "accumulate_counts",
        "the load counters' ring row for the next call is never zeroed",
        "test_accumulated",
    ),
    Mutant(
        "mutant-shared-output-buffer",
        "SharedOutputBuffer",
        "concurrency",
        "the grouped matmul returns one buffer reused by every call (results alias, threads race)",
        "test_op_contracts or test_concurrency",
    ),
    Mutant(
        "mutant-ep-dispatcher-declared-not-built",
        "EpDeclaredNotBuilt",
        "EP dispatchers",
        "declares its own expert-parallel dispatcher (normal and low-latency) that its ops do not provide",
        "",
        ep_ranks=2,
    ),
]

SOURCE = '''
import dataclasses

import torch

from hal import ActivationKind, DispatchDtype, GemmKind, QuantizedTensor
from hal.reference import ReferenceOps
from vendors.cpu import CpuVendor


def _vendor(name, ops, **declared):
    """A CPU vendor called `name` computing with `ops` (and `declared` capabilities replaced)."""

    def _make_ops(self):
        return ops()

    def _detect_capabilities(self):
        caps = CpuVendor._detect_capabilities(self)
        return dataclasses.replace(caps, **declared) if declared else caps

    return type(name, (CpuVendor,), {"name": name, "_make_ops": _make_ops, "_detect_capabilities": _detect_capabilities})


class Int8PerTensorScaleOps(ReferenceOps):
    def quantize(self, x, *, dtype, layout, global_scale):
        if dtype is not DispatchDtype.INT8:
            return super().quantize(x, dtype=dtype, layout=layout, global_scale=global_scale)
        flat = x.to(torch.float32)
        scale = (flat.abs().amax() / 127).clamp_min(1e-12)
        data = torch.round(flat / scale).clamp(-127, 127).to(torch.int8)
        return QuantizedTensor(data, dtype, layout, scale.expand(x.shape[:-1]).contiguous())


def _without_scale(broken, field):
    """Ops whose grouped matmul of kind `broken` reads the weight's `field` (a scale) as ones."""

    class Ops(ReferenceOps):
        def grouped_matmul(self, x, weight, groups, *, kind, out_dtype):
            if kind is broken:
                weight = dataclasses.replace(weight, **{field: torch.ones_like(getattr(weight, field))})
            return super().grouped_matmul(x, weight, groups, kind=kind, out_dtype=out_dtype)

    return Ops


class Fp8GemmSwapsExpertsOps(ReferenceOps):
    def grouped_matmul(self, x, weight, groups, *, kind, out_dtype):
        if kind is GemmKind.FP8_ROWWISE and weight.num_experts > 1:
            weight = dataclasses.replace(weight, scale=torch.roll(weight.scale, 1, 0))
        return super().grouped_matmul(x, weight, groups, kind=kind, out_dtype=out_dtype)


class GeluTanhExactOps(ReferenceOps):
    def activate(self, x, *, activation):
        exact = {ActivationKind.GELU_TANH_GLU: ActivationKind.GELU_GLU, ActivationKind.GELU_TANH: ActivationKind.GELU}
        if activation.kind in exact:
            activation = dataclasses.replace(activation, kind=exact[activation.kind])
        return super().activate(x, activation=activation)


class BiasDroppedOps(ReferenceOps):
    def add_expert_bias(self, y, bias, *, groups):
        return y.clone()


class SortUnstableOps(ReferenceOps):
    def sort_by_expert(self, topk_ids, *, num_experts):
        flat = topk_ids.reshape(-1).to(torch.int64)
        pairs = torch.arange(flat.numel(), device=flat.device)
        order = torch.argsort(flat * (flat.numel() + 1) - pairs, stable=True)  # reverse pair order per expert
        inverse = torch.empty_like(order).scatter_(0, order, pairs)
        return order, inverse, torch.bincount(flat, minlength=num_experts)

    def sort_by_expert_tokens(self, topk_ids, *, num_experts):
        order, inverse, counts = self.sort_by_expert(topk_ids, num_experts=num_experts)
        return order, inverse, counts, order // topk_ids.shape[1]


class CombineDropsLastSlotOps(ReferenceOps):
    def weighted_combine(self, rows, index, topk_weights, *, out_dtype):
        if topk_weights.shape[1] > 1:
            topk_weights = topk_weights.clone()
            topk_weights[:, -1] = 0
        return super().weighted_combine(rows, index, topk_weights, out_dtype=out_dtype)


class SoftmaxIgnoresRenormalizeOps(ReferenceOps):
    def softmax_topk(self, logits, *, top_k, renormalize):
        return super().softmax_topk(logits, top_k=top_k, renormalize=False)


class SharedExpertsDroppedOps(ReferenceOps):
    def overlap(self, work):
        result = work()
        return lambda: torch.zeros_like(result)


class CountsRingNotClearedOps(ReferenceOps):
    def accumulate_counts(self, values, total, ring, step, *, ids):
        kept = ring.clone()
        super().accumulate_counts(values, total, ring, step, ids=ids)
        written = int(step.item() - 1) % ring.shape[0]
        cleared = int(step.item()) % ring.shape[0]
        if cleared != written:
            ring[cleared] = kept[cleared]


class SharedOutputBufferOps(ReferenceOps):
    def __init__(self):
        super().__init__()
        self._out = None

    def grouped_matmul(self, x, weight, groups, *, kind, out_dtype):
        y = super().grouped_matmul(x, weight, groups, kind=kind, out_dtype=out_dtype)
        if self._out is None or self._out.shape != y.shape or self._out.dtype != y.dtype:
            self._out = torch.empty_like(y)
        return self._out.copy_(y)


Int8PerTensorScale = _vendor("mutant-int8-per-tensor-scale", Int8PerTensorScaleOps)
Int8GemmNoWeightScale = _vendor("mutant-int8-gemm-no-weight-scale", _without_scale(GemmKind.INT8, "scale"))
Int4GemmNoWeightScale = _vendor("mutant-int4-gemm-no-weight-scale", _without_scale(GemmKind.INT4, "scale"))
Nvfp4GemmNoGlobalScale = _vendor("mutant-nvfp4-gemm-no-global-scale", _without_scale(GemmKind.NVFP4, "global_scale"))
Fp8GemmSwapsExperts = _vendor("mutant-fp8-gemm-shifted-scales", Fp8GemmSwapsExpertsOps)
GeluTanhExact = _vendor("mutant-gelu-tanh-exact", GeluTanhExactOps)
BiasDropped = _vendor("mutant-bias-dropped", BiasDroppedOps)
SortUnstable = _vendor("mutant-sort-unstable", SortUnstableOps)
CombineDropsLastSlot = _vendor("mutant-combine-drops-last-slot", CombineDropsLastSlotOps)
SoftmaxIgnoresRenormalize = _vendor("mutant-softmax-ignores-renormalize", SoftmaxIgnoresRenormalizeOps)
SharedExpertsDropped = _vendor("mutant-shared-experts-dropped", SharedExpertsDroppedOps)
CountsRingNotCleared = _vendor("mutant-counts-ring-not-cleared", CountsRingNotClearedOps)
SharedOutputBuffer = _vendor("mutant-shared-output-buffer", SharedOutputBufferOps)
EpDeclaredNotBuilt = _vendor(
    "mutant-ep-dispatcher-declared-not-built",
    ReferenceOps,
    ep_dispatchers=frozenset({"loopback"}),
    ep_low_latency=frozenset({"loopback"}),
)
'''


def write_mutant_vendors(root: Path) -> Path:
    """A distribution registering every mutant of `MUTANTS` in `hal.vendors`."""
    return write_distribution(
        root,
        "hal-mutant-vendors",
        {"hal.vendors": {m.name: f"mutant_vendors:{m.cls}" for m in MUTANTS}},
        {"mutant_vendors": SOURCE},
    )
