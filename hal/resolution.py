"""Dispatch-dtype resolution (design.md section 4): one function, a plan with provenance.

Precedence, highest first: explicit setting > `HAL_DISPATCH_DTYPE` > legacy variables
(deprecated) > the model dtype (a scheme that computes in it, the unquantized one, over
fp16 or fp32 weights) > the quant scheme > the expert runner's requirement > the vendor
default. The vendor then validates: a supported dtype is kept, an unsupported one follows
the declared fallback (one warning per vendor instance and pair) or is rejected. A model
dtype the vendor neither carries nor falls back from is not rejected: nobody asked for it
explicitly, so it yields to the scheme's declared dtype, recorded as a fallback.

Nothing here writes `os.environ` or any global; the environment is only read, and
can be passed in as a mapping.
"""

from __future__ import annotations

import enum
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hal.capabilities import Capabilities
from hal import checks
from hal.dtypes import DispatchDtype, ScaleLayout
from hal.errors import InvalidInput, UnsupportedDispatchDtype, invalid, names, positive_int
from hal.schemes import SchemeTraits, parse_scheme
from hal.platform import Platform, unsupported_dispatch_message

#: The environment variable that requests a dispatch dtype (below explicit settings).
ENV_DISPATCH_DTYPE = "HAL_DISPATCH_DTYPE"

#: Variables other engines used for the same purpose: name -> dtype requested when truthy.
LEGACY_DISPATCH_VARIABLES: Mapping[str, DispatchDtype] = {
    "SGLANG_DEEPEP_BF16_DISPATCH": DispatchDtype.BF16,
    "DEEP_NORMAL_MODE_USE_INT8_QUANT": DispatchDtype.INT8,
}

_TRUTHY = {"1", "true", "yes", "on"}


class HalDeprecationWarning(FutureWarning):
    """A deprecated setting was used; the message names its replacement."""


class PlanSource(str, enum.Enum):
    """Where a dispatch-dtype decision came from."""

    EXPLICIT = "explicit"
    ENVIRONMENT = "environment"
    LEGACY_ENVIRONMENT = "legacy-environment"
    MODEL_DTYPE = "model-dtype"
    SCHEME = "scheme"
    RUNNER = "runner"
    VENDOR_DEFAULT = "vendor-default"

    def __str__(self) -> str:
        return self.value


#: The expert-parallel modes a `DispatchConfig` may ask for.
EP_MODES = ("normal", "low-latency", "auto")


@dataclass(frozen=True)
class DispatchConfig:
    """Per-layer dispatch settings: the dtype request and the low-latency capacity."""

    dtype: DispatchDtype | str = DispatchDtype.AUTO
    max_dispatch_tokens_per_rank: int | None = None
    #: a vendor's own expert-parallel dispatcher by name (e.g. Ascend's "mc2", CUDA's "deepep");
    #: None: torch.distributed
    ep_dispatcher: str | None = None
    #: expert-parallel mode: "normal" (variable rows, one host synchronisation), "low-latency" (fixed
    #: capacity `max_dispatch_tokens_per_rank`, no host synchronisation), "auto" (low-latency for a batch
    #: of at most the capacity, normal above it, chosen per call); None: low-latency where a capacity is
    #: set, else normal
    ep_mode: str | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "dtype", DispatchDtype.parse(self.dtype))
        except InvalidInput:
            raise invalid("dtype", f"a dispatch dtype, one of {', '.join(DispatchDtype.names())}", self.dtype) from None
        if self.ep_dispatcher is not None and (not isinstance(self.ep_dispatcher, str) or not self.ep_dispatcher):
            raise InvalidInput(f"ep_dispatcher: expected a dispatcher name or None, got {self.ep_dispatcher!r}")
        if self.max_dispatch_tokens_per_rank is not None:
            positive_int("max_dispatch_tokens_per_rank", self.max_dispatch_tokens_per_rank, "a positive int or None")
        if self.ep_mode is not None and self.ep_mode not in EP_MODES:
            raise invalid("ep_mode", f"one of {', '.join(EP_MODES)} or None", self.ep_mode)
        if self.ep_mode in ("low-latency", "auto") and self.max_dispatch_tokens_per_rank is None:
            raise InvalidInput(
                f"ep_mode {self.ep_mode!r}: expected max_dispatch_tokens_per_rank (the low-latency capacity), got None"
            )

    @property
    def mode(self) -> str:
        """The expert-parallel mode this config asks for ("normal", "low-latency" or "auto")."""
        if self.ep_mode is not None:
            return self.ep_mode
        return "normal" if self.max_dispatch_tokens_per_rank is None else "low-latency"


