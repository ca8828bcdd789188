"""The built-in `hal` commands: vendors, caps, explain (`doctor` and `conformance` come from plugins)."""

from __future__ import annotations

import argparse
import functools
import json
import warnings
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hal.activations import ActivationKind
from hal.capabilities import Capabilities
from hal.discovery import VendorRegistry
from hal.entry_points import guarded, load_plugins
from hal.ops import OpSource
from hal.layer_spec import LayerSpec
from hal.platform import DispatchFallbackWarning
from hal.errors import UnsupportedDispatchDtype
from hal.resolution import DispatchConfig
from hal.scheme_fallbacks import SchemeChoice, resolve_layer_plan
from hal.schemes import parse_scheme
from hal.vendor import Vendor


def _emit_json(payload: dict[str, Any]) -> None:
    print(json.dumps(payload, indent=2))


@dataclass(frozen=True)
class _Target:
    """A vendor and the capability table a command uses for it."""

    vendor: Vendor
    capabilities: Capabilities
    source: str  # "probed" or "declared"
    device_model: str | None
    note: str


def _target(registry: VendorRegistry, name: str | None, device_model: str | None) -> _Target:
    """The vendor named (or selected) and its probed table, or a declared one when asked or absent."""
    vendor = registry.select(name, require_available=False).vendor
    probe = registry.status(vendor)
    if device_model is None and probe.available:
        return _Target(vendor, vendor.capabilities(), "probed", None, f"probed on this machine: {probe.reason}")
    caps = vendor.declared_capabilities(device_model)
    model = device_model or vendor.default_model
    if probe.available:
        note = f"declared table for device model {model} (asked with --device-model)"
    else:
        note = (
            f"{vendor.name} is unavailable here ({probe.reason}); showing the declared table for "
            f"device model {model} (choose with --device-model: {', '.join(vendor.declared_models())})"
        )
    return _Target(vendor, caps, "declared", model, note)


def vendors(args: argparse.Namespace, console: Console) -> int:
    """`hal vendors`: every discovered vendor, available or why not, and failed plugins."""
    registry = VendorRegistry.discover()
    try:
        selection = registry.select()
        selected, why = selection.vendor.name, f"{selection.source}: {selection.detail}"
    except Exception as exc:  # no vendor available: still list them all
        selected, why = None, str(exc)
    statuses = [(v, registry.status(v)) for v in registry.vendors()]  # probes bounded by the registry's timeout
    rows = [
        {
            "name": v.name,
            "priority": v.priority,
            "available": status.available,
            "detail": status.reason,
            "description": v.description,
        }
        for v, status in statuses
    ]
    if args.json:  # which ops each available vendor computes natively (building its ops object once)
        for row, vendor in zip(rows, registry.vendors()):
            row["ops"] = _op_summary(vendor) if row["available"] else None
    failures = [{"name": f.name, "target": f.target, "error": f.error} for f in registry.failures]
    if args.json:
        _emit_json({"vendors": rows, "failures": failures, "selected": selected, "selection": why})
        return 0
    table = Table(title="moe-hal vendors", title_justify="left")
    for column in ("vendor", "priority", "status", "detail"):
        table.add_column(column, overflow="fold")
    for row in rows:
        status = "[green]available[/]" if row["available"] else "[red]unavailable[/]"
        mark = " (selected)" if row["name"] == selected else ""
        table.add_row(f"{row['name']}{mark}", str(row["priority"]), status, escape(str(row["detail"])))
    console.print(table)
    for failure in failures:
        console.print(
            f"[red]plugin {escape(repr(failure['name']))} ({escape(failure['target'])}) "
            f"failed to load:[/] {escape(failure['error'])}"
        )
    console.print(f"selected: {selected or 'none'} ({escape(why)})")
    return 0


def _op_summary(vendor: Vendor) -> dict[str, str]:
    """op -> "native" or "reference" (or the error that kept the ops from being built)."""
    try:
        return {s.op: "native" if s.native else "reference" for s in vendor.op_sources()}
    except Exception as exc:  # a vendor whose ops cannot be built is still listed
        return {"error": f"{type(exc).__name__}: {exc}"}


def _op_rows(sources: list[OpSource]) -> list[tuple[str, str]]:
    """Table rows: the native ops with how they run, then the ops left to the reference."""
    native = [f"{s.op}: {s.detail}" for s in sources if s.native]
    reference = [s.op for s in sources if not s.native]
    return [("ops (native)", "; ".join(native) or "none"), ("ops (hal.reference)", ", ".join(reference) or "none")]


