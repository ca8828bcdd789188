"""Which scheme a layer's experts run as on a vendor: the scheme asked for, or the one the vendor declares
in its place (`Capabilities.scheme_fallbacks`) when it lacks the scheme's grouped-matmul kind.

A scheme fallback converts the weights once, at load (FP8 checkpoints as W8A8-INT8 on Atlas A2/A3); the
dispatch plan is still resolved for the scheme asked for, so the chain reads: scheme fallback (weights),
then dispatch fallback (activations), each with its reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hal.capabilities import Capabilities, SchemeFallback
from hal.errors import UnsupportedDispatchDtype, names
from hal.platform import Platform
from hal.resolution import DispatchConfig, DispatchPlan, resolve_dispatch_plan
from hal.schemes import KNOWN_SCHEMES, SchemeTraits


@dataclass(frozen=True)
class SchemeChoice:
    """The scheme asked for (`requested`), the one whose kernels run (`effective`), the declared fallback
    that leads from one to the other (None: no conversion), or `problem`: why neither can run."""

    requested: SchemeTraits
    effective: SchemeTraits
    fallback: SchemeFallback | None = None
    problem: str | None = None

    @property
    def converted(self) -> bool:
        """Whether the weights are converted at load to another scheme."""
        return self.fallback is not None and self.problem is None

    def text(self) -> str:
        """One line for logs and `hal explain`."""
        if self.problem is not None:
            return f"scheme fallback: none possible: {self.problem}"
        if self.fallback is None:
            return f"scheme fallback: none ({self.requested.name} runs as it is)"
        bound = "" if self.fallback.max_error is None else f" (declared error bound {self.fallback.max_error:g})"
        return (
            f"scheme fallback: {self.requested.name} -> {self.effective.name}, weights converted once at load: "
            f"{self.fallback.reason}{bound}"
        )


def choose_scheme(capabilities: Capabilities, scheme: SchemeTraits) -> SchemeChoice:
    """The scheme a layer of `scheme` runs as with `capabilities` (see the module)."""
    kind = scheme.compute_kind
    if kind is None or capabilities.supports_gemm(kind):
        return SchemeChoice(scheme, scheme)
    lacking = (
        f"the {kind} grouped matmul that scheme {scheme.name!r} needs is not declared "
        f"(declared: {names(capabilities.grouped_matmul)})"
    )
    declared = capabilities.scheme_fallbacks.get(scheme.name)
    activations = _dispatch_side(capabilities, scheme)
    if declared is None:
        return SchemeChoice(
            scheme, scheme, None, f"{lacking}, and no scheme fallback is declared for it; {activations}"
        )
    if declared.target is None:
        return SchemeChoice(
            scheme, scheme, declared, f"{lacking}; its scheme fallback is refused: {declared.reason}; {activations}"
        )
    target = KNOWN_SCHEMES[declared.target]
    if target.compute_kind is not None and not capabilities.supports_gemm(target.compute_kind):
        return SchemeChoice(
            scheme,
            scheme,
            declared,
            f"{lacking}; its declared fallback {target.name!r} needs the {target.compute_kind} grouped matmul, "
            "which is not declared either",
        )
    return SchemeChoice(scheme, target, declared)


def _dispatch_side(capabilities: Capabilities, scheme: SchemeTraits) -> str:
    """What the dispatch fallbacks say of the scheme's activations, for a refusal that names both chains."""
    dtype = scheme.preferred_dtype
    if dtype in capabilities.dispatch_dtypes:
        return f"its activations ({dtype}) would be carried as they are"
    fallback = capabilities.fallbacks.get(dtype)
    if fallback is None:
        return f"no dispatch fallback is declared for its activations ({dtype}) either"
    why = f" ({fallback.reason})" if fallback.reason else ""
    if fallback.target is None:
        return f"the dispatch fallback of its activations ({dtype}) is refused too{why}"
    return f"its activations would fall back {dtype} -> {fallback.target}{why}"


def resolve_layer_plan(
    vendor: Platform,
    hidden_size: int,
    choice: SchemeChoice,
    *,
    config: DispatchConfig | None = None,
    environ: Mapping[str, str] | None = None,
    capabilities: Capabilities | None = None,
    runner_dtype: str | None = None,
) -> DispatchPlan:
    """The dispatch plan of a layer whose scheme resolved to `choice`: resolved for the scheme asked for
    (its dispatch fallbacks apply); where that dtype is refused, or the converted scheme does not take it in
    that scale layout, resolved for the scheme that runs."""
    kwargs = {"config": config, "environ": environ, "capabilities": capabilities, "runner_dtype": runner_dtype}
    try:
        plan = resolve_dispatch_plan(vendor, hidden_size, scheme=choice.requested, **kwargs)  # type: ignore[arg-type]
    except UnsupportedDispatchDtype:
        if not choice.converted:
            raise
        return resolve_dispatch_plan(vendor, hidden_size, scheme=choice.effective, **kwargs)  # type: ignore[arg-type]
    wanted = choice.effective.layout_for(plan.resolved)
    if choice.converted and (
        plan.resolved not in choice.effective.accepts or (wanted is not None and wanted is not plan.scale_layout)
    ):
        return resolve_dispatch_plan(vendor, hidden_size, scheme=choice.effective, **kwargs)  # type: ignore[arg-type]
    return plan


__all__ = ["SchemeChoice", "SchemeFallback", "choose_scheme", "resolve_layer_plan"]
