"""The contracts every op keeps beside its numbers, for every op the vendor declares and for the
MoE layer of every scheme it runs: (i) it never writes into its inputs (each input tensor, the
fields of quantized operands and group lists included, is bitwise the same after the call);
(ii) the tensors it returns are contiguous, so a caller may `.view` them (the layer's output
too); (iii) two calls with the same inputs return bit-identical results, unless the vendor
declares `deterministic=False`.

Faults of this kind have no numeric effect on one call, so the numeric tests cannot see them.
The sizes are realistic (64 experts, 320 tokens at top-8, so 2560 rows; with `--hal-depth
full` 256 experts and 2048 tokens) so that a kernel whose reduction order changes from run to
run shows it on most calls. Weights are the vendor's storage format (`prepare_weight` may give
them other strides, e.g. K-major one-byte weights on CUDA): `quantize_weight` is held to (i)
and (iii) only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from conformance.capability import (
    OP_CONTRACTS,
    build_scheme,
    mark,
    require_activation,
    require_expert_bias,
    require_gemm,
    require_scheme,
)
from conformance.expectations import expected_resolution
from conformance.operands import random_codes_activation, random_codes_weight, to_device
from conformance.reference import generator
from hal import (
    KNOWN_SCHEMES,
    ActivationKind,
    DispatchConfig,
    DispatchDtype,
    GemmKind,
    Groups,
    PackedInt4Tensor,
    QuantizedTensor,
    QuantizedWeight,
    Vendor,
)
from moe import MoELayer

pytestmark = mark(OP_CONTRACTS)


@dataclass(frozen=True)
class Sizes:
    """The shapes every case is built with."""

    experts: int
    tokens: int
    hidden: int
    intermediate: int
    top_k: int = 8

    @property
    def rows(self) -> int:
        """Rows after dispatch: one per (token, slot)."""
        return self.tokens * self.top_k


#: `--hal-depth` -> sizes (quick: CI on a CPU, a few seconds; full: closer to large models)
SIZES = {"quick": Sizes(64, 320, 256, 128), "full": Sizes(256, 2048, 512, 256)}

Operand = torch.Tensor | QuantizedTensor | QuantizedWeight | PackedInt4Tensor | Groups | None


def _tensors(name: str, value: object) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside an operand or result, named after the argument (`x.scale`, `result[1]`)."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, Groups):
        yield f"{name}.tensor", value.tensor
    elif isinstance(value, (QuantizedTensor, QuantizedWeight, PackedInt4Tensor)):
        for field in ("data", "scale", "global_scale"):
            tensor = getattr(value, field, None)
            if tensor is not None:
                yield f"{name}.{field}", tensor
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _tensors(f"{name}[{i}]", item)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (so that NaN equals itself and -0.0 differs from 0.0)."""
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _differences(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when `a` and `b` are bitwise equal, else what differs."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype} {tuple(a.shape)} against {b.dtype} {tuple(b.shape)}"
    unequal = int((_bits(a) != _bits(b)).sum())
    return None if unequal == 0 else f"{unequal} of {a.numel()} elements differ"


@dataclass
class Run:
    """Two calls of one op on the same inputs: what the inputs were and became, and both results
    (copies, taken at once, so nothing done later can change them)."""

    before: dict[str, torch.Tensor]  #: the input tensors before the first call
    after: dict[str, torch.Tensor]  #: the input tensors as the first call left them
    first: dict[str, torch.Tensor]
    second: dict[str, torch.Tensor]
    strided: dict[str, tuple[int, ...]]  #: the first call's non-contiguous results, with their strides
    flat_view_error: str | None  #: why `result.view(-1)` failed, for a result that is one tensor


def _copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in tensors.items()}


def _run_twice(inputs: dict[str, Operand], call: Callable[[], object]) -> Run:
    """Call twice; the inputs are restored between the calls, so the second sees what the first saw."""
    tensors = dict(t for name, value in inputs.items() for t in _tensors(name, value))
    before = _copies(tensors)
    result = call()
    first = dict(_tensors("result", result))
    strided = {name: tuple(t.stride()) for name, t in first.items() if not t.is_contiguous()}
    flat_view_error = None
    if isinstance(result, torch.Tensor):
        try:
            result.view(-1)
        except RuntimeError as exc:
            flat_view_error = str(exc)
    first, after = _copies(first), _copies(tensors)
    with torch.no_grad():
        for name, t in tensors.items():
            t.copy_(before[name])
    second = _copies(dict(_tensors("result", call())))
    return Run(before, after, first, second, strided, flat_view_error)


