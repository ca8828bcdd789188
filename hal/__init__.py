"""moe-hal's hardware-abstraction layer: capabilities, dispatch-dtype plans, vendor discovery, ops.

This module is the API: `moe`, the vendors, the conformance suite and engines import
from `hal` itself. Two subpackages are public too: `hal.reference` (the torch reference
implementation of every op, which vendors build on) and `hal.cli` (for `hal.commands`
plugins). Every other submodule is private; the import contracts in pyproject.toml and
`tests/integration/test_import_boundary.py` hold the other layers to that.

Engine code asks `hal` every device question; vendors answer through the `Vendor`
interface and register themselves as plugins in the `hal.vendors` entry-point group.

Names are imported on first use (PEP 562), so that `import hal` and the `hal` command's
argument parsing, help and version do not pay torch's import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Where each public name lives (the private module it is imported from on first use).
_SOURCES: dict[str, str] = {
    "Activation": "hal.activations",
    "ActivationKind": "hal.activations",
    "Capabilities": "hal.capabilities",
    "DeclaredFallback": "hal.capabilities",
    "Int8QuantMode": "hal.capabilities",
    "KernelLimits": "hal.capabilities",
    "SchemeFallback": "hal.capabilities",
    "DEFAULT_PROBE_TIMEOUT": "hal.discovery",
    "ENTRY_POINT_GROUP": "hal.discovery",
    "ENV_VENDOR": "hal.discovery",
    "PluginFailure": "hal.discovery",
    "Selection": "hal.discovery",
    "SelectionSource": "hal.discovery",
    "VendorRegistry": "hal.discovery",
    "get_vendor": "hal.discovery",
    "load_plugins": "hal.discovery",
    "DTYPES": "hal.dtypes",
    "E2M1_VALUES": "hal.dtypes",
    "E8M0_BIAS": "hal.dtypes",
    "FLOAT_DTYPES": "hal.dtypes",
    "FP4_MAX": "hal.dtypes",
    "FP8_GROUP_SIZE": "hal.dtypes",
    "FP8_MAX": "hal.dtypes",
    "HOST_DEVICE": "hal.dtypes",
    "INT4_MAX": "hal.dtypes",
    "INT4_PER_WORD": "hal.dtypes",
    "INT8_MAX": "hal.dtypes",
    "MXFP4_BLOCK_SIZE": "hal.dtypes",
    "NVFP4_BLOCK_SIZE": "hal.dtypes",
    "WEIGHT_LAYOUTS": "hal.dtypes",
    "Codec": "hal.dtypes",
    "DispatchDtype": "hal.dtypes",
    "DtypeSpec": "hal.dtypes",
    "ScaleLayout": "hal.dtypes",
    "FP32_MAX": "hal.errors",
    "FP32_TINY": "hal.errors",
    "HalError": "hal.errors",
    "InvalidInput": "hal.errors",
    "UnknownVendor": "hal.errors",
    "UnsupportedCapability": "hal.errors",
    "UnsupportedDispatchDtype": "hal.errors",
    "VendorUnavailable": "hal.errors",
    "VendorFault": "hal.errors",
    "invalid": "hal.errors",
    "positive_fp32": "hal.errors",
    "positive_int": "hal.errors",
    "refuse_non_finite": "hal.finite",
    "PackedInt4Tensor": "hal.formats",
    "QuantizedTensor": "hal.formats",
    "QuantizedWeight": "hal.formats",
    "take_rows": "hal.formats",
    "GEMM_KINDS": "hal.gemm_kinds",
    "ActivationFormat": "hal.gemm_kinds",
    "GemmKind": "hal.gemm_kinds",
    "GemmSpec": "hal.gemm_kinds",
    "gemm_kind_of": "hal.gemm_kinds",
    "gemm_kinds_consuming": "hal.gemm_kinds",
    "environ_mapping": "hal.checks",
    "LayerProblem": "hal.layer_spec",
    "LayerSpec": "hal.layer_spec",
    "GemmProblem": "hal.tuning",
    "CapturedCall": "hal.graphs",
    "GraphSet": "hal.graphs",
    "GroupListKind": "hal.groups",
    "Groups": "hal.groups",
    "OP_NAMES": "hal.ops",
    "OpSource": "hal.ops",
    "VendorOps": "hal.ops",
    "MAX_DEVICE_MEMORY_BYTES": "hal.platform",
    "DispatchFallbackWarning": "hal.platform",
    "Platform": "hal.platform",
    "ProbeResult": "hal.platform",
    "ReferenceOps": "hal.reference",
    "ENV_DISPATCH_DTYPE": "hal.resolution",
    "LEGACY_DISPATCH_VARIABLES": "hal.resolution",
    "DispatchConfig": "hal.resolution",
    "DispatchPlan": "hal.resolution",
    "Fallback": "hal.resolution",
    "HalDeprecationWarning": "hal.resolution",
    "PlanSource": "hal.resolution",
    "TraceStep": "hal.resolution",
    "resolve_dispatch_plan": "hal.resolution",
    "KNOWN_SCHEMES": "hal.schemes",
    "SchemeTraits": "hal.schemes",
    "parse_scheme": "hal.schemes",
    "SchemeChoice": "hal.scheme_fallbacks",
    "choose_scheme": "hal.scheme_fallbacks",
    "resolve_layer_plan": "hal.scheme_fallbacks",
    "Vendor": "hal.vendor",
}

if TYPE_CHECKING:
    from hal.activations import Activation, ActivationKind
    from hal.capabilities import Capabilities, DeclaredFallback, Int8QuantMode, KernelLimits, SchemeFallback
    from hal.discovery import (
        DEFAULT_PROBE_TIMEOUT,
        ENTRY_POINT_GROUP,
        ENV_VENDOR,
        PluginFailure,
        Selection,
        SelectionSource,
        VendorRegistry,
        get_vendor,
        load_plugins,
    )
    from hal.dtypes import (
        DTYPES,
        E2M1_VALUES,
        E8M0_BIAS,
        FLOAT_DTYPES,
        FP4_MAX,
        FP8_GROUP_SIZE,
        FP8_MAX,
        HOST_DEVICE,
        INT4_MAX,
        INT4_PER_WORD,
        INT8_MAX,
        MXFP4_BLOCK_SIZE,
        NVFP4_BLOCK_SIZE,
        WEIGHT_LAYOUTS,
        Codec,
        DispatchDtype,
        DtypeSpec,
        ScaleLayout,
    )
    from hal.errors import (
        FP32_MAX,
        FP32_TINY,
        HalError,
        InvalidInput,
        UnknownVendor,
        UnsupportedCapability,
        UnsupportedDispatchDtype,
        VendorFault,
        VendorUnavailable,
        invalid,
        positive_fp32,
        positive_int,
    )
    from hal.finite import refuse_non_finite
    from hal.formats import PackedInt4Tensor, QuantizedTensor, QuantizedWeight, take_rows
    from hal.gemm_kinds import GEMM_KINDS, ActivationFormat, GemmKind, GemmSpec, gemm_kind_of, gemm_kinds_consuming
    from hal.checks import environ_mapping
    from hal.layer_spec import LayerProblem, LayerSpec
    from hal.tuning import GemmProblem
    from hal.graphs import CapturedCall, GraphSet
    from hal.groups import GroupListKind, Groups
    from hal.ops import OP_NAMES, OpSource, VendorOps
    from hal.platform import MAX_DEVICE_MEMORY_BYTES, DispatchFallbackWarning, Platform, ProbeResult
    from hal.reference import ReferenceOps
    from hal.resolution import (
        ENV_DISPATCH_DTYPE,
        LEGACY_DISPATCH_VARIABLES,
        DispatchConfig,
        DispatchPlan,
        Fallback,
        HalDeprecationWarning,
        PlanSource,
        TraceStep,
        resolve_dispatch_plan,
    )
    from hal.schemes import KNOWN_SCHEMES, SchemeTraits, parse_scheme
    from hal.scheme_fallbacks import SchemeChoice, choose_scheme, resolve_layer_plan
    from hal.vendor import Vendor

__all__ = [
    # capabilities and the tables of dtypes and grouped-matmul kinds
    "Capabilities",
    "Int8QuantMode",
    "DeclaredFallback",
    "SchemeFallback",
    "SchemeChoice",
    "choose_scheme",
    "resolve_layer_plan",
    "KernelLimits",
    # what a layer is, and why a vendor cannot build it
    "LayerSpec",
    "LayerProblem",
    "Activation",
    "ActivationKind",
    "DTYPES",
    "DtypeSpec",
    "Codec",
    "DispatchDtype",
    "ScaleLayout",
    "WEIGHT_LAYOUTS",
    "GEMM_KINDS",
    "GemmSpec",
    "GemmKind",
    "ActivationFormat",
    "gemm_kind_of",
    "gemm_kinds_consuming",
    "GemmProblem",
    "environ_mapping",
    "FLOAT_DTYPES",
    "FP8_GROUP_SIZE",
    "NVFP4_BLOCK_SIZE",
    "MXFP4_BLOCK_SIZE",
    "E8M0_BIAS",
    "INT8_MAX",
    "FP8_MAX",
    "HOST_DEVICE",
    "FP4_MAX",
    "INT4_MAX",
    "INT4_PER_WORD",
    "E2M1_VALUES",
    # operands
    "PackedInt4Tensor",
    "QuantizedTensor",
    "QuantizedWeight",
    "GroupListKind",
    "Groups",
    "GraphSet",
    "CapturedCall",
    "take_rows",
    # vendors: the platform, the checked op methods, the op implementations
    "Platform",
    "ProbeResult",
    "Vendor",
    "VendorOps",
    "ReferenceOps",
    "OpSource",
    "OP_NAMES",
    "DispatchFallbackWarning",
    # discovery
    "DEFAULT_PROBE_TIMEOUT",
    "ENTRY_POINT_GROUP",
    "ENV_VENDOR",
    "PluginFailure",
    "Selection",
    "SelectionSource",
    "VendorRegistry",
    "get_vendor",
    "load_plugins",
    # dispatch-dtype resolution and schemes
    "ENV_DISPATCH_DTYPE",
    "LEGACY_DISPATCH_VARIABLES",
    "DispatchConfig",
    "DispatchPlan",
    "Fallback",
    "HalDeprecationWarning",
    "PlanSource",
    "TraceStep",
    "resolve_dispatch_plan",
    "KNOWN_SCHEMES",
    "SchemeTraits",
    "parse_scheme",
    # errors
    "HalError",
    "InvalidInput",
    "UnknownVendor",
    "UnsupportedCapability",
    "UnsupportedDispatchDtype",
    "VendorUnavailable",
    "VendorFault",
    "invalid",
    "positive_int",
    "positive_fp32",
    "FP32_MAX",
    "FP32_TINY",
    "MAX_DEVICE_MEMORY_BYTES",
    "refuse_non_finite",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use; a subpackage (`hal.reference`) likewise."""
    source = _SOURCES.get(name)
    if source is None:
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
