"""Why a layer runs the way it does: the pipeline, dispatcher, expert runner and dispatch dtype chosen, and
for every one not chosen, the reason.

`explain_layer` answers for settings alone (a `hal.LayerSpec`, a `DispatchConfig`), without weights or
hardware (a declared device model's table works too); `MoELayer.explanation` answers for a built layer,
from the same rules the layer was built by (`dispatcher_kind`, `LayerSpec.takes_fused`, the runner
registry's lookup). `hal layer` prints it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from hal import (
    Capabilities,
    DispatchConfig,
    DispatchPlan,
    HalError,
    LayerSpec,
    SchemeTraits,
    Vendor,
    resolve_layer_plan,
)
from moe.dispatch import DispatchFormat
from moe.dispatch.low_latency import capacity_problem
from moe.runners import ANY_VENDOR, RunnerKey, RunnerRegistry

#: The dispatchers of the torch.distributed path, by the name `dispatcher_kind` gives them.
TORCH_DISPATCHERS = ("local", "all-to-all", "low-latency", "auto")
_FORMATS = {
    "local": (DispatchFormat.STANDARD,),
    "all-to-all": (DispatchFormat.EP_NORMAL,),
    "low-latency": (DispatchFormat.EP_NORMAL,),
    "auto": (DispatchFormat.EP_NORMAL,),
}


def dispatcher_kind(config: DispatchConfig, expert_parallel: bool) -> str:
    """Which dispatcher a layer takes: the vendor's named one, else auto / low-latency by the mode, else
    all-to-all with a process group, else local (the rule `MoELayer` builds its dispatcher by)."""
    if config.ep_dispatcher is not None:
        return config.ep_dispatcher
    if config.mode in ("auto", "low-latency"):
        return config.mode
    return "all-to-all" if expert_parallel else "local"


@dataclass(frozen=True)
class Alternative:
    """A pipeline, dispatcher or runner the layer does not take, and why."""

    what: str
    name: str
    reason: str


@dataclass(frozen=True)
class LayerExplanation:
    """The choices for one layer (see the module); `text()` is what `hal layer` prints."""

    vendor: str
    device: str
    spec: LayerSpec
    problems: tuple[str, ...]
    plan: DispatchPlan | None = None
    pipeline: str | None = None
    dispatcher: str | None = None
    runner: str | None = None
    rejected: tuple[Alternative, ...] = field(default_factory=tuple)
    warnings: tuple[str, ...] = ()
    #: the scheme the experts run as, where the vendor converts the weights to another at load
    scheme_fallback: str | None = None
    #: how a built layer's eager calls run (`MoELayer.eager_calls`); None for settings alone
    eager: str | None = None

    def with_eager(self, eager: str) -> LayerExplanation:
        """This explanation with how the built layer's eager calls run."""
        return replace(self, eager=eager)

    @property
    def buildable(self) -> bool:
        """Whether the layer can be built at all."""
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return {
            "vendor": self.vendor,
            "device": self.device,
            "buildable": self.buildable,
            "problems": list(self.problems),
            "dispatch_dtype": None if self.plan is None else str(self.plan.resolved),
            "dispatch_source": None if self.plan is None else self.plan.source,
            "scheme_fallback": self.scheme_fallback,
            "fallback": None if self.plan is None or self.plan.fallback is None else str(self.plan.fallback.reason),
            "pipeline": self.pipeline,
            "dispatcher": self.dispatcher,
            "runner": self.runner,
            "rejected": [{"what": a.what, "name": a.name, "reason": a.reason} for a in self.rejected],
            "warnings": list(self.warnings),
            "eager_calls": self.eager,
        }

    def text(self) -> str:
        """The explanation in lines of text (an engine may log it)."""
        s = self.spec
        lines = [
            f"layer: hidden {s.hidden_size}, intermediate {s.intermediate_size}, {s.num_experts} experts, "
            f"top-{s.top_k}, scheme {s.traits.name}, {s.parsed_activation}"
            + (", biases" if s.bias else "")
            + (f", {s.redundant_experts} redundant experts" if s.redundant_experts else "")
            + (f", {s.ep_ranks} expert-parallel ranks" if s.expert_parallel else "")
            + (f", tp {s.tp_ranks}" if s.tp_ranks > 1 else ""),
            f"vendor: {self.vendor} ({self.device})",
        ]
        plan = self.plan
        if self.problems or plan is None:  # a buildable explanation always carries its plan
            lines += [f"refused: {p}" for p in self.problems]
            return "\n".join(lines)
        fallback = "" if plan.fallback is None else f"; fallback {plan.fallback.source} -> {plan.fallback.target}"
        if self.scheme_fallback is not None:
            lines.append(self.scheme_fallback)
        lines += [
            f"dispatch dtype: {plan.resolved} ({plan.scale_layout}), from {plan.source}{_why(plan)}{fallback}",
            f"pipeline: {self.pipeline}",
            f"dispatcher: {self.dispatcher}",
            f"runner: {self.runner}",
        ]
        if self.eager is not None:
            lines.append(f"eager calls: {self.eager}")
        lines += [f"not {a.what} {a.name}: {a.reason}" for a in self.rejected]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _why(plan: DispatchPlan) -> str:
    """The deciding step's own words (`scheme 'w4a16-mxfp4' declares bf16 (weight-only: ...)`)."""
    step = next((t for t in plan.trace if t.decided), None)
    return "" if step is None else f" ({step.detail})"


