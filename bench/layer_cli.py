"""`hal layer`: which pipeline, dispatcher, expert runner and dispatch dtype a MoE layer of a model's settings
takes on a vendor, and why not the others (`moe.explain`); on a declared device model's table too."""

from __future__ import annotations

import argparse
import json

from typing import TYPE_CHECKING

from rich.markup import escape

from hal import InvalidInput
from hal.cli import dispatch_dtype_name_argument, positive_int_argument, scheme_name_argument

if TYPE_CHECKING:
    from rich.console import Console

#: Model presets: (hidden, intermediate, experts, top-k, activation, biases, expert-parallel ranks, capacity)
MODELS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, "silu-glu", False, 1, None),
    "mixtral-8x7b": (4096, 14336, 8, 2, "silu-glu", False, 1, None),
    "deepseek-v3": (7168, 2048, 256, 8, "silu-glu", False, 8, 128),
    "gpt-oss-20b": (2880, 2880, 32, 4, "swiglu-oai", True, 1, None),
}
#: The scheme a preset's released checkpoint is served with, where it is not unquantized
PRESET_SCHEMES = {"gpt-oss-20b": "w4a16-mxfp4"}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `layer` command to the `hal` command line."""
    text = "explain a MoE layer: the dispatch dtype, pipeline, dispatcher and expert runner chosen, and why not others"
    parser = subparsers.add_parser("layer", help=text, description=text)
    parser.add_argument("--vendor", help="vendor name (default: HAL_VENDOR, then the highest-priority available)")
    parser.add_argument("--device-model", help="explain on a named device model's declared table (e.g. H100, A3)")
    parser.add_argument("--model", choices=sorted(MODELS), help="a model's MoE settings (the options below override)")
    for flag, what in (
        ("--hidden", "hidden size"),
        ("--intermediate", "expert intermediate size"),
        ("--experts", "routed experts"),
        ("--top-k", "experts per token"),
        ("--ep-ranks", "expert-parallel ranks (deepseek-v3's preset: 8)"),
        ("--capacity", "low-latency capacity, tokens per rank (max_dispatch_tokens_per_rank)"),
    ):
        parser.add_argument(flag, type=positive_int_argument, help=what)
    parser.add_argument(
        "--scheme",
        type=scheme_name_argument,
        help="quant scheme (default: the preset's checkpoint scheme, gpt-oss-20b w4a16-mxfp4; else unquantized)",
    )
    parser.add_argument("--activation", help="the experts' activation (default: the preset's, else silu-glu)")
    parser.add_argument("--bias", action="store_true", default=None, help="the experts have biases")
    parser.add_argument("--redundant", type=int, default=0, metavar="R", help="redundant expert slots")
    parser.add_argument("--ep-mode", choices=("normal", "low-latency", "auto"), help="expert-parallel mode")
    parser.add_argument("--ep-dispatcher", metavar="NAME", help="a vendor's own expert-parallel dispatcher")
    parser.add_argument(
        "--dispatch-dtype",
        default="auto",
        type=dispatch_dtype_name_argument,
        help="requested dispatch dtype (default auto)",
    )
    parser.add_argument("--no-fused", action="store_true", help="never take the vendor's fused op")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(handler=layer)


def layer(args: argparse.Namespace, console: Console) -> int:
    """Print the explanation; exit 1 where the layer cannot be built."""
    from hal import Activation, DispatchConfig, LayerSpec, VendorRegistry, parse_scheme
    from moe.explain import explain_layer

    preset = MODELS.get(args.model or "", (4096, 1024, 64, 8, "silu-glu", False, 1, None))
    hidden, inter, experts, top_k, activation, bias, ranks, capacity = preset
    ranks = args.ep_ranks or (ranks if args.model else 1)
    capacity = args.capacity or (capacity if args.model and ranks > 1 else None)
    if args.redundant < 0:
        raise InvalidInput(f"--redundant: expected an int >= 0, got {args.redundant}")
    spec = LayerSpec(
        args.hidden or hidden,
        args.intermediate or inter,
        args.experts or experts,
        args.top_k or top_k,
        scheme=parse_scheme(args.scheme or PRESET_SCHEMES.get(args.model or "", "unquantized")),
        activation=Activation.parse(args.activation or activation),
        bias=bias if args.bias is None else args.bias,
        fused=False if args.no_fused else None,
        ep_ranks=ranks,
        expert_parallel=ranks > 1 or args.ep_dispatcher is not None,
        ep_dispatcher=args.ep_dispatcher,
        redundant_experts=args.redundant,
    )
    mode = args.ep_mode or ("low-latency" if capacity else "normal")
    config = DispatchConfig(
        dtype=args.dispatch_dtype,
        max_dispatch_tokens_per_rank=capacity,
        ep_mode=mode if ranks > 1 or args.ep_dispatcher else None,
        ep_dispatcher=args.ep_dispatcher,
    )
    registry = VendorRegistry.discover()
    vendor = registry.select(args.vendor, require_available=False).vendor
    available = registry.status(vendor).available
    if args.device_model is None and available:
        caps, table = vendor.capabilities(), "probed"
    else:
        caps = vendor.declared_capabilities(args.device_model)
        table = f"declared for device model {args.device_model or vendor.default_model}"
    explanation = explain_layer(vendor, spec, dispatch=config, capabilities=caps, environ={})
    if args.json:
        print(json.dumps({**explanation.as_dict(), "table": table}, indent=1))
    else:
        console.print(f"table: {escape(table)}")
        console.print(escape(explanation.text()), soft_wrap=True)
    return 0 if explanation.buildable else 1