@dataclass(frozen=True)
class TraceStep:
    """One source consulted during resolution and what it said."""

    source: PlanSource
    says: DispatchDtype | None
    detail: str
    decided: bool = False


@dataclass(frozen=True)
class Fallback:
    """A declared fallback that was applied."""

    source: DispatchDtype
    target: DispatchDtype
    reason: str


@dataclass(frozen=True)
class DispatchPlan:
    """The outcome of resolution, with its provenance."""

    def __deepcopy__(self, memo: dict[int, object]) -> DispatchPlan:
        """Itself: the object is immutable, so a deep copy (of a layer, of a model) shares it."""
        return self

    vendor: str
    device_name: str
    hidden_size: int
    requested: DispatchDtype
    source: PlanSource
    resolved: DispatchDtype
    scale_layout: ScaleLayout
    bytes_per_token: int
    fallback: Fallback | None = None
    scheme: str | None = None
    trace: tuple[TraceStep, ...] = field(default_factory=tuple)
    model_dtype: DispatchDtype | None = None  #: the scheme's model dtype, where it asked for one

    def buffer_bytes(self, tokens: int) -> int:
        """Bytes a dispatch buffer needs for `tokens` tokens (never 2 bytes per element blindly)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise InvalidInput(f"tokens: expected a non-negative int, got {tokens!r}")
        return tokens * self.bytes_per_token

    def as_dict(self) -> dict[str, Any]:
        """Plain-data view for JSON output."""
        return {
            "vendor": self.vendor,
            "device_name": self.device_name,
            "scheme": self.scheme,
            "model_dtype": self.model_dtype.value if self.model_dtype else None,
            "hidden_size": self.hidden_size,
            "requested": self.requested.value,
            "source": self.source.value,
            "resolved": self.resolved.value,
            "scale_layout": self.scale_layout.value,
            "bytes_per_token": self.bytes_per_token,
            "fallback": None
            if self.fallback is None
            else {"from": self.fallback.source.value, "to": self.fallback.target.value, "reason": self.fallback.reason},
            "trace": [
                {
                    "source": s.source.value,
                    "says": s.says.value if s.says else None,
                    "detail": s.detail,
                    "decided": s.decided,
                }
                for s in self.trace
            ],
        }


def resolve_dispatch_plan(
    vendor: Platform,
    hidden_size: int,
    *,
    config: DispatchConfig | None = None,
    scheme: SchemeTraits | str | None = None,
    runner_dtype: DispatchDtype | str | None = None,
    environ: Mapping[str, str] | None = None,
    capabilities: Capabilities | None = None,
) -> DispatchPlan:
    """Resolve the dispatch dtype for one dispatcher and return the plan.

    `capabilities` defaults to the vendor's own (probed) ones; pass a declared table
    (`vendor.declared_capabilities("H100")`) to plan for absent hardware. `environ`
    defaults to the process environment, which is only read.
    """
    if not isinstance(vendor, Platform):
        raise invalid("vendor", "a hal.Vendor", type(vendor).__name__)
    positive_int("hidden_size", hidden_size)
    if config is not None and not isinstance(config, DispatchConfig):
        raise invalid("config", "a hal.DispatchConfig or None", type(config).__name__)
    if capabilities is not None and not isinstance(capabilities, Capabilities):
        raise invalid("capabilities", "a hal.Capabilities or None", type(capabilities).__name__)
    if scheme is not None and not isinstance(scheme, (SchemeTraits, str)):
        raise invalid("scheme", "a hal.SchemeTraits, a scheme name or None", type(scheme).__name__)
    config = config or DispatchConfig()
    traits = parse_scheme(scheme) if scheme is not None else None
    runner = _runner_dtype(runner_dtype)
    checked = checks.environ_mapping(environ)
    env = os.environ if checked is None else checked
    caps = capabilities if capabilities is not None else vendor.capabilities()

    steps = _consult_sources(config, env, traits, runner, caps)
    decided = next(s for s in steps if s.says is not None)
    trace = tuple(TraceStep(s.source, s.says, s.detail, decided=(s is decided)) for s in steps)
    requested: DispatchDtype = decided.says  # type: ignore[assignment]  # the vendor default always speaks
    if (
        traits is not None
        and decided.source in (PlanSource.EXPLICIT, PlanSource.ENVIRONMENT, PlanSource.LEGACY_ENVIRONMENT)
        and requested not in traits.accepts
    ):
        raise InvalidInput(
            f"dispatch dtype ({decided.detail}): scheme {traits.name!r} accepts "
            f"{names(traits.accepts)}, got {requested}"
        )

    yields_to = traits.dispatch_dtype if traits is not None and decided.source is PlanSource.MODEL_DTYPE else None
    resolved, fallback = _validate(vendor, caps, requested, traits, yields_to)
    layout = _scale_layout(resolved, traits, caps)
    return DispatchPlan(
        vendor=vendor.name,
        device_name=caps.device_name,
        hidden_size=hidden_size,
        requested=requested,
        source=decided.source,
        resolved=resolved,
        scale_layout=layout,
        bytes_per_token=resolved.bytes_per_token(hidden_size, layout),
        fallback=fallback,
        scheme=traits.name if traits else None,
        trace=trace,
        model_dtype=traits.model_dtype if traits else None,
    )


def _runner_dtype(runner_dtype: object) -> DispatchDtype | None:
    """The runner's required dispatch dtype (None for none or auto), or `InvalidInput` naming `runner_dtype`."""
    if runner_dtype is None:
        return None
    try:
        parsed = DispatchDtype.parse(runner_dtype)  # type: ignore[arg-type]
    except InvalidInput:
        raise invalid("runner_dtype", f"None or one of {', '.join(DispatchDtype.names())}", runner_dtype) from None
    return None if parsed is DispatchDtype.AUTO else parsed


