"""Capabilities: what a vendor can do on one device, declared once, asked everywhere."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from hal.activations import ActivationKind
from hal.dtypes import DispatchDtype, ScaleLayout
from hal.errors import InvalidInput
from hal.gemm_kinds import GemmKind, gemm_kinds_consuming
from hal.schemes import KNOWN_SCHEMES, parse_scheme


class Int8QuantMode(str, enum.Enum):
    """How a vendor quantizes activations to int8."""

    NONE = "none"  #: int8 is not a dispatch dtype here
    PER_TOKEN_DYNAMIC = "per-token-dynamic"  #: symmetric, scale = rowmax(|x|) / 127

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class KernelLimits:
    """Hard limits of a vendor's kernels; `None` means unlimited."""

    max_group_rows: int | None = None  #: rows one grouped-matmul call may take in total
    max_inner_dim: int | None = None  #: largest K (and N) a grouped matmul accepts
    max_groups: int | None = None  #: most groups (experts) in one grouped matmul

    def as_dict(self) -> dict[str, int | None]:
        """Plain-data view for JSON output."""
        return {
            "max_group_rows": self.max_group_rows,
            "max_inner_dim": self.max_inner_dim,
            "max_groups": self.max_groups,
        }


@dataclass(frozen=True)
class DeclaredFallback:
    """What an unsupported dispatch dtype becomes (`target`; None: it is refused) and why, in words."""

    target: DispatchDtype | None
    reason: str = ""

    def __post_init__(self) -> None:
        target = None if self.target is None else DispatchDtype.parse(self.target)
        if target is DispatchDtype.AUTO:
            raise InvalidInput("DeclaredFallback.target: expected a concrete dtype or None, got 'auto'")
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "reason", str(self.reason))


@dataclass(frozen=True)
class SchemeFallback:
    """What a scheme whose grouped-matmul kind a vendor lacks runs as instead: `target` names the scheme its
    weights are converted to once, at load (None: the scheme is refused), `reason` says why in words, and
    `max_error` bounds the converted layer's error, `||y - ref|| / ||ref||` against the float64 layer of
    the original weights (the conformance suite checks it; None: no bound declared)."""

    target: str | None
    reason: str = ""
    max_error: float | None = None

    def __post_init__(self) -> None:
        if self.target is not None and not isinstance(self.target, str):
            raise InvalidInput(f"SchemeFallback.target: expected a scheme name or None, got {self.target!r}")
        bound = self.max_error
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound > 0):
            raise InvalidInput(f"SchemeFallback.max_error: expected None or a positive number, got {bound!r}")
        object.__setattr__(self, "reason", str(self.reason))