def _ep_text(c: Capabilities) -> str:
    """The vendor's expert-parallel dispatchers (modes), then the absent ones with their reasons."""
    present = [f"{n} (normal{', low-latency' if n in c.ep_low_latency else ''})" for n in sorted(c.ep_dispatchers)]
    absent = [f"{n} absent: {why}" for n, why in sorted(c.ep_dispatchers_absent.items())]
    torch_path = "torch.distributed all-to-all and low-latency (always)"
    return "; ".join([*present, *absent, torch_path])


def _fallback_text(caps: Capabilities) -> str:
    parts = [
        f"{src} -> {dst if dst is not None else 'rejected'}"
        for src, dst in sorted(caps.dispatch_fallbacks.items(), key=lambda kv: kv[0].value)
    ]
    return "; ".join(parts) or "none"


def _scheme_fallback_text(caps: Capabilities) -> str:
    parts = [
        f"{name} -> {f.target or 'refused'}" + (f" (bound {f.max_error:g})" if f.max_error is not None else "")
        for name, f in sorted(caps.scheme_fallbacks.items())
    ]
    return "; ".join(parts) or "none"


#: Entry-point group of `hal caps` sections: `hook(vendor) -> [(row, value), ...]` from upper layers (moe's runners).
CAPS_SECTION_GROUP = "hal.caps_sections"


def _caps_sections(vendor: Vendor) -> dict[str, list[tuple[str, str]]]:
    """Each registered section's rows for `vendor`; a failing section is one row saying why."""
    loaded, failures = load_plugins(CAPS_SECTION_GROUP)
    sections = {f.name: [(f.name, f"section failed to load: {f.error}")] for f in failures}
    for name, hook in loaded:
        rows, error = guarded(functools.partial(_section_rows, hook, vendor))
        sections[name] = rows if error is None else [(name, f"section failed: {error}")]
    return sections


def _section_rows(hook: object, vendor: Vendor) -> list[tuple[str, str]]:
    if not callable(hook):
        raise TypeError(f"expected a callable hook(vendor), got {hook!r}")
    return [(str(key), str(value)) for key, value in hook(vendor)]


def caps(args: argparse.Namespace, console: Console) -> int:
    """`hal caps`: the capability table of a vendor (probed, or declared for a device model)."""
    target = _target(VendorRegistry.discover(), args.vendor, args.device_model)
    c = target.capabilities
    problems = c.consistency_problems()
    sources = target.vendor.op_sources() if target.source == "probed" else None
    sections = _caps_sections(target.vendor)
    if args.json:
        _emit_json(
            {
                "vendor": target.vendor.name,
                "source": target.source,
                "device_model": target.device_model,
                "note": target.note,
                "capabilities": c.as_dict(),
                "consistency_problems": problems,
                "ops": None if sources is None else [s.as_dict() for s in sources],
                "sections": sections,
            }
        )
        return 0
    table = Table(title=f"capabilities of vendor {target.vendor.name!r}", title_justify="left")
    table.add_column("capability")
    table.add_column("value", overflow="fold")
    limits = ", ".join(f"{k}={v}" for k, v in c.limits.as_dict().items() if v is not None) or "none"
    for key, value in (
        ("device", c.device_name),
        ("table", target.source),
        ("dispatch_dtypes", ", ".join(sorted(d.value for d in c.dispatch_dtypes))),
        ("dispatch_fallbacks", _fallback_text(c)),
        ("supports_fp8_dispatch", "yes" if c.supports_fp8_dispatch else "no"),
        ("default_dispatch_dtype", c.default_dispatch_dtype.value),
        ("fp8_scale_layout", c.fp8_scale_layout.value),
        ("int8_quant_mode", c.int8_quant_mode.value),
        ("grouped_matmul", ", ".join(sorted(k.value for k in c.grouped_matmul)) or "none"),
        ("fused_deep_moe", ", ".join(sorted(c.fused_deep_moe)) or "none"),
        ("scheme_fallbacks", _scheme_fallback_text(c)),
        ("activations", ", ".join(k.value for k in ActivationKind if k in c.activations) or "none"),
        ("expert_bias", "yes" if c.expert_bias else "no"),
        ("host_synchronous", "yes (value checks are cheap)" if c.host_synchronous else "no"),
        ("deterministic", "yes (bit-reproducible ops)" if c.deterministic else "no (ops are not bit-reproducible)"),
        ("graph_capture", "yes (a layer may replay its forward: moe.GraphConfig)" if c.graph_capture else "no"),
        ("ep_dispatchers", _ep_text(c)),
        ("limits", limits),
        ("collective_backend", c.collective_backend),
    ):
        table.add_row(key, escape(value))
    for key, value in _op_rows(sources) if sources is not None else [("ops", "not built (declared table)")]:
        table.add_row(key, escape(value))
    for key, value in (row for rows in sections.values() for row in rows):
        table.add_row(escape(key), escape(value))
    console.print(table)
    console.print(f"note: {escape(target.note)}")
    for note in c.notes:
        console.print(f"note: {escape(note)}")
    for problem in problems:
        console.print(f"[red]inconsistent declaration:[/] {escape(problem)}")
    return 0


