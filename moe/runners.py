"""Expert runners: who computes the experts for a (dispatch format, kernel kind, scheme).

A runner takes the dispatch output and returns one output row per payload row (same
leading shape, H channels). The generic runner below issues exactly one grouped GEMM
per projection through `hal`, with swiglu between them, and serves every format and
scheme. Vendors add specialised runners with a `moe.expert_runners` entry point naming
`register(registry)`; a vendor-specific entry wins over the generic one for that vendor.
A plugin may replace a runner that serves every vendor (`replace=True` on a key without a
vendor) only where the registry was built naming it in `replace_generic` (or
`MOE_RUNNER_REPLACEMENTS`); every replacement is logged, recorded and shown by `hal caps`
(`caps_rows`, registered in `hal.caps_sections`). A registry is an object handed to the
layer, never a process-wide table.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from hal import (
    GemmKind,
    Groups,
    InvalidInput,
    PluginFailure,
    QuantizedTensor,
    UnsupportedCapability,
    Vendor,
    environ_mapping,
    invalid,
    load_plugins,
)
from moe.dispatch.base import DispatchFormat, DispatchOutput, padded_counts
from moe.schemes import SCHEMES, QuantScheme
from moe.schemes.base import ExpertWeights, GemmOperand

#: The entry-point group through which plugins add runners.
RUNNER_ENTRY_POINT_GROUP = "moe.expert_runners"
#: The vendor field of a key that serves every vendor.
ANY_VENDOR = "*"
#: Environment variable: comma-separated runner plugins allowed to replace runners that serve every vendor.
ENV_REPLACE_GENERIC = "MOE_RUNNER_REPLACEMENTS"
#: Who registered a runner: the built-in generic runners, or code calling `register` itself (else a plugin's name).
GENERIC, CALLER = "generic", "caller"

_LOG = logging.getLogger(__name__)

ExpertRunner = Callable[[Vendor, QuantScheme, ExpertWeights, DispatchOutput], torch.Tensor]


@dataclass(frozen=True)
class RunnerKey:
    """(dispatch format, grouped-matmul kind, scheme name), optionally for one vendor only."""

    format: DispatchFormat
    kernel: GemmKind
    scheme: str
    vendor: str = ANY_VENDOR

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", DispatchFormat(self.format))
        object.__setattr__(self, "kernel", GemmKind(self.kernel))

    def __str__(self) -> str:
        return f"(format={self.format}, kernel={self.kernel}, scheme={self.scheme}, vendor={self.vendor})"


@dataclass(frozen=True)
class RunnerReplacement:
    """A runner registered with `replace=True` over another: the key, who replaced, whose runner it was."""

    key: RunnerKey
    by: str
    replaced: str


class RunnerRegistry:
    """A table of expert runners; lookups prefer the vendor's own entry over the generic one.

    `replace_generic` names the runner plugins allowed to replace a runner that serves every vendor.
    """

    def __init__(
        self, entries: Iterable[tuple[RunnerKey, ExpertRunner]] = (), *, replace_generic: Iterable[str] = ()
    ) -> None:
        if isinstance(replace_generic, str) or not isinstance(replace_generic, Iterable):
            raise invalid("replace_generic", "plugin names (an iterable of str, not one str)", replace_generic)
        self._replace_generic = frozenset(_plugin_names(replace_generic))
        self._entries: dict[RunnerKey, ExpertRunner] = {}
        self._origins: dict[RunnerKey, str] = {}
        self._replacements: list[RunnerReplacement] = []
        self._plugin: str | None = None  # the plugin whose register() is running
        for key, runner in entries:
            self.register(key, runner)

    @classmethod
    def with_defaults(
        cls,
        *,
        plugins: bool = True,
        replace_generic: Iterable[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> RunnerRegistry:
        """The generic runners, plus those registered by `moe.expert_runners` plugins.

        `replace_generic` (default: `MOE_RUNNER_REPLACEMENTS` in `environ`, comma-separated)
        names the plugins allowed to replace runners that serve every vendor. A plugin that fails
        (or is refused) leaves nothing registered and is reported with a `RuntimeWarning`.
        """
        if replace_generic is None:
            checked = environ_mapping(environ)
            env = os.environ if checked is None else checked
            replace_generic = env.get(ENV_REPLACE_GENERIC, "").split(",")
        registry = cls(replace_generic=replace_generic)
        for scheme, scheme_cls in SCHEMES.items():
            for kind in scheme_cls.gemm_kinds:
                for fmt in DispatchFormat:
                    registry._put(RunnerKey(fmt, kind, scheme), run_grouped_experts, GENERIC)
        if plugins:
            loaded, failures = load_plugins(RUNNER_ENTRY_POINT_GROUP)
            for name, register in loaded:
                error = registry._run_plugin(name, register)
                if error is not None:
                    failures.append(PluginFailure(name, repr(register), error))
            for failure in failures:
                warnings.warn(
                    f"expert-runner plugin {failure.name!r} ({failure.target}) was not loaded: {failure.error}",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return registry

    def _run_plugin(self, name: str, register: object) -> str | None:
        """Call a plugin's `register(registry)`; on any failure undo what it registered and return why."""
        saved = dict(self._entries), dict(self._origins), list(self._replacements)
        self._plugin = name
        try:
            if not callable(register):
                raise InvalidInput(f"plugin {name!r}: expected a callable register(registry), got {register!r}")
            register(self)
            return None
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a broken plugin (even one calling sys.exit) must not hide the others
            self._entries, self._origins, self._replacements = saved
            return f"{type(exc).__name__}: {exc}"
        finally:
            self._plugin = None

    def register(self, key: RunnerKey, runner: ExpertRunner, *, replace: bool = False) -> None:
        """Add a runner; registering a key twice raises unless `replace`.

        A plugin replacing a runner that serves every vendor must be named in the registry's
        `replace_generic`; every replacement is logged and listed in `replacements`.
        """
        if not isinstance(key, RunnerKey):
            raise InvalidInput(f"key: expected a RunnerKey, got {type(key).__name__}")
        if not callable(runner):
            raise InvalidInput(f"runner: expected a callable, got {type(runner).__name__}")
        who = self._plugin or CALLER
        if key in self._entries:
            if not replace:
                raise InvalidInput(
                    f"runner key {key}: expected a new key, got one already registered "
                    "(pass replace=True to override it)"
                )
            if key.vendor == ANY_VENDOR and self._plugin is not None and self._plugin not in self._replace_generic:
                raise InvalidInput(
                    f"runner key {key}: plugin {who!r} may replace runners of one named vendor only; replacing the "
                    f"{self._origins[key]} runner that serves every vendor needs an opt-in: "
                    f"RunnerRegistry.with_defaults(replace_generic=[{who!r}]) or {ENV_REPLACE_GENERIC}={who}"
                )
            self._replacements.append(RunnerReplacement(key, who, self._origins[key]))
            _LOG.log(
                logging.WARNING if self._plugin else logging.INFO,
                "expert runner %s: %s replaced the %s runner",
                key,
                f"plugin {who!r}" if self._plugin else "the caller",
                self._origins[key],
            )
        self._put(key, runner, who)

    def _put(self, key: RunnerKey, runner: ExpertRunner, origin: str) -> None:
        self._entries[key] = runner
        self._origins[key] = origin

    def keys(self) -> list[RunnerKey]:
        """Every registered key."""
        return list(self._entries)

    def origin(self, key: RunnerKey) -> str:
        """Who registered the runner of `key`: "generic", "caller", or a plugin's name."""
        if key not in self._origins:
            raise invalid("key", f"a registered RunnerKey ({len(self._origins)} are registered)", key)
        return self._origins[key]

    @property
    def replacements(self) -> list[RunnerReplacement]:
        """Every runner replaced so far, in order."""
        return list(self._replacements)

    def lookup(self, vendor: str, format: DispatchFormat, kernel: GemmKind, scheme: str) -> ExpertRunner:
        """The runner for the key: the vendor's own entry, else the generic one.

        Raises `UnsupportedCapability` naming the missing key.
        """
        for who in (vendor, ANY_VENDOR):
            runner = self._entries.get(RunnerKey(format, kernel, scheme, who))
            if runner is not None:
                return runner
        raise UnsupportedCapability(
            f"no expert runner for (format={DispatchFormat(format)}, kernel={GemmKind(kernel)}, "
            f"scheme={scheme}) on vendor {vendor!r}; registered runners serve: "
            + (", ".join(sorted({f"({k.format}, {k.kernel}, {k.scheme})" for k in self._entries})) or "nothing")
        )