# -- the op cases --------------------------------------------------------------------------------

Case = Callable[[Vendor, Sizes], tuple[dict[str, Operand], Callable[[], object]]]


def _groups(device: torch.device, n: Sizes) -> Groups:
    """The rows over the experts as top-k routing makes them: uneven, some experts empty."""
    gen = generator("contract-groups", n)
    weights = torch.rand(n.experts, generator=gen) ** 3
    weights[::9] = 0  # a few experts nobody picks
    picks = torch.multinomial(weights, n.rows, replacement=True, generator=gen)
    return Groups.from_counts(torch.bincount(picks, minlength=n.experts).to(device))


def _activations(vendor: Vendor, rows: int, width: int, seed: str) -> torch.Tensor:
    return (torch.randn(rows, width, generator=generator("contract", seed)) * 2).to(torch.bfloat16).to(vendor.device)


def _require_quantizes_to(vendor: Vendor, dtype: DispatchDtype) -> None:
    if not vendor.capabilities().quantizes_to(dtype):
        pytest.skip(f"vendor {vendor.name} does not quantize to {dtype}")


def _quantize_case(vendor: Vendor, n: Sizes, dtype: DispatchDtype):
    _require_quantizes_to(vendor, dtype)
    x = _activations(vendor, n.rows, n.hidden, f"quantize-{dtype}")
    return {"x": x}, lambda: vendor.quantize(x, dtype)


def _dequantize_case(vendor: Vendor, n: Sizes, dtype: DispatchDtype):
    _require_quantizes_to(vendor, dtype)
    q = vendor.quantize(_activations(vendor, n.rows, n.hidden, f"dequantize-{dtype}"), dtype)
    return {"q": q}, lambda: vendor.dequantize(q, torch.float32)


def _quantize_int4_case(vendor: Vendor, n: Sizes):
    require_gemm(vendor, GemmKind.INT4)
    x = _activations(vendor, n.rows, n.hidden, "quantize-int4")
    return {"x": x}, lambda: vendor.quantize_int4(x)


def _quantize_weight_case(vendor: Vendor, n: Sizes, kind: GemmKind):
    require_gemm(vendor, kind)
    spec = kind.spec
    w = torch.randn(n.experts, n.hidden, n.hidden, generator=generator("contract-weight", kind)) / n.hidden**0.5
    w = w.to(vendor.device)
    return {"weight": w}, lambda: vendor.quantize_weight(w, spec.weight_layout, spec.weight_dtype)


def _gemm_case(vendor: Vendor, n: Sizes, kind: GemmKind | None, bias: bool = False, activated: bool = False):
    if kind is None:  # the bias case: the first float kind declared
        caps = vendor.capabilities()
        kind = next((k for k in (GemmKind.BF16, GemmKind.FP32, GemmKind.FP16) if caps.supports_gemm(k)), GemmKind.BF16)
    require_gemm(vendor, kind)
    if bias:
        require_expert_bias(vendor)
    gen = generator("contract-gemm", kind, bias)
    x = to_device(random_codes_activation(kind.value, n.rows, n.hidden, gen), vendor.device)
    if activated:
        require_activation(vendor, ActivationKind.SILU_GLU)
    w = to_device(random_codes_weight(kind.value, n.experts, n.hidden, n.hidden, gen), vendor.device)
    w = vendor.prepare_weight(w)  # type: ignore[arg-type]
    groups = _groups(vendor.device, n)
    b = torch.randn(n.experts, n.hidden, generator=gen).to(vendor.device) if bias else None
    extra = {"bias": b} if bias else {"activation": ActivationKind.SILU_GLU} if activated else {}
    return ({"x": x, "weight": w, "groups": groups, "bias": b}, lambda: vendor.grouped_matmul(x, w, groups, **extra))


def _swiglu_case(vendor: Vendor, n: Sizes):
    x = _activations(vendor, n.rows, 2 * n.intermediate, "swiglu")
    return {"x": x}, lambda: vendor.swiglu(x)