def explain_layer(
    vendor: Vendor,
    spec: LayerSpec,
    *,
    dispatch: DispatchConfig | None = None,
    runners: RunnerRegistry | None = None,
    capabilities: Capabilities | None = None,
    environ: Mapping[str, str] | None = None,
) -> LayerExplanation:
    """The choices a layer of `spec` makes on `vendor` (its probed table, or `capabilities`, e.g. a declared
    device model's), without building it."""
    caps = capabilities if capabilities is not None else vendor.capabilities()
    config = dispatch or DispatchConfig()
    base = {"vendor": vendor.name, "device": caps.device_name, "spec": spec}
    problems = [p.message for p in spec.problems(caps)]
    choice = spec.scheme_choice(caps)
    plan, caught = None, []
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            plan = resolve_layer_plan(
                vendor, spec.hidden_size, choice, config=config, environ=environ or {}, capabilities=caps
            )
        caught = [str(w.message) for w in seen]
    except HalError as exc:
        problems.insert(0, str(exc))
    kind = dispatcher_kind(config, spec.expert_parallel)
    capacity = config.max_dispatch_tokens_per_rank
    if plan is not None and kind in ("auto", "low-latency") and capacity is not None:
        too_large = capacity_problem(plan, capacity, spec.ep_ranks, vendor)
        problems += [] if too_large is None else [too_large]
    if problems or plan is None:
        return LayerExplanation(problems=tuple(problems), **base)
    rejected: list[Alternative] = []
    fused = spec.takes_fused(caps)
    pipeline = "fused (the vendor's fused_deep_moe)" if fused else "unfused (dispatch -> grouped GEMMs -> combine)"
    rejected.append(_pipeline_alternative(spec, caps, fused))
    rejected += _dispatcher_alternatives(kind, config, spec, caps)
    dispatcher = _dispatcher_text(kind, config, caps)
    if fused:
        dispatcher = f"none: the fused op moves the tokens itself (the {kind} dispatcher is built but not called)"
    runner = "none: the fused op computes the experts"
    if not fused:
        runner, others = _runners(vendor.name, kind, choice.effective, runners, environ)
        rejected += others
    return LayerExplanation(
        plan=plan,
        scheme_fallback=choice.text() if choice.converted else None,
        pipeline=pipeline,
        dispatcher=dispatcher,
        runner=runner,
        rejected=tuple(rejected),
        warnings=tuple(caught),
        problems=(),
        **base,
    )


def _pipeline_alternative(spec: LayerSpec, caps: Capabilities, fused: bool) -> Alternative:
    if fused:
        return Alternative(
            "pipeline", "unfused", "the vendor declares fused_deep_moe for this scheme (fused=False forces it)"
        )
    if spec.fused is False:
        why = "fused=False"
    elif (runs := spec.scheme_choice(caps).effective.name) not in caps.fused_deep_moe:
        declared = ", ".join(sorted(caps.fused_deep_moe)) or "no scheme"
        why = f"fused_deep_moe is not declared for scheme {runs!r} (declared for: {declared})"
    else:
        why = "the fused op computes SiLU-GLU experts without biases"
    return Alternative("pipeline", "fused", why)