def _plugin_names(names: Iterable[object]) -> set[str]:
    """Plugin names as `load_plugins` reports them (lower-cased); blanks dropped."""
    found = set()
    for name in names:
        if not isinstance(name, str):
            raise invalid("replace_generic", "plugin names (str)", name)
        if name.strip():
            found.add(name.strip().lower())
    return found


def caps_rows(vendor: Vendor) -> list[tuple[str, str]]:
    """`hal caps` rows (the `hal.caps_sections` hook): who computes the experts for `vendor` in the
    default registry, which plugin replaced which runner, and runner plugins that failed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry = RunnerRegistry.with_defaults()
    served: dict[tuple[str, str, str], RunnerKey] = {}
    for key in sorted(registry.keys(), key=lambda k: k.vendor != ANY_VENDOR):  # the vendor's own entries last
        if key.vendor in (ANY_VENDOR, vendor.name):
            served[(str(key.format), str(key.kernel), key.scheme)] = key
    by_plugins = [
        f"({', '.join(triple)}){'' if key.vendor == ANY_VENDOR else ' for ' + key.vendor}: "
        f"plugin {registry.origin(key)!r}"
        for triple, key in sorted(served.items())
        if registry.origin(key) not in (GENERIC, CALLER)
    ]
    generic = sum(registry.origin(key) == GENERIC for key in served.values())
    replaced = [f"{r.key}: plugin {r.by!r} replaced the {r.replaced} runner" for r in registry.replacements]
    rows = [
        (
            "expert runners",
            f"{len(served)} (format, kind, scheme) keys: {generic} by the generic runner "
            f"(moe.run_grouped_experts), {len(by_plugins)} by plugins",
        ),
        ("expert runners (plugins)", "; ".join(by_plugins) or "none"),
        ("runner replacements", "; ".join(replaced) or "none"),
    ]
    failed = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return rows + ([("runner plugin failures", "; ".join(failed))] if failed else [])


def run_grouped_experts(
    vendor: Vendor, scheme: QuantScheme, weights: ExpertWeights, dispatched: DispatchOutput
) -> torch.Tensor:
    """gate/up grouped GEMM -> the experts' activation -> down grouped GEMM, one `hal` call per
    projection (the experts' biases added by the same call).

    The masked low-latency payload `[L, slots, H]` is computed on its valid rows only: they are read
    through an index that lists them expert by expert (the grouped GEMMs follow the counts, so the
    work follows the real pairs, not the capacity), and the results are written back to their
    slots; empty slots are zero where the vendor reads counts back for free (`host_synchronous`),
    else left unwritten. Shapes never depend on the counts.
    The rows a dispatcher hands over through an index (`dispatched.row_index`) are read through it
    by the first GEMM (the tokens are brought into the scheme's operand format once each, not once
    per expert).
    """
    if dispatched.format is DispatchFormat.EP_LOW_LATENCY and dispatched.row_index is None:
        return _run_masked(vendor, scheme, weights, dispatched)
    groups = dispatched.groups()
    if dispatched.row_index is not None:
        lead, rows, row_index = dispatched.row_index.shape, dispatched.source, dispatched.row_index
    else:
        payload = dispatched.payload
        lead, rows, row_index = payload.data.shape[:-1], _flatten_rows(payload), None
    down = _both_projections(vendor, scheme, weights, rows, groups, row_index)
    return down if down.dim() == len(lead) + 1 else down.view(*lead, down.shape[-1])


def _both_projections(
    vendor: Vendor,
    scheme: QuantScheme,
    weights: ExpertWeights,
    rows: QuantizedTensor,
    groups: Groups,
    row_index: torch.Tensor | None,
) -> torch.Tensor:
    out_dtype = scheme.output_dtype()
    operand = scheme.first_operand(vendor, rows, weights)
    activated = first_projection(vendor, operand, weights, groups, out_dtype, row_index=row_index)
    return vendor.grouped_matmul(
        scheme.second_operand(vendor, activated, weights), weights.w2, groups, out_dtype=out_dtype, bias=weights.w2_bias
    )


def _run_masked(
    vendor: Vendor, scheme: QuantScheme, weights: ExpertWeights, dispatched: DispatchOutput
) -> torch.Tensor:
    """The masked layout's valid rows, computed compactly and written back to their slots."""
    payload, counts = dispatched.payload, dispatched.expert_counts
    local, slots = payload.data.shape[:2]
    valid = (torch.arange(slots, device=counts.device) < counts.unsqueeze(1)).reshape(-1)
    before = torch.cumsum(valid, 0) - valid.to(torch.int64)  # valid slots ahead of each slot
    total = counts.sum()
    compact = torch.where(valid, before, total + torch.arange(valid.numel(), device=valid.device) - before)
    slot_of_row = torch.empty_like(compact).scatter_(0, compact, torch.arange(compact.numel(), device=compact.device))
    caps = vendor.capabilities()
    exact = caps.host_synchronous
    if exact:  # such vendors want groups covering every row; reading the count costs nothing here
        slot_of_row = slot_of_row[: int(total)]
    elif dispatched.max_rows is not None:  # the valid rows come first: the static bound is enough
        slot_of_row = slot_of_row[: min(dispatched.max_rows, slot_of_row.numel())]
    gemm_counts = counts if exact or caps.grouped_matmul_padding else padded_counts(counts, slot_of_row.numel())
    down = _both_projections(
        vendor, scheme, weights, _flatten_rows(payload), Groups.from_counts(gemm_counts), slot_of_row
    )
    rows = local * slots
    out = down.new_zeros((rows, down.shape[-1])) if exact else down.new_empty((rows, down.shape[-1]))
    out.index_copy_(0, slot_of_row, down)
    return out.view(local, slots, down.shape[-1])


def first_projection(
    vendor: Vendor,
    operand: GemmOperand,
    weights: ExpertWeights,
    groups: Groups,
    out_dtype: torch.dtype,
    *,
    row_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gate/up GEMM and the experts' activation, as one `hal` call (the vendor may apply the
    activation in the GEMM's epilogue), over the operand's rows `row_index` when given (the vendor
    may read them through the index)."""
    return vendor.grouped_matmul(
        operand,
        weights.w13,
        groups,
        out_dtype=out_dtype,
        activation=weights.activation,
        bias=weights.w13_bias,
        row_index=row_index,
    )


def _flatten_rows(q: QuantizedTensor) -> QuantizedTensor:
    """`[..., H]` quantized rows as `[M, H]`."""
    if q.data.dim() == 2:
        return q
    scale = None
    if q.scale is not None:
        per_row = q.scale.dim() == q.data.dim() - 1
        scale = q.scale.reshape(-1) if per_row else q.scale.reshape(-1, q.scale.shape[-1])
    return QuantizedTensor(q.data.reshape(-1, q.data.shape[-1]), q.dtype, q.layout, scale, q.global_scale)