def _activate_case(vendor: Vendor, n: Sizes, kind: ActivationKind):
    require_activation(vendor, kind)
    x = _activations(vendor, n.rows, 2 * n.intermediate if kind.gated else n.intermediate, f"activate-{kind}")
    return {"x": x}, lambda: vendor.activate(x, kind)


def _routing(device: torch.device, n: Sizes, seed: str) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(n.tokens, n.experts, generator=generator("contract-routing", seed))
    weights, ids = torch.softmax(logits, dim=-1).topk(n.top_k, dim=-1)
    return ids.to(device), (weights / weights.sum(-1, keepdim=True)).to(device)


def _softmax_topk_case(vendor: Vendor, n: Sizes):
    logits = torch.randn(n.tokens, n.experts, generator=generator("contract-softmax-topk")).to(vendor.device)
    return {"logits": logits}, lambda: vendor.softmax_topk(logits, n.top_k)


def _sort_case(vendor: Vendor, n: Sizes):
    ids, _ = _routing(vendor.device, n, "sort")
    return {"topk_ids": ids}, lambda: vendor.sort_by_expert(ids, n.experts)


def _combine_case(vendor: Vendor, n: Sizes):
    _, weights = _routing(vendor.device, n, "combine")
    rows = _activations(vendor, n.rows, n.hidden, "combine")
    index = torch.randperm(n.rows, generator=generator("contract-combine-index")).to(vendor.device)
    return (
        {"rows": rows, "index": index, "topk_weights": weights},
        lambda: vendor.weighted_combine(rows, index, weights, torch.bfloat16),
    )


def _op_cases() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    for d in DispatchDtype.concrete():
        cases[f"quantize-{d}"] = lambda v, n, d=d: _quantize_case(v, n, d)
        cases[f"dequantize-{d}"] = lambda v, n, d=d: _dequantize_case(v, n, d)
    cases["quantize_int4"] = _quantize_int4_case
    for k in GemmKind:
        cases[f"quantize_weight-{k}"] = lambda v, n, k=k: _quantize_weight_case(v, n, k)
        cases[f"grouped_matmul-{k}"] = lambda v, n, k=k: _gemm_case(v, n, k)
        cases[f"grouped_matmul-{k}-silu-glu"] = lambda v, n, k=k: _gemm_case(v, n, k, activated=True)
    cases["grouped_matmul-bias"] = lambda v, n: _gemm_case(v, n, None, bias=True)
    cases["swiglu"] = _swiglu_case
    for a in ActivationKind:
        cases[f"activate-{a}"] = lambda v, n, a=a: _activate_case(v, n, a)
    cases["softmax_topk"] = _softmax_topk_case
    cases["sort_by_expert"] = _sort_case
    cases["weighted_combine"] = _combine_case
    return cases


OP_CASES = _op_cases()
#: ops whose results are the vendor's weight storage, where other strides are allowed (see the module)
STORAGE_RESULTS = {name for name in OP_CASES if name.startswith("quantize_weight-")}


class Runs:
    """Each case's two calls, made on first use and read by all three contract tests."""

    def __init__(self, vendor: Vendor, sizes: Sizes) -> None:
        self.vendor, self.sizes = vendor, sizes
        self.done: dict[str, Run] = {}

    def op(self, case: str) -> Run:
        """The run of one op case."""
        if case not in self.done:
            inputs, call = OP_CASES[case](self.vendor, self.sizes)
            self.done[case] = _run_twice(inputs, call)
        return self.done[case]

    def layer(self, scheme: str) -> Run:
        """The run of the MoE layer of one scheme."""
        key = f"layer-{scheme}"
        if key not in self.done:
            self.done[key] = _layer_run(self.vendor, self.sizes, scheme)
        return self.done[key]


@pytest.fixture(scope="module")
def runs(hal_vendor: Vendor, request: pytest.FixtureRequest) -> Runs:
    """The module's runs, at the sizes of the session's `--hal-depth` (quick without that option)."""
    depth = request.config.getoption("hal_depth", default="quick")
    return Runs(hal_vendor, SIZES.get(str(depth), SIZES["quick"]))


