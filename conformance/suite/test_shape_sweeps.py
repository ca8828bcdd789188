"""Shape sweeps that follow real models: every op and the layer at the sizes where kernels change
behaviour, with magnitudes that differ by orders of magnitude, against float64.

Many experts (128 groups, 256 where the vendor's limits allow), token counts on both sides of
powers of two (1, 7, 255, 257, 600; 4097 and 8192 at `--hal-depth full`), H, K and N that are not
multiples of 128 (as far as each format allows), top-1 through top-8, empty groups at random
positions, and rows, channels, 128-channel groups and 128x128 weight tiles scaled by 1e-3..1e3, so a
scale read from the wrong tile, channel or token changes the result at any token count. The cases
depend on the depth (`quick` for CI on a CPU, `full` for devices); their ids carry the sizes.
"""

from __future__ import annotations

import math

import pytest
import torch

from conformance import dtype_facts
from conformance.capability import (
    SORT_AND_COMBINE,
    build_scheme,
    dispatch_label,
    gemm_label,
    layer_label,
    mark,
    require_dispatch,
    require_gemm,
    require_scheme,
    scheme_gemm,
)
from conformance.checks import K_GRANULARITY, N_GRANULARITY, run_gemm_case
from conformance.expectations import expected_resolution
from conformance.operands import layer_weights, routing, spread_rows, spread_weights, uneven_counts
from conformance.plugin import depth_of
from conformance.reference import expert_order, generator, moe_features, relative_error, weighted_combine, worst
from conformance.tolerances import combine_bound, layer_tolerance, quantize_sweep_bound, weight_quantize_bound
from hal import KNOWN_SCHEMES, DispatchConfig, DispatchDtype, GemmKind, QuantizedTensor, UnsupportedDispatchDtype
from hal.reference import activation_value, weight_value
from moe import MoELayer

#: Token counts on both sides of powers of two (and past the 256 a kernel's grid may cover).
TOKENS = {"quick": (1, 7, 255, 257, 600), "full": (1, 7, 255, 257, 600, 4097, 8192)}
#: Hidden sizes of the quantize sweep: not multiples of 128 (a partial fp8 group).
QUANTIZE_HIDDEN = {"quick": 1000, "full": 2880}

#: quantize_weight cases: name -> (experts, K, N), neither K nor N a multiple of 128 except where named.
WEIGHT_SHAPES = {
    "quick": {"unaligned": (3, 400, 328), "128-experts": (128, 144, 72)},
    "full": {
        "unaligned": (3, 400, 328),
        "128-experts": (128, 144, 72),
        "wide": (8, 2880, 1000),
        "256-experts": (256, 528, 200),
    },
}
#: grouped_matmul cases: name -> (groups, rows, K, N); rows spread unevenly, a quarter of the groups empty.
GEMM_SHAPES = {
    "quick": {
        "128-groups": (128, 600, 336, 200),
        "256-groups": (256, 257, 208, 72),
        "rows-past-256": (4, 600, 1008, 136),
    },
    "full": {
        "128-groups": (128, 4097, 2880, 360),
        "256-groups": (256, 8192, 1024, 200),
        "rows-past-256": (4, 600, 1008, 136),
    },
}
#: Experts of the sort sweep.
SORT_EXPERTS = 256
#: Hidden size of the combine sweep.
COMBINE_HIDDEN = {"quick": 200, "full": 1000}
#: The layer sweep: (experts, H, I, token counts); H and I are rounded up to what the scheme's format needs.
LAYER_SHAPES = {"quick": (128, 200, 96, (1, 257, 600)), "full": (256, 1000, 360, (1, 257, 4097))}
#: One-token calls the layer sweep makes for its one-token case.
DECODE_STEPS = 8


