"""moe-hal's hardware-abstraction layer: capabilities, dispatch-dtype plans, vendor discovery, ops.

This module is the API: `moe`, the vendors, the conformance suite and engines import
from `hal` itself. Two subpackages are public too: `hal.reference` (the torch reference
implementation of every op, which vendors build on) and `hal.cli` (for `hal.commands`
plugins). Every other submodule is private; the import contracts in pyproject.toml and
`tests/integration/test_import_boundary.py` hold the other layers to that.

Engine code asks `hal` every device question; vendors answer through the `Vendor`
interface and register themselves as plugins in the `hal.vendors` entry-point group.
"""

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
    VendorUnavailable,
    invalid,
    positive_fp32,
    positive_int,
)
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
    "invalid",
    "positive_int",
    "positive_fp32",
    "FP32_MAX",
    "FP32_TINY",
    "MAX_DEVICE_MEMORY_BYTES",
]
