"""Whether DeepEP (V1, the `deep_ep` module) can serve the CUDA vendor here, and what its build has: found and
imported only when asked (never at module import); any failure is a reason, never a crash."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Any

#: The dispatcher's name (`DispatchConfig(ep_dispatcher="deepep")`).
DEEPEP = "deepep"
#: What `deep_ep.Buffer` must have to be DeepEP V1 (the Ascend port is also a module named deep_ep).
_API = (
    "get_dispatch_layout",
    "dispatch",
    "combine",
    "low_latency_dispatch",
    "low_latency_combine",
    "get_low_latency_rdma_size_hint",
    "get_dispatch_config",
    "is_sm90_compiled",
)
_INSTALL = "build DeepEP v1.2.1 from source and put it on the path (docs/deepep.md)"


@dataclass(frozen=True)
class DeepEpProbe:
    """What the probe found of `deep_ep`: `reason` why it cannot serve (None: it can) and what its build has."""

    reason: str | None
    version: str = ""
    location: str = ""
    fp8: bool = False  #: built with the sm90 features (fp8 rows)
    low_latency: bool = False  #: built with NVSHMEM (low-latency and internode kernels)

    @property
    def available(self) -> bool:
        return self.reason is None

    def describe(self) -> str:
        """The module found, in words (for `hal caps`)."""
        version = f"DeepEP {self.version}" if self.version else "DeepEP (version unknown: no package metadata)"
        return f"{version} at {self.location}" if self.location else version


def probe_deep_ep() -> DeepEpProbe:
    """Find and import `deep_ep` (never at module import) and read what its build has; any failure is a reason."""
    try:
        spec = importlib.util.find_spec("deep_ep")
    except (ImportError, ValueError) as exc:
        return DeepEpProbe(f"deep_ep cannot be looked up ({type(exc).__name__}: {exc}); {_INSTALL}")
    if spec is None:
        return DeepEpProbe(f"deep_ep is not installed: {_INSTALL}")
    try:
        module = importlib.import_module("deep_ep")
    except Exception as exc:  # a broken build, missing CUDA/NVSHMEM libraries: the reason, never a crash
        return DeepEpProbe(f"deep_ep does not import ({type(exc).__name__}: {exc}); {_INSTALL}")
    location = str(getattr(module, "__file__", "") or "")
    missing = [name for name in _API if not hasattr(getattr(module, "Buffer", None), name)]
    if missing:
        return DeepEpProbe(
            f"the deep_ep module at {location or '?'} is not DeepEP V1 (its Buffer lacks "
            f"{', '.join(missing)}); {_INSTALL}",
            location=location,
        )
    try:
        version = importlib.metadata.version("deep_ep")
    except importlib.metadata.PackageNotFoundError:  # built in place (build_ext --inplace) and on PYTHONPATH
        version = ""
    try:
        fp8 = bool(module.Buffer.is_sm90_compiled())
    except Exception as exc:
        return DeepEpProbe(
            f"deep_ep at {location} fails its build query ({type(exc).__name__}: {exc})", version, location
        )
    return DeepEpProbe(None, version, location, fp8=fp8, low_latency=_has_nvshmem(module))


def _has_nvshmem(module: Any) -> bool:
    """Whether deep_ep was built with NVSHMEM: its internode size hint refuses otherwise (a host-only call)."""
    try:
        module.Config().get_rdma_buffer_size_hint(2 * 7168, 16)
    except Exception:  # "NVSHMEM is disabled during compilation"
        return False
    return True
