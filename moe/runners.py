"""Expert runners: who computes the experts for a (dispatch format, kernel kind, scheme).

A runner takes the dispatch output and returns one output row per payload row (same
leading shape, H channels). The generic runner below issues exactly one grouped GEMM
per projection through `hal`, with swiglu between them, and serves every format and
scheme. Vendors add specialised runners with a `moe.expert_runners` entry point naming
`register(registry)`; a vendor-specific entry wins over the generic one for that vendor.
A registry is an object handed to the layer, never a process-wide table.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from hal import GemmKind, InvalidInput, PluginFailure, QuantizedTensor, UnsupportedCapability, Vendor, load_plugins
from moe.dispatch.base import DispatchFormat, DispatchOutput
from moe.schemes import SCHEMES, QuantScheme
from moe.schemes.base import ExpertWeights

#: The entry-point group through which plugins add runners.
RUNNER_ENTRY_POINT_GROUP = "moe.expert_runners"
#: The vendor field of a key that serves every vendor.
ANY_VENDOR = "*"

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


class RunnerRegistry:
    """A table of expert runners; lookups prefer the vendor's own entry over the generic one."""

    def __init__(self, entries: Iterable[tuple[RunnerKey, ExpertRunner]] = ()) -> None:
        self._entries: dict[RunnerKey, ExpertRunner] = {}
        for key, runner in entries:
            self.register(key, runner)

    @classmethod
    def with_defaults(cls, *, plugins: bool = True) -> RunnerRegistry:
        """The generic runners, plus those registered by `moe.expert_runners` plugins."""
        registry = cls()
        for scheme, cls in SCHEMES.items():
            for kind in cls.gemm_kinds:
                for fmt in DispatchFormat:
                    registry.register(RunnerKey(fmt, kind, scheme), run_grouped_experts)
        if plugins:
            loaded, failures = load_plugins(RUNNER_ENTRY_POINT_GROUP)
            for name, register in loaded:
                try:
                    register(registry)
                except Exception as exc:  # a broken plugin must not hide the generic runners
                    failures.append(PluginFailure(name, repr(register), f"{type(exc).__name__}: {exc}"))
            for failure in failures:
                warnings.warn(f"expert-runner plugin {failure.name!r} ({failure.target}) was not loaded: "
                              f"{failure.error}", RuntimeWarning, stacklevel=2)
        return registry

    def register(self, key: RunnerKey, runner: ExpertRunner, *, replace: bool = False) -> None:
        """Add a runner; registering a key twice raises unless `replace`."""
        if not isinstance(key, RunnerKey):
            raise InvalidInput(f"key: expected a RunnerKey, got {type(key).__name__}")
        if not callable(runner):
            raise InvalidInput(f"runner: expected a callable, got {type(runner).__name__}")
        if key in self._entries and not replace:
            raise InvalidInput(f"runner key {key}: expected a new key, got one already registered "
                               "(pass replace=True to override it)")
        self._entries[key] = runner

    def keys(self) -> list[RunnerKey]:
        """Every registered key."""
        return list(self._entries)

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


def run_grouped_experts(vendor: Vendor, scheme: QuantScheme, weights: ExpertWeights,
                        dispatched: DispatchOutput) -> torch.Tensor:
    """gate/up grouped GEMM -> the experts' activation -> down grouped GEMM, one `hal` call per
    projection (the experts' biases added by the same call).

    The masked low-latency payload is computed slot by slot (empty slots hold zeros), so
    the shapes never depend on the counts.
    """
    payload = dispatched.payload
    lead = payload.data.shape[:-1]
    rows = _flatten_rows(payload)
    groups = dispatched.groups()
    out_dtype = scheme.output_dtype()
    gate_up = vendor.grouped_matmul(scheme.first_operand(vendor, rows, weights), weights.w13, groups,
                                    out_dtype=out_dtype, **_bias(weights.w13_bias))
    activated = vendor.activate(gate_up, weights.activation)
    down = vendor.grouped_matmul(scheme.second_operand(vendor, activated, weights), weights.w2, groups,
                                 out_dtype=out_dtype, **_bias(weights.w2_bias))
    return down.view(*lead, down.shape[-1])


def _bias(bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The bias keyword only where there is one (vendors that override `grouped_matmul` without it still serve
    bias-free experts)."""
    return {} if bias is None else {"bias": bias}


def _flatten_rows(q: QuantizedTensor) -> QuantizedTensor:
    """`[..., H]` quantized rows as `[M, H]`."""
    if q.data.dim() == 2:
        return q
    scale = None
    if q.scale is not None:
        per_row = q.scale.dim() == q.data.dim() - 1
        scale = q.scale.reshape(-1) if per_row else q.scale.reshape(-1, q.scale.shape[-1])
    return QuantizedTensor(q.data.reshape(-1, q.data.shape[-1]), q.dtype, q.layout, scale, q.global_scale)
