"""Checks shared by suite modules: one grouped-matmul case; a refused call leaves the vendor as it was."""

from __future__ import annotations

import math

import pytest
import torch

from conformance.operands import random_codes_activation, random_codes_weight, spread_scales, strided, to_device
from conformance.reference import activation as reference_activation
from conformance.reference import generator, grouped_matmul, relative_error, worst
from conformance.tolerances import OUTPUT_ROUNDING, gemm_bound, swiglu_bound
from hal import GEMM_KINDS, ActivationKind, GemmKind, Groups, Vendor, take_rows
from hal.reference import activation_value


def expect(condition: bool, message: str) -> None:
    """Fail the current test with `message` unless `condition` holds (helpers outside test
    modules get no assertion rewriting, so they say what went wrong themselves)."""
    if not condition:
        pytest.fail(message)


K, N = 320, 200  # partial 128-wide tiles in both directions; multiples of 16 and 8
#: Channels a kind packs or blocks along K (K a multiple of it), and output channels int4 packs per word.
K_GRANULARITY = {kind: spec.k_multiple for kind, spec in GEMM_KINDS.items() if spec.k_multiple > 1}
N_GRANULARITY = {GemmKind.INT4: 8}
FLOAT_KINDS = {GemmKind.BF16: torch.bfloat16, GemmKind.FP16: torch.float16, GemmKind.FP32: torch.float32}


def default_out_dtype(kind: GemmKind) -> torch.dtype:
    """Float kinds return the activation dtype; quantized kinds bf16."""
    return FLOAT_KINDS.get(kind, torch.bfloat16)


def run_gemm_case(vendor, kind: GemmKind, counts: list[int], k: int = K, n: int = N, **how):
    """Build operands from random codes, call the vendor, and check against float64.

    `how` may ask for counts given as offsets, an int32 group list, strided operands, an output
    dtype, `spread=((low, high), (low, high))`: the activations' and the weights' scales (float
    kinds: rows and 128x128 tiles) multiplied by factors `10^[low, high]`, or `gather_from=T`:
    the product's rows read from T source rows through `row_index` (`index_dtype`, default int64)."""
    gen = generator("gemm", kind, counts, k, n, sorted(how.items(), key=str))
    source, row_index = _gathered_rows(kind, sum(counts), k, gen, how)
    x = random_codes_activation(kind.value, sum(counts), k, gen) if source is None else take_rows(source, row_index)
    w = random_codes_weight(kind.value, len(counts), k, n, gen)
    if how.get("spread"):
        (x_low, x_high), (w_low, w_high) = how["spread"]
        x, w = spread_scales(x, gen, x_low, x_high), spread_scales(w, gen, w_low, w_high)
    ref, magnitude = grouped_matmul(x, w, counts)
    device = vendor.device
    x_dev, w_dev = to_device(x if source is None else source, device), to_device(w, device)
    if how.get("strided_x"):
        x_dev = strided(x_dev)
    if how.get("strided_w"):
        w_dev = strided(w_dev)
    values = torch.tensor(counts, dtype=how.get("group_dtype", torch.int64))
    groups = (
        Groups.from_offsets(values.cumsum(0).to(values.dtype)) if how.get("offsets") else Groups.from_counts(values)
    )
    groups = Groups(groups.tensor.to(device), groups.kind)
    out_dtype = how.get("out_dtype")
    extra = {"out_dtype": out_dtype} if out_dtype else {}
    if row_index is not None:
        extra["row_index"] = row_index.to(device)
    y = vendor.grouped_matmul(x_dev, w_dev, groups, **extra)
    want_dtype = out_dtype or default_out_dtype(kind)
    expect(y.dtype == want_dtype, f"output dtype {y.dtype}, expected {want_dtype}")
    expect(tuple(y.shape) == (sum(counts), n), f"output shape {tuple(y.shape)}, expected {(sum(counts), n)}")
    expect(y.device == device, f"output on {y.device}, expected {device}")
    error = (y.double().cpu() - ref).abs()
    bound = gemm_bound(ref, magnitude, want_dtype)
    if not bool((error <= bound).all()):
        pytest.fail(worst(error, bound) + _group_of_worst(error, bound, counts))


