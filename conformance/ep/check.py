"""One expert-parallel case on one rank: build the EP layer, run this rank's tokens, compare.

The EP layer's output is compared with (a) the single-rank layer of all experts (same scheme and
dispatch dtype) on the same tokens and (b) the float64 MoE of those tokens, routed by the layer's
router, through the single-rank layer's stored (dequantized) weights. An EP combine may add each
token's per-rank partial sums in another order, so the layers need not agree bit for bit; what is
required (`bounds`):

- the EP error against float64 stays within the suite's layer bound (`layer_tolerance`);
- it is at most `EP_ERROR_FACTOR` times the single-rank layer's own error plus `EP_ROUNDINGS`
  roundings of the output dtype;
- the EP and single-rank outputs differ by at most `AGREEMENT_FACTOR` times the single-rank error
  plus those roundings (a rounding that lands differently may flip a quantized value downstream).

A layer may refuse a case (`UnsupportedCapability` / `InvalidInput`) when it is built, and a vendor's
own dispatcher may also refuse a forward for a shape limit (`InvalidInput`): the case is skipped with
the message. A capability lacking only at the forward of a layer that was built (`UnsupportedCapability`)
fails the case: the dispatcher is declared, so the build must refuse what it cannot run.
The torch.distributed dispatchers run every shape the single-rank layer runs, so a refusal in
their forward fails the case, as does an auto-mode layer refusing a batch above its capacity
(auto must then take normal mode).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from conformance.ep.cases import TORCH, Case, Shape
from conformance.expectations import Expected, expected_resolution
from conformance.reference import generator, moe_features, relative_error
from conformance.tolerances import OUTPUT_ROUNDING, layer_tolerance
from hal import (
    KNOWN_SCHEMES,
    DispatchConfig,
    DispatchDtype,
    InvalidInput,
    UnsupportedCapability,
    UnsupportedDispatchDtype,
    Vendor,
)
from hal.reference import weight_value
from moe import MoELayer, make_scheme

#: The EP error against float64 may be this multiple of the single-rank layer's own error ...
EP_ERROR_FACTOR = 1.25
#: ... plus this many roundings of the output dtype (`OUTPUT_ROUNDING`): the combine rounds each rank's
#: partial sum and then their sum.
EP_ROUNDINGS = 2
#: The EP and single-rank outputs may differ by this fraction of the single-rank error (plus the roundings).
AGREEMENT_FACTOR = 0.5
#: Longest traceback kept per rank and case.
MAX_DETAILS = 4000


class CaseFailure(AssertionError):
    """A check of a case did not hold."""


@dataclass
class Inputs:
    """A shape's global weights and every rank's tokens, the same on every rank."""

    w13: torch.Tensor
    w2: torch.Tensor
    x: torch.Tensor  #: bf16 `[all tokens, H]`
    logits: torch.Tensor  #: fp32 `[all tokens, E]`
    bounds: list[int]  #: token offsets of the ranks


@dataclass
class Single:
    """The single-rank layer's result on this rank's tokens and the float64 MoE it is judged by."""

    y: torch.Tensor
    ref: torch.Tensor
    error: float
    note: str = ""  #: how the reference was made, where it is not the usual way


@dataclass
class RankContext:
    """What a rank keeps between cases: its vendor, group and the last shape's data (cases come grouped)."""

    vendor: Vendor
    rank: int
    world: int
    _inputs: tuple[Shape, Inputs] | None = None
    _single: tuple[tuple[Shape, str], Single] | None = None

    def inputs(self, shape: Shape) -> Inputs:
        """The shape's weights and tokens (made once per shape)."""
        if self._inputs is None or self._inputs[0] != shape:
            self._inputs = (shape, make_inputs(shape, self.world))
        return self._inputs[1]

    def single(self, case: Case, x: torch.Tensor, logits: torch.Tensor) -> Single:
        """The single-rank layer of all experts on this rank's tokens (once per shape and dtype)."""
        key = (case.shape, case.dtype)
        if self._single is None or self._single[0] != key:
            self._single = (key, run_single(case, self.inputs(case.shape), self.vendor, x, logits))
        return self._single[1]