@dataclass(frozen=True)
class Capabilities:
    """A frozen declaration of what one vendor can do on one device: only what cannot be derived.

    `fallbacks` maps an unsupported dispatch dtype to a `DeclaredFallback` (the dtype it becomes, or None
    for refused, and the reason); whatever is neither carried nor listed is refused too. A value
    may be given as a bare dtype or None (no reason). `scale_layouts` names the activation scale
    layout a dtype is carried and quantized with where it is not the dtype's default (fp8's default
    is one scale per 128 channels). `supports_fp8_dispatch`, `int8_quant_mode`, `fp8_scale_layout`,
    `dispatch_fallbacks` and `fallback_reasons` are derived views. `scheme_fallbacks` maps a scheme
    (by name) whose grouped-matmul kind is not declared to the `SchemeFallback` it runs as.
    """

    def __deepcopy__(self, memo: dict[int, object]) -> Capabilities:
        """Itself: the object is immutable, so a deep copy (of a layer, of a model) shares it."""
        return self

    device_name: str
    dispatch_dtypes: frozenset[DispatchDtype]
    fallbacks: Mapping[DispatchDtype, DeclaredFallback] = field(default_factory=dict)
    default_dispatch_dtype: DispatchDtype = DispatchDtype.BF16
    scale_layouts: Mapping[DispatchDtype, ScaleLayout] = field(default_factory=dict)
    grouped_matmul: frozenset[GemmKind] = frozenset()
    fused_deep_moe: frozenset[str] = frozenset()
    activations: frozenset[ActivationKind] = frozenset(ActivationKind)  #: kinds `Vendor.activate` computes
    expert_bias: bool = True  #: `grouped_matmul(..., bias=)` (per-expert output bias) is computed
    #: ops run in step with the host, so reading a value back costs no stall (value checks are cheap)
    host_synchronous: bool = False
    #: two calls of an op with the same inputs give bit-identical results (no atomics, no run-to-run
    #: reduction order); a vendor whose kernels are not bit-reproducible declares False
    deterministic: bool = True
    #: `grouped_matmul` takes groups covering fewer rows than its operand and leaves the rest uncomputed
    #: (unspecified): a fixed-shape dispatch can then hand over a padded tail without reading counts back
    grouped_matmul_padding: bool = False
    #: the vendor captures a sequence of its ops once and replays it (`Vendor.graph_set`, e.g. CUDA graphs):
    #: a layer built with `moe.GraphConfig` replays its forward instead of issuing every op from the host
    graph_capture: bool = False
    #: the vendor's own expert-parallel dispatchers (`Vendor.ep_dispatch` / `ep_combine`), by name
    ep_dispatchers: frozenset[str] = frozenset()
    #: those of `ep_dispatchers` that also run in low-latency mode (a fixed per-rank token capacity,
    #: the masked `[local experts, capacity * ranks, H]` layout, no host synchronisation)
    ep_low_latency: frozenset[str] = frozenset()
    #: expert-parallel dispatchers the vendor could offer but cannot here, each with the reason
    #: (e.g. its library does not import); shown by `hal caps` and `hal explain`
    ep_dispatchers_absent: Mapping[str, str] = field(default_factory=dict)
    #: scheme name -> the scheme its weights are converted to at load where its GEMM kind is lacking
    scheme_fallbacks: Mapping[str, SchemeFallback] = field(default_factory=dict)
    limits: KernelLimits = KernelLimits()
    collective_backend: str = "gloo"
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        dtypes = frozenset(DispatchDtype.parse(d) for d in self.dispatch_dtypes)
        if DispatchDtype.AUTO in dtypes:
            raise InvalidInput("dispatch_dtypes: expected concrete dtypes, got 'auto' among them")
        fallbacks: dict[DispatchDtype, DeclaredFallback] = {}
        for source, value in dict(self.fallbacks).items():
            src = DispatchDtype.parse(source)
            fallback = value if isinstance(value, DeclaredFallback) else DeclaredFallback(value)
            if src is DispatchDtype.AUTO:
                raise InvalidInput(f"fallbacks: expected concrete dtypes, got {source!r} -> {value!r}")
            fallbacks[src] = fallback
        object.__setattr__(self, "dispatch_dtypes", dtypes)
        object.__setattr__(self, "fallbacks", MappingProxyType(fallbacks))
        object.__setattr__(self, "default_dispatch_dtype", DispatchDtype.parse(self.default_dispatch_dtype))
        layouts = {DispatchDtype.parse(k): ScaleLayout(v) for k, v in dict(self.scale_layouts).items()}
        object.__setattr__(self, "scale_layouts", MappingProxyType(layouts))
        object.__setattr__(self, "grouped_matmul", frozenset(GemmKind(k) for k in self.grouped_matmul))
        object.__setattr__(self, "fused_deep_moe", frozenset(self.fused_deep_moe))
        object.__setattr__(self, "activations", frozenset(ActivationKind(a) for a in self.activations))
        object.__setattr__(self, "expert_bias", bool(self.expert_bias))
        object.__setattr__(self, "host_synchronous", bool(self.host_synchronous))
        object.__setattr__(self, "deterministic", bool(self.deterministic))
        object.__setattr__(self, "grouped_matmul_padding", bool(self.grouped_matmul_padding))
        object.__setattr__(self, "graph_capture", bool(self.graph_capture))
        object.__setattr__(self, "ep_dispatchers", frozenset(str(n) for n in self.ep_dispatchers))
        object.__setattr__(self, "ep_low_latency", frozenset(str(n) for n in self.ep_low_latency))
        object.__setattr__(
            self,
            "ep_dispatchers_absent",
            MappingProxyType({str(k): str(v) for k, v in dict(self.ep_dispatchers_absent).items()}),
        )
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "scheme_fallbacks", MappingProxyType(_scheme_fallbacks(self.scheme_fallbacks)))

    def __hash__(self) -> int:
        return hash(
            (
                self.device_name,
                self.dispatch_dtypes,
                tuple(sorted((k.value, v.value if v else "") for k, v in self.dispatch_fallbacks.items())),
                self.grouped_matmul,
                self.fused_deep_moe,
            )
        )

    @property
    def supports_fp8_dispatch(self) -> bool:
        """Whether fp8 is carried natively (derived from `dispatch_dtypes`)."""
        return DispatchDtype.FP8 in self.dispatch_dtypes

    @property
    def dispatch_fallbacks(self) -> Mapping[DispatchDtype, DispatchDtype | None]:
        """The target of each declared fallback (None: refused); a view of `fallbacks`."""
        return MappingProxyType({k: v.target for k, v in self.fallbacks.items()})

    @property
    def fallback_reasons(self) -> Mapping[DispatchDtype, str]:
        """The reason of each declared fallback that gives one; a view of `fallbacks`."""
        return MappingProxyType({k: v.reason for k, v in self.fallbacks.items() if v.reason})

    @property
    def fp8_scale_layout(self) -> ScaleLayout:
        """The scale layout fp8 is carried with (`layout_for(fp8)`)."""
        return self.layout_for(DispatchDtype.FP8)

    @property
    def int8_quant_mode(self) -> Int8QuantMode:
        """How activations are quantized to int8 for dispatch: per token, dynamic, where int8 is carried."""
        if DispatchDtype.INT8 in self.dispatch_dtypes:
            return Int8QuantMode.PER_TOKEN_DYNAMIC
        return Int8QuantMode.NONE

    def supports_dispatch(self, dtype: DispatchDtype | str) -> bool:
        """Whether `dtype` is carried natively."""
        return DispatchDtype.parse(dtype) in self.dispatch_dtypes

    def fallback_for(self, dtype: DispatchDtype | str) -> DispatchDtype | None:
        """The declared fallback of an unsupported dtype, or `None` when it is rejected."""
        found = self.fallbacks.get(DispatchDtype.parse(dtype))
        return None if found is None else found.target

    def supports_gemm(self, kind: GemmKind | str) -> bool:
        """Whether a grouped-matmul kind is declared."""
        return GemmKind(kind) in self.grouped_matmul

    def supports_activation(self, activation: object) -> bool:
        """Whether an activation kind (an `Activation`, kind or name) is declared."""
        from hal.activations import Activation

        return Activation.parse(activation).kind in self.activations  # type: ignore[arg-type]

    def layout_for(self, dtype: DispatchDtype | str) -> ScaleLayout:
        """The activation scale layout `dtype` is carried and quantized with unless told otherwise."""
        parsed = DispatchDtype.parse(dtype)
        return self.scale_layouts.get(parsed) or parsed.spec.default_layout

    def quantizes_to(self, dtype: DispatchDtype | str) -> bool:
        """Whether activations are quantized to `dtype` here: it is carried, or a declared
        grouped-matmul kind consumes it."""
        parsed = DispatchDtype.parse(dtype)
        return parsed in self.dispatch_dtypes or any(k in self.grouped_matmul for k in gemm_kinds_consuming(parsed))

    def consistency_problems(self) -> list[str]:
        """Contradictions inside this declaration; an empty list means consistent."""
        problems: list[str] = []
        if self.default_dispatch_dtype not in self.dispatch_dtypes:
            problems.append(f"default dispatch dtype {self.default_dispatch_dtype} is not a supported dispatch dtype")
        for source, target in self.dispatch_fallbacks.items():
            if source in self.dispatch_dtypes:
                problems.append(f"fallback declared for {source}, which is supported natively")
            if target is not None and target not in self.dispatch_dtypes:
                problems.append(f"fallback {source} -> {target} targets an unsupported dtype")
        for dtype, layout in self.scale_layouts.items():
            if layout not in dtype.scale_layouts():
                problems.append(
                    f"scale layout {layout} declared for {dtype}, which is carried as "
                    f"{', '.join(map(str, dtype.scale_layouts()))}"
                )
        for source, fallback in self.fallbacks.items():
            seen, current = {source}, fallback.target
            while current is not None and current in self.fallbacks and current not in self.dispatch_dtypes:
                if current in seen:
                    problems.append(f"fallbacks from {source} form a cycle")
                    break
                seen.add(current)
                current = self.fallbacks[current].target
        for name, declared in self.scheme_fallbacks.items():
            kind = KNOWN_SCHEMES[name].compute_kind
            if kind is not None and kind in self.grouped_matmul:
                problems.append(f"scheme fallback declared for {name}, whose {kind} grouped matmul is declared")
            target = None if declared.target is None else KNOWN_SCHEMES[declared.target].compute_kind
            if target is not None and target not in self.grouped_matmul:
                problems.append(f"scheme fallback {name} -> {declared.target} targets an undeclared {target} matmul")
        for name in sorted(self.ep_low_latency - self.ep_dispatchers):
            problems.append(f"ep_low_latency names {name!r}, which is not among ep_dispatchers")
        for name in sorted(self.ep_dispatchers & set(self.ep_dispatchers_absent)):
            problems.append(f"ep dispatcher {name!r} is declared both present and absent")
        return problems

    def as_dict(self) -> dict[str, Any]:
        """Plain-data view for JSON output and reports."""
        return {
            "device_name": self.device_name,
            "dispatch_dtypes": _sorted_values(self.dispatch_dtypes),
            "dispatch_fallbacks": {
                k.value: (v.value if v is not None else None)
                for k, v in sorted(self.dispatch_fallbacks.items(), key=lambda kv: kv[0].value)
            },
            "fallback_reasons": {
                k.value: v for k, v in sorted(self.fallback_reasons.items(), key=lambda kv: kv[0].value)
            },
            "supports_fp8_dispatch": self.supports_fp8_dispatch,
            "default_dispatch_dtype": self.default_dispatch_dtype.value,
            "fp8_scale_layout": self.fp8_scale_layout.value,
            "scale_layouts": {
                k.value: v.value for k, v in sorted(self.scale_layouts.items(), key=lambda kv: kv[0].value)
            },
            "int8_quant_mode": self.int8_quant_mode.value,
            "grouped_matmul": _sorted_values(self.grouped_matmul),
            "fused_deep_moe": sorted(self.fused_deep_moe),
            "activations": _sorted_values(self.activations),
            "expert_bias": self.expert_bias,
            "host_synchronous": self.host_synchronous,
            "deterministic": self.deterministic,
            "grouped_matmul_padding": self.grouped_matmul_padding,
            "graph_capture": self.graph_capture,
            "ep_dispatchers": sorted(self.ep_dispatchers),
            "ep_low_latency": sorted(self.ep_low_latency),
            "ep_dispatchers_absent": dict(sorted(self.ep_dispatchers_absent.items())),
            "scheme_fallbacks": {
                name: {"target": f.target, "reason": f.reason, "max_error": f.max_error}
                for name, f in sorted(self.scheme_fallbacks.items())
            },
            "limits": self.limits.as_dict(),
            "collective_backend": self.collective_backend,
            "notes": list(self.notes),
        }


def _scheme_fallbacks(declared: Mapping[str, Any]) -> dict[str, SchemeFallback]:
    """Scheme fallbacks keyed and targeted by the schemes' canonical names (`hal.parse_scheme`)."""
    parsed: dict[str, SchemeFallback] = {}
    for source, value in dict(declared).items():
        fallback = value if isinstance(value, SchemeFallback) else SchemeFallback(value)
        target = None if fallback.target is None else parse_scheme(fallback.target).name
        name = parse_scheme(source).name
        if target == name:
            raise InvalidInput(f"scheme_fallbacks: {name} falls back to itself")
        parsed[name] = SchemeFallback(target, fallback.reason, fallback.max_error)
    return parsed


def _sorted_values(items: Iterable[enum.Enum]) -> list[str]:
    return sorted(str(i.value) for i in items)