def _consult_sources(
    config: DispatchConfig,
    env: Mapping[str, str],
    traits: SchemeTraits | None,
    runner: DispatchDtype | None,
    caps: Capabilities,
) -> list[TraceStep]:
    """What every source says, in precedence order (the first that speaks decides)."""
    explicit = None if config.dtype is DispatchDtype.AUTO else config.dtype
    steps = [TraceStep(PlanSource.EXPLICIT, explicit, f"DispatchConfig(dtype={config.dtype.value!r})")]

    raw = env.get(ENV_DISPATCH_DTYPE)
    from_env = None
    if raw is not None and raw.strip():
        try:
            from_env = DispatchDtype.parse(raw)
        except InvalidInput:
            raise InvalidInput(
                f"{ENV_DISPATCH_DTYPE}: expected one of {', '.join(DispatchDtype.names())}, got {raw!r}"
            ) from None
        from_env = None if from_env is DispatchDtype.AUTO else from_env
    steps.append(
        TraceStep(
            PlanSource.ENVIRONMENT,
            from_env,
            f"{ENV_DISPATCH_DTYPE}={raw!r}" if raw is not None else f"{ENV_DISPATCH_DTYPE} unset",
        )
    )

    legacy, legacy_detail = None, "no legacy variable set"
    for variable, dtype in LEGACY_DISPATCH_VARIABLES.items():
        value = env.get(variable)
        if value is not None and value.strip().lower() in _TRUTHY:
            warnings.warn(
                f"{variable} is deprecated: set {ENV_DISPATCH_DTYPE}={dtype.value} or "
                f"DispatchConfig(dtype={dtype.value!r}) instead",
                HalDeprecationWarning,
                stacklevel=3,  # the caller of resolve_dispatch_plan
            )
            if legacy is None:
                legacy, legacy_detail = dtype, f"{variable}={value!r} (deprecated)"
    steps.append(TraceStep(PlanSource.LEGACY_ENVIRONMENT, legacy, legacy_detail))

    steps.append(_model_dtype_step(traits))
    if traits is None:
        steps.append(TraceStep(PlanSource.SCHEME, None, "no scheme given"))
    elif traits.input_global_scale:
        steps.append(
            TraceStep(PlanSource.SCHEME, DispatchDtype.NVFP4, f"scheme {traits.name!r} has an input global scale")
        )
    else:
        kind = traits.gemm_kind.spec if traits.gemm_kind is not None else None
        why = (
            f" (weight-only: {kind.pairing()}; the activations stay {traits.dispatch_dtype})"
            if kind is not None and kind.weight_only
            else ""
        )
        steps.append(
            TraceStep(
                PlanSource.SCHEME,
                traits.dispatch_dtype,
                f"scheme {traits.name!r} declares {traits.dispatch_dtype}{why}",
            )
        )

    steps.append(
        TraceStep(PlanSource.RUNNER, runner, f"runner requires {runner}" if runner else "runner has no requirement")
    )
    steps.append(TraceStep(PlanSource.VENDOR_DEFAULT, caps.default_dispatch_dtype, f"{caps.device_name} default"))
    return steps