def _layer_run(vendor: Vendor, n: Sizes, scheme: str) -> Run:
    require_scheme(vendor, scheme)
    dispatch = _dispatch_for(vendor, scheme)
    gen = generator("contract-layer", scheme)
    w13 = torch.randn(n.experts, n.hidden, 2 * n.intermediate, generator=gen) / n.hidden**0.5
    w2 = torch.randn(n.experts, n.intermediate, n.hidden, generator=gen) / n.intermediate**0.5
    x = torch.randn(n.tokens, n.hidden, generator=gen).to(torch.bfloat16)
    logits = torch.randn(n.tokens, n.experts, generator=gen)
    quant = build_scheme(scheme, input_amax=float(x.abs().max()))
    layer = MoELayer.from_float(
        w13, w2, n.top_k, scheme=quant, vendor=vendor, environ={}, dispatch=DispatchConfig(dtype=dispatch)
    )
    x, logits = x.to(vendor.device), logits.to(vendor.device)
    state = {f"layer.{name}": t for name, t in layer.state_dict().items() if isinstance(t, torch.Tensor)}
    return _run_twice({"hidden_states": x, "router_logits": logits, **state}, lambda: layer(x, logits))


def _dispatch_for(vendor: Vendor, scheme: str) -> DispatchDtype:
    """The scheme's own dispatch dtype where the vendor's table lets the layer build, else the first
    dtype the scheme accepts and the vendor carries (skip when there is none)."""
    traits = KNOWN_SCHEMES[scheme]
    caps = vendor.capabilities()
    if expected_resolution(caps, None, traits).outcome != "rejected":
        return DispatchDtype.AUTO
    for dtype in sorted(traits.accepts, key=lambda d: d.value):
        if expected_resolution(caps, dtype, traits).outcome in ("native", "fallback"):
            return dtype
    pytest.skip(f"vendor {vendor.name} carries no dispatch dtype scheme {scheme} accepts")


def _contract_params(excluded: set[str] | None = None) -> list:
    return [pytest.param(case, id=case) for case in OP_CASES if case not in (excluded or set())]


def _skip_unless_deterministic(vendor: Vendor) -> None:
    if not vendor.capabilities().deterministic:
        pytest.skip(f"vendor {vendor.name} declares deterministic=False (its ops are not bit-reproducible)")


def _check_inputs(run: Run, what: str) -> None:
    changed = {name: d for name in run.before if (d := _differences(run.after[name], run.before[name]))}
    assert not changed, f"{what} wrote into its inputs: " + "; ".join(f"{n}: {d}" for n, d in changed.items())


def _check_repeat(run: Run, what: str) -> None:
    assert run.first.keys() == run.second.keys(), f"{what}: the two calls returned different structures"
    changed = {name: d for name in run.first if (d := _differences(run.second[name], run.first[name]))}
    assert not changed, f"{what} is not bit-reproducible (declare deterministic=False if that is meant): " + "; ".join(
        f"{n}: {d}" for n, d in changed.items()
    )


# -- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", _contract_params())
def test_op_leaves_its_inputs_unchanged(hal_vendor, runs, case):
    _check_inputs(runs.op(case), case)


@pytest.mark.parametrize("case", _contract_params(STORAGE_RESULTS))
def test_op_returns_contiguous_tensors(hal_vendor, runs, case):
    strided = runs.op(case).strided
    assert not strided, f"{case} returned non-contiguous tensors (name: strides): {strided}"


@pytest.mark.parametrize("case", _contract_params())
def test_op_repeats_bit_identically(hal_vendor, runs, case):
    _skip_unless_deterministic(hal_vendor)
    _check_repeat(runs.op(case), case)


@pytest.mark.parametrize("scheme", list(KNOWN_SCHEMES))
def test_layer_keeps_its_inputs_and_returns_a_contiguous_output(hal_vendor, runs, scheme):
    run = runs.layer(scheme)
    _check_inputs(run, f"the {scheme} layer")
    assert run.flat_view_error is None, f"the {scheme} layer's output cannot be viewed flat: {run.flat_view_error}"
    assert not run.strided, f"the {scheme} layer returned a non-contiguous output (strides {run.strided})"


@pytest.mark.parametrize("scheme", list(KNOWN_SCHEMES))
def test_layer_repeats_bit_identically(hal_vendor, runs, scheme):
    _skip_unless_deterministic(hal_vendor)
    _check_repeat(runs.layer(scheme), f"the {scheme} layer")