def _up(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


# -- cases, by depth ----------------------------------------------------------------------------------


def _quantize_cases(depth: str) -> list:
    hidden = QUANTIZE_HIDDEN[depth]
    return [
        pytest.param(
            d,
            layout,
            tokens,
            _up(hidden, dtype_facts.channel_multiple(d, layout)),
            id=f"{d}-{layout}-{tokens}-tokens",
            marks=mark(dispatch_label(d)),
        )
        for d in DispatchDtype.concrete()
        for layout in d.scale_layouts()
        for tokens in TOKENS[depth]
    ]


def _weight_cases(depth: str) -> list:
    cases = []
    for kind in GemmKind:
        for name, (experts, k, n) in WEIGHT_SHAPES[depth].items():
            shape = (experts, _up(k, K_GRANULARITY.get(kind, 1)), _up(n, N_GRANULARITY.get(kind, 1)))
            cases.append(
                pytest.param(kind, shape, id=f"{kind}-{name}-{'x'.join(map(str, shape))}", marks=mark(gemm_label(kind)))
            )
    return cases


def _gemm_cases(depth: str) -> list:
    return [
        pytest.param(kind, name, shape, id=f"{kind}-{name}-{'x'.join(map(str, shape))}", marks=mark(gemm_label(kind)))
        for kind in GemmKind
        for name, shape in GEMM_SHAPES[depth].items()
    ]


def _sort_cases(depth: str) -> list:
    return [
        pytest.param(tokens, top_k, id=f"{tokens}-tokens-top{top_k}", marks=mark(SORT_AND_COMBINE))
        for tokens in TOKENS[depth]
        for top_k in (1, 8)
    ]


def _combine_cases(depth: str) -> list:
    return [
        pytest.param(
            tokens, top_k, COMBINE_HIDDEN[depth], id=f"{tokens}-tokens-top{top_k}", marks=mark(SORT_AND_COMBINE)
        )
        for tokens in TOKENS[depth]
        for top_k in range(1, 9)
    ]


def _layer_cases(depth: str) -> list:
    experts, hidden, inter, tokens = LAYER_SHAPES[depth]
    cases = []
    for scheme in KNOWN_SCHEMES:
        multiple = K_GRANULARITY.get(scheme_gemm(scheme), 1)
        shape = (experts, _up(hidden, multiple), _up(inter, multiple))
        for top_k in (1, 8):
            cases.append(
                pytest.param(
                    scheme,
                    top_k,
                    shape,
                    tokens,
                    id=f"{scheme}-top{top_k}-E{shape[0]}-H{shape[1]}-I{shape[2]}",
                    marks=mark(layer_label(scheme)),
                )
            )
    return cases


CASES = {
    "test_quantize_sweep": ("dtype, layout, tokens, hidden", _quantize_cases),
    "test_quantize_weight_sweep": ("kind, shape", _weight_cases),
    "test_grouped_matmul_sweep": ("kind, name, shape", _gemm_cases),
    "test_sort_by_expert_sweep": ("tokens, top_k", _sort_cases),
    "test_weighted_combine_sweep": ("tokens, top_k, hidden", _combine_cases),
    "test_layer_sweep": ("scheme, top_k, shape, token_counts", _layer_cases),
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize each sweep with the cases of the session's `--hal-depth`."""
    found = CASES.get(metafunc.function.__name__)
    if found is not None:
        names, cases = found
        metafunc.parametrize(names, cases(depth_of(metafunc.config)))


# -- the sweeps ---------------------------------------------------------------------------------------


def test_quantize_sweep(hal_vendor, dtype, layout, tokens, hidden):
    """Activations whose rows and 128-channel groups span six decades, quantized and read back."""
    require_dispatch(hal_vendor, dtype)
    x = spread_rows(tokens, hidden, generator("quantize-sweep", dtype, layout, tokens, hidden)).to(torch.bfloat16)
    q = hal_vendor.quantize(x.to(hal_vendor.device), dtype, layout=layout)
    assert isinstance(q, QuantizedTensor) and tuple(q.shape) == (tokens, hidden), (
        f"quantize returned {type(q).__name__} of shape {tuple(getattr(q, 'shape', ()))}"
    )
    ref = x.double()
    bound = quantize_sweep_bound(dtype.value, layout.value, ref)
    for value, what in (
        (activation_value(q), "the format's value"),
        (hal_vendor.dequantize(q, torch.float32).double().cpu(), "vendor.dequantize"),
    ):
        error = (value - ref).abs()
        assert bool((error <= bound).all()), f"{what}, {tokens} tokens of {hidden}: {worst(error, bound)}"


def test_quantize_weight_sweep(hal_vendor, kind, shape):
    """Expert weights whose 128x128 tiles span six decades, in the weight format of each declared kind."""
    require_gemm(hal_vendor, kind)
    spec = kind.spec
    w = spread_weights(*shape, generator("weight-sweep", kind, shape))
    q = hal_vendor.quantize_weight(w.to(hal_vendor.device), spec.weight_layout, spec.weight_dtype)
    assert (q.layout, q.data.dtype) == (spec.weight_layout, spec.weight_storage), (
        f"{kind}: got {q.data.dtype} {q.layout} weights, expected {spec.weight_storage} {spec.weight_layout}"
    )
    assert (q.num_experts, q.in_features, q.out_features) == shape, (
        f"{kind}: logical shape {(q.num_experts, q.in_features, q.out_features)}, expected {shape}"
    )
    assert q.data.device == hal_vendor.device
    ref = w.double()
    error = (weight_value(q) - ref).abs()
    bound = weight_quantize_bound(kind, ref)
    assert bool((error <= bound).all()), f"{kind} weights {shape}: {worst(error, bound)} (index: expert, k, n)"


def _fit(vendor, groups: int, rows: int, k: int) -> tuple[int, int]:
    """(groups, rows) within the vendor's declared kernel limits (a limit below the case shrinks it)."""
    limits = vendor.capabilities().limits
    if limits.max_inner_dim is not None and k > limits.max_inner_dim:
        pytest.skip(f"vendor {vendor.name} declares K at most {limits.max_inner_dim}")
    if limits.max_groups is not None:
        groups = min(groups, limits.max_groups)
    if limits.max_group_rows is not None:
        rows = min(rows, limits.max_group_rows)
    return groups, rows


#: Exponent ranges of the factors on the activations' and the weights' scales in the grouped-matmul
#: sweep: weight channels and tiles down to 1e-3 of each other, tokens 1e-1..1e1; outputs stay of
#: the size real layers produce (a few thousand at most).
GEMM_SPREAD = ((-1.0, 1.0), (-3.0, 0.0))


def test_grouped_matmul_sweep(hal_vendor, kind, name, shape):
    """Many groups, a quarter empty at random positions; rows past 256; K and N in partial tiles;
    weight channels, groups and tiles whose scales differ by up to 1e3, token scales by up to 1e2."""
    require_gemm(hal_vendor, kind)
    groups, rows, k, n = shape
    k, n = _up(k, K_GRANULARITY.get(kind, 1)), _up(n, N_GRANULARITY.get(kind, 1))
    groups, rows = _fit(hal_vendor, groups, rows, k)
    gen = generator("gemm-sweep", kind, name, shape)
    counts = [255, 0, 257, rows - 512] if name == "rows-past-256" and rows >= 512 else uneven_counts(groups, rows, gen)
    run_gemm_case(hal_vendor, kind, counts, k=k, n=n, spread=GEMM_SPREAD)


def test_sort_by_expert_sweep(hal_vendor, tokens, top_k):
    """The stable sort by expert over 256 experts, a quarter of them never chosen."""
    ids, _ = routing(tokens, top_k, SORT_EXPERTS, generator("sort-sweep", tokens, top_k))
    device = hal_vendor.device
    order, inverse, counts = hal_vendor.sort_by_expert(ids.to(device), SORT_EXPERTS)
    expected, expected_counts = expert_order(ids, SORT_EXPERTS)
    assert counts.dtype == torch.int64 and counts.cpu().tolist() == expected_counts, (
        f"counts differ from the routing's at experts {_differing(counts.cpu().tolist(), expected_counts)}"
    )
    got = order.cpu().tolist()
    assert got == expected, f"order is not the stable sort by expert from position {_differing(got, expected)[:1]}"
    assert torch.equal(inverse.cpu()[torch.tensor(expected, dtype=torch.int64)], torch.arange(len(expected))), (
        "inverse does not undo order"
    )


def _differing(got: list[int], expected: list[int]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(got, expected)) if a != b][:8] or [min(len(got), len(expected))]


def test_weighted_combine_sweep(hal_vendor, tokens, top_k, hidden):
    """Each token's weighted sum of its k rows (weights that do not sum to one; rows spanning six
    decades), indexed and in pair order, bf16 rows into bf16 and fp32 outputs."""
    gen = generator("combine-sweep", tokens, top_k, hidden)
    _, weights = routing(tokens, top_k, 16, gen)
    rows = spread_rows(tokens * top_k, hidden, gen).to(torch.bfloat16)
    device = hal_vendor.device
    for index, out_dtype in ((torch.randperm(tokens * top_k, generator=gen), torch.bfloat16), (None, torch.float32)):
        out = hal_vendor.weighted_combine(
            rows.to(device), None if index is None else index.to(device), weights.to(device), out_dtype
        )
        how = "indexed" if index is not None else "in pair order"
        assert tuple(out.shape) == (tokens, hidden) and out.dtype == out_dtype, (
            f"{how}: got {out.dtype} {tuple(out.shape)}, expected {out_dtype} {(tokens, hidden)}"
        )
        ref, magnitude = weighted_combine(rows, index, weights)
        error = (out.double().cpu() - ref).abs()
        bound = combine_bound(ref, magnitude, out_dtype)
        assert bool((error <= bound).all()), f"{how}, {tokens} tokens, top-{top_k}: {worst(error, bound)}"


def _dispatch_request(vendor, scheme: str):
    """The first of auto and the scheme's accepted dtypes the vendor can carry (natively or by its
    fallback), with its expected resolution; refusals are `test_moe_layer`'s subject."""
    traits = KNOWN_SCHEMES[scheme]
    for requested in (None, *sorted(traits.accepts, key=lambda d: d.value)):
        expected = expected_resolution(vendor.capabilities(), requested, traits)
        if expected.outcome in ("native", "fallback"):
            return requested, expected
    pytest.skip(f"vendor {vendor.name} carries no dispatch dtype scheme {scheme} accepts")


def test_layer_sweep(hal_vendor, scheme, top_k, shape, token_counts):
    """`MoELayer.from_float` with 128 experts (256 in full), H and I not multiples of 128 where the
    scheme allows, weight tiles of very different magnitude, precomputed routing with a quarter of the
    experts idle and weights that do not sum to one, at 1 token and past 256."""
    require_scheme(hal_vendor, scheme)
    experts, hidden, inter = shape
    gen = generator("layer-sweep", scheme, top_k, shape)
    w13, w2 = layer_weights(experts, hidden, inter, gen)
    requested, expected = _dispatch_request(hal_vendor, scheme)
    config = DispatchConfig(dtype=requested or DispatchDtype.AUTO)
    try:
        layer = MoELayer.from_float(
            w13, w2, top_k, scheme=build_scheme(scheme, input_amax=5.0), dispatch=config, vendor=hal_vendor, environ={}
        )
    except UnsupportedDispatchDtype as exc:
        pytest.fail(
            f"the declared table implies {expected.outcome} to {expected.resolved}, but the layer refused: {exc}"
        )
    assert layer.plan.resolved == expected.resolved
    bound = layer_tolerance(scheme, str(expected.resolved))
    path = "fused" if layer.fused else "unfused"
    device = hal_vendor.device
    for tokens in token_counts:
        # One token is taken as DECODE_STEPS separate one-token calls, judged together: the error of
        # a single token of a few hundred channels varies too much to hold to a layer bound alone.
        steps, batch = (DECODE_STEPS, 1) if tokens == 1 else (1, tokens)
        x = torch.randn(steps * batch, hidden, generator=gen).to(torch.bfloat16)
        ids, weights = routing(steps * batch, top_k, experts, gen)
        y = torch.cat(
            [
                layer(x[rows].to(device), topk_ids=ids[rows].to(device), topk_weights=weights[rows].to(device))
                for rows in (slice(s * batch, (s + 1) * batch) for s in range(steps))
            ]
        )
        assert tuple(y.shape) == tuple(x.shape) and y.dtype == x.dtype
        error = relative_error(y, moe_features(x, ids, weights, w13, w2))
        what = f"{steps} calls of one token" if steps > 1 else f"{tokens} tokens"
        assert error <= bound, (
            f"{what}, top-{top_k}: relative error {error:.4g} > {bound} "
            f"(scheme {scheme} carried as {expected.resolved}, {path} path)"
        )