def make_inputs(shape: Shape, world: int) -> Inputs:
    """Weights of order-one activations, bf16 tokens, logits with a popular expert and the idle ones never chosen."""
    experts = shape.num_experts(world)
    gen = generator("ep-weights", shape.name, experts)
    w13 = torch.randn(experts, shape.hidden, 2 * shape.intermediate, generator=gen) / shape.hidden**0.5
    w2 = torch.randn(experts, shape.intermediate, shape.hidden, generator=gen) / shape.intermediate**0.5
    counts = shape.tokens_per_rank(world)
    total = sum(counts)
    gen = generator("ep-tokens", shape.name, experts, tuple(counts))
    x = torch.randn(total, shape.hidden, generator=gen).to(torch.bfloat16)
    logits = torch.randn(total, experts, generator=gen)
    logits[: total // 3, 0] += 3.0  # uneven loads: expert 0 is popular
    idle = shape.idle(world)
    if idle:
        logits[:, idle] = -1e4
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + count)
    return Inputs(w13, w2, x, logits, bounds)


def build_kwargs(case: Case, vendor: Vendor) -> dict[str, Any]:
    """The layer arguments every layer of a case shares: the unfused path, whose dispatcher the case names
    (a vendor's `fused_deep_moe` moves the tokens itself)."""
    return {"scheme": case.scheme, "vendor": vendor, "environ": {}, "fused": False}


def run_single(case: Case, inputs: Inputs, vendor: Vendor, x: torch.Tensor, logits: torch.Tensor) -> Single:
    """The single-rank layer's output on `x`, the float64 MoE through its stored weights, its error."""
    layer = MoELayer.from_float(
        inputs.w13, inputs.w2, case.shape.top_k, dispatch=DispatchConfig(dtype=case.dtype), **build_kwargs(case, vendor)
    )
    y = layer(x, logits).detach().cpu()
    routing = layer.router(logits)
    weights, note = layer.expert_weights, ""
    try:
        w13, w2 = weight_value(weights.w13).cpu(), weight_value(weights.w2).cpu()
    except Exception as exc:  # noqa: BLE001 - a vendor's stored form hal.reference cannot read
        w13, w2 = inputs.w13, inputs.w2
        note = (
            f"the float64 MoE uses the float weights: hal.reference.weight_value cannot read the stored "
            f"weights of vendor {vendor.name} ({type(exc).__name__}: {exc})"
        )
    ref = moe_features(x.cpu(), routing.topk_ids.cpu(), routing.topk_weights.cpu(), w13, w2)
    return Single(y, ref, relative_error(y, ref), note)


def scheme_skip(case: Case, vendor: Vendor) -> str | None:
    """Why the vendor cannot run the case's scheme at all (None: it can)."""
    caps = vendor.capabilities()
    kind = make_scheme(case.scheme).gemm_kind()
    if caps.supports_gemm(kind):
        return None
    return f"vendor {vendor.name} declares no {kind} grouped matmul (the unfused path of scheme {case.scheme})"


def run_case(case: Case, ctx: RankContext, group: Any) -> dict[str, Any]:
    """This rank's outcome of `case`: `{"outcome": passed | failed | skipped, "message", "notes", metrics}`."""
    started = time.perf_counter()
    result: dict[str, Any] = {"outcome": "passed", "message": "", "notes": [], "details": "", "stage": "build"}
    try:
        _run(case, ctx, group, result)
    except (UnsupportedCapability, InvalidInput) as exc:
        refused, stage = f"{type(exc).__name__}: {exc}", result["stage"]
        if stage == "forward" and case.mode == "auto-large":
            result.update(outcome="failed", message=f"auto mode refused a batch above its capacity ({refused})")
        elif stage == "forward" and case.dispatcher == TORCH:
            result.update(
                outcome="failed",
                message=f"the torch.distributed dispatcher refused the forward of a layer it built ({refused})",
                details=traceback.format_exc()[-MAX_DETAILS:],
            )
        elif stage == "forward" and isinstance(exc, UnsupportedCapability):  # a shape limit is InvalidInput
            result.update(
                outcome="failed",
                message=f"the declared dispatcher {case.dispatcher!r} built a layer, then lacked a capability "
                f"at its forward ({refused})",
                details=traceback.format_exc()[-MAX_DETAILS:],
            )
        else:
            result.update(outcome="skipped", message=f"refused at {stage}: {refused}")
    except CaseFailure as exc:
        result.update(outcome="failed", message=str(exc))
    except Exception as exc:  # noqa: BLE001 - any error of a case is its failure, the next case still runs
        result.update(
            outcome="failed",
            message=f"{type(exc).__name__} at {result['stage']}: {exc}",
            details=traceback.format_exc()[-MAX_DETAILS:],
        )
    result["seconds"] = time.perf_counter() - started
    return result