def run_activated_gemm_case(
    vendor: Vendor,
    kind: GemmKind,
    counts: list[int],
    activation_kind: ActivationKind,
    k: int = K,
    n: int = 2 * N,
    gather_from: int | None = None,
    bias: bool = False,
) -> None:
    """`grouped_matmul(..., activation=...)` against the float64 activation of the float64 product
    (`bias`: plus a per-group bias row of the product's size, added before the activation).

    The bound: the product's own (`gemm_bound`), carried through the activation by evaluating
    it at the corners of each element's error box (twice that, for curvature), plus the
    activation's rounding (`swiglu_bound`). A vendor may apply the activation to the rounded
    product or to its accumulators; both fall inside. `gather_from=T`: the rows are read from T
    source rows through `row_index`, as a dispatch hands them over."""
    gen = generator(
        "gemm-activated", kind, counts, k, n, activation_kind.value, *(() if gather_from is None else (gather_from,))
    )
    source, row_index = _gathered_rows(kind, sum(counts), k, gen, {"gather_from": gather_from})
    x = random_codes_activation(kind.value, sum(counts), k, gen) if source is None else take_rows(source, row_index)
    w = random_codes_weight(kind.value, len(counts), k, n, gen)
    product, magnitude = grouped_matmul(x, w, counts)
    rms = float(product.square().mean().sqrt()) if product.numel() else 1.0
    if rms > 0 and not 0.5 <= rms <= 8:  # products of order one, where the activation's shape shows
        w = spread_scales(w, gen, math.log10(2 / rms), math.log10(2 / rms))
        product, magnitude = grouped_matmul(x, w, counts)
    device = vendor.device
    groups = Groups.from_counts(torch.tensor(counts).to(device))
    extra = {} if row_index is None else {"row_index": row_index.to(device)}
    rounded_first: torch.Tensor | float = 0.0
    if bias:
        size = float(product.square().mean().sqrt()) if product.numel() else 1.0  # biases of the product's order
        rows_bias = torch.randn(len(counts), n, generator=gen) * max(size, 1e-3)
        per_row = torch.repeat_interleave(rows_bias.double(), torch.tensor(counts), dim=0)
        # the product may be rounded to the output dtype before the bias is added: one more rounding
        rounded_first = OUTPUT_ROUNDING[default_out_dtype(kind)] * product.abs()
        product, magnitude = product + per_row, magnitude + per_row.abs()
        extra["bias"] = rows_bias.to(device)
    y = vendor.grouped_matmul(
        to_device(x if source is None else source, device),
        to_device(w, device),
        groups,
        activation=activation_kind,
        **extra,
    )
    out_dtype = default_out_dtype(kind)
    width = n // 2 if activation_kind.gated else n
    expect(y.dtype == out_dtype, f"{activation_kind}: output dtype {y.dtype}, expected {out_dtype}")
    expect(
        tuple(y.shape) == (sum(counts), width),
        f"{activation_kind}: output shape {tuple(y.shape)}, expected {(sum(counts), width)}",
    )
    ref, act_magnitude = reference_activation(product, activation_kind.value)
    slack = gemm_bound(product, magnitude, out_dtype) + rounded_first
    halves = 2 if activation_kind.gated else 1
    signs = [(a, b) for a in (-1, 1) for b in ((-1, 1) if halves == 2 else (1,))]
    carried = torch.zeros_like(ref)
    for a, b in signs:
        moved = product + slack * torch.cat(
            [
                torch.full((1, n // halves), float(a), dtype=torch.float64),
                torch.full((1, n - n // halves), float(b), dtype=torch.float64),
            ],
            1,
        )
        carried = torch.maximum(carried, (reference_activation(moved, activation_kind.value)[0] - ref).abs())
    error = (y.double().cpu() - ref).abs()
    bound = 2 * carried + swiglu_bound(ref, act_magnitude, out_dtype)
    if not bool((error <= bound).all()):
        pytest.fail(f"{kind} with {activation_kind}: " + worst(error, bound) + _group_of_worst(error, bound, counts))


def _gathered_rows(kind: GemmKind, rows: int, k: int, gen: torch.Generator, how: dict):
    """`(source rows, row_index)` for a case read through an index (`how["gather_from"]` source rows,
    every one of them read at least once when there are rows enough, some twice), else `(None, None)`."""
    tokens = how.get("gather_from")
    if tokens is None:
        return None, None
    source = random_codes_activation(kind.value, tokens, k, gen)
    index = torch.randint(0, tokens, (rows,), generator=gen)
    index[: min(rows, tokens)] = torch.randperm(tokens, generator=gen)[:rows]
    return source, index.to(how.get("index_dtype", torch.int64))


def _group_of_worst(error: torch.Tensor, bound: torch.Tensor, counts: list[int]) -> str:
    if error.numel() == 0:
        return ""
    row = int((error / bound.clamp_min(1e-300)).amax(dim=1).argmax())
    ends = torch.tensor(counts).cumsum(0)
    return f" (row {row} belongs to group {int((ends <= row).sum())} of counts {counts})"


def snapshot(vendor: Vendor) -> dict[str, torch.Tensor]:
    """What a few good calls return now: swiglu, the default dispatch quantizer, the first declared GEMM."""
    gen = generator("snapshot")
    x = torch.randn(6, 64, generator=gen).to(torch.bfloat16).to(vendor.device)
    caps = vendor.capabilities()
    taken = {
        "swiglu": vendor.swiglu(x).cpu(),
        "quantize": activation_value(vendor.quantize(x, caps.default_dispatch_dtype)),
    }
    kinds = sorted(caps.grouped_matmul, key=lambda k: k.value)
    if kinds:
        a = to_device(random_codes_activation(kinds[0].value, 5, 64, gen), vendor.device)
        w = to_device(random_codes_weight(kinds[0].value, 3, 64, 32, gen), vendor.device)
        groups = Groups.from_counts(torch.tensor([3, 0, 2], device=vendor.device))
        taken[f"grouped_matmul {kinds[0]}"] = vendor.grouped_matmul(a, w, groups).double().cpu()
    return taken


def assert_unchanged(vendor: Vendor, before: dict[str, torch.Tensor]) -> None:
    """The same good calls give the same results as before a refused call (the vendor kept no bad state)."""
    after = snapshot(vendor)
    for name, value in before.items():
        again = after[name]
        scale = float(value.double().abs().max()) if value.numel() else 0.0
        difference = float((again.double() - value.double()).abs().max()) if value.numel() else 0.0
        expect(
            again.shape == value.shape and difference <= 1e-3 * scale,
            f"{name} gives other results after the refused call (max difference {difference:.3g})",
        )


#: How far two runs of the same call may differ on a vendor declaring `deterministic=False` (another
#: order of sums), relative to the result; an aliased or stale result differs by about 1.
NON_DETERMINISTIC_RELATIVE = 1e-2


def same_result(vendor: Vendor, got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether two results of the same call agree: bit for bit, or within `NON_DETERMINISTIC_RELATIVE`
    for float results of a vendor that declares its ops non-deterministic."""
    if vendor.capabilities().deterministic or not got.is_floating_point():
        return torch.equal(got, want)
    return got.shape == want.shape and relative_error(got, want.double().cpu()) <= NON_DETERMINISTIC_RELATIVE
