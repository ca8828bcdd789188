"""Capability labels (the rows of the conformance matrix) and the rule that skips a test.

Every suite test carries one label through the `hal_capability` marker. The labels are
fixed (every dispatch dtype, grouped-matmul kind and scheme moe-hal knows), so collection
is the same for every vendor and every xdist worker; what a vendor declares absent is
skipped at run time with the reason.
"""

from __future__ import annotations

import pytest

from conformance.plugin import MARKER
from hal import KNOWN_SCHEMES, ActivationKind, Capabilities, DispatchDtype, GemmKind, Vendor, parse_scheme
from moe import NvFp4, QuantScheme, make_scheme, nvfp4_global_scale

DECLARATIONS = "declarations"
SWIGLU = "swiglu"
EXPERT_BIAS = "expert bias"
MODEL_FEATURES = "model features"  #: activations, biases, shared experts, precomputed routing in the layer
SORT_AND_COMBINE = "sort and combine"
BAD_INPUT = "bad input"
OP_CONTRACTS = "op contracts"  #: inputs kept, contiguous outputs, bit-identical repeats (unless not deterministic)
LOAD_COUNTERS = "load counters"  #: accumulate_counts: per-expert load counters on the device
SCHEME_FALLBACKS = "scheme fallbacks"  #: schemes converted at load to the vendor's declared fallback, within bound
CONCURRENCY = "concurrency"  #: results owned by their caller; calls from several threads equal serial calls
GRAPH_CAPTURE = "graph capture"  #: captured calls and graphed layers replay new inputs like the plain calls


def dispatch_label(dtype: DispatchDtype | str) -> str:
    """`dispatch fp8`: resolution, quantize / dequantize and the dispatch round trip of a dtype."""
    return f"dispatch {DispatchDtype.parse(dtype)}"


def gemm_label(kind: GemmKind | str) -> str:
    """`grouped_matmul int8`: one grouped-matmul kind (and, for int4, its activation quantizer)."""
    return f"grouped_matmul {GemmKind(kind)}"


def activation_label(kind: ActivationKind | str) -> str:
    """`activation gelu-glu`: one activation kind of `Vendor.activate`."""
    return f"activation {ActivationKind(kind)}"


def layer_label(scheme: str) -> str:
    """`moe layer w8a8-int8`: the MoE layer of one quant scheme against the float64 MoE."""
    return f"moe layer {scheme}"


def fused_label(scheme: str) -> str:
    """`fused_deep_moe w8a8-int8`: the vendor's fused op for one scheme."""
    return f"fused_deep_moe {scheme}"


def mark(label: str) -> pytest.MarkDecorator:
    """The marker putting a test (or one parameter set) in a matrix row."""
    return getattr(pytest.mark, MARKER)(label)


def all_labels() -> list[str]:
    """Every matrix row, in the order reports show them."""
    return [
        DECLARATIONS,
        *(dispatch_label(d) for d in DispatchDtype.concrete()),
        *(gemm_label(k) for k in GemmKind),
        SWIGLU,
        *(activation_label(k) for k in ActivationKind),
        EXPERT_BIAS,
        SORT_AND_COMBINE,
        LOAD_COUNTERS,
        *(layer_label(s) for s in KNOWN_SCHEMES),
        *(fused_label(s) for s in KNOWN_SCHEMES),
        MODEL_FEATURES,
        SCHEME_FALLBACKS,
        OP_CONTRACTS,
        CONCURRENCY,
        GRAPH_CAPTURE,
        BAD_INPUT,
    ]


def build_scheme(name: str, input_amax: float = 4.0, intermediate_amax: float = 4.0) -> QuantScheme:
    """The `moe` scheme object of a known scheme name (nvfp4 gets global scales for the amaxes)."""
    if parse_scheme(name).name == NvFp4.traits.name:
        return NvFp4(nvfp4_global_scale(input_amax), nvfp4_global_scale(intermediate_amax))
    return make_scheme(name)


def scheme_gemm(name: str) -> GemmKind:
    """The grouped-matmul kind a scheme's experts run (unquantized: bf16)."""
    return build_scheme(name).gemm_kind()