def _dispatcher_text(kind: str, config: DispatchConfig, caps: Capabilities) -> str:
    if kind == "low-latency":
        return f"low-latency (torch.distributed, capacity {config.max_dispatch_tokens_per_rank} tokens per rank)"
    if kind == "auto":
        return f"auto (torch.distributed: low-latency up to {config.max_dispatch_tokens_per_rank} tokens per rank)"
    if kind in TORCH_DISPATCHERS:
        return f"{kind} (torch.distributed)" if kind != "local" else "local (one rank holds every expert)"
    return f"{kind} (the vendor's own, {config.mode} mode)"


def _dispatcher_alternatives(
    kind: str, config: DispatchConfig, spec: LayerSpec, caps: Capabilities
) -> list[Alternative]:
    ep = spec.expert_parallel
    capacity = config.max_dispatch_tokens_per_rank
    named = config.ep_dispatcher
    reasons = {
        "local": "the layer is expert parallel (it has a process group)",
        "all-to-all": "no process group: one rank holds every expert" if not ep else "",
        "low-latency": "no max_dispatch_tokens_per_rank (a per-rank capacity selects it)"
        if capacity is None
        else "ep_mode is 'auto' (it takes low-latency per call where the batches fit)",
        "auto": "ep_mode is not 'auto'",
    }
    if ep and capacity is not None:
        reasons["all-to-all"] = f"a capacity ({capacity} tokens per rank) selects {config.mode}"
    out = []
    for name in TORCH_DISPATCHERS:
        if name == kind:
            continue
        why = f"ep_dispatcher {named!r} is named" if named is not None else reasons[name]
        out.append(Alternative("dispatcher", name, why))
    for name in sorted(caps.ep_dispatchers):
        if name != kind:
            out.append(
                Alternative("dispatcher", name, "declared by the vendor, not named in DispatchConfig.ep_dispatcher")
            )
    for name, why in sorted(caps.ep_dispatchers_absent.items()):
        out.append(Alternative("dispatcher", name, f"not available here: {why}"))
    return out


def _runners(
    vendor: str, kind: str, traits: SchemeTraits, runners: RunnerRegistry | None, environ: Mapping[str, str] | None
) -> tuple[str, list[Alternative]]:
    registry = runners if runners is not None else RunnerRegistry.with_defaults(environ=environ or {})
    gemm = traits.compute_kind
    scheme = traits.name
    if gemm is None:
        return f"unknown: scheme {scheme!r} names no grouped-matmul kind hal knows", []
    formats = _FORMATS.get(kind, (DispatchFormat.EP_NORMAL, DispatchFormat.EP_LOW_LATENCY))
    chosen_key = None
    for who in (vendor, ANY_VENDOR):
        key = RunnerKey(formats[0], gemm, scheme, who)
        if key in registry.keys():
            chosen_key = key
            break
    if chosen_key is None:
        return "none registered for this key", []
    chosen = f"{_origin(registry, chosen_key)}, key {_key(chosen_key)}"
    out = []
    for key in registry.keys():
        if key == chosen_key or key.scheme != scheme:
            continue
        same_key = key.format in formats and key.kernel == gemm
        if same_key and key.vendor not in (ANY_VENDOR, vendor):
            why = f"registered for vendor {key.vendor!r}"
        elif same_key and key.vendor == ANY_VENDOR:
            why = f"the vendor's own runner ({_origin(registry, chosen_key)}) serves this key"
        elif registry.origin(key) == "generic" or key.vendor not in (ANY_VENDOR, vendor):
            continue  # the generic runner's other keys, other vendors' runners for other keys: no alternative
        elif key.kernel != gemm:
            why = f"computes {key.kernel}; scheme {scheme!r} runs {gemm} here"
        else:
            why = f"takes dispatch format {key.format}; the {kind} dispatcher hands over {formats[0]}"
        out.append(Alternative("runner", f"{_origin(registry, key)}, key {_key(key)}", why))
    return chosen, out


def _key(key: RunnerKey) -> str:
    return f"({key.format}, {key.kernel}, {key.scheme}{'' if key.vendor == ANY_VENDOR else ', ' + key.vendor})"


def _origin(registry: RunnerRegistry, key: RunnerKey) -> str:
    origin = registry.origin(key)
    return {
        "generic": "the generic runner (moe.run_grouped_experts)",
        "caller": "a runner registered by the caller",
    }.get(origin, f"plugin {origin!r}")


__all__ = ["Alternative", "LayerExplanation", "dispatcher_kind", "explain_layer"]
