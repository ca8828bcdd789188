"""The `Vendor` interface every backend plugin implements."""

from __future__ import annotations

import abc
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from hal.capabilities import Capabilities
from hal.combine import weighted_combine
from hal.sorting import sort_by_expert
from hal.dtypes import DispatchDtype, ScaleLayout
from hal.errors import InvalidInput, UnsupportedCapability, VendorUnavailable, names
from hal.formats import PackedInt4Tensor, QuantizedTensor, QuantizedWeight
from hal.groups import Groups


class DispatchFallbackWarning(UserWarning):
    """A requested dispatch dtype was replaced by the vendor's declared fallback."""


@dataclass(frozen=True)
class ProbeResult:
    """Whether a vendor can run here, and if not, why (in words a person can act on)."""

    available: bool
    reason: str = ""

    @classmethod
    def ok(cls, detail: str = "") -> ProbeResult:
        """An available vendor; `detail` may name the device found."""
        return cls(True, detail)

    @classmethod
    def unavailable(cls, reason: str) -> ProbeResult:
        """An unavailable vendor and the reason."""
        return cls(False, reason)


class Vendor(abc.ABC):
    """A hardware backend: probe, devices, capabilities and ops.

    Subclasses set `name`, `priority` and `description`, and implement `probe`,
    `devices`, `_detect_capabilities`, `declared_models` and the ops. Capabilities
    are resolved once per instance (one instance drives one device).
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    description: ClassVar[str] = ""

    def __init__(self) -> None:
        self._capabilities: Capabilities | None = None
        self._probe: ProbeResult | None = None
        self._warned: set[tuple[DispatchDtype, DispatchDtype]] = set()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    # -- discovery -------------------------------------------------------------------------------

    @abc.abstractmethod
    def _probe_once(self) -> ProbeResult:
        """Check for hardware and libraries; must not raise for a missing runtime."""

    def probe(self) -> ProbeResult:
        """Whether this vendor can run here (cached per instance)."""
        if self._probe is None:
            try:
                self._probe = self._probe_once()
            except Exception as exc:  # a broken runtime must not break discovery
                self._probe = ProbeResult.unavailable(f"probe failed: {type(exc).__name__}: {exc}")
        return self._probe

    def require_available(self) -> None:
        """Raise `VendorUnavailable` with the probe's reason unless the vendor can run here."""
        result = self.probe()
        if not result.available:
            raise VendorUnavailable(f"vendor {self.name!r} is unavailable: {result.reason}")

    @abc.abstractmethod
    def devices(self) -> list[torch.device]:
        """The devices this vendor drives (requires availability)."""

    @property
    def device(self) -> torch.device:
        """The device this instance computes on (the first of `devices()`)."""
        return self.devices()[0]

    # -- capabilities ----------------------------------------------------------------------------

    @abc.abstractmethod
    def _detect_capabilities(self) -> Capabilities:
        """Read the device and build its capabilities (called once)."""

    def capabilities(self) -> Capabilities:
        """The capabilities of this instance's device, resolved once."""
        if self._capabilities is None:
            self.require_available()
            with self._lock:
                if self._capabilities is None:
                    self._capabilities = self._detect_capabilities()
        return self._capabilities

    @abc.abstractmethod
    def declared_models(self) -> Mapping[str, Capabilities]:
        """Capability tables for named device models, usable without the hardware."""

    @property
    def default_model(self) -> str:
        """The declared model shown when the hardware is absent."""
        return next(iter(self.declared_models()))

    def declared_capabilities(self, model: str | None = None) -> Capabilities:
        """The declared table of a named device model (case-insensitive)."""
        models = self.declared_models()
        if model is None:
            model = self.default_model
        for key, caps in models.items():
            if key.lower() == model.strip().lower():
                return caps
        raise InvalidInput(
            f"device model: expected one of {', '.join(models)} for vendor {self.name!r}, got {model!r}"
        )

    # -- fallback warnings (per instance, never global) ------------------------------------------

    def warn_fallback_once(self, source: DispatchDtype, target: DispatchDtype, why: str) -> bool:
        """Warn that `source` dispatch becomes `target`, once per (this vendor, source, target)."""
        key = (source, target)
        with self._lock:
            if key in self._warned:
                return False
            self._warned.add(key)
        warnings.warn(
            f"vendor {self.name!r}: dispatch dtype {source} is not supported; using {target} ({why})",
            DispatchFallbackWarning,
            stacklevel=4,  # warn_fallback_once <- _validate <- resolve_dispatch_plan <- the caller
        )
        return True

    # -- ops -------------------------------------------------------------------------------------

    @abc.abstractmethod
    def quantize(
        self,
        x: torch.Tensor,
        dtype: DispatchDtype,
        *,
        layout: ScaleLayout | None = None,
        global_scale: torch.Tensor | None = None,
    ) -> QuantizedTensor:
        """Quantize activations `[..., H]` into a dispatch dtype (bf16 is a plain cast).

        `layout` defaults to the dtype's default; `global_scale` is nvfp4's per-tensor
        scale (computed from the input when not given). Input with inf or NaN is either
        refused with `InvalidInput` or quantized row by row, every finite row exactly as if
        the others were absent (nvfp4: when `global_scale` is given); what a non-finite
        row becomes is unspecified. A kernel that must not synchronise takes the second way.
        """

    @abc.abstractmethod
    def dequantize(self, q: QuantizedTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Turn quantized activations back into `out_dtype`."""

    @abc.abstractmethod
    def quantize_weight(
        self, weight: torch.Tensor, layout: ScaleLayout, dtype: torch.dtype | None = None
    ) -> QuantizedWeight:
        """Quantize float expert weights `[E, K, N]` into the formats `hal.formats` documents.

        `layout` is none (cast to `dtype`), per-channel (`dtype` int8, float8_e4m3fn, or
        `torch.quint4x2` for int4 packed eight per int32), block-128x128 (fp8) or block-16
        (nvfp4, with a per-expert global scale).
        """

    @abc.abstractmethod
    def grouped_matmul(
        self,
        x: torch.Tensor | QuantizedTensor,
        weight: QuantizedWeight,
        groups: Groups,
        *,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """`y[rows of g] = x[rows of g] @ weight[g]` for every group g, scales applied.

        x is `[M, K]` with rows sorted by group; the result is `[M, N]` in `out_dtype`
        (default: the activation dtype for float kinds, bf16 for quantized kinds).
        """

    def quantize_int4(self, x: torch.Tensor) -> PackedInt4Tensor:
        """Quantize activations `[..., H]` to per-token int4 (`scale = rowmax|x| / 7`), packed.

        A compute format for the int4 grouped-matmul kind, never a dispatch dtype. Vendors
        that declare `GemmKind.INT4` override this; the default raises `UnsupportedCapability`.
        """
        raise UnsupportedCapability(
            f"vendor {self.name!r} does not implement int4 activation quantization "
            "(it does not declare the int4 grouped-matmul kind)"
        )

    @abc.abstractmethod
    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(a) * b` where a is the first and b the second half of the last dimension."""

    def sort_by_expert(self, topk_ids: torch.Tensor,
                       num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (token, slot) pairs of `topk_ids` `[T, k]` sorted by expert, token order kept within one:
        `(order, inverse, counts)`, see `hal.sorting.sort_by_expert`. Must not synchronise with
        the host. The default is plain torch; a vendor may override it with one kernel.
        """
        return sort_by_expert(topk_ids, num_experts)

    def weighted_combine(self, rows: torch.Tensor, index: torch.Tensor | None, topk_weights: torch.Tensor,
                         out_dtype: torch.dtype) -> torch.Tensor:
        """Each token's routing-weighted sum of its experts' rows: `[T, H]` in `out_dtype`.

        `out[t] = sum_j topk_weights[t, j] * rows[index[t*k + j]]` accumulated in fp32 (`index`
        None: rows already in (token, slot) order). The default is plain torch; a vendor may
        override it with a single-pass kernel.
        """
        return weighted_combine(rows, index, topk_weights, out_dtype)

    def fused_deep_moe(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: QuantizedWeight,
        w2: QuantizedWeight,
        *,
        scheme: str,
        process_group: object | None = None,
        dispatch_dtype: DispatchDtype | None = None,
        max_tokens_per_rank: int | None = None,
    ) -> torch.Tensor:
        """Dispatch, both grouped GEMMs with swiglu, and combine as one op: `[T, H]`.

        `w13` / `w2` are this rank's experts (gate and up projections concatenated, gate
        first; then the down projection); `topk_ids` are global expert ids; `process_group`
        is the expert-parallel group (None on one rank). `dispatch_dtype` is the calling
        layer's resolved dispatch dtype (None: the scheme's own) and `max_tokens_per_rank`
        its low-latency capacity (None: normal mode); a vendor may use or ignore them, but
        never takes them from process-wide state. Only for schemes listed in
        `capabilities().fused_deep_moe`; a vendor that declares one overrides this. The
        default raises `UnsupportedCapability`.
        """
        declared = sorted(self.capabilities().fused_deep_moe)
        raise UnsupportedCapability(
            f"vendor {self.name!r} does not declare fused_deep_moe for scheme {scheme!r} "
            f"(declared for: {', '.join(declared) or 'no scheme'})"
        )


def unsupported_dispatch_message(vendor: str, dtype: DispatchDtype, caps: Capabilities) -> str:
    """The house message for a rejected dispatch dtype."""
    reason = caps.fallback_reasons.get(dtype)
    return (
        f"vendor {vendor!r} ({caps.device_name}) cannot dispatch {dtype}: it is not supported and "
        f"has no declared fallback{f' ({reason})' if reason else ''}; "
        f"supported dispatch dtypes: {names(caps.dispatch_dtypes)}"
    )
