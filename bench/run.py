"""`hal bench`'s run: every (model, precision, tokens) case timed on a vendor (the command is `bench.cli`)."""

from __future__ import annotations

import argparse
import datetime
import json

import torch
from rich.console import Console

from bench import ceilings as ceiling_probe
from bench.cases import CaseResult, ShapeBench
from bench.cli import writable_file
from bench.report import markdown, print_report
from bench.shapes import CPU_TOKENS, DEFAULT_PRECISIONS, PRECISIONS, TOKENS, parse_shapes
from bench.timing import DeviceTimer
from hal import Capabilities, HalError, InvalidInput, VendorRegistry, parse_scheme

_FULL = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3-ep8")
NO_ROOFLINE = (
    "roofline figures need a GPU: this vendor's device has no CUDA events or graphs to measure "
    "its copy bandwidth and matmul peak, so only eager times are shown"
)


def bench(args: argparse.Namespace, console: Console) -> int:
    """Run every (model, precision, tokens) case; print the table or the JSON (`--ep`: `bench.ep`)."""
    if args.ep is not None:  # `--routing` given before `--ep` is refused there like the other options
        from bench.ep import from_hal

        return from_hal(args)
    for option, path in (("--output", args.output), ("--markdown", args.markdown)):
        writable_file(option, path)  # before the run, not after it
    vendor = VendorRegistry.discover().select(args.vendor).vendor  # a HalError: exit 2 (bad name) or 1
    device = vendor.device
    gpu = device.type == "cuda"
    try:
        shapes = parse_shapes(args.models, _FULL if gpu else ("tiny",))
    except ValueError as exc:
        raise InvalidInput(f"--model: {exc}") from None
    caps = vendor.capabilities()
    precisions = args.precisions or [p for p in DEFAULT_PRECISIONS if _supported(caps, p)]
    tokens = args.tokens or list(TOKENS if gpu else CPU_TOKENS)
    progress = Console(stderr=True) if args.json else console
    timer = DeviceTimer(device)
    measured = None
    if gpu:
        progress.print("measuring the device's ceilings (copy bandwidth, dense matmul)...")
        measured = ceiling_probe.measure(timer)
    payload = {
        "vendor": vendor.name,
        "device": caps.device_name,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "ceilings": measured.as_dict() if measured else None,
        "note": "" if gpu else NO_ROOFLINE,
        "shapes": {
            s.name: {
                "hidden": s.hidden,
                "intermediate": s.intermediate,
                "experts": s.experts,
                "top_k": s.top_k,
                "note": s.note,
            }
            for s in shapes
        },
    }
    results: list[CaseResult] = []
    total = len(shapes) * len(precisions) * len(tokens)
    for shape in shapes:
        try:
            built = ShapeBench(vendor, shape, precisions, routing=args.routing)
        except HalError as exc:
            console.print(f"[red]error:[/red] {shape.name}: {exc}")
            return 1
        for precision in precisions:
            for count in tokens:
                result = built.run(precision, count, timer, measured, graphs=gpu)
                results.append(result)
                fraction = result.derived()["roofline_fraction_graph"]
                progress.print(
                    f"[{len(results)}/{total}] {shape.name} {precision} {count} tokens: "
                    f"{result.best_us:.1f} µs"
                    + (f" ({100 * fraction:.0f}% of roofline)" if fraction else "")
                    + (f" (noisy: rounds varied ±{100 * result.eager_spread:.0f}%)" if result.noisy else "")
                )
        del built
        if gpu:
            torch.cuda.empty_cache()
    payload["cases"] = [r.as_dict() for r in results]
    if args.output:
        args.output.write_text(json.dumps(payload, indent=2))
    if args.markdown:
        args.markdown.write_text(markdown(results) + "\n")
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        print_report(console, payload, results)
    return 0


def _supported(caps: Capabilities, precision: str) -> bool:
    """Whether the vendor declares the grouped-matmul kind a precision's scheme needs."""
    kind = parse_scheme(PRECISIONS[precision]).compute_kind
    return kind is not None and caps.supports_gemm(kind)
