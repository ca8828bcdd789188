"""Property-based tests of every op: hypothesis draws shapes, group sizes, dtypes and magnitudes, and
each drawn case is checked against float64 with the suite's bounds.

quantize / dequantize (every carried dispatch dtype and layout), quantize_weight (the weight format
of every declared grouped-matmul kind), grouped_matmul (every declared kind), swiglu and activate
(every declared kind), sort_by_expert and weighted_combine. Examples are derandomized (the same
cases on every run in one environment, so CI is reproducible; hypothesis also mixes in constants of
the loaded modules, so another environment may draw others) and stored nowhere; `--hal-depth quick`
draws `conformance.hypothesis_settings.EXAMPLES["quick"]` per test, `full` many more. Needs hypothesis
(the `[test]` extra); without it this module is skipped.
"""

from __future__ import annotations

import math

import pytest
import torch

from conformance import dtype_facts
from conformance.capability import (
    SORT_AND_COMBINE,
    SWIGLU,
    activation_label,
    dispatch_label,
    gemm_label,
    mark,
    require_activation,
    require_dispatch,
    require_gemm,
)
from conformance.checks import K_GRANULARITY, N_GRANULARITY, run_gemm_case
from conformance.operands import magnitudes, routing, spread_weights, uneven_counts
from conformance.reference import activation, expert_order, swiglu, weighted_combine, worst
from conformance.tolerances import (
    OUTPUT_ROUNDING,
    SLACK,
    combine_bound,
    quantize_sweep_bound,
    swiglu_bound,
    weight_quantize_bound,
)
from hal import ActivationKind, DispatchDtype, GemmKind
from hal.reference import activation_value, weight_value

pytest.importorskip("hypothesis", reason="the property tests need hypothesis: pip install 'moe-hal[test]'")
from hypothesis import example, given
from hypothesis import strategies as st

from conformance.hypothesis_settings import property_settings

#: Examples per property test at each depth.
FLOATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FORMATS = [(d, layout) for d in DispatchDtype.concrete() for layout in d.scale_layouts()]


def _up(value: int, multiple: int) -> int:
    return max(multiple, math.ceil(value / multiple) * multiple)


seeds = st.integers(0, 2**31 - 1)
float_names = st.sampled_from(sorted(FLOATS))


@pytest.mark.parametrize(
    "dtype, layout", [pytest.param(d, lay, id=f"{d}-{lay}", marks=mark(dispatch_label(d))) for d, lay in FORMATS]
)
def test_quantize_round_trip_property(hal_vendor, hal_depth, dtype, layout):
    """Any token count and hidden size the format allows, any input dtype, rows whose magnitudes differ
    by up to 1e3: the format's value and `dequantize` (in any float dtype) within one rounding."""
    require_dispatch(hal_vendor, dtype)
    multiple = dtype_facts.channel_multiple(dtype, layout)

    @property_settings(hal_depth)
    @given(
        tokens=st.integers(0, 300),
        hidden=st.integers(1, 700),
        input_dtype=float_names,
        out_dtype=float_names,
        center=st.floats(-3, 2),
        spread=st.floats(0, 1.5),
        seed=seeds,
    )
    def check(tokens, hidden, input_dtype, out_dtype, center, spread, seed):
        hidden = _up(hidden, multiple)
        gen = torch.Generator().manual_seed(seed)
        rows = magnitudes((tokens, 1), center - spread, center + spread, gen)
        x = (torch.randn(tokens, hidden, generator=gen, dtype=torch.float64) * rows).to(FLOATS[input_dtype])
        q = hal_vendor.quantize(x.to(hal_vendor.device), dtype, layout=layout)
        assert tuple(q.shape) == (tokens, hidden), f"logical shape {tuple(q.shape)}, expected {(tokens, hidden)}"
        value, ref = activation_value(q), x.double()
        error, bound = (value - ref).abs(), quantize_sweep_bound(dtype.value, layout.value, ref)
        assert bool((error <= bound).all()), f"the format's value: {worst(error, bound)}"
        out = hal_vendor.dequantize(q, FLOATS[out_dtype])
        assert out.dtype == FLOATS[out_dtype] and tuple(out.shape) == (tokens, hidden)
        rowmax = value.abs().amax(dim=-1, keepdim=True) if tokens else value
        error = (out.double().cpu() - value).abs()
        bound = OUTPUT_ROUNDING[FLOATS[out_dtype]] * value.abs() + SLACK * rowmax + _subnormal(FLOATS[out_dtype])
        assert bool((error <= bound).all()), f"dequantize to {out_dtype}: {worst(error, bound)}"

    check()