def _scheme_fallback_json(choice: SchemeChoice) -> dict[str, object] | None:
    if not choice.converted or choice.fallback is None:
        return None
    return {
        "requested": choice.requested.name,
        "runs_as": choice.effective.name,
        "reason": choice.fallback.reason,
        "max_error": choice.fallback.max_error,
    }


def explain(args: argparse.Namespace, console: Console) -> int:
    """`hal explain`: the dispatch-dtype resolution trace, the decision and bytes per token."""
    target = _target(VendorRegistry.discover(), args.vendor, args.device_model)
    scheme = args.scheme
    if getattr(args, "model_dtype", None) is not None:  # the scheme over weights of that dtype
        scheme = parse_scheme(scheme or "unquantized").with_model_dtype(args.model_dtype)
    caps = target.capabilities
    wanted = getattr(args, "ep_dispatcher", None)
    ep_ranks = getattr(args, "ep_ranks", None)
    spec = LayerSpec(
        args.hidden,
        getattr(args, "intermediate", None),
        getattr(args, "experts", None),
        getattr(args, "top_k", None),
        scheme=parse_scheme(scheme or "unquantized"),
        activation=getattr(args, "activation", None) or ActivationKind.SILU_GLU,
        bias=bool(getattr(args, "bias", False)),
        ep_ranks=ep_ranks or 1,
        tp_ranks=getattr(args, "tp_ranks", None) or 1,
        expert_parallel=wanted is not None or ep_ranks is not None,
        ep_dispatcher=wanted,
    )
    problems = [p.message for p in spec.problems(caps)]
    choice = spec.scheme_choice(caps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            plan = resolve_layer_plan(
                target.vendor,
                args.hidden,
                choice,
                config=DispatchConfig(dtype=args.dispatch_dtype or "auto"),
                runner_dtype=args.runner_dtype,
                capabilities=target.capabilities,
            )
        except UnsupportedDispatchDtype as exc:
            if choice.problem is None:
                raise
            raise UnsupportedDispatchDtype(f"{exc}; {choice.text()}") from None
    messages = [str(w.message) for w in caught]
    # The fallback line below says what a DispatchFallbackWarning says; show only the others.
    others = [str(w.message) for w in caught if not issubclass(w.category, DispatchFallbackWarning)]
    if args.json:
        _emit_json(
            {
                "table": target.source,
                "device_model": target.device_model,
                "note": target.note,
                "plan": plan.as_dict(),
                "scheme_fallback": _scheme_fallback_json(choice),
                "warnings": messages,
                "buildable": not problems,
                "problems": problems,
                "ep_dispatchers": {
                    "declared": sorted(caps.ep_dispatchers),
                    "low_latency": sorted(caps.ep_low_latency),
                    "absent": dict(caps.ep_dispatchers_absent),
                },
            }
        )
        return 1 if problems else 0
    console.print(f"dispatch plan for vendor {plan.vendor!r} on {escape(plan.device_name)}")
    console.print(f"note: {escape(target.note)}")
    table = Table(title="sources, highest precedence first", title_justify="left")
    for column in ("source", "says", "detail", ""):
        table.add_column(column, overflow="fold")
    for step in plan.trace:
        table.add_row(
            step.source.value,
            step.says.value if step.says else "-",
            escape(step.detail),
            "[bold]decides[/]" if step.decided else "",
        )
    console.print(table)
    if choice.converted:
        console.print(f"scheme:    {escape(choice.text().removeprefix('scheme fallback: '))}")
    console.print(f"requested: {plan.requested} (from {plan.source})")
    if plan.fallback is not None:
        console.print(f"fallback:  {plan.fallback.source} -> {plan.fallback.target}: {escape(plan.fallback.reason)}")
    else:
        console.print(f"fallback:  none ({plan.requested} is supported)")
    console.print(
        f"resolved:  {plan.resolved} ({plan.scale_layout}), {plan.bytes_per_token} bytes per token "
        f"at hidden {plan.hidden_size} (bf16 would be {2 * plan.hidden_size})"
    )
    console.print(f"expert parallel: {escape(_ep_text(caps))}")
    for message in others:
        console.print(f"[yellow]warning:[/] {escape(message)}")
    for problem in problems:
        console.print(f"[red]refused:[/] a layer of this plan cannot be built: {escape(problem)}")
    return 1 if problems else 0