def _model_dtype_step(traits: SchemeTraits | None) -> TraceStep:
    """What the model dtype says: the dtype of a scheme that computes in it, where it is not the
    scheme's declared one."""
    if traits is None:
        return TraceStep(PlanSource.MODEL_DTYPE, None, "no scheme given")
    if traits.model_dtype is not None:
        return TraceStep(
            PlanSource.MODEL_DTYPE,
            traits.model_dtype,
            f"scheme {traits.name!r} computes in its {traits.model_dtype} weights' dtype",
        )
    if traits.follows_model_dtype:
        return TraceStep(
            PlanSource.MODEL_DTYPE,
            None,
            f"scheme {traits.name!r}: weights in its own {traits.dispatch_dtype} (no other model dtype)",
        )
    kind = traits.gemm_kind.spec if traits.gemm_kind is not None else None
    if kind is not None and kind.weight_only:
        return TraceStep(
            PlanSource.MODEL_DTYPE, None, f"scheme {traits.name!r} is weight-only: its activations are always bf16"
        )
    return TraceStep(PlanSource.MODEL_DTYPE, None, f"scheme {traits.name!r} quantizes its activations")


def _validate(
    vendor: Platform,
    caps: Capabilities,
    requested: DispatchDtype,
    traits: SchemeTraits | None,
    yields_to: DispatchDtype | None = None,
) -> tuple[DispatchDtype, Fallback | None]:
    """Keep a supported dtype, apply the declared fallback, or raise; a model-dtype request
    (`yields_to`: the scheme's declared dtype) that would be rejected yields to that dtype."""
    if caps.supports_dispatch(requested):
        return requested, None
    target = caps.fallback_for(requested)
    scheme_note = f" (scheme {traits.name!r})" if traits else ""
    usable = target is not None and caps.supports_dispatch(target)
    if traits is not None and yields_to is not None and not usable and caps.supports_dispatch(yields_to):
        declared = caps.fallback_reasons.get(requested) or f"{caps.device_name} declares no {requested} dispatch"
        reason = (
            f"{declared}; the model dtype {requested} yields to the {yields_to} of scheme "
            f"{traits.name!r} (its experts still compute in {requested} after dispatch)"
        )
        vendor.warn_fallback_once(requested, yields_to, reason)
        return yields_to, Fallback(requested, yields_to, reason)
    if target is None:
        raise UnsupportedDispatchDtype(unsupported_dispatch_message(vendor.name, requested, caps) + scheme_note)
    if not caps.supports_dispatch(target):
        raise UnsupportedDispatchDtype(
            f"vendor {vendor.name!r} ({caps.device_name}) declares fallback {requested} -> {target}, "
            f"but {target} is not supported either; supported: {names(caps.dispatch_dtypes)}"
        )
    if traits is not None and target not in traits.accepts:
        raise UnsupportedDispatchDtype(
            f"vendor {vendor.name!r} ({caps.device_name}) carries {requested} as {target}, which "
            f"scheme {traits.name!r} cannot consume (it accepts {names(traits.accepts)})"
        )
    reason = caps.fallback_reasons.get(requested) or (
        f"{caps.device_name} does not carry {requested}; declared fallback {requested} -> {target}"
    )
    vendor.warn_fallback_once(requested, target, reason)
    return target, Fallback(requested, target, reason)


def _scale_layout(dtype: DispatchDtype, traits: SchemeTraits | None, caps: Capabilities) -> ScaleLayout:
    """The scheme's layout for `dtype` where it names one, else the vendor's."""
    chosen = traits.layout_for(dtype) if traits is not None else None
    return chosen or caps.layout_for(dtype)
