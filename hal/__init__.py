"""moe-hal's hardware-abstraction layer: capabilities, dispatch-dtype plans, vendor discovery.

Engine code asks `hal` every device question; vendors answer through the `Vendor`
interface and register themselves as plugins in the `hal.vendors` entry-point group.
"""

from hal.capabilities import Capabilities, GemmKind, Int8QuantMode, KernelLimits
from hal.discovery import (
    ENTRY_POINT_GROUP,
    ENV_VENDOR,
    PluginFailure,
    Selection,
    SelectionSource,
    VendorRegistry,
    get_vendor,
)
from hal.dtypes import FP8_GROUP_SIZE, NVFP4_BLOCK_SIZE, DispatchDtype, ScaleLayout
from hal.errors import (
    HalError,
    InvalidInput,
    UnsupportedCapability,
    UnsupportedDispatchDtype,
    VendorUnavailable,
)
from hal.formats import INT4_MAX, INT4_PER_WORD, PackedInt4Tensor, QuantizedTensor, QuantizedWeight, gemm_kind_of
from hal.groups import GroupListKind, Groups
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
from hal.vendor import DispatchFallbackWarning, ProbeResult, Vendor

__all__ = [
    "Capabilities", "GemmKind", "Int8QuantMode", "KernelLimits",
    "ENTRY_POINT_GROUP", "ENV_VENDOR", "PluginFailure", "Selection", "SelectionSource",
    "VendorRegistry", "get_vendor",
    "FP8_GROUP_SIZE", "NVFP4_BLOCK_SIZE", "DispatchDtype", "ScaleLayout",
    "HalError", "InvalidInput", "UnsupportedCapability", "UnsupportedDispatchDtype",
    "VendorUnavailable",
    "INT4_MAX", "INT4_PER_WORD", "PackedInt4Tensor", "QuantizedTensor", "QuantizedWeight", "gemm_kind_of",
    "GroupListKind", "Groups",
    "ENV_DISPATCH_DTYPE", "LEGACY_DISPATCH_VARIABLES", "DispatchConfig", "DispatchPlan",
    "Fallback", "HalDeprecationWarning", "PlanSource", "TraceStep", "resolve_dispatch_plan",
    "KNOWN_SCHEMES", "SchemeTraits", "parse_scheme",
    "DispatchFallbackWarning", "ProbeResult", "Vendor",
]