def _run(case: Case, ctx: RankContext, group: Any, result: dict[str, Any]) -> None:
    vendor, caps = ctx.vendor, ctx.vendor.capabilities()
    inputs = ctx.inputs(case.shape)
    mine = slice(inputs.bounds[ctx.rank], inputs.bounds[ctx.rank + 1])
    x, logits = inputs.x[mine].to(vendor.device), inputs.logits[mine].to(vendor.device)
    expected = expected_resolution(caps, DispatchDtype.parse(case.dtype), KNOWN_SCHEMES[case.scheme])
    build = {"process_group": group, "dispatch": case.config(ctx.world), **build_kwargs(case, vendor)}
    if expected.outcome == "rejected":
        try:
            MoELayer.from_float(inputs.w13, inputs.w2, case.shape.top_k, **build)
        except UnsupportedDispatchDtype as exc:
            result["message"] = f"refused as declared: {exc}"
            return
        raise CaseFailure(
            f"vendor {vendor.name} declares {case.dtype} dispatch rejected for {case.scheme}, but the layer was built"
        )
    layer = MoELayer.from_float(inputs.w13, inputs.w2, case.shape.top_k, **build)
    _check_plan(layer, expected, result)
    result["stage"] = "forward"
    y = layer(x, logits)
    if tuple(y.shape) != tuple(x.shape) or y.dtype != x.dtype:
        raise CaseFailure(f"output {y.dtype} {tuple(y.shape)}, expected {x.dtype} {tuple(x.shape)}")
    _check_mode(case, layer, ctx.world, result)
    result["stage"] = "single-rank layer"
    single = ctx.single(case, x, logits)
    if single.note:
        result["notes"].append(single.note)
    result["stage"] = "check"
    _check_numbers(case, y.detach().cpu(), single, str(expected.resolved), result)


def _check_plan(layer: MoELayer, expected: Expected, result: dict[str, Any]) -> None:
    plan = layer.plan
    result["resolved"] = str(plan.resolved)
    result["fallback"] = None if plan.fallback is None else f"{plan.fallback.source} -> {plan.fallback.target}"
    if plan.resolved != expected.resolved:
        raise CaseFailure(
            f"the plan resolved {plan.resolved}; the declarations imply {expected.resolved} ({expected.outcome})"
        )
    if expected.outcome == "fallback" and (plan.fallback is None or plan.fallback.target != expected.resolved):
        raise CaseFailure(
            f"{expected.wanted} falls back to {expected.resolved} but the plan records no such "
            f"fallback ({result['fallback']})"
        )
    if expected.outcome == "native" and plan.fallback is not None:
        raise CaseFailure(
            f"{expected.wanted} is carried natively but the plan records a fallback ({result['fallback']})"
        )


def _check_mode(case: Case, layer: MoELayer, world: int, result: dict[str, Any]) -> None:
    taken = getattr(layer.dispatcher, "last_mode", None)
    result["mode_taken"] = taken
    if taken is None:
        if case.mode.startswith("auto"):
            result["notes"].append("layer.dispatcher.last_mode is absent: the mode auto took is not checked")
        return
    expected = case.expected_mode(world)
    if taken != expected:
        raise CaseFailure(f"the layer took {taken} mode; {case.mode} expects {expected}")


def bounds(scheme: str, resolved: str, single_error: float, out_dtype: torch.dtype) -> dict[str, float]:
    """The three bounds of a case (see the module's docstring)."""
    slack = EP_ROUNDINGS * OUTPUT_ROUNDING[out_dtype]
    return {
        "layer": layer_tolerance(scheme, resolved),
        "relative": EP_ERROR_FACTOR * single_error + slack,
        "agreement": AGREEMENT_FACTOR * single_error + slack,
    }


def _check_numbers(case: Case, y: torch.Tensor, single: Single, resolved: str, result: dict[str, Any]) -> None:
    error = relative_error(y, single.ref)
    agreement = relative_error(y, single.y.double()) if single.y.numel() else 0.0
    limit = bounds(case.scheme, resolved, single.error, y.dtype)
    result.update(ep_error=error, single_error=single.error, agreement=agreement, bounds=limit)
    problems = []
    if error > limit["layer"]:
        problems.append(f"EP error {error:.4g} against float64 > {limit['layer']} (the layer bound)")
    if error > limit["relative"]:
        problems.append(
            f"EP error {error:.4g} > {EP_ERROR_FACTOR:g} x the single-rank error {single.error:.4g} "
            f"+ {EP_ROUNDINGS} roundings = {limit['relative']:.4g}"
        )
    if agreement > limit["agreement"]:
        problems.append(f"EP differs from the single-rank layer by {agreement:.4g} > {limit['agreement']:.4g}")
    if problems and single.error > limit["layer"]:
        problems.append(
            f"the single-rank layer is out of its bound too ({single.error:.4g}): the fault is not "
            "specific to expert parallelism"
        )
    if problems:
        raise CaseFailure("; ".join(problems))