def dispatch_status(caps: Capabilities, dtype: DispatchDtype) -> str:
    """`native`, `falls back to <dtype>` or `rejected`, as declared."""
    if caps.supports_dispatch(dtype):
        return "native"
    target = caps.fallback_for(dtype)
    return "rejected" if target is None else f"falls back to {target}"


def declared_status(caps: Capabilities, label: str) -> str:
    """What the vendor declares for a matrix row, in words."""
    kind, _, name = label.partition(" ")
    if label.startswith("dispatch "):
        return dispatch_status(caps, DispatchDtype.parse(name))
    if kind == "grouped_matmul":
        return "declared" if caps.supports_gemm(name) else "not declared"
    if label.startswith("moe layer "):
        scheme = label.removeprefix("moe layer ")
        if scheme in caps.fused_deep_moe:
            return "supported (fused)"
        gemm = scheme_gemm(scheme)
        fallback = caps.scheme_fallbacks.get(scheme)
        if not caps.supports_gemm(gemm) and fallback is not None and fallback.target is not None:
            return f"converted at load to {fallback.target} (no {gemm} grouped matmul)"
        return "supported" if caps.supports_gemm(gemm) else f"not supported (no {gemm} grouped matmul)"
    if kind == "fused_deep_moe":
        return "declared" if name in caps.fused_deep_moe else "not declared"
    if kind == "activation":
        return "declared" if ActivationKind(name) in caps.activations else "not declared"
    if label == EXPERT_BIAS:
        return "declared" if caps.expert_bias else "not declared"
    if label == GRAPH_CAPTURE:
        return "declared" if caps.graph_capture else "not declared"
    if label == SCHEME_FALLBACKS:
        declared = [f"{n} -> {f.target or 'refused'}" for n, f in sorted(caps.scheme_fallbacks.items())]
        return ", ".join(declared) if declared else "none declared"
    if label == OP_CONTRACTS:
        return "required (deterministic)" if caps.deterministic else "required (deterministic=False)"
    return "required"


def _skip(vendor: Vendor, what: str) -> None:
    pytest.skip(f"vendor {vendor.name} declares no {what}")


def require_dispatch(vendor: Vendor, dtype: DispatchDtype) -> None:
    """Skip unless the vendor carries `dtype` natively (the reason says what it does instead)."""
    status = dispatch_status(vendor.capabilities(), dtype)
    if status != "native":
        _skip(vendor, f"{dtype} dispatch ({status})")


def require_gemm(vendor: Vendor, kind: GemmKind) -> None:
    """Skip unless the vendor declares the grouped-matmul kind."""
    if not vendor.capabilities().supports_gemm(kind):
        _skip(vendor, f"{kind} grouped matmul")


def require_activation(vendor: Vendor, kind: ActivationKind) -> None:
    """Skip unless the vendor declares the activation kind."""
    if kind not in vendor.capabilities().activations:
        _skip(vendor, f"{kind} activation")


def require_expert_bias(vendor: Vendor) -> None:
    """Skip unless the vendor declares per-expert biases of the grouped matmul."""
    if not vendor.capabilities().expert_bias:
        _skip(vendor, "expert_bias")


def require_graph_capture(vendor: Vendor) -> None:
    """Skip unless the vendor declares `graph_capture` (captured, replayed calls)."""
    if not vendor.capabilities().graph_capture:
        _skip(vendor, "graph_capture")


def require_scheme(vendor: Vendor, scheme: str) -> None:
    """Skip unless the vendor can run the scheme's experts (its GEMM kind, or a fused op)."""
    caps = vendor.capabilities()
    gemm = scheme_gemm(scheme)
    if scheme not in caps.fused_deep_moe and not caps.supports_gemm(gemm):
        _skip(vendor, f"{gemm} grouped matmul (scheme {scheme} needs it)")


def require_fused(vendor: Vendor, scheme: str) -> None:
    """Skip unless the vendor declares `fused_deep_moe` for the scheme."""
    if scheme not in vendor.capabilities().fused_deep_moe:
        _skip(vendor, f"fused_deep_moe for {scheme}")