def _subnormal(dtype: torch.dtype) -> float:
    """Half the smallest subnormal step of a float dtype (values below its normal range round on it)."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


@pytest.mark.parametrize("kind", [pytest.param(k, id=str(k), marks=mark(gemm_label(k))) for k in GemmKind])
def test_quantize_weight_property(hal_vendor, hal_depth, kind):
    """Any expert count, K and N the format allows, tiles whose magnitudes differ by up to 1e6:
    every weight within one rounding in its scale group."""
    require_gemm(hal_vendor, kind)
    spec = kind.spec

    @property_settings(hal_depth)
    @given(experts=st.integers(1, 6), k=st.integers(1, 300), n=st.integers(1, 300), spread=st.floats(0, 3), seed=seeds)
    def check(experts, k, n, spread, seed):
        shape = (experts, _up(k, K_GRANULARITY.get(kind, 1)), _up(n, N_GRANULARITY.get(kind, 1)))
        w = spread_weights(*shape, torch.Generator().manual_seed(seed), spread)
        q = hal_vendor.quantize_weight(w.to(hal_vendor.device), spec.weight_layout, spec.weight_dtype)
        assert (q.num_experts, q.in_features, q.out_features) == shape
        error = (weight_value(q) - w.double()).abs()
        bound = weight_quantize_bound(kind, w.double())
        assert bool((error <= bound).all()), f"{kind} weights {shape}: {worst(error, bound)}"

    check()


@pytest.mark.parametrize("kind", [pytest.param(k, id=str(k), marks=mark(gemm_label(k))) for k in GemmKind])
def test_grouped_matmul_property(hal_vendor, hal_depth, kind):
    """Any number of groups (up to 40; empty ones anywhere), up to 500 rows, K and N the kind allows,
    counts or offsets, int32 or int64 group lists, token and weight scales of very different magnitude."""
    require_gemm(hal_vendor, kind)
    limits = hal_vendor.capabilities().limits
    most_groups = min(40, limits.max_groups or 40)

    @property_settings(hal_depth)
    @given(
        groups=st.integers(1, most_groups),
        rows=st.integers(0, 500),
        empty=st.floats(0, 0.9),
        k=st.integers(1, 300),
        n=st.integers(1, 200),
        offsets=st.booleans(),
        int32=st.booleans(),
        x_spread=st.floats(0, 1),
        w_spread=st.floats(0, 3),
        seed=seeds,
    )
    # Found by this test: an int8 output element just above 1.0 with no cancellation, where an output
    # rounded twice (to fp16, then to bf16) lands on the wrong side of the bf16 half-way point.
    @example(groups=4, rows=40, empty=0.0, k=8, n=8, offsets=True, int32=True, x_spread=0.0, w_spread=0.0, seed=1)
    def check(groups, rows, empty, k, n, offsets, int32, x_spread, w_spread, seed):
        counts = uneven_counts(groups, rows, torch.Generator().manual_seed(seed), empty)
        k, n = _up(k, K_GRANULARITY.get(kind, 1)), _up(n, N_GRANULARITY.get(kind, 1))
        run_gemm_case(
            hal_vendor,
            kind,
            counts,
            k=k,
            n=n,
            offsets=offsets,
            group_dtype=torch.int32 if int32 else torch.int64,
            spread=((-x_spread, x_spread), (-w_spread, 0.0)),
        )

    check()


def _activation_params():
    params = [pytest.param(None, id="swiglu", marks=mark(SWIGLU))]
    return params + [pytest.param(k, id=str(k), marks=mark(activation_label(k))) for k in ActivationKind]


@pytest.mark.parametrize("kind", _activation_params())
def test_activation_property(hal_vendor, hal_depth, kind):
    """`swiglu` and `activate` on any leading shape and width, any float dtype, inputs from tiny to
    well past gpt-oss's clamp: within two roundings of the float64 formula."""
    if kind is not None:
        require_activation(hal_vendor, kind)
    gated = kind is None or kind.gated

    @property_settings(hal_depth)
    @given(
        lead=st.lists(st.integers(0, 40), min_size=1, max_size=3),
        width=st.integers(1, 300),
        dtype=float_names,
        scale=st.floats(-2, 1.3),
        seed=seeds,
    )
    def check(lead, width, dtype, scale, seed):
        width = 2 * width if gated else width
        gen = torch.Generator().manual_seed(seed)
        x = (torch.randn(*lead, width, generator=gen, dtype=torch.float64) * 10**scale).to(FLOATS[dtype])
        x_dev = x.to(hal_vendor.device)
        y = hal_vendor.swiglu(x_dev) if kind is None else hal_vendor.activate(x_dev, kind)
        want = (*lead, width // 2 if gated else width)
        assert tuple(y.shape) == want and y.dtype == x.dtype, f"got {y.dtype} {tuple(y.shape)}, expected {want}"
        ref, magnitude = swiglu(x) if kind is None else activation(x, kind.value)
        error = (y.double().cpu() - ref).abs()
        bound = swiglu_bound(ref, magnitude, x.dtype) + _subnormal(x.dtype) * 2
        assert bool((error <= bound).all()), f"{kind or 'swiglu'} {dtype} {tuple(x.shape)}: {worst(error, bound)}"

    check()


@mark(SORT_AND_COMBINE)
def test_sort_by_expert_property(hal_vendor, hal_depth):
    """Any token count, top-k and expert count, int32 or int64 ids: the stable sort by expert, its
    inverse, and the pairs of every expert."""

    @property_settings(hal_depth)
    @given(
        tokens=st.integers(0, 300), top_k=st.integers(1, 8), extra=st.integers(0, 300), int32=st.booleans(), seed=seeds
    )
    def check(tokens, top_k, extra, int32, seed):
        experts = top_k + extra
        ids, _ = routing(tokens, top_k, experts, torch.Generator().manual_seed(seed))
        given_ids = ids.to(torch.int32 if int32 else torch.int64).to(hal_vendor.device)
        order, inverse, counts = hal_vendor.sort_by_expert(given_ids, experts)
        expected, expected_counts = expert_order(ids, experts)
        assert counts.cpu().tolist() == expected_counts, "counts differ from the routing's"
        assert order.cpu().tolist() == expected, "order is not the stable sort by expert"
        assert torch.equal(inverse.cpu()[torch.tensor(expected, dtype=torch.int64)], torch.arange(len(expected))), (
            "inverse does not undo order"
        )

    check()


@mark(SORT_AND_COMBINE)
def test_weighted_combine_property(hal_vendor, hal_depth):
    """Any token count, top-k (1 to 8) and width, indexed or in pair order, any row and output
    dtype, rows of very different magnitude, weights that do not sum to one."""

    @property_settings(hal_depth)
    @given(
        tokens=st.integers(0, 300),
        top_k=st.integers(1, 8),
        hidden=st.integers(1, 300),
        indexed=st.booleans(),
        rows_dtype=float_names,
        out_dtype=float_names,
        spread=st.floats(0, 1.5),
        seed=seeds,
    )
    def check(tokens, top_k, hidden, indexed, rows_dtype, out_dtype, spread, seed):
        gen = torch.Generator().manual_seed(seed)
        _, weights = routing(tokens, top_k, top_k, gen)
        factor = magnitudes((tokens * top_k, 1), -spread, spread, gen)
        rows = (torch.randn(tokens * top_k, hidden, generator=gen, dtype=torch.float64) * factor).to(FLOATS[rows_dtype])
        index = torch.randperm(tokens * top_k, generator=gen) if indexed else None
        device = hal_vendor.device
        out = hal_vendor.weighted_combine(
            rows.to(device), None if index is None else index.to(device), weights.to(device), FLOATS[out_dtype]
        )
        assert tuple(out.shape) == (tokens, hidden) and out.dtype == FLOATS[out_dtype]
        ref, magnitude = weighted_combine(rows, index, weights)
        error = (out.double().cpu() - ref).abs()
        bound = combine_bound(ref, magnitude, FLOATS[out_dtype]) + _subnormal(FLOATS[out_dtype])
        assert bool((error <= bound).all()), f"{tokens} tokens, top-{top_k}: {worst(error, bound)}"

    check()
